"""What launching the trainer as a job needs, whoever launches it (the train step, a sweep).

On a cluster the prepared data is copied into the pipeline workspace (a PVC that the task's
`dsl.TaskConfig` volumes mount in the job's pods too), the job writes checkpoints and the final
model there, and the launcher copies results back into the task's artifacts. The local backend
runs the same job as processes on this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from kubejax import tpu, tracking
from kubejax.errors import InfeasibleError
from kubejax.flags import to_flags
from kubejax.jobs.client import in_cluster
from kubejax.jobs.spec import LABEL_PREFIX, JAXJobSpec
from kubejax.trainer.config import ConfigError, TrainConfig, parser

TRAINER_COMMAND = ["python", "-m", "kubejax.trainer"]
GPU = "nvidia.com/gpu"
#: GKE taints TPU nodes `google.com/tpu=present:NoSchedule`; its admission adds this toleration
#: to pods that ask for chips, and it is spelled out so clusters without that admission (or a
#: Kueue flavor's own taints) schedule the workers too.
TPU_TOLERATION = {"key": tpu.RESOURCE, "operator": "Exists", "effect": "NoSchedule"}
#: The node label of a GKE node pool: a multi-host TPU slice is one node pool.
NODE_POOL_LABEL = "cloud.google.com/gke-nodepool"
#: Settings the launcher fills in itself.
RESERVED = ("data_dir", "output_dir")


def trainer_args(params: dict[str, Any]) -> list[str]:
    """Trainer flags from a mapping of TrainConfig field → value; unknown names are errors."""
    return to_flags(TrainConfig, params, where="hyperparameters", reserved=RESERVED)


def check_hyperparameters(params: dict[str, Any]) -> TrainConfig:
    """Validate trainer settings before any job is submitted: a typo such as
    schedule="cosin" fails here, in the launcher, instead of in every pod."""
    flags = parser()
    flags.exit_on_error = False  # a bad value raises instead of exiting the launcher
    try:
        values = flags.parse_args(trainer_args({"data_dir": "-", "output_dir": "-", **params}))
    except argparse.ArgumentError as err:
        raise ConfigError(f"hyperparameters: {err}") from err
    return TrainConfig(**vars(values)).validate(check_paths=False)


#: Trainer settings a component takes as parameters of their own (beside `hyperparameters`):
#: an empty string or 0 leaves the hyperparameters' value (or the trainer's default).
SETTING_PARAMS = ("mesh", "peft", "lora_rank", "lora_alpha", "lora_targets", "lora_dropout")


def with_settings(hyperparameters: dict, **settings) -> dict:
    """`hyperparameters` with the components' own setting parameters that are set."""
    unknown = set(settings) - set(SETTING_PARAMS)
    if unknown:
        raise TypeError(f"not a component setting: {', '.join(sorted(unknown))}")
    return {**hyperparameters, **{k: v for k, v in settings.items() if v not in ("", 0, None)}}


def with_mlflow_tags(hyperparameters: dict, tags: dict[str, str]) -> dict:
    """The settings with `tags` added to the user's own `mlflow_tags` (a JSON object)."""
    user = json.loads(hyperparameters.get("mlflow_tags") or "{}")
    return {**hyperparameters, "mlflow_tags": json.dumps({**user, **tags})}


def task_config_fields(task_config) -> dict:
    """Pod settings from a `dsl.TaskConfig` (every field may be None, as under kfp.local)."""
    if task_config is None:
        return {}
    names = (
        "resources",
        "env",
        "volumes",
        "volume_mounts",
        "node_selector",
        "tolerations",
        "affinity",
    )
    out = {name: getattr(task_config, name, None) or None for name in names}
    return {k: v for k, v in out.items() if v is not None}


