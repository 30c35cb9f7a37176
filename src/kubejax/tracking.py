"""A small tracking interface, with MLflow and no-op implementations.

Nothing else in kubejax imports mlflow for tracking: the trainer, evaluation and the sweep take
a `Tracker`. Step metrics are buffered and sent by a background thread in batches
(`MlflowClient.log_batch`), so a training step never waits on the tracking server.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kubejax.errors import KubejaxError

log = logging.getLogger(__name__)

#: Metrics buffered before a batch is sent (MLflow accepts up to 1000 per log_batch).
BATCH_SIZE = 500
#: A partial batch is sent after this many seconds.
FLUSH_SECONDS = 5.0
#: Metrics that failed to send are retried with each later batch and, at the end of the run,
#: for up to this many seconds before they are counted as undelivered.
FINISH_RETRY_SECONDS = 60.0
#: At most this many metric values wait for a server that is down; older ones beyond it are
#: counted as undelivered (bounded memory over a long outage).
MAX_PENDING = 200_000
#: Seconds between system-metrics samples.
SYSTEM_METRICS_SECONDS = 2.0
#: MLflow truncates longer parameter values.
_MAX_PARAM = 6000


class TrackingError(KubejaxError, RuntimeError):
    """The tracking server cannot be used."""


class Tracker:
    """The no-op tracker; also the interface every tracker implements."""

    run_id: str | None = None
    tracking_uri: str | None = None

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Record hyperparameters (once per run)."""

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Record metric values at a step."""

    def log_summary(self, summary: Mapping[str, float]) -> None:
        """Record final figures."""

    def set_tags(self, tags: Mapping[str, str]) -> None:
        """Attach tags to the run."""

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Upload a file or folder."""

    def log_pyfunc_model(self, model_dir: str | Path, input_example) -> str:
        """Log a model folder as a pyfunc model of this run; returns its URI ('' if none)."""
        return ""

    def log_figure(self, figure, artifact_file: str) -> None:
        """Store a matplotlib figure as an artifact of the run (shown in the MLflow UI)."""

    def start_system_metrics(self, node_id: str):
        """Sample CPU, memory, disk, network (and GPU) into this run until `.finish()`."""
        return None

    def skipped_run(self, name: str, params: Mapping[str, Any], tags: Mapping[str, str]) -> str:
        """A nested run, already ended (KILLED), for a trial that never started; its id."""
        return ""

    def update_run(self, run_id: str, tags: Mapping[str, str], status: str | None = None) -> None:
        """Tag another run of the same store (a sweep trial), optionally ending it."""

    def finish(self, status: str = "FINISHED") -> list[tuple]:
        """Flush everything and end the run (FINISHED, FAILED or KILLED). Returns the metric
        values that could not be delivered, as (key, value, timestamp_ms, step)."""
        return []


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = str(v)[:_MAX_PARAM]
    return out


