"""The verbs every job backend (local, jaxjob, trainjob) implements; the client calls only these.

Backends import this module and `types`, never the client that constructs them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator

from kubejax.jobs.spec import JAXJobSpec
from kubejax.jobs.types import JobStatus, poll_until


class Backend(ABC):
    """Create, read, follow and delete the jobs of one engine."""

    @abstractmethod
    def create_job(self, spec: JAXJobSpec) -> str:
        """Create the job; if one of that name exists already, attach to it. Returns the name."""

    @abstractmethod
    def get_job(self, name: str) -> JobStatus:
        """The job's current conditions and replica statuses; KeyError if there is none."""

    @abstractmethod
    def list_jobs(self) -> list[JobStatus]:
        """Every job this backend knows of (on a cluster: in the namespace)."""

    def wait_for_job_status(
        self,
        name: str,
        status: set[str],
        timeout: float,
        polling_interval: float,
        callback: Callable[[JobStatus], None] | None = None,
    ) -> JobStatus:
        """Poll until the job's state is in `status` or it has finished."""
        return poll_until(lambda: self.get_job(name), status, timeout, polling_interval, callback)

    def queue_reason(self, status: JobStatus) -> str:
        """Why a suspended job waits (its Kueue Workload's reason); '' when unknown."""
        return ""

    @abstractmethod
    def get_job_logs(self, name: str, follow: bool = False, worker: int = 0) -> Iterator[str]:
        """Log lines of one worker; with `follow`, until it ends."""

    @abstractmethod
    def failure_log(self, name: str, lines: int = 40) -> str:
        """The last log lines of the job's first failed worker (else of worker 0), headed by
        the worker's name; '' when there are none."""

    @abstractmethod
    def delete_job(self, name: str) -> None:
        """Delete the job and its workers; nothing if it is gone already."""

    def close(self) -> None:
        """Release what the backend holds (the local one stops its jobs)."""
        return None  # the cluster backends hold nothing that outlives a call