def build_train_spec(
    *,
    name: str,
    image: str,
    replicas: int,
    data_dir: str,
    output_dir: str,
    hyperparameters: dict[str, Any],
    task_config=None,
    restart_policy: str = "OnFailure",
    backoff_limit: int = 3,
    active_deadline_seconds: int | None = None,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    extra_env: dict[str, str] | None = None,
    devices_per_worker: int = 0,
    accelerator: str = "",
    tpu_topology: str = "",
    queue_name: str = "",
    priority_class: str = "",
) -> JAXJobSpec:
    """The job that trains with `hyperparameters` on `data_dir` into `output_dir`, on
    `accelerator` (`place_workers`: `replicas` pods with `devices_per_worker` GPUs, or the hosts
    of a TPU slice of `tpu_topology`), in Kueue's `queue_name` at `priority_class` when set.
    `image` empty: kubejax's for the accelerator. Refused before submission when its mesh does
    not fit the devices or its memory plan the device (`kubejax.trainer.plan.check_job`)."""
    params = {**hyperparameters, "data_dir": data_dir, "output_dir": output_dir}
    cfg = check_hyperparameters(params)
    replicas, pod, shape = place_workers(
        task_config_fields(task_config),
        replicas=replicas,
        devices_per_worker=devices_per_worker,
        accelerator=accelerator,
        tpu_topology=tpu_topology,
        job=name,
    )
    check_job(cfg, replicas, pod, shape)
    env = list(pod.pop("env", []) or [])
    env += [{"name": k, "value": str(v)} for k, v in (extra_env or {}).items()]
    return JAXJobSpec(
        name=name,
        image=tpu.image_for(accelerator, image),
        command=TRAINER_COMMAND,
        args=trainer_args(params),
        replicas=replicas,
        env=env,
        restart_policy=restart_policy,
        backoff_limit=backoff_limit,
        active_deadline_seconds=active_deadline_seconds,
        labels=labels or {},
        annotations=annotations or {},
        queue_name=queue_name,
        priority_class=priority_class,
        **pod,
    )


def pod_resources(pod: dict, devices_per_worker: int) -> dict:
    """The pods' resources (`task_config_fields`) with `devices_per_worker` GPUs as their
    `nvidia.com/gpu` limit (0: as they are)."""
    if devices_per_worker < 0:
        raise ConfigError(f"devices_per_worker: must be 0 or more, got {devices_per_worker}")
    resources = dict(pod.get("resources") or {})
    if devices_per_worker:
        resources["limits"] = {**resources.get("limits", {}), GPU: devices_per_worker}
    return resources


def _limit(pod: dict, resource: str) -> int:
    return int((pod.get("resources") or {}).get("limits", {}).get(resource) or 0)


#: The settings `place_workers` names in its errors, as the components and pipelines call them.
SETTING_NAMES = {
    "accelerator": "accelerator",
    "tpu_topology": "tpu_topology",
    "replicas": "replicas",
    "devices_per_worker": "devices_per_worker",
    "gpus_per_worker": "gpus_per_worker",
}


