"""The Kubernetes JAXJob backend: the kubeflow-training SDK's TrainingClient.

The SDK creates, polls and deletes the job and reads pod logs; the kubernetes client fills in
where the SDK falls short (reading a job as a plain dict, listing the namespace's jobs).
Configuration: in-cluster inside a pod, else the kubeconfig; the namespace is the pod's service
account's unless given.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

from kubejax.jobs import kueue
from kubejax.jobs.backend import Backend
from kubejax.jobs.spec import API_VERSION, KIND, PLURAL, JAXJobSpec, build_manifest
from kubejax.jobs.types import JobStatus

GROUP, VERSION = API_VERSION.split("/")
_SA_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
_CONFLICT = 409
_NOT_FOUND = 404


def default_namespace() -> str:
    """The pod's own namespace, else the kubeconfig context's, else `default`."""
    if _SA_NAMESPACE.is_file():
        return _SA_NAMESPACE.read_text().strip()
    try:
        from kubernetes import config

        _, context = config.list_kube_config_contexts()
        return context.get("context", {}).get("namespace") or "default"
    except Exception:  # no kubeconfig
        return "default"


def api_client(
    client_configuration=None, config_file: str | None = None, context: str | None = None
):
    """A kubernetes ApiClient: from `client_configuration` when given, else in-cluster inside a
    pod, else the kubeconfig ($KUBECONFIG read now: the client library reads it once, at import)."""
    from kubernetes import client, config

    if client_configuration is not None:
        return client.ApiClient(client_configuration)
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config(
            config_file=config_file or os.environ.get("KUBECONFIG"), context=context
        )
    return client.ApiClient()


def stream_lines(resp) -> Iterator[str]:
    """Lines of a followed pod log (an unpreloaded response), as they arrive."""
    buf = b""
    for chunk in resp.stream(4096):
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            yield line.decode("utf-8", "replace")
    if buf:
        yield buf.decode("utf-8", "replace")


class _Response:
    """What the SDK's ApiClient.deserialize expects: an object with JSON `data`."""

    def __init__(self, obj: dict):
        self.data = json.dumps(obj)


class KubernetesBackend(Backend):
    """JAXJobs on a cluster with the Kubeflow Training Operator (v1.9 or later)."""

    def __init__(
        self,
        namespace: str | None = None,
        client_configuration=None,
        config_file: str | None = None,
        context: str | None = None,
    ):
        from kubeflow.training import TrainingClient

        self.namespace = namespace or default_namespace()
        self.sdk = TrainingClient(
            config_file=config_file,
            context=context,
            client_configuration=client_configuration,
            namespace=self.namespace,
            job_kind=KIND,
        )
        self.custom = self.sdk.custom_api

    def _get(self, name: str) -> dict:
        return self.sdk.custom_api.get_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, name
        )

    def create_job(self, spec: JAXJobSpec) -> str:
        from kubernetes.client.rest import ApiException

        try:
            self._get(spec.name)
            return spec.name  # a retried launcher re-attaches to the job it created
        except ApiException as err:
            if err.status != _NOT_FOUND:
                raise
        manifest = build_manifest(spec)
        manifest["metadata"]["namespace"] = self.namespace
        job = self.sdk.api_client.deserialize(_Response(manifest), "KubeflowOrgV1JAXJob")
        try:
            self.sdk.create_job(job=job, namespace=self.namespace)
        except RuntimeError as err:
            cause = err.__cause__
            if isinstance(cause, ApiException) and cause.status == _CONFLICT:
                return spec.name  # created meanwhile by another attempt
            raise
        return spec.name

    @staticmethod
    def _status(obj: dict) -> JobStatus:
        status = obj.get("status") or {}
        return JobStatus(
            obj["metadata"]["name"],
            list(status.get("conditions") or []),
            dict(status.get("replicaStatuses") or {}),
            uid=obj["metadata"].get("uid", ""),
        )

    def queue_reason(self, status: JobStatus) -> str:
        return kueue.workload_reason(self.sdk.custom_api, self.namespace, status.uid)

    def get_job(self, name: str) -> JobStatus:
        from kubernetes.client.rest import ApiException

        try:
            return self._status(self._get(name))
        except ApiException as err:
            if err.status == _NOT_FOUND:
                raise KeyError(f"JAXJob {self.namespace}/{name} not found") from err
            raise

    def list_jobs(self) -> list[JobStatus]:
        items = self.sdk.custom_api.list_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL
        ).get("items", [])
        return [self._status(o) for o in items]

    def wait_for_job_status(self, name, status, timeout, polling_interval, callback=None):
        def on_poll(job):
            if callback is not None:
                callback(self._status(self.sdk.api_client.sanitize_for_serialization(job)))

        # Failed is always a condition to stop at: the caller decides what it means.
        self.sdk.wait_for_job_conditions(
            name,
            namespace=self.namespace,
            job_kind=KIND,
            expected_conditions=set(status) | {"Failed"},
            wait_timeout=int(timeout),
            polling_interval=polling_interval,
            callback=on_poll,
        )
        return self.get_job(name)

    def _worker_pod(self, name: str, worker: int) -> str:
        return f"{name}-worker-{worker}"

    def get_job_logs(self, name: str, follow: bool = False, worker: int = 0) -> Iterator[str]:
        from kubernetes.client.rest import ApiException

        pod = self._worker_pod(name, worker)
        core = self.sdk.core_api
        if follow:
            # Wait for the pod to leave Pending before following its log.
            while True:
                try:
                    phase = core.read_namespaced_pod(pod, self.namespace).status.phase
                except ApiException as err:
                    if err.status != _NOT_FOUND:
                        raise
                    phase = None
                if phase in ("Running", "Succeeded", "Failed"):
                    break
                if self.get_job(name).finished:
                    return
                time.sleep(2)
            resp = core.read_namespaced_pod_log(
                pod, self.namespace, container="jax", follow=True, _preload_content=False
            )
            yield from stream_lines(resp)
            return
        try:
            text = core.read_namespaced_pod_log(pod, self.namespace, container="jax")
        except ApiException as err:
            if err.status == _NOT_FOUND:
                return
            raise
        yield from text.splitlines()

    def failure_log(self, name: str, lines: int = 40) -> str:
        from kubernetes.client.rest import ApiException

        pod = self._worker_pod(name, 0)
        try:
            pods = self.sdk.core_api.list_namespaced_pod(
                self.namespace, label_selector=f"training.kubeflow.org/job-name={name}"
            ).items
            failed = sorted(p.metadata.name for p in pods if p.status.phase == "Failed")
            pod = failed[0] if failed else pod
            text = self.sdk.core_api.read_namespaced_pod_log(
                pod, self.namespace, container="jax", tail_lines=lines
            )
            return f"[{pod}]\n{text}"
        except ApiException:
            return ""

    def delete_job(self, name: str) -> None:
        from kubernetes.client.rest import ApiException

        try:
            self.sdk.custom_api.delete_namespaced_custom_object(
                GROUP, VERSION, self.namespace, PLURAL, name
            )
        except ApiException as err:
            if err.status != _NOT_FOUND:
                raise
