"""The Kubernetes TrainJob backend: Kubeflow Trainer v2 (`jax-distributed` runtime, or
kubejax's `jax-tpu` for jobs on a TPU slice).

It talks to the TrainJob CRD through the kubernetes client's CustomObjectsApi rather than the
Kubeflow SDK's TrainerClient: `TrainerClient.train` generates a random job name (a retried
launcher could not find the job it created), accepts env only as plain strings (no secret
references from the task's config) and builds the TrainJob itself (no runtime patches for the
task's volumes, node selector, tolerations and affinity). The same verbs as the JAXJob backends.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from kubejax.jobs import kueue
from kubejax.jobs.backend import Backend
from kubejax.jobs.kubernetes import api_client, default_namespace, stream_lines
from kubejax.jobs.spec import JAXJobSpec
from kubejax.jobs.trainjob import (
    API_GROUP,
    API_VERSION,
    CONTAINER,
    PLURAL,
    POD_JOB_LABEL,
    TPU_RUNTIME,
    build_trainjob_manifest,
    runtime_for,
)
from kubejax.jobs.types import FAILED, RUNNING, SUCCEEDED, SUSPENDED, JobStatus

VERSION = API_VERSION.split("/")[1]
_NOT_FOUND, _CONFLICT = 404, 409
#: The Job controller's label with a pod's completion index: the JAX process id.
_INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
#: TrainJob condition types → the job states every backend reports.
_STATES = {"Complete": SUCCEEDED, "Failed": FAILED, "Suspended": SUSPENDED}


def trainjob_status(obj: dict) -> JobStatus:
    """A TrainJob object's conditions in the states every backend reports (Complete becomes
    Succeeded; an active JobSet without a condition is Running)."""
    status = obj.get("status") or {}
    conditions = [
        {**c, "type": _STATES.get(c.get("type"), c.get("type"))}
        for c in status.get("conditions") or []
    ]
    jobs = status.get("jobsStatus") or []
    active = sum(int(j.get("active") or 0) for j in jobs)
    if active and not any(str(c.get("status")) == "True" for c in conditions):
        conditions.append({"type": RUNNING, "status": "True", "reason": "JobsActive"})
    replicas = {
        j.get("name", "node"): {k: j.get(k, 0) for k in ("active", "succeeded", "failed")}
        for j in jobs
    }
    return JobStatus(
        obj["metadata"]["name"],
        conditions,
        replicas,
        uid=obj["metadata"].get("uid", ""),
        progress=dict(status.get("trainerStatus") or {}),
    )


class TrainJobBackend(Backend):
    """TrainJobs on a cluster with Kubeflow Trainer v2.2+ and its `jax-distributed` runtime
    (`jax-tpu` for TPU jobs); `runtime` set: every job on that one."""

    def __init__(
        self,
        namespace: str | None = None,
        client_configuration=None,
        config_file: str | None = None,
        context: str | None = None,
        runtime: str = "",
    ):
        from kubernetes import client

        api = api_client(client_configuration, config_file, context)
        self.namespace = namespace or default_namespace()
        self.runtime = runtime
        self.custom = client.CustomObjectsApi(api)
        self.core = client.CoreV1Api(api)

    def _get(self, name: str) -> dict:
        return self.custom.get_namespaced_custom_object(
            API_GROUP, VERSION, self.namespace, PLURAL, name
        )

    def check_runtime(self, runtime: str) -> None:
        """The ClusterTrainingRuntime must exist; else a clear error naming what to install."""
        from kubernetes.client.rest import ApiException

        try:
            self.custom.get_cluster_custom_object(
                API_GROUP, VERSION, "clustertrainingruntimes", runtime
            )
        except ApiException as err:
            if err.status == _NOT_FOUND:
                install = (
                    "apply kubejax's: kubectl apply --server-side -f deploy/trainer/jax-tpu.yaml"
                    if runtime == TPU_RUNTIME
                    else "install Kubeflow Trainer v2.2 or later with its default runtimes "
                    "(they include jax-distributed)"
                )
                raise RuntimeError(
                    f"engine: the ClusterTrainingRuntime {runtime!r} is not installed; {install}"
                ) from err
            raise

    def create_job(self, spec: JAXJobSpec) -> str:
        from kubernetes.client.rest import ApiException

        try:
            self._get(spec.name)
            return spec.name  # a retried launcher re-attaches to the job it created
        except ApiException as err:
            if err.status != _NOT_FOUND:
                raise
        runtime = self.runtime or runtime_for(spec)
        self.check_runtime(runtime)
        manifest = build_trainjob_manifest(spec, runtime)
        manifest["metadata"]["namespace"] = self.namespace
        try:
            self.custom.create_namespaced_custom_object(
                API_GROUP, VERSION, self.namespace, PLURAL, manifest
            )
        except ApiException as err:
            if err.status != _CONFLICT:  # created meanwhile by another attempt
                raise
        return spec.name

    def get_job(self, name: str) -> JobStatus:
        from kubernetes.client.rest import ApiException

        try:
            return trainjob_status(self._get(name))
        except ApiException as err:
            if err.status == _NOT_FOUND:
                raise KeyError(f"TrainJob {self.namespace}/{name} not found") from err
            raise

    def queue_reason(self, status: JobStatus) -> str:
        return kueue.workload_reason(self.custom, self.namespace, status.uid)

    def list_jobs(self) -> list[JobStatus]:
        items = self.custom.list_namespaced_custom_object(
            API_GROUP, VERSION, self.namespace, PLURAL
        ).get("items", [])
        return [trainjob_status(o) for o in items]

    def _pods(self, name: str) -> list:
        pods = self.core.list_namespaced_pod(
            self.namespace, label_selector=f"{POD_JOB_LABEL}={name}"
        ).items
        return sorted(pods, key=lambda p: p.metadata.name)

    def _node_pod(self, name: str, node: int):
        for pod in self._pods(name):
            labels = pod.metadata.labels or {}
            if labels.get(_INDEX_LABEL, "0") == str(node):
                return pod
        return None

    def get_job_logs(self, name: str, follow: bool = False, worker: int = 0) -> Iterator[str]:
        """Log lines of node `worker` (its JAX process id); with `follow`, until it ends."""
        pod = self._node_pod(name, worker)
        while follow and (pod is None or pod.status.phase == "Pending"):
            if self.get_job(name).finished:
                break
            time.sleep(2)
            pod = self._node_pod(name, worker)
        if pod is None:
            return
        if not follow:
            text = self.core.read_namespaced_pod_log(
                pod.metadata.name, self.namespace, container=CONTAINER
            )
            yield from text.splitlines()
            return
        resp = self.core.read_namespaced_pod_log(
            pod.metadata.name,
            self.namespace,
            container=CONTAINER,
            follow=True,
            _preload_content=False,
        )
        yield from stream_lines(resp)

    def failure_log(self, name: str, lines: int = 40) -> str:
        from kubernetes.client.rest import ApiException

        try:
            pods = self._pods(name)
            failed = [p for p in pods if p.status.phase == "Failed"]
            pod = failed[0] if failed else self._node_pod(name, 0)
            if pod is None:
                return ""
            text = self.core.read_namespaced_pod_log(
                pod.metadata.name, self.namespace, container=CONTAINER, tail_lines=lines
            )
            return f"[{pod.metadata.name}]\n{text}"
        except ApiException:
            return ""

    def delete_job(self, name: str) -> None:
        from kubernetes.client.rest import ApiException

        try:
            self.custom.delete_namespaced_custom_object(
                API_GROUP, VERSION, self.namespace, PLURAL, name
            )
        except ApiException as err:
            if err.status != _NOT_FOUND:
                raise