def place_workers(
    pod: dict,
    *,
    replicas: int,
    devices_per_worker: int = 0,
    accelerator: str = "",
    tpu_topology: str = "",
    job: str = "",
    names: dict[str, str] | None = None,
) -> tuple[int, dict, tpu.SliceShape | None]:
    """The job's worker count, its pods' settings (`task_config_fields`) and its TPU slice
    (None off TPUs), from the accelerator settings (`kubejax.tpu`):

    - `nvidia` (or empty): as before, `devices_per_worker` GPUs a pod (0: the task's own
      resources; no GPUs: one CPU device a pod);
    - `cpu`: no GPUs at all (the task's or `devices_per_worker`);
    - a TPU type: the slice of `tpu_topology`, one worker a host (`replicas` 0 or the slice's
      hosts), `google.com/tpu` the chips of a host (`devices_per_worker` or the task's limit 0,
      or one of the type's host shapes), GKE's node selectors and the TPU taint's toleration,
      and on several hosts every pod of `job` in one node pool (`one_node_pool`); no GPUs.

    `replicas` 0 off TPUs means one worker. TPUError names the setting that contradicts, by
    its name in `names` (SETTING_NAMES' keys; the components' names by default)."""
    said = {**SETTING_NAMES, **(names or {})}
    name = tpu.check_accelerator(accelerator, said["accelerator"])
    if devices_per_worker < 0:
        raise ConfigError(
            f"{said['devices_per_worker']}: must be 0 or more, got {devices_per_worker}"
        )
    pod = dict(pod)
    gpus = _limit(pod, GPU)
    if name not in tpu.TPU_TYPES:
        if tpu_topology:
            # A topology needs a TPU type: this raises, naming the choices.
            tpu.tpu_slice(name, tpu_topology, setting=said["tpu_topology"])
        if name == tpu.CPU and (devices_per_worker or gpus):
            raise tpu.TPUError(
                f"{said['gpus_per_worker']}: accelerator cpu takes no GPUs, but the workers ask "
                f"{devices_per_worker or gpus} {GPU}; set it to 0, or accelerator nvidia"
            )
        pod["resources"] = pod_resources(pod, devices_per_worker)
        return replicas or 1, pod, None
    if gpus:
        raise tpu.TPUError(
            f"{said['gpus_per_worker']}: accelerator {name} takes no GPUs, but the workers ask "
            f"{GPU}: {gpus}; set it to 0"
        )
    shape = tpu.tpu_slice(
        name,
        tpu_topology,
        devices_per_worker or _limit(pod, tpu.RESOURCE),
        setting=said["tpu_topology"],
        host_setting=said["devices_per_worker"],
    )
    workers = tpu.workers(shape, replicas, said["replicas"])
    selector = dict(pod.get("node_selector") or {})
    for key, value in shape.node_selector.items():
        if selector.get(key, value) != value:
            raise tpu.TPUError(
                f"worker_node_selector: {key}={selector[key]} contradicts accelerator {name} "
                f"and {said['tpu_topology']} {shape.topology} ({key}={value}); leave it out"
            )
    pod["node_selector"] = {**selector, **shape.node_selector}
    resources = dict(pod.get("resources") or {})
    resources["limits"] = {**resources.get("limits", {}), tpu.RESOURCE: shape.chips_per_host}
    pod["resources"] = resources
    tolerations = list(pod.get("tolerations") or [])
    pod["tolerations"] = tolerations + ([] if TPU_TOLERATION in tolerations else [TPU_TOLERATION])
    if shape.hosts > 1 and job:
        pod["affinity"] = one_node_pool(pod.get("affinity"), job)
    return workers, pod, shape


def one_node_pool(affinity: dict | None, job: str) -> dict:
    """`affinity` with every pod of `job` required in one GKE node pool: a multi-host slice is
    one node pool, and a node selector on type and topology alone would let the workers of
    one job land on two slices of the same shape (whose chips share no interconnect)."""
    affinity = dict(affinity or {})
    pod_affinity = dict(affinity.get("podAffinity") or {})
    term = {
        "labelSelector": {"matchLabels": {f"{LABEL_PREFIX}/job-name": job}},
        "topologyKey": NODE_POOL_LABEL,
    }
    required = list(pod_affinity.get("requiredDuringSchedulingIgnoredDuringExecution") or [])
    pod_affinity["requiredDuringSchedulingIgnoredDuringExecution"] = [*required, term]
    return {**affinity, "podAffinity": pod_affinity}


def check_mesh(cfg: TrainConfig, shape: tpu.SliceShape) -> None:
    """The mesh against a TPU slice's chips, the refusal naming the slice."""
    from kubejax.trainer import sharding  # JAX: only when checking

    try:
        sharding.parse_mesh(cfg.mesh, shape.chips)
    except sharding.MeshError as err:
        raise InfeasibleError(f"{err}; the slice is {shape.describe()}") from err