class MlflowTracker(Tracker):
    """Logs to one MLflow run, created here or resumed by id."""

    def __init__(
        self,
        tracking_uri: str,
        experiment: str,
        *,
        run_name: str | None = None,
        run_id: str | None = None,
        parent_run_id: str | None = None,
        tags: Mapping[str, str] | None = None,
        end_run: bool = True,
    ):
        from mlflow.tracking import MlflowClient

        self.tracking_uri = tracking_uri
        # A run joined rather than made here (a KFP task's) is left for its owner to end.
        self.end_run = end_run
        self.client = MlflowClient(tracking_uri)
        try:
            self._check_reachable()
            if run_id:
                self.run_id = self.client.get_run(run_id).info.run_id
                if end_run:
                    self.client.update_run(run_id, status="RUNNING")
            elif parent_run_id:
                # A nested run lives in its parent's experiment, or the UI cannot show it.
                exp_id = self.client.get_run(parent_run_id).info.experiment_id
            else:
                exp = self.client.get_experiment_by_name(experiment)
                exp_id = (
                    exp.experiment_id
                    if exp
                    else self.client.create_experiment(
                        experiment, artifact_location=_artifact_location(tracking_uri)
                    )
                )
            if not run_id:
                all_tags = dict(tags or {})
                if parent_run_id:
                    all_tags["mlflow.parentRunId"] = parent_run_id
                if run_name:
                    all_tags["mlflow.runName"] = run_name
                self.run_id = self.client.create_run(exp_id, tags=all_tags).info.run_id
        except Exception as err:  # mlflow raises many types for an unreachable server
            raise TrackingError(
                f"mlflow_tracking_uri: cannot use the MLflow tracking server at {tracking_uri!r} "
                f"({type(err).__name__}: {err})"
            ) from err
        if run_id and tags:
            self.set_tags(tags)
        self._queue: queue.Queue = queue.Queue()
        self._errors: list[str] = []
        self._undelivered: list = []
        self._failing = False
        self._thread = threading.Thread(target=self._send_loop, name="mlflow-batch", daemon=True)
        self._thread.start()

    def _check_reachable(self) -> None:
        """Fail in seconds, not after MLflow's minutes of retries, when the server is down."""
        if not self.tracking_uri.startswith(("http://", "https://")):
            return
        quick = {
            "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
            "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
            "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
        }
        saved = {k: os.environ.get(k) for k in quick}
        os.environ.update(quick)
        try:
            self.client.search_experiments(max_results=1)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def _send_loop(self) -> None:
        """Send queued metrics in batches. A batch the server refuses or cannot take (down,
        restarting) stays pending and goes again with the next batch, so an outage delays
        metrics instead of losing them; at the end, pending ones are retried for
        FINISH_RETRY_SECONDS and whatever still fails is kept in `_undelivered`."""
        from mlflow.entities import Metric

        pending: list = []
        deadline = time.monotonic() + FLUSH_SECONDS
        done = False
        while not done:
            try:
                item = self._queue.get(timeout=max(0.01, deadline - time.monotonic()))
                if item is None:
                    done = True
                else:
                    pending.extend(Metric(k, v, ts, st) for k, v, ts, st in item)
            except queue.Empty:
                pass
            if pending and (done or len(pending) >= BATCH_SIZE or time.monotonic() >= deadline):
                pending = self._deliver(pending)
            if time.monotonic() >= deadline:
                deadline = time.monotonic() + FLUSH_SECONDS
        give_up, wait = time.monotonic() + FINISH_RETRY_SECONDS, 1.0
        while pending and time.monotonic() < give_up:
            time.sleep(min(wait, max(0.0, give_up - time.monotonic())))
            wait = min(wait * 2, 10.0)
            pending = self._deliver(pending)
        self._undelivered.extend(pending)

    def _deliver(self, pending: list) -> list:
        """Send `pending` oldest first; return what is left after the first failure."""
        for start in range(0, len(pending), 1000):
            try:
                self.client.log_batch(self.run_id, metrics=pending[start : start + 1000])
            except Exception as err:  # keep training; retried later, reported at finish
                if not self._failing:
                    log.warning("MLflow: sending metrics failed, will retry (%s)", err)
                self._failing = True
                self._errors.append(f"{type(err).__name__}: {err}")
                left = pending[start:]
                if len(left) > MAX_PENDING:
                    self._undelivered.extend(left[: len(left) - MAX_PENDING])
                    left = left[len(left) - MAX_PENDING :]
                return left
        if self._failing:
            log.warning("MLflow: the server is back; %d delayed metric values sent", len(pending))
            self._failing = False
        return []

    def log_params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        flat = [Param(k, v) for k, v in _flatten(params).items()]
        for start in range(0, len(flat), 100):
            self.client.log_batch(self.run_id, params=flat[start : start + 100])

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        ts = int(time.time() * 1000)
        self._queue.put([(k, float(v), ts, step or 0) for k, v in metrics.items()])

    def log_summary(self, summary: Mapping[str, float]) -> None:
        self.log_metrics({k: v for k, v in summary.items() if isinstance(v, int | float)})

    def set_tags(self, tags: Mapping[str, str]) -> None:
        for k, v in tags.items():
            self.client.set_tag(self.run_id, k, str(v))

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        path = Path(path)
        if path.is_dir():
            self.client.log_artifacts(self.run_id, str(path), artifact_path)
        else:
            self.client.log_artifact(self.run_id, str(path), artifact_path)

    def log_figure(self, figure, artifact_file: str) -> None:
        try:
            self.client.log_figure(self.run_id, figure, artifact_file)
        except Exception as err:  # a figure is not worth failing a finished training for
            log.warning("MLflow: figure %s not stored (%s)", artifact_file, err)

    def log_pyfunc_model(self, model_dir: str | Path, input_example) -> str:
        import mlflow
        from mlflow.models import infer_signature

        from kubejax.mlflow_model import BertTextClassifier
        from kubejax.version import __version__

        probe = BertTextClassifier()
        probe._load(Path(model_dir))
        signature = infer_signature(input_example, probe.predict(None, input_example))
        mlflow.set_tracking_uri(self.tracking_uri)
        with mlflow.start_run(run_id=self.run_id):
            info = mlflow.pyfunc.log_model(
                name="model",
                python_model=BertTextClassifier(),
                artifacts={"model": str(model_dir)},
                signature=signature,
                input_example=input_example,
                pip_requirements=[f"kubejax=={__version__}"],
            )
        self.client.set_tag(self.run_id, "kubejax.model_uri", info.model_uri)
        return info.model_uri

    def start_system_metrics(self, node_id: str):
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        monitor = SystemMetricsMonitor(
            self.run_id,
            sampling_interval=SYSTEM_METRICS_SECONDS,
            samples_before_logging=1,
            node_id=node_id,
            tracking_uri=self.tracking_uri,
        )
        monitor.start()
        return monitor

    def skipped_run(self, name: str, params: Mapping[str, Any], tags: Mapping[str, str]) -> str:
        from mlflow.entities import Param

        exp_id = self.client.get_run(self.run_id).info.experiment_id
        all_tags = {**tags, "mlflow.parentRunId": self.run_id, "mlflow.runName": name}
        run_id = self.client.create_run(exp_id, tags=all_tags).info.run_id
        self.client.log_batch(run_id, params=[Param(k, str(v)) for k, v in params.items()])
        self.client.set_terminated(run_id, status="KILLED")
        return run_id

    def update_run(self, run_id: str, tags: Mapping[str, str], status: str | None = None) -> None:
        for k, v in tags.items():
            self.client.set_tag(run_id, k, str(v))
        if status is not None:
            self.client.set_terminated(run_id, status=status)

    def finish(self, status: str = "FINISHED") -> list[tuple]:
        self._queue.put(None)
        self._thread.join()
        lost = [(m.key, m.value, m.timestamp, m.step) for m in self._undelivered]
        if lost:
            log.warning(
                "MLflow: %d metric values of run %s could not be delivered (%d failed sends; "
                "first: %s)",
                len(lost),
                self.run_id,
                len(self._errors),
                self._errors[0] if self._errors else "?",
            )
        if not self.end_run:
            return lost
        try:
            self.client.set_terminated(self.run_id, status=status)
        except Exception as err:
            log.warning("MLflow: run %s not marked %s (%s)", self.run_id, status, err)
        return lost


