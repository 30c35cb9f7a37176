"""The Kubeflow Trainer v2 `TrainJob` built from the same job spec as a JAXJob.

Facts from Kubeflow Trainer v2.3.0 (this targets v2.2 and later, where pod-template settings
are `runtimePatches`; v2.0 named them `podSpecOverrides`, v2.1 `podTemplateOverrides`): the
built-in `ClusterTrainingRuntime` `jax-distributed` runs one replicated job `node` with one
container `node`, one JAX process per pod; its JAX plugin sets JAX_COORDINATOR_ADDRESS
(`<job>-node-0-0.<job>:29500`), JAX_NUM_PROCESSES and JAX_PROCESS_ID and opens port 29500.

Mapping of a `JAXJobSpec`: replicas → `trainer.numNodes`, resources → `trainer.resourcesPerNode`,
env → `trainer.env`, image/command/args → `trainer`; node selector, tolerations, affinity,
volumes, service account, pod labels and annotations, and the container's volume mounts →
one `runtimePatches` entry for job `node`; `activeDeadlineSeconds` as it is. Restarts come from
the runtime's JobSet failure policy, not from the spec (a TrainJob has no restartPolicy or
backoffLimit).

A job on a GKE TPU slice (the `cloud.google.com/gke-tpu-accelerator` node selector) points at
kubejax's `jax-tpu` runtime instead (deploy/trainer/jax-tpu.yaml): the same JobSet shape and JAX
plugin on kubejax's TPU image, since the built-in runtime's image holds JAX's CUDA backend, which
conflicts with the TPU one. Its pods belong to an Indexed Job, so GKE gives them the TPU
environment (TPU_WORKER_ID, TPU_WORKER_HOSTNAMES) itself.
"""

from __future__ import annotations

from kubejax import tpu
from kubejax.jobs.spec import LABEL_PREFIX, JAXJobSpec, drop_empty, job_labels, job_metadata

API_GROUP = "trainer.kubeflow.org"
API_VERSION = f"{API_GROUP}/v1alpha1"
KIND = "TrainJob"
PLURAL = "trainjobs"
RUNTIME = "jax-distributed"
#: kubejax's runtime for GKE TPU slices (deploy/trainer/jax-tpu.yaml).
TPU_RUNTIME = "jax-tpu"
RUNTIME_KIND = "ClusterTrainingRuntime"
REPLICATED_JOB = "node"
CONTAINER = "node"
PATCH_MANAGER = f"{LABEL_PREFIX}/launcher"
#: The label JobSet puts on every pod of a TrainJob.
POD_JOB_LABEL = "jobset.sigs.k8s.io/jobset-name"


def runtime_for(spec: JAXJobSpec) -> str:
    """The ClusterTrainingRuntime of a job: `jax-tpu` on a TPU slice, else `jax-distributed`."""
    return TPU_RUNTIME if tpu.ACCELERATOR_LABEL in spec.node_selector else RUNTIME


def build_trainjob_manifest(spec: JAXJobSpec, runtime: str = "") -> dict:
    """The `trainer.kubeflow.org/v1alpha1` TrainJob object for `spec`, as a plain dict, on
    `runtime` (empty: `runtime_for(spec)`)."""
    runtime = runtime or runtime_for(spec)
    labels = job_labels(spec)
    pod_spec = drop_empty(
        {
            "nodeSelector": spec.node_selector,
            "tolerations": spec.tolerations,
            "affinity": spec.affinity,
            "volumes": spec.volumes,
            "serviceAccountName": spec.service_account,
            "containers": (
                [{"name": CONTAINER, "volumeMounts": spec.volume_mounts}]
                if spec.volume_mounts
                else []
            ),
        }
    )
    pod_template = drop_empty(
        {
            # Copies: a shared dict would print as a YAML anchor.
            "metadata": drop_empty({"labels": dict(labels), "annotations": dict(spec.annotations)}),
            "spec": pod_spec,
        }
    )
    patch = {
        "manager": PATCH_MANAGER,
        "trainingRuntimeSpec": {
            "template": {
                "spec": {
                    "replicatedJobs": [
                        {"name": REPLICATED_JOB, "template": {"spec": {"template": pod_template}}}
                    ]
                }
            }
        },
    }
    trainer = drop_empty(
        {
            "image": spec.image,
            "command": spec.command,
            "args": spec.args,
            "env": spec.env,
            "numNodes": spec.replicas,
            "resourcesPerNode": spec.resources,
        }
    )
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": job_metadata(spec),
        "spec": drop_empty(
            {
                "runtimeRef": {"name": runtime, "kind": RUNTIME_KIND, "apiGroup": API_GROUP},
                "trainer": trainer,
                "runtimePatches": [patch],
                "activeDeadlineSeconds": spec.active_deadline_seconds,
            }
        ),
    }