def check_job(
    cfg: TrainConfig,
    replicas: int,
    pod: dict,
    shape: tpu.SliceShape | None = None,
    model_cfg=None,
) -> None:
    """The mesh against the job's devices (replicas × the pods' GPUs or TPU chips, one device a
    CPU pod; on a TPU slice, named with it), the memory plan against the device's memory
    (`kubejax.trainer.plan.check_job`, which reads the chip's from the TPU node selector and
    settles `auto` micro-batches and remat as the trainer will), from `model_cfg` where given
    (the model's config.json read by `plan.model_config_file`)."""
    from kubejax.trainer import plan  # JAX, for the mesh and the shapes: only when checking

    if shape is not None:
        check_mesh(cfg, shape)
    plan.check_job(cfg, replicas, devices_per_pod(pod), pod.get("node_selector"), model_cfg)


def devices_per_pod(pod: dict) -> int:
    """The devices of one pod: its GPUs or TPU chips (0: a CPU pod, one device)."""
    return _limit(pod, GPU) or _limit(pod, tpu.RESOURCE)


def kfp_labels(run_id: str, task: str) -> tuple[dict, dict]:
    """Labels and annotations that link a job to its KFP run and task."""
    labels = {"pipelines.kubeflow.org/run-id": run_id[:63]} if run_id else {}
    annotations = {"kubejax.dev/kfp-run-id": run_id, "kubejax.dev/kfp-task": task}
    return labels, annotations


def copytree(src: Path, dst: Path) -> None:
    """Copy a folder over whatever `dst` holds."""
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)


def task_root(workspace: str, name: str, fallback: Path) -> Path:
    """The folder of one task's job (or study): `<workspace>/kubejax/<name>` when the pipeline
    has a workspace, else `fallback` (a folder beside the task's outputs)."""
    root = Path(workspace) / "kubejax" / name if workspace else fallback
    root.mkdir(parents=True, exist_ok=True)
    return root


def stage_dataset(dataset_path: str | Path, workspace: str, root: Path) -> Path:
    """Where the job's pods read the prepared dataset: a copy in the workspace (a retried task
    finds the complete copy of its first attempt and reuses it), or the artifact itself when
    there is no workspace (local runs)."""
    if not workspace:
        return Path(dataset_path)
    target = root / "data"
    if not (target / "dataset_dict.json").exists():
        copytree(Path(dataset_path), target)
    return target


#: glibc's malloc tunable for trainer processes: transparent huge pages for its large blocks.
#: XLA's CPU runtime allocates a step's temporaries in one block (1.45 GB for MiniLM at batch
#: 32) and frees it after the step; with 4 KiB pages every step faulted it in again (2.9 M page
#: faults in 8 steps) and a step took 1.73 s, 1.28 s with this (bench/NOTES.md). glibc 2.35 and
#: later read it, older ones ignore it; it takes effect where the kernel's THP mode is
#: `madvise` (most distributions) or `always`. The image sets it for every process too.
MALLOC_TUNABLE = "glibc.malloc.hugetlb=1"


def glibc_tunables(current: str = "") -> str:
    """`GLIBC_TUNABLES` with MALLOC_TUNABLE added to `current`; a hugetlb setting of the
    user's own is kept as it is."""
    parts = [part for part in current.split(":") if part]
    if not any(part.startswith("glibc.malloc.hugetlb=") for part in parts):
        parts.append(MALLOC_TUNABLE)
    return ":".join(parts)


def worker_env(workspace: str, tracking_uri: str) -> dict[str, str]:
    """Environment of the job's workers: MLflow's, glibc's malloc tunable (MALLOC_TUNABLE),
    and JAX's persistent compilation cache shared through the workspace (the sweep's trials
    and the final training compile the same programs once). A cache the task already has (set
    on the task, or by a local run) is kept: the workers get it too."""
    env = tracking.worker_env(tracking_uri)
    env["GLIBC_TUNABLES"] = glibc_tunables(os.environ.get("GLIBC_TUNABLES", ""))
    if workspace and not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        env["JAX_COMPILATION_CACHE_DIR"] = str(Path(workspace) / "kubejax" / "jax-cache")
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    return env


def is_local(backend: str) -> bool:
    """True when `backend` runs the job as processes on this machine."""
    return backend == "local" or (backend == "auto" and not in_cluster())


def log_to_stdout(line: str) -> None:
    """Print a line and flush (KFP shows the task's stdout as its log)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
