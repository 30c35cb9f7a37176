"""The JAXJob spec (what to run) and the `kubeflow.org/v1` manifest built from it.

Facts from Training Operator v1.9.0: the only replica type is `Worker`; one container must be
named `jax` and expose the port named `jaxjob-port` (COORDINATOR_PORT); the job name is a
DNS-1035 label; the operator injects COORDINATOR_ADDRESS, COORDINATOR_PORT, NUM_PROCESSES,
PROCESS_ID and PYTHONUNBUFFERED into every container.

On a multi-host TPU slice (a GKE TPU node selector, several workers) the workers also get the
TPU environment GKE's webhook gives the pods of Indexed Jobs (JobSet's, so a TrainJob's), and not
a JAXJob's plain pods: TPU_WORKER_ID (the replica index, from the operator's pod label) and
TPU_WORKER_HOSTNAMES (the workers' names, which the operator's per-replica Services resolve).
JAX's Cloud TPU cluster detection and the TPU runtime read them to join the slice.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Any

from kubejax import tpu
from kubejax.errors import KubejaxError
from kubejax.jobs import kueue

API_VERSION = "kubeflow.org/v1"
KIND = "JAXJob"
PLURAL = "jaxjobs"
CONTAINER = "jax"
PORT_NAME = "jaxjob-port"
DEFAULT_PORT = 6666
RESTART_POLICIES = ("Never", "OnFailure", "Always", "ExitCode")
CLEAN_POD_POLICIES = ("All", "Running", "None")
LABEL_PREFIX = "kubejax.dev"
#: The Training Operator's pod label with the replica's index (its PROCESS_ID).
REPLICA_INDEX_LABEL = "training.kubeflow.org/replica-index"
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_MAX_NAME = 63


class SpecError(KubejaxError, ValueError):
    """A bad JAXJob setting; the message names it."""


def job_name(*parts: str, prefix: str = "kubejax") -> str:
    """A deterministic DNS-1035 job name from e.g. (KFP run id, task name).

    The same parts give the same name, so a retried launcher finds the job it created.
    """
    digest = hashlib.sha256("/".join(parts).encode()).hexdigest()[:10]
    stem = re.sub(r"[^a-z0-9-]+", "-", prefix.lower()).strip("-") or "job"
    stem = stem if stem[0].isalpha() else f"j-{stem}"
    return f"{stem[: _MAX_NAME - 11 - 7]}-{digest}"


def env_list(env: dict[str, str] | list[dict] | None) -> list[dict]:
    """Kubernetes env entries from a name → value mapping (or entries as they are)."""
    if not env:
        return []
    if isinstance(env, dict):
        return [{"name": k, "value": str(v)} for k, v in env.items()]
    return [dict(e) for e in env]


def resources(
    cpu: str | None = None,
    memory: str | None = None,
    gpus: int = 0,
    tpus: int = 0,
) -> dict:
    """Container resources with equal requests and limits."""
    limits: dict[str, Any] = {}
    if cpu:
        limits["cpu"] = str(cpu)
    if memory:
        limits["memory"] = str(memory)
    if gpus:
        limits["nvidia.com/gpu"] = int(gpus)
    if tpus:
        limits["google.com/tpu"] = int(tpus)
    if not limits:
        return {}
    requests = {k: v for k, v in limits.items() if k in ("cpu", "memory")}
    return {"limits": limits, **({"requests": requests} if requests else {})}


@dataclass
class JAXJobSpec:
    """Everything that describes one JAXJob; validated on construction."""

    name: str
    image: str
    command: list[str]
    args: list[str] = field(default_factory=list)
    replicas: int = 1
    namespace: str | None = None
    resources: dict = field(default_factory=dict)
    env: list[dict] = field(default_factory=list)
    volumes: list[dict] = field(default_factory=list)
    volume_mounts: list[dict] = field(default_factory=list)
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict] = field(default_factory=list)
    affinity: dict = field(default_factory=dict)
    restart_policy: str = "Never"
    backoff_limit: int | None = None
    active_deadline_seconds: int | None = None
    clean_pod_policy: str | None = None
    ttl_seconds_after_finished: int | None = None
    scheduling_policy: dict = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    service_account: str | None = None
    port: int = DEFAULT_PORT
    working_dir: str | None = None
    #: Kueue's LocalQueue and WorkloadPriorityClass for the job (`kubejax.jobs.kueue`).
    queue_name: str = ""
    priority_class: str = ""

    def __post_init__(self):
        if (
            not isinstance(self.name, str)
            or len(self.name) > _MAX_NAME
            or not _DNS1035.match(self.name)
        ):
            raise SpecError(
                f"name: {self.name!r} is not a DNS-1035 label (lower-case letters, digits and "
                f"'-', starting with a letter, at most {_MAX_NAME} characters)"
            )
        if not self.image:
            raise SpecError("image: required (every container needs an image)")
        if not self.command:
            raise SpecError("command: required")
        if not isinstance(self.replicas, int) or self.replicas < 1:
            raise SpecError(f"replicas: must be a positive integer, got {self.replicas!r}")
        if self.restart_policy not in RESTART_POLICIES:
            raise SpecError(
                f"restart_policy: {self.restart_policy!r} is not one of "
                f"{', '.join(RESTART_POLICIES)}"
            )
        if self.clean_pod_policy is not None and self.clean_pod_policy not in CLEAN_POD_POLICIES:
            raise SpecError(
                f"clean_pod_policy: {self.clean_pod_policy!r} is not one of "
                f"{', '.join(CLEAN_POD_POLICIES)}"
            )
        for name in ("backoff_limit", "active_deadline_seconds", "ttl_seconds_after_finished"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 0):
                raise SpecError(f"{name}: must be a non-negative integer, got {v!r}")
        if not 1 <= self.port <= 65535:
            raise SpecError(f"port: {self.port} is not a TCP port")
        for setting in ("queue_name", "priority_class"):
            try:
                kueue.check_name(setting, getattr(self, setting))
            except ValueError as err:
                raise SpecError(str(err)) from err
        self.command = [str(c) for c in self.command]
        self.args = [str(a) for a in self.args]
        self.env = env_list(self.env)


def drop_empty(d: dict) -> dict:
    """The entries of a manifest mapping that carry a value (None, {} and [] are left out)."""
    return {k: v for k, v in d.items() if v not in (None, {}, [])}


def job_labels(spec: JAXJobSpec) -> dict[str, str]:
    """The job's and its pods' labels: kubejax's job-name label and the spec's own."""
    return {f"{LABEL_PREFIX}/job-name": spec.name, **spec.labels}


def job_metadata(spec: JAXJobSpec) -> dict:
    """The metadata of the job object (JAXJob or TrainJob): its labels are its pods' and
    Kueue's (the queue and priority are the job's, not the pods')."""
    return drop_empty(
        {
            "name": spec.name,
            "namespace": spec.namespace,
            "labels": {**job_labels(spec), **kueue.labels(spec.queue_name, spec.priority_class)},
            "annotations": dict(spec.annotations),
        }
    )


