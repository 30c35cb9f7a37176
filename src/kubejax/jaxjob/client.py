"""One JAXJob client in front of two backends with the same verbs.

    client = JAXJobClient("local")          # or "kubernetes", or "auto"
    client.create_job(spec)
    client.wait_for_job_status(spec.name, timeout=3600)
    client.get_job_logs(spec.name)
    client.delete_job(spec.name)

`kubernetes` talks to a cluster's Training Operator; `local` starts the workers as processes on
this machine with the operator's environment contract. Everything that launches training (the
train step and every sweep trial) goes through this client.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from kubejax.jaxjob.spec import JAXJobSpec

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
POLL_SECONDS = 5.0
BACKENDS = ("auto", "kubernetes", "local")


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
    """A job's state as the operator reports it."""

    name: str
    conditions: list[dict] = field(default_factory=list)
    replica_statuses: dict = field(default_factory=dict)

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


def in_cluster() -> bool:
    """True inside a Kubernetes pod."""
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST"))


class JAXJobClient:
    """Create, watch, read and delete JAXJobs on the chosen backend."""

    def __init__(self, backend: str = "auto", **backend_options):
        if backend not in BACKENDS:
            raise ValueError(f"backend: {backend!r} is not one of {', '.join(BACKENDS)}")
        if backend == "auto":
            backend = "kubernetes" if in_cluster() else "local"
        self.backend_name = backend
        if backend == "kubernetes":
            from kubejax.jaxjob.kubernetes import KubernetesBackend

            self.backend = KubernetesBackend(**backend_options)
        else:
            from kubejax.jaxjob.local import LocalBackend

            self.backend = LocalBackend(**backend_options)

    def create_job(self, spec: JAXJobSpec) -> str:
        """Create the job; if one of that name exists already, attach to it. Returns the name."""
        return self.backend.create_job(spec)

    def get_job(self, name: str) -> JobStatus:
        """The job's current conditions and replica statuses."""
        return self.backend.get_job(name)

    def list_jobs(self) -> list[JobStatus]:
        """Every job this backend knows of (on kubernetes: in the namespace)."""
        return self.backend.list_jobs()

    def wait_for_job_status(
        self,
        name: str,
        status: set[str] | frozenset[str] = TERMINAL,
        timeout: float = 3600,
        polling_interval: float = POLL_SECONDS,
        callback: Callable[[JobStatus], None] | None = None,
    ) -> JobStatus:
        """Poll until the job's state is in `status`; TimeoutError after `timeout` seconds."""
        return self.backend.wait_for_job_status(
            name, set(status), timeout, polling_interval, callback
        )

    def get_job_logs(self, name: str, follow: bool = False, worker: int = 0) -> Iterator[str]:
        """Log lines of one worker (default 0); with `follow`, until it ends."""
        return self.backend.get_job_logs(name, follow=follow, worker=worker)

    def delete_job(self, name: str) -> None:
        """Delete the job and its workers."""
        self.backend.delete_job(name)
