"""Run one JAXJob to its end: create (or re-attach), stream worker-0's log, wait, clean up.

This is what the train component and every sweep trial call. On a cancelled KFP run the
launcher pod gets SIGTERM: the job is deleted before the launcher exits. A job that Kueue holds
(suspended until its queue admits it) is reported queued, with its Workload's reason, and its
timeout counts from admission; a TrainJob's progress (`status.trainerStatus`) is shown as it
changes.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator

from kubejax.jobs.client import (
    FAILED,
    POLL_SECONDS,
    SUSPENDED,
    JAXJobClient,
    JobFailedError,
    JobStatus,
)
from kubejax.jobs.spec import JAXJobSpec

DELETE_POLICIES = ("always", "on_success", "never")


@contextlib.contextmanager
def delete_on_sigterm(client: JAXJobClient, names: Callable[[], list[str]]) -> Iterator[None]:
    """While inside, SIGTERM deletes the jobs `names()` returns, then exits with 143."""

    def cleanup():
        for name in names():
            with contextlib.suppress(Exception):
                client.delete_job(name)

    with on_sigterm(cleanup):
        yield


@contextlib.contextmanager
def on_sigterm(cleanup: Callable[[], None]) -> Iterator[None]:
    """While inside, SIGTERM (a cancelled KFP run) calls `cleanup`, then exits with 143."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        cleanup()
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


def progress_line(progress: dict) -> str:
    """A TrainJob's `status.trainerStatus` in one line ('' when it has reported nothing):
    "42% done, 3m10s left, loss=0.51, eval_accuracy=0.62"."""
    parts = []
    if progress.get("progressPercentage") is not None:
        parts.append(f"{progress['progressPercentage']}% done")
    left = progress.get("estimatedRemainingSeconds")
    if left is not None:
        parts.append(f"{int(left) // 60}m{int(left) % 60:02d}s left")
    parts += [f"{m.get('name')}={m.get('value')}" for m in progress.get("metrics") or []]
    return ", ".join(parts)


def wait_for_end(
    client: JAXJobClient,
    name: str,
    *,
    timeout: float,
    polling_interval: float = POLL_SECONDS,
    log: Callable[[str], None] | None = print,
) -> JobStatus:
    """Read the job until it has finished; TimeoutError after `timeout` seconds of it being
    admitted: while Kueue holds it suspended the clock stands (each new reason it waits for is
    logged once). The progress a TrainJob's trainer reports is logged as it changes."""
    say = log or (lambda line: None)
    interval = client.poll_interval(polling_interval)
    deadline, queued, shown = None, None, ""
    while True:
        status = client.get_job(name)
        if status.finished:
            return status
        if status.state == SUSPENDED:
            deadline = None
            reason = client.queue_reason(status)
            if reason != queued:
                say(f"kubejax: {client.kind} {name} queued" + (f": {reason}" if reason else ""))
                queued = reason
        else:
            if deadline is None:
                deadline = time.monotonic() + timeout
                if queued is not None:
                    say(f"kubejax: {client.kind} {name} admitted; its timeout starts now")
                queued = None
            line = progress_line(status.progress)
            if line and line != shown:
                say(f"kubejax: {client.kind} {name}: {line}")
                shown = line
            if time.monotonic() >= deadline:
                raise TimeoutError(f"job {name} did not finish in {timeout}s of running")
        time.sleep(interval)


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
    interval = POLL_SECONDS if polling_interval is None else polling_interval
    with delete_on_sigterm(client, lambda: [name]):
        try:
            status = wait_for_end(client, name, timeout=timeout, polling_interval=interval, log=log)
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
