"""What every job backend reports: condition types, a job's status, a failed job's error.

The backends (local, jaxjob, trainjob) and the client that constructs them import these; none
of them imports the client.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kubejax.errors import KubejaxError

CREATED, RUNNING, RESTARTING, SUCCEEDED, FAILED, SUSPENDED = (
    "Created",
    "Running",
    "Restarting",
    "Succeeded",
    "Failed",
    "Suspended",
)
CONDITION_TYPES = (CREATED, RUNNING, RESTARTING, SUCCEEDED, FAILED, SUSPENDED)
TERMINAL = frozenset({SUCCEEDED, FAILED})


class JobFailedError(RuntimeError):
    """A JAXJob ended Failed; carries the condition's reason and the last log lines."""

    def __init__(self, name: str, reason: str, message: str, log_tail: str = ""):
        self.name, self.reason, self.message, self.log_tail = name, reason, message, log_tail
        text = f"JAXJob {name} failed: {reason}: {message}"
        if log_tail:
            text += f"\n--- last log lines ---\n{log_tail}"
        super().__init__(text)


@dataclass
class JobStatus:
    """A job's state as the operator reports it; `uid` the object's (its Kueue Workload's
    label); `progress` a TrainJob's `status.trainerStatus` (what its trainer reported)."""

    name: str
    conditions: list[dict] = field(default_factory=list)
    replica_statuses: dict = field(default_factory=dict)
    uid: str = ""
    progress: dict = field(default_factory=dict)

    @property
    def state(self) -> str:
        """The type of the latest true condition (Created when there is none yet)."""
        true = [c for c in self.conditions if str(c.get("status", "True")) == "True"]
        return true[-1]["type"] if true else CREATED

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL

    def condition(self, type_: str) -> dict | None:
        """The latest condition of a type, if any."""
        found = [c for c in self.conditions if c.get("type") == type_]
        return found[-1] if found else None


class EngineNotFoundError(KubejaxError, RuntimeError):
    """The cluster serves neither TrainJob nor JAXJob."""


def poll_until(
    get: Callable[[], JobStatus],
    status: set[str],
    timeout: float,
    polling_interval: float,
    callback: Callable[[JobStatus], None] | None = None,
) -> JobStatus:
    """Read a job's status until its state is in `status` or it has finished (a terminal
    state not asked for changes no more); TimeoutError after `timeout` seconds."""
    end = time.monotonic() + timeout
    while True:
        st = get()
        if callback is not None:
            callback(st)
        if st.state in status or st.finished:
            return st
        if time.monotonic() >= end:
            raise TimeoutError(f"job {st.name} did not reach {sorted(status)} in {timeout}s")
        time.sleep(min(polling_interval, max(end - time.monotonic(), 0.01)))