def _artifact_location(tracking_uri: str) -> str | None:
    """Artifacts of a new experiment in a local sqlite store: beside the database.

    MLflow's default for database stores is `./mlruns` of whatever directory the process runs
    in, which scatters a run's models over working directories. Servers keep their own default.
    """
    if not tracking_uri.startswith("sqlite:///"):
        return None
    return (Path(tracking_uri.removeprefix("sqlite:///")).parent / "mlartifacts").resolve().as_uri()


def local_tracking_uri(workdir: str | Path) -> str:
    """The embedded default: an sqlite store in `workdir`."""
    path = Path(workdir).resolve() / "mlflow.db"
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"


def resolve_uri(tracking_uri: str | None = "") -> str:
    """The tracking URI in effect: the one given, else $MLFLOW_TRACKING_URI ('' = none)."""
    return tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "")


def create_tracker(
    tracking_uri: str | None,
    experiment: str,
    *,
    enabled: bool = True,
    **kwargs,
) -> Tracker:
    """An MlflowTracker when a URI is given (or $MLFLOW_TRACKING_URI is set), else a no-op."""
    uri = resolve_uri(tracking_uri)
    if not enabled or not uri:
        return Tracker()
    return MlflowTracker(uri, experiment, **kwargs)


#: Set by KFP's MLflow integration (2.17) in a task's container: the task's own run, under
#: which kubejax nests the runs it creates.
KFP_TASK_RUN_ENV = "MLFLOW_RUN_ID"
#: MLflow variables a task passes on to its job's workers. Credentials are not among them:
#: they reach the workers as secret references through the task's env passthrough, never as
#: plain values in a job manifest.
_WORKER_ENV = ("MLFLOW_EXPERIMENT_ID", "MLFLOW_WORKSPACE")


