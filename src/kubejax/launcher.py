"""Training as a JAXJob, from inside a KFP task (or anywhere): the train component's body.

On a cluster the prepared data is copied into the pipeline workspace (a PVC that the task's
`dsl.TaskConfig` volumes mount in the JAXJob's pods too), the job writes checkpoints and the
final model there, and the model is copied back into the task's Model artifact. The local
backend runs the same job as processes on this machine.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import typing
from pathlib import Path
from typing import Any

from kubejax import tracking
from kubejax.jaxjob.client import JAXJobClient
from kubejax.jaxjob.launch import run_job
from kubejax.jaxjob.spec import JAXJobSpec, job_name
from kubejax.trainer.config import ConfigError, TrainConfig
from kubejax.trainer.outputs import METRICS_FILE, MODEL_DIR

TRAINER_COMMAND = ["python", "-m", "kubejax.trainer"]
_RESERVED = {"data_dir", "output_dir"}


def trainer_args(params: dict[str, Any]) -> list[str]:
    """Trainer flags from a mapping of TrainConfig field → value; unknown names are errors.

    KFP passes dict parameters as protobuf Structs, whose numbers are all doubles: integral
    values of int settings are turned back into ints.
    """
    hints = typing.get_type_hints(TrainConfig)
    args = []
    for key, value in params.items():
        if key not in hints:
            raise ConfigError(
                f"hyperparameters: {key!r} is not a trainer setting; known: "
                f"{', '.join(sorted(set(hints) - _RESERVED))}"
            )
        if value is None:
            continue
        if hints[key] is int and isinstance(value, float):
            if not value.is_integer():
                raise ConfigError(f"hyperparameters: {key} must be an integer, got {value}")
            value = int(value)
        if isinstance(value, dict):
            value = json.dumps(value)
        args += ["--" + key.replace("_", "-"), str(value)]
    return args


def check_hyperparameters(params: dict[str, Any]) -> None:
    """Validate trainer settings before any job is submitted: a typo such as
    schedule="cosin" fails here, in the launcher, instead of in every pod."""
    import argparse

    from kubejax.trainer.config import parser

    flags = parser()
    flags.exit_on_error = False  # a bad value raises instead of exiting the launcher
    try:
        values = flags.parse_args(trainer_args({"data_dir": "-", "output_dir": "-", **params}))
    except argparse.ArgumentError as err:
        raise ConfigError(f"hyperparameters: {err}") from err
    TrainConfig(**vars(values)).validate(check_paths=False)


def _task_config_fields(task_config) -> dict:
    """Pod settings from a `dsl.TaskConfig` (every field may be None, as under kfp.local)."""
    if task_config is None:
        return {}
    get = lambda name: getattr(task_config, name, None) or None  # noqa: E731
    out = {
        "resources": get("resources"),
        "env": get("env"),
        "volumes": get("volumes"),
        "volume_mounts": get("volume_mounts"),
        "node_selector": get("node_selector"),
        "tolerations": get("tolerations"),
        "affinity": get("affinity"),
    }
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
) -> JAXJobSpec:
    """The JAXJobSpec that trains with `hyperparameters` on `data_dir` into `output_dir`."""
    params = {**hyperparameters, "data_dir": data_dir, "output_dir": output_dir}
    check_hyperparameters(params)
    pod = _task_config_fields(task_config)
    env = list(pod.pop("env", []) or [])
    env += [{"name": k, "value": str(v)} for k, v in (extra_env or {}).items()]
    return JAXJobSpec(
        name=name,
        image=image,
        command=TRAINER_COMMAND,
        args=trainer_args(params),
        replicas=replicas,
        env=env,
        restart_policy=restart_policy,
        backoff_limit=backoff_limit,
        active_deadline_seconds=active_deadline_seconds,
        labels=labels or {},
        annotations=annotations or {},
        **pod,
    )


def kfp_labels(run_id: str, task: str) -> tuple[dict, dict]:
    """Labels and annotations that link a JAXJob to its KFP run and task."""
    labels = {"pipelines.kubeflow.org/run-id": run_id[:63]} if run_id else {}
    annotations = {"kubejax.dev/kfp-run-id": run_id, "kubejax.dev/kfp-task": task}
    return labels, annotations


def _copytree(src: Path, dst: Path) -> None:
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)


def stage_dataset(dataset_path: str | Path, target: Path) -> Path:
    """Copy a prepared dataset into the workspace, where the JAXJob's pods can read it.

    A retried task finds the complete copy of its first attempt and reuses it.
    """
    if not (target / "dataset_dict.json").exists():
        _copytree(Path(dataset_path), target)
    return target


def compilation_cache_env(workspace: str | Path) -> dict[str, str]:
    """Worker env that shares JAX's persistent compilation cache through the workspace: the
    sweep's trials and the final training compile the same programs once. A cache the task
    already has (set on the task, or by a local run) is kept: the workers get it too."""
    if not workspace or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return {}
    return {
        "JAX_COMPILATION_CACHE_DIR": str(Path(workspace) / "kubejax" / "jax-cache"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }


def train_with_jaxjob(
    *,
    dataset_path: str,
    model_path: str,
    hyperparameters: dict[str, Any],
    replicas: int = 1,
    image: str,
    backend: str = "auto",
    timeout: float = 24 * 3600,
    workspace: str = "",
    run_id: str = "",
    task_name: str = "train",
    task_config=None,
    mlflow_tracking_uri: str = "",
    restart_policy: str = "OnFailure",
    backoff_limit: int = 3,
    delete: str = "on_success",
    log=print,
) -> dict:
    """Run training as a JAXJob and put the final model folder at `model_path`.

    Returns the job's final metrics (metrics.json's `final`, plus `job_name`,
    `mlflow_run_id`, `output_dir`).
    """
    client = JAXJobClient(backend, **({"echo": log} if _is_local(backend) else {}))
    name = job_name(run_id or os.urandom(8).hex(), task_name, prefix=f"kubejax-{task_name}")
    if workspace:
        root = Path(workspace) / "kubejax" / name
        data_dir = stage_dataset(dataset_path, root / "data")
        output_dir = root / "output"
    else:
        data_dir = Path(dataset_path)
        output_dir = Path(model_path).parent / f"{name}-output"
    if client.on_cluster and not workspace:
        raise ConfigError("workspace: required on kubernetes (the JAXJob pods read data from it)")
    labels, annotations = kfp_labels(run_id, task_name)
    tags = {"kubejax.jaxjob": name, "kfp.run_id": run_id, "kfp.task_name": task_name}
    hp = dict(hyperparameters)
    hp["mlflow_tags"] = json.dumps({**json.loads(hp.get("mlflow_tags") or "{}"), **tags})
    if tracking.kfp_task_run():
        # Under KFP's MLflow integration the training run nests under the task's run.
        hp.setdefault("mlflow_parent_run_id", tracking.kfp_task_run())
    extra_env = {**tracking.worker_env(mlflow_tracking_uri), **compilation_cache_env(workspace)}
    spec = build_train_spec(
        name=name,
        image=image,
        replicas=replicas,
        data_dir=str(data_dir),
        output_dir=str(output_dir),
        hyperparameters=hp,
        task_config=task_config,
        restart_policy=restart_policy,
        backoff_limit=backoff_limit,
        active_deadline_seconds=int(timeout),
        labels=labels,
        annotations=annotations,
        extra_env=extra_env,
    )
    log(
        f"kubejax: launching {client.kind} {name} ({replicas} worker(s), "
        f"{client.backend_name} backend)"
    )
    run_job(client, spec, timeout=timeout + 60, delete=delete, log=log)
    metrics = json.loads((output_dir / METRICS_FILE).read_text())
    _copytree(output_dir / MODEL_DIR, Path(model_path))
    return {
        **metrics.get("final", {}),
        "job_name": name,
        "mlflow_run_id": metrics.get("mlflow_run_id", ""),
        "output_dir": str(output_dir),
        "history": {"train": metrics.get("train", []), "evals": metrics.get("evals", [])},
    }


def _is_local(backend: str) -> bool:
    from kubejax.jaxjob.client import in_cluster

    return backend == "local" or (backend == "auto" and not in_cluster())


def log_to_stdout(line: str) -> None:
    """Print a line and flush (KFP shows the task's stdout as its log)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
