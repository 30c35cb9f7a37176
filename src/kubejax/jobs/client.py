"""One JAXJob client in front of two backends with the same verbs.

    client = JAXJobClient("local")          # or "kubernetes", or "auto"
    client.create_job(spec)
    client.wait_for_job_status(spec.name, timeout=3600)
    client.get_job_logs(spec.name)
    client.delete_job(spec.name)

Backends (the "engine"): `trainjob` runs Kubeflow Trainer v2 TrainJobs on the `jax-distributed`
runtime, `jaxjob` Training Operator v1 JAXJobs, `local` starts the workers as processes on this
machine with either engine's environment contract. `kubernetes` asks the API server which of the
two CRDs it serves (TrainJob first); `auto` is that inside a cluster and `local` elsewhere.
Everything that launches training (the train step and every sweep trial) goes through this
client.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

from kubejax.jobs.backend import Backend
from kubejax.jobs.spec import JAXJobSpec
from kubejax.jobs.types import (  # noqa: F401  (re-exported: callers import them from here)
    CONDITION_TYPES,
    CREATED,
    FAILED,
    RESTARTING,
    RUNNING,
    SUCCEEDED,
    SUSPENDED,
    TERMINAL,
    EngineNotFoundError,
    JobFailedError,
    JobStatus,
)

POLL_SECONDS = 5.0
#: A local job's status is in memory: looking costs nothing, and a sweep trial on the tiny or
#: MiniLM model can end within seconds, so local jobs are looked at this often.
LOCAL_POLL_SECONDS = 0.2
BACKENDS = ("auto", "kubernetes", "trainjob", "jaxjob", "local")
CLUSTER_ENGINES = ("trainjob", "jaxjob")
#: (API group/version path, resource) that says a cluster serves each engine, preferred first.
_ENGINE_RESOURCES = {
    "trainjob": ("/apis/trainer.kubeflow.org/v1alpha1", "trainjobs"),
    "jaxjob": ("/apis/kubeflow.org/v1", "jaxjobs"),
}


def in_cluster() -> bool:
    """True inside a Kubernetes pod."""
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST"))


def served_engines(client_configuration=None) -> list[str]:
    """The engines whose CRD the API server serves (discovery), preferred first."""
    from kubernetes.client.rest import ApiException

    from kubejax.jobs.kubernetes import api_client

    api = api_client(client_configuration)
    found = []
    for engine, (path, resource) in _ENGINE_RESOURCES.items():
        try:
            data = api.call_api(path, "GET", response_type="object", auth_settings=["BearerToken"])[
                0
            ]
        except ApiException as err:
            if err.status == 404:
                continue
            raise
        if any(r.get("name") == resource for r in (data or {}).get("resources", [])):
            found.append(engine)
    return found


def resolve_engine(backend: str, client_configuration=None) -> str:
    """`auto` → a cluster engine inside a pod, else `local`; `kubernetes` → the first engine
    the cluster serves (TrainJob, then JAXJob); anything else as it is."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: {backend!r} is not one of {', '.join(BACKENDS)}")
    if backend == "auto":
        backend = "kubernetes" if in_cluster() else "local"
    if backend != "kubernetes":
        return backend
    engines = served_engines(client_configuration)
    if not engines:
        raise EngineNotFoundError(
            "backend: this cluster serves neither TrainJob (install Kubeflow Trainer v2.2 or "
            "later, with its jax-distributed runtime) nor JAXJob (install the Kubeflow "
            "Training Operator v1.9)"
        )
    return engines[0]


class JAXJobClient:
    """Create, watch, read and delete JAXJobs on the chosen backend."""

    def __init__(self, backend: str = "auto", **backend_options):
        self.engine = resolve_engine(backend, backend_options.get("client_configuration"))
        self._backend: Backend
        if self.engine == "trainjob":
            from kubejax.jobs.trainjob_backend import TrainJobBackend

            self._backend = TrainJobBackend(**backend_options)
        elif self.engine == "jaxjob":
            from kubejax.jobs.kubernetes import KubernetesBackend

            self._backend = KubernetesBackend(**backend_options)
        else:
            from kubejax.jobs.local import LocalBackend

            self._backend = LocalBackend(**backend_options)

    @property
    def on_cluster(self) -> bool:
        """True when jobs run on Kubernetes (their pods read data from the workspace)."""
        return self.engine in CLUSTER_ENGINES

    def poll_interval(self, requested: float) -> float:
        """Seconds between looks at a job: `requested` on a cluster (each look is an API call),
        at most LOCAL_POLL_SECONDS locally."""
        return requested if self.on_cluster else min(requested, LOCAL_POLL_SECONDS)

    @property
    def kind(self) -> str:
        """The kind of job this client creates, for messages."""
        return "TrainJob" if self.engine == "trainjob" else "JAXJob"

    def failure_log(self, name: str) -> str:
        """The last log lines of the job's failed worker (else of worker 0)."""
        return self._backend.failure_log(name)

    def create_job(self, spec: JAXJobSpec) -> str:
        """Create the job; if one of that name exists already, attach to it. Returns the name."""
        return self._backend.create_job(spec)

    def get_job(self, name: str) -> JobStatus:
        """The job's current conditions and replica statuses."""
        return self._backend.get_job(name)

    def list_jobs(self) -> list[JobStatus]:
        """Every job this backend knows of (on kubernetes: in the namespace)."""
        return self._backend.list_jobs()

    def wait_for_job_status(
        self,
        name: str,
        status: set[str] | frozenset[str] = TERMINAL,
        timeout: float = 3600,
        polling_interval: float = POLL_SECONDS,
        callback: Callable[[JobStatus], None] | None = None,
    ) -> JobStatus:
        """Poll until the job's state is in `status`; TimeoutError after `timeout` seconds."""
        return self._backend.wait_for_job_status(
            name, set(status), timeout, self.poll_interval(polling_interval), callback
        )

    def queue_reason(self, status: JobStatus) -> str:
        """Why a suspended job waits in Kueue ('' when no Workload says)."""
        return self._backend.queue_reason(status)

    def get_job_logs(self, name: str, follow: bool = False, worker: int = 0) -> Iterator[str]:
        """Log lines of one worker (default 0); with `follow`, until it ends."""
        return self._backend.get_job_logs(name, follow=follow, worker=worker)

    def delete_job(self, name: str) -> None:
        """Delete the job and its workers."""
        self._backend.delete_job(name)

    def custom_objects(self):
        """(kubernetes CustomObjectsApi, namespace) of a cluster backend, for the objects that
        sit beside its jobs (Katib's Experiments); ValueError on the local backend."""
        if not self.on_cluster:
            raise ValueError(f"backend: {self.engine} has no Kubernetes API")
        return self._backend.custom, self._backend.namespace

    def close(self) -> None:
        """Release the backend (the local one stops every job it started)."""
        self._backend.close()
