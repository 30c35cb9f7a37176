"""Training progress for a TrainJob's status (Kubeflow Trainer ≥ 2.2, `TrainJobStatus` gate).

With the gate on, Trainer gives every container `KUBEFLOW_TRAINER_SERVER_URL` (the HTTPS
endpoint of this TrainJob's status), `KUBEFLOW_TRAINER_SERVER_CA_CERT` (its CA, a file) and
`KUBEFLOW_TRAINER_SERVER_TOKEN` (a projected service-account token, a file that rotates: read
at each request). Worker 0 POSTs `{"trainerStatus": {progressPercentage,
estimatedRemainingSeconds, metrics: [{name, value}], lastUpdatedTime}}`, which Trainer copies
into `status.trainerStatus` (`kubectl get trainjob` shows the progress; `kubejax launch` and the
train step print it). At most one update every 5 s, in a thread of its own with a short
timeout: a slow or absent server never holds a step, and a failing one costs one warning line,
never the training. The Kubeflow SDK's `update_trainjob_status` does the same, but would add
the `kubeflow` package (and its pins) to the image for one POST.
"""

from __future__ import annotations

import datetime
import json
import os
import ssl
import sys
import threading
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path

URL_ENV = "KUBEFLOW_TRAINER_SERVER_URL"
CA_ENV = "KUBEFLOW_TRAINER_SERVER_CA_CERT"
TOKEN_ENV = "KUBEFLOW_TRAINER_SERVER_TOKEN"
#: Trainer's limit on update frequency, and on the metrics it keeps (count, name length).
MIN_INTERVAL = 5.0
MAX_METRICS, MAX_NAME = 256, 64


def payload(step: int, total: int, remaining_s: float | None, metrics: Mapping) -> dict:
    """The status body for `step` of `total` with `remaining_s` to go and the latest
    `metrics` (numbers, written as strings as the API takes them)."""
    status: dict = {
        "progressPercentage": int(100 * step / total) if total else 100,
        "metrics": [
            {"name": str(k)[:MAX_NAME], "value": f"{float(v):.6g}"}
            for k, v in list(metrics.items())[:MAX_METRICS]
        ],
        "lastUpdatedTime": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    if remaining_s is not None:
        status["estimatedRemainingSeconds"] = max(int(remaining_s), 0)
    return {"trainerStatus": status}


class StatusReporter:
    """Worker 0's progress to Trainer's status server: `update` each logged step (throttled,
    in the background), `finish` once at the end (100 %, waited for briefly)."""

    def __init__(
        self,
        url: str,
        ca_file: str | None,
        token_file: str | None,
        *,
        min_interval: float = MIN_INTERVAL,
        timeout: float = 5.0,
    ):
        self.url, self.token_file, self.timeout = url, token_file, timeout
        self.min_interval = min_interval
        self.context = ssl.create_default_context(cafile=ca_file) if ca_file else None
        self.metrics: dict[str, float] = {}
        self.last_sent = -float("inf")
        self.thread: threading.Thread | None = None
        self.warned = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> StatusReporter | None:
        """The reporter Trainer's environment asks for, None outside such a TrainJob (or
        when the CA file it names cannot be read: one warning, no reporting)."""
        url = env.get(URL_ENV)
        if not url:
            return None
        try:
            return cls(url, env.get(CA_ENV), env.get(TOKEN_ENV))
        except (OSError, ssl.SSLError) as err:
            _warn(f"its CA certificate {env.get(CA_ENV)} is unusable ({err})")
            return None

    def update(self, step: int, total: int, remaining_s: float | None, metrics: Mapping) -> None:
        """Note `metrics` (merged with those noted before); send the status unless one was
        sent less than `min_interval` ago or is still on its way."""
        self.metrics.update({k: float(v) for k, v in metrics.items()})
        now = time.monotonic()
        busy = self.thread is not None and self.thread.is_alive()
        if busy or now - self.last_sent < self.min_interval:
            return
        self.last_sent = now
        body = payload(step, total, remaining_s, self.metrics)
        self.thread = threading.Thread(target=self._post, args=(body,), daemon=True)
        self.thread.start()

    def finish(self, total: int, metrics: Mapping) -> None:
        """The final status (100 %, nothing remaining, the final metrics), sent whatever the
        interval, waiting at most `timeout` for it."""
        if self.thread is not None:
            self.thread.join(self.timeout)
        self.metrics.update({k: float(v) for k, v in metrics.items()})
        self._post(payload(total, total, 0, self.metrics))

    def _post(self, body: dict) -> None:
        try:
            headers = {"Content-Type": "application/json"}
            if self.token_file:  # re-read each time: the projected token rotates
                token = Path(self.token_file).read_text().strip()
                headers["Authorization"] = f"Bearer {token}"
            request = urllib.request.Request(
                self.url, data=json.dumps(body).encode(), headers=headers, method="POST"
            )
            with urllib.request.urlopen(request, timeout=self.timeout, context=self.context):
                pass
        except Exception as err:  # never the training's failure: one warning a run
            if not self.warned:
                self.warned = True
                _warn(f"the status server at {self.url} did not take an update ({err})")


def _warn(what: str) -> None:
    print(
        f"kubejax trainer: warning: TrainJob progress not reported: {what}; training goes on",
        file=sys.stderr,
        flush=True,
    )