def kfp_task_run() -> str:
    """The KFP task's MLflow run id ('' outside KFP's MLflow integration)."""
    return os.environ.get(KFP_TASK_RUN_ENV, "")


def kfp_task_tracking(tracking_uri: str | None = "") -> dict:
    """`create_tracker` arguments that log into the KFP task's own run (KFP's MLflow
    integration: MLFLOW_RUN_ID on the server of MLFLOW_TRACKING_URI) instead of a run beside
    it, left for KFP to end; {} outside that integration or for another server."""
    run, server = kfp_task_run(), os.environ.get("MLFLOW_TRACKING_URI", "")
    if not run or (server and resolve_uri(tracking_uri) != server):
        return {}
    return {"run_id": run, "end_run": False}


def worker_env(tracking_uri: str) -> dict[str, str]:
    """The MLflow environment of a job's workers: the tracking URI in effect and KFP's
    experiment and workspace variables when the task has them."""
    env = {k: os.environ[k] for k in _WORKER_ENV if os.environ.get(k)}
    uri = resolve_uri(tracking_uri)
    if uri:
        env["MLFLOW_TRACKING_URI"] = uri
    return env


def kfp_tags(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Tags that link an MLflow run to its KFP run and task, from the pod's environment."""
    tags = {}
    for env, tag in (
        ("KFP_RUN_ID", "kfp.run_id"),
        ("KFP_RUN_NAME", "kfp.run_name"),
        ("KFP_TASK_NAME", "kfp.task_name"),
        ("KFP_POD_NAME", "kfp.pod_name"),
    ):
        if os.environ.get(env):
            tags[tag] = os.environ[env]
    tags.update(extra or {})
    return tags


def parse_tags(text: str) -> dict[str, str]:
    """A JSON object of tags; empty text gives none."""
    return {str(k): str(v) for k, v in json.loads(text).items()} if text else {}


def log_figures(tracking_uri: str | None, run_id: str, figures: Mapping[str, Any]) -> None:
    """Add matplotlib figures (by file name, under `training/`) to a run, finished or not."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(resolve_uri(tracking_uri))
    for name, fig in figures.items():
        client.log_figure(run_id, fig, f"training/{name}")


def register_model(tracking_uri: str | None, model_uri: str, name: str) -> str:
    """Register a logged model under `name` in the Model Registry; returns the version."""
    import mlflow

    uri = resolve_uri(tracking_uri)
    if not uri:
        raise TrackingError("mlflow_tracking_uri: required to register a model")
    if not name:
        raise TrackingError("model_name: required to register a model")
    mlflow.set_tracking_uri(uri)
    return str(mlflow.register_model(model_uri, name).version)


def search_runs(tracking_uri: str, experiment: str) -> list:
    """All runs of an experiment, newest first (mlflow.entities.Run objects)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise TrackingError(f"mlflow_experiment: no experiment {experiment!r} at {tracking_uri}")
    return client.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"])
