"""One training as a job: the train component's work.

    outcome = train_task(dataset_path, model_path, base_model="...", hyperparameters={...})

The job's final model lands at `model_path`; the outcome carries the figures, the model's
metadata and the HTML report the component logs.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubejax import monitoring, report, tpu, tracking
from kubejax.jobs.client import JAXJobClient
from kubejax.jobs.launch import run_job
from kubejax.jobs.spec import job_name
from kubejax.launchers.common import (
    SETTING_PARAMS,
    build_train_spec,
    copytree,
    is_local,
    kfp_labels,
    log_to_stdout,
    stage_dataset,
    task_root,
    with_mlflow_tags,
    with_settings,
    worker_env,
)
from kubejax.outputs import METRICS_FILE, MODEL_DIR
from kubejax.trainer.config import ConfigError

#: The figures the train step reports in the KFP UI (metrics.json's `final`).
FINAL_METRICS = (
    "train_loss",
    "train_accuracy",
    "eval_loss",
    "eval_accuracy",
    "examples_per_s",
    "tokens_per_s",
    "wall_s",
    "steps",
)


def train_with_jaxjob(
    *,
    dataset_path: str,
    model_path: str,
    hyperparameters: dict[str, Any],
    replicas: int = 1,
    devices_per_worker: int = 0,
    accelerator: str = "nvidia",
    tpu_topology: str = "",
    image: str = "",
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
    queue_name: str = "",
    priority_class: str = "",
    log=print,
) -> dict:
    """Run training as a job and put the final model folder at `model_path`: `replicas`
    workers of `devices_per_worker` GPUs, or on `accelerator` a TPU slice of `tpu_topology`
    (`kubejax.launchers.common.place_workers`); `image` empty: kubejax's for the accelerator.

    Returns the job's metrics.json (`final`, `train`, `evals`, ...) plus `job_name` and
    `output_dir`.
    """
    client = JAXJobClient(backend, **({"echo": log} if is_local(backend) else {}))
    if client.on_cluster and not workspace:
        raise ConfigError("workspace: required on kubernetes (the job's pods read data from it)")
    name = job_name(run_id or os.urandom(8).hex(), task_name, prefix=f"kubejax-{task_name}")
    root = task_root(workspace, name, Path(model_path).parent / f"{name}-output")
    output_dir = root / "output" if workspace else root
    hp = with_mlflow_tags(
        hyperparameters,
        {"kubejax.jobs": name, "kfp.run_id": run_id, "kfp.task_name": task_name},
    )
    if tracking.kfp_task_run():
        # Under KFP's MLflow integration the training run nests under the task's run.
        hp.setdefault("mlflow_parent_run_id", tracking.kfp_task_run())
    labels, annotations = kfp_labels(run_id, task_name)
    spec = build_train_spec(
        name=name,
        image=image,
        replicas=replicas,
        data_dir=str(stage_dataset(dataset_path, workspace, root)),
        output_dir=str(output_dir),
        hyperparameters=hp,
        task_config=task_config,
        restart_policy=restart_policy,
        backoff_limit=backoff_limit,
        active_deadline_seconds=int(timeout),
        labels=labels,
        annotations=annotations,
        extra_env=worker_env(workspace, tracking.resolve_uri(mlflow_tracking_uri)),
        devices_per_worker=devices_per_worker,
        accelerator=accelerator,
        tpu_topology=tpu_topology,
        queue_name=queue_name,
        priority_class=priority_class,
    )
    on = f", {accelerator} {tpu_topology}" if tpu.is_tpu(accelerator) else ""
    log(
        f"kubejax: launching {client.kind} {name} ({spec.replicas} worker(s){on}, "
        f"{client.engine} engine)"
    )
    run_job(client, spec, timeout=timeout + 60, delete=delete, log=log)
    metrics = json.loads((output_dir / METRICS_FILE).read_text())
    copytree(output_dir / MODEL_DIR, Path(model_path))
    return {**metrics, "job_name": name, "output_dir": str(output_dir)}


@dataclass
class TrainOutcome:
    """What the train component logs: figures, the model's metadata, the HTML report."""

    metrics: dict[str, float]
    model_metadata: dict[str, str]
    report_html: str
    mlflow_run_id: str
    job_name: str


def train_task(
    dataset_path: str,
    model_path: str,
    *,
    base_model: str,
    hyperparameters: dict[str, Any] | None = None,
    best_params: dict[str, Any] | None = None,
    mlflow_experiment: str = "kubejax",
    image: str = "",
    **launch,
) -> TrainOutcome:
    """Train `base_model` with `hyperparameters` overridden by `best_params` (a sweep's, whose
    `replicas` sets the worker count), as a job (`launch`: the keywords of
    `train_with_jaxjob`, or the train component's parameters by their names, its setting
    parameters (`SETTING_PARAMS`) included); the figures and report of the run."""
    settings = {k: launch.pop(k) for k in SETTING_PARAMS if k in launch}
    renamed = {"timeout_seconds": "timeout", "workspace_path": "workspace"}
    launch = {renamed.get(k, k): v for k, v in launch.items()}
    best = dict(best_params or {})
    # On a TPU the slice sets the final training's workers and chips: a searched resource of
    # the trials' (maybe smaller) slice does not carry over.
    on_tpu = tpu.is_tpu(launch.get("accelerator", ""))
    for resource in ("replicas", "devices_per_worker"):
        if resource in best:
            value = int(best.pop(resource))
            if not on_tpu:
                launch[resource] = value
    hp = {**with_settings(hyperparameters or {}, **settings), **best}
    hp["model"] = base_model
    hp.setdefault("mlflow_experiment", mlflow_experiment)
    result = train_with_jaxjob(
        dataset_path=dataset_path,
        model_path=model_path,
        hyperparameters=hp,
        image=image,
        log=log_to_stdout,
        **launch,
    )
    final, resources = result["final"], monitoring.read_worker_summaries(result["output_dir"])
    metrics = {key: float(final[key]) for key in FINAL_METRICS}
    for r in resources:
        worker = f"worker{r['worker']}"
        metrics[f"{worker}_peak_rss_mb"] = round(r["peak_rss_mb"], 1)
        metrics[f"{worker}_cpu_percent_mean"] = round(r["cpu_percent_mean"], 1)
        if "examples_per_s" in r:
            metrics[f"{worker}_examples_per_s"] = round(r["examples_per_s"], 2)
    title = f"Training: job {result['job_name']}"
    if result.get("mlflow_run_id"):
        figures = monitoring.worker_figures(resources)
        tracking.log_figures(launch.get("mlflow_tracking_uri"), result["mlflow_run_id"], figures)
        report.close(figures.values())
    return TrainOutcome(
        metrics=metrics,
        model_metadata={
            "base_model": base_model,
            "jaxjob": result["job_name"],
            "mlflow_run_id": result.get("mlflow_run_id", ""),
            "framework": "jax/flax",
        },
        report_html=monitoring.training_report(result, resources, title=title),
        mlflow_run_id=result.get("mlflow_run_id", ""),
        job_name=result["job_name"],
    )
