"""Run one JAXJob to its end: create (or re-attach), stream worker-0's log, wait, clean up.

This is what the train component and every sweep trial call. On a cancelled KFP run the
launcher pod gets SIGTERM: the job is deleted before the launcher exits.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator

from kubejax.jobs.client import FAILED, TERMINAL, JAXJobClient, JobFailedError, JobStatus
from kubejax.jobs.spec import JAXJobSpec

DELETE_POLICIES = ("always", "on_success", "never")


@contextlib.contextmanager
def delete_on_sigterm(client: JAXJobClient, names: Callable[[], list[str]]) -> Iterator[None]:
    """While inside, SIGTERM deletes the jobs `names()` returns, then exits with 143."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        for name in names():
            with contextlib.suppress(Exception):
                client.delete_job(name)
        sys.exit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _stream(client: JAXJobClient, name: str, log: Callable[[str], None]) -> threading.Thread:
    def follow():
        with contextlib.suppress(Exception):  # the log stream ends when the job is deleted
            for line in client.get_job_logs(name, follow=True):
                log(f"[{name}-worker-0] {line}")

    thread = threading.Thread(target=follow, name=f"logs-{name}", daemon=True)
    thread.start()
    return thread


def run_job(
    client: JAXJobClient,
    spec: JAXJobSpec,
    *,
    timeout: float,
    delete: str = "on_success",
    log: Callable[[str], None] | None = print,
    polling_interval: float | None = None,
) -> JobStatus:
    """Create `spec` (or attach to the job of its name), wait until it ends or `timeout`.

    Raises JobFailedError (with the condition's reason and message and the failed worker's
    last log lines) when the job fails, TimeoutError when it runs past `timeout`; the job is
    deleted per `delete` (always, on_success, never), and always on timeout.
    """
    if delete not in DELETE_POLICIES:
        raise ValueError(f"delete: {delete!r} is not one of {', '.join(DELETE_POLICIES)}")
    name = client.create_job(spec)
    streamer = None
    if log is not None and client.on_cluster:
        streamer = _stream(client, name, log)
    kwargs = {} if polling_interval is None else {"polling_interval": polling_interval}
    with delete_on_sigterm(client, lambda: [name]):
        try:
            status = client.wait_for_job_status(name, TERMINAL, timeout=timeout, **kwargs)
        except TimeoutError:
            client.delete_job(name)
            raise
        if streamer is not None:
            streamer.join(timeout=10)
        if status.state == FAILED:
            cond = status.condition(FAILED) or {}
            tail = client.failure_log(name)
            if delete == "always":
                client.delete_job(name)
            raise JobFailedError(name, cond.get("reason", "Failed"), cond.get("message", ""), tail)
        if delete in ("always", "on_success"):
            client.delete_job(name)
        return status