def tpu_worker_env(spec: JAXJobSpec) -> list[dict]:
    """The TPU environment of a JAXJob's workers on a multi-host slice (see the module's
    docstring); none on one host, off TPUs, or where the spec sets a variable itself."""
    if spec.replicas < 2 or tpu.ACCELERATOR_LABEL not in spec.node_selector:
        return []
    hosts = ",".join(f"{spec.name}-worker-{i}" for i in range(spec.replicas))
    index = {"fieldRef": {"fieldPath": f"metadata.labels['{REPLICA_INDEX_LABEL}']"}}
    own = {e["name"] for e in spec.env}
    env = [
        {"name": "TPU_WORKER_ID", "valueFrom": index},
        {"name": "TPU_WORKER_HOSTNAMES", "value": hosts},
    ]
    return [e for e in env if e["name"] not in own]


def build_manifest(spec: JAXJobSpec) -> dict:
    """The `kubeflow.org/v1` JAXJob object for `spec`, as a plain dict."""
    container = drop_empty(
        {
            "name": CONTAINER,
            "image": spec.image,
            "command": spec.command,
            "args": spec.args,
            "ports": [{"name": PORT_NAME, "containerPort": spec.port}],
            "env": [*spec.env, *tpu_worker_env(spec)],
            "resources": spec.resources,
            "volumeMounts": spec.volume_mounts,
            "workingDir": spec.working_dir,
        }
    )
    pod_spec = drop_empty(
        {
            "containers": [container],
            "volumes": spec.volumes,
            "nodeSelector": spec.node_selector,
            "tolerations": spec.tolerations,
            "affinity": spec.affinity,
            "serviceAccountName": spec.service_account,
        }
    )
    labels = job_labels(spec)
    run_policy = drop_empty(
        {
            "backoffLimit": spec.backoff_limit,
            "activeDeadlineSeconds": spec.active_deadline_seconds,
            "cleanPodPolicy": spec.clean_pod_policy,
            "ttlSecondsAfterFinished": spec.ttl_seconds_after_finished,
            "schedulingPolicy": spec.scheduling_policy,
        }
    )
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": job_metadata(spec),
        "spec": {
            "jaxReplicaSpecs": {
                "Worker": {
                    "replicas": spec.replicas,
                    "restartPolicy": spec.restart_policy,
                    "template": {
                        "metadata": drop_empty(
                            {"labels": dict(labels), "annotations": dict(spec.annotations)}
                        ),
                        "spec": pod_spec,
                    },
                }
            },
            # Always present: the kubeflow-training SDK's model requires it.
            "runPolicy": run_policy,
        },
    }
