"""A sweep whose trials train the kubejax trainer as jobs: the tune-sweep component's work.

outcome = sweep_task(dataset_path, trials_path, report_path, base_model="...",
                     sweep=SweepConfig(space=...), hyperparameters={...})
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kubejax import report, tracking
from kubejax.errors import InfeasibleError
from kubejax.jobs.client import JAXJobClient
from kubejax.jobs.spec import JAXJobSpec, job_name
from kubejax.launchers.common import (
    build_train_spec,
    check_hyperparameters,
    check_job,
    log_to_stdout,
    pod_resources,
    stage_dataset,
    task_config_fields,
    task_root,
    with_mlflow_tags,
    with_settings,
    worker_env,
)
from kubejax.launchers.katib import sweep_with_katib
from kubejax.outputs import read_metrics
from kubejax.tune import katib, ray_tune
from kubejax.tune.controller import (
    SweepConfig,
    SweepResult,
    TrialSpecFactory,
    tag_trial_run,
    tune,
)
from kubejax.tune.report import sweep_figures, write_report, write_trials
from kubejax.tune.space import RESOURCE_PARAMS, SweepError, lowest_point
from kubejax.version import IMAGE


def trainer_trial_spec(
    *,
    image: str,
    replicas: int,
    data_dir: str,
    hyperparameters: dict,
    parent_run_id: str = "",
    task_config=None,
    trial_timeout: float = 3600.0,
    extra_env: dict[str, str] | None = None,
    devices_per_worker: int = 0,
    queue_name: str = "",
    priority_class: str = "",
) -> TrialSpecFactory:
    """Trial jobs that train with the fixed `hyperparameters` plus the trial's params; a
    `replicas` or `devices_per_worker` param sets the trial's resources instead."""

    def make(number: int, params: dict, output_dir: str, name: str) -> JAXJobSpec:
        settings = {k: v for k, v in params.items() if k not in RESOURCE_PARAMS}
        # A trial is never restarted (backoff 0) and the pipeline retrains the best settings,
        # so by default it writes neither a final checkpoint nor a model (about 2 s a trial).
        hp = {
            "save_final": False,
            **hyperparameters,
            **settings,
            "mlflow_run_name": f"trial-{number}",
        }
        if parent_run_id:
            hp["mlflow_parent_run_id"] = parent_run_id
        hp = with_mlflow_tags(hp, {"kubejax.trial": str(number), "kubejax.jobs": name})
        return build_train_spec(
            name=name,
            image=image,
            replicas=int(params.get("replicas", replicas)),
            data_dir=data_dir,
            output_dir=output_dir,
            hyperparameters=hp,
            task_config=task_config,
            restart_policy="Never",
            backoff_limit=0,
            active_deadline_seconds=int(trial_timeout),
            labels={"kubejax.dev/sweep": "true"},
            extra_env=extra_env,
            devices_per_worker=int(params.get("devices_per_worker", devices_per_worker)),
            queue_name=queue_name,
            priority_class=priority_class,
        )

    return make


def sweep_with_jaxjobs(
    cfg: SweepConfig,
    *,
    data_dir: str,
    trials_root: str,
    hyperparameters: dict,
    image: str = IMAGE,
    replicas: int = 1,
    devices_per_worker: int = 0,
    backend: str = "auto",
    task_config=None,
    mlflow_tracking_uri: str = "",
    mlflow_experiment: str = "kubejax",
    tags: dict | None = None,
    workspace: str = "",
    queue_name: str = "",
    priority_class: str = "",
    log: Callable[[str], None] = print,
) -> tuple[SweepResult, str]:
    """A sweep whose trials train the kubejax trainer; an MLflow parent run with one nested
    run per trial. Returns the result and the parent run id ('' without tracking). With a
    Kueue `queue_name` every trial job waits in that queue: up to `parallelism` are submitted
    and Kueue admits those its quota holds (`max_workers` is then Kueue's to enforce)."""
    # The fixed settings, and each dimension at its lower end, before anything is created.
    client = JAXJobClient(backend)
    if cfg.tuner == "katib":
        katib.check_sweep(cfg, client.engine)
        hyperparameters = {**hyperparameters, "katib_metrics": True}
    if cfg.tuner == "ray":
        cfg, hyperparameters = _for_ray(cfg, hyperparameters)
    lowest = lowest_point(cfg.space)
    point = {k: v for k, v in lowest.items() if k not in RESOURCE_PARAMS}
    checked = check_hyperparameters({**hyperparameters, **point})
    _check_some_point_fits(cfg.space, checked, replicas, devices_per_worker, task_config)
    if cfg.max_workers and "replicas" not in cfg.space and replicas > cfg.max_workers:
        raise SweepError(
            f"max_workers: {cfg.max_workers} is below the {replicas} workers of every trial"
        )
    tracker = tracking.create_tracker(
        mlflow_tracking_uri,
        mlflow_experiment,
        run_name=cfg.study_name,
        # Under KFP's MLflow integration the sweep nests under the task's run.
        parent_run_id=tracking.kfp_task_run() or None,
        tags=tracking.kfp_tags({"kubejax.step": "tune-sweep", **(tags or {})}),
    )
    tracker.log_params({"sweep": _sweep_params(cfg), "fixed": hyperparameters})
    factory = trainer_trial_spec(
        image=image,
        replicas=replicas,
        data_dir=data_dir,
        hyperparameters={"mlflow_experiment": mlflow_experiment, **hyperparameters},
        parent_run_id=tracker.run_id or "",
        task_config=task_config,
        trial_timeout=cfg.trial_timeout,
        extra_env=worker_env(workspace, tracker.tracking_uri or ""),
        devices_per_worker=devices_per_worker,
        queue_name=queue_name,
        priority_class=priority_class,
    )
    status = "FAILED"
    try:
        if cfg.tuner == "katib":
            result = sweep_with_katib(
                cfg, factory, client, trials_root, tracker=tracker, replicas=replicas, log=log
            )
        elif cfg.tuner == "ray":
            result = _sweep_with_ray(cfg, factory, trials_root, backend, hyperparameters,
                                     tracker=tracker, replicas=replicas, log=log)  # fmt: skip
        else:
            result = tune(cfg, factory, trials_root, client=client, tracker=tracker, log=log)
        _record_best(tracker, result, trials_root)
        figures = sweep_figures(result, cfg)
        for name, fig in figures.items():
            tracker.log_figure(fig, f"sweep/{name}")
        report.close(figures.values())
        status = "FINISHED"
        return result, tracker.run_id or ""
    finally:
        tracker.finish(status)


def _for_ray(cfg: SweepConfig, hyperparameters: dict) -> tuple[SweepConfig, dict]:
    """What Ray Tune's schedulers need of the trials, checked before anything starts: PBT
    exploits at evaluations, so every evaluation is checkpointed and the perturbation
    interval defaults to the evaluation interval."""
    ray_tune.check_sweep(cfg)
    if cfg.scheduler != "pbt":
        return cfg, hyperparameters
    every = int(hyperparameters.get("eval_every") or 0)
    if every <= 0:
        raise SweepError(
            "hyperparameters.eval_every: PBT exploits at the trials' evaluations; set eval_every "
            "(and max_steps) in the trials' hyperparameters"
        )
    interval = cfg.perturbation_interval or every
    return dataclasses.replace(cfg, perturbation_interval=interval), {
        **hyperparameters,
        "checkpoint_every": every,
    }


def _sweep_with_ray(cfg, factory, trials_root, backend, hyperparameters, *, tracker, replicas, log):
    """The sweep under Ray Tune (`kubejax.tune.ray_tune`): its trials as the Optuna path's
    records, their MLflow runs tagged (a PBT trial's earlier runs as pruned: they stopped at an
    exploit), the best complete trial."""
    every = int(hyperparameters.get("eval_every") or 1)
    trials, _ = ray_tune.run(
        cfg,
        factory,
        trials_root,
        backend=backend,
        backend_options={},
        workers_of=lambda config: int(config.get("replicas", replicas)),
        max_steps=int(hyperparameters.get("max_steps") or 10**9),
        grace_steps=max(cfg.pruner_min_steps, every),
        log=log,
    )
    for t in trials:
        runs = t.pop("mlflow_run_ids")
        for i, run_id in enumerate(runs):
            if run_id:
                tag_trial_run(tracker, run_id, t["state"] if i == len(runs) - 1 else "pruned")
    failed = [t for t in trials if t["state"] == "failed"]
    if len(failed) > cfg.max_failed_trials:
        raise SweepError(
            f"max_failed_trials: {len(failed)} trials failed (limit {cfg.max_failed_trials}): "
            + ", ".join(f"trial {t['number']} (job {t['job']})" for t in failed)
        )
    complete = [t for t in trials if t["state"] == "complete"]
    if not complete:
        raise SweepError("max_trials: no trial completed; see the trials' errors above")
    pick = max if cfg.direction == "maximize" else min
    best = pick(complete, key=lambda t: t["value"])
    log(f"sweep: best trial {best['number']}: {cfg.objective}={best['value']:.4f}")
    return SweepResult(dict(best["params"]), float(best["value"]), best["number"], trials)


def _check_some_point_fits(space, checked, replicas, devices_per_worker, task_config) -> None:
    """Refuse a space none of whose points the devices can run, before any job: the point
    most likely to fit (every resource at its most, every other setting at its lowest) is
    checked against the mesh and the memory plan. Other points that do not fit are skipped
    one by one as the sweep meets them."""
    point = lowest_point(space)
    for name in RESOURCE_PARAMS:
        entry = space.get(name)
        if entry is not None:
            point[name] = max(entry["choices"]) if "choices" in entry else entry["high"]
    pod = task_config_fields(task_config)
    pod["resources"] = pod_resources(pod, int(point.get("devices_per_worker", devices_per_worker)))
    try:
        check_job(checked, int(point.get("replicas", replicas)), pod)
    except InfeasibleError as err:
        raise InfeasibleError(
            f"search_space: no point can run, not even {point} with the most resources: {err}"
        ) from err


def _sweep_params(cfg: SweepConfig) -> dict:
    names = ("algorithm", "objective", "direction", "max_trials", "parallelism", "pruner", "seed")
    return {**{n: getattr(cfg, n) for n in names}, "space": json.dumps(cfg.space)}


def _record_best(tracker: tracking.Tracker, result: SweepResult, trials_root: str) -> None:
    """The best trial on the sweep's run (params, tags, summary) and on the trial's own run."""
    tracker.log_params({f"best.{k}": v for k, v in result.best_params.items()})
    tracker.log_summary(
        {
            "best_value": result.best_value,
            "trial_steps": result.trial_steps,
            **{f"trials_{k}": v for k, v in result.counts.items()},
        }
    )
    best_job = next(t["job"] for t in result.trials if t["number"] == result.best_trial)
    tracker.set_tags(
        {"kubejax.best_trial": str(result.best_trial), "kubejax.best_jaxjob": best_job}
    )
    best_dir = Path(trials_root) / f"trial-{result.best_trial:03d}"
    best_run = read_metrics(best_dir).get("mlflow_run_id")
    if best_run:
        tracker.update_run(best_run, {"kubejax.best_trial": "true"})


@dataclass
class SweepOutcome:
    """What the tune-sweep component logs and returns."""

    result: SweepResult
    metrics: dict[str, float]
    parent_run_id: str


def sweep_task(
    dataset_path: str,
    trials_path: str,
    report_path: str,
    *,
    base_model: str,
    search_space: str,
    hyperparameters: dict | None = None,
    objective: str = "eval_accuracy",
    direction: str = "maximize",
    tuner: str = "optuna",
    algorithm: str = "tpe",
    max_trials: int = 8,
    parallelism: int = 2,
    max_workers: int = 0,
    max_failed_trials: int = 2,
    trial_timeout_seconds: int = 3600,
    pruner: str = "median",
    pruner_min_steps: int = 1,
    scheduler: str = "none",
    pbt_mutations: str = "learning_rate",
    perturbation_interval: int = 0,
    seed: int = 0,
    replicas: int = 1,
    devices_per_worker: int = 0,
    mesh: str = "",
    peft: str = "",
    lora_rank: int = 0,
    lora_alpha: float = 0.0,
    lora_targets: str = "",
    lora_dropout: float = 0.0,
    queue_name: str = "",
    priority_class: str = "",
    image: str = "",
    backend: str = "auto",
    workspace_path: str = "",
    storage: str = "",
    run_id: str = "",
    task_name: str = "tune-sweep",
    mlflow_tracking_uri: str = "",
    mlflow_experiment: str = "kubejax",
    poll_seconds: float = 5.0,
    task_config=None,
) -> SweepOutcome:
    """The tune-sweep component's work (its parameters, by the same names; see the component
    for each one's meaning). The study runs in the task's folder of the workspace (data, trial
    folders, the sqlite study, so a retried task continues it); every trial goes to
    `trials_path` as JSON and the HTML report to `report_path`."""
    study = job_name(run_id, task_name, prefix="sweep") if run_id else "sweep"
    root = task_root(workspace_path, study, Path(trials_path).parent / study)
    cfg = SweepConfig(
        space=search_space,
        objective=objective,
        direction=direction,
        tuner=tuner,
        algorithm=algorithm,
        max_trials=max_trials,
        parallelism=parallelism,
        max_workers=max_workers,
        max_failed_trials=max_failed_trials,
        trial_timeout=trial_timeout_seconds,
        pruner=pruner,
        pruner_min_steps=pruner_min_steps,
        scheduler=scheduler,
        pbt_mutations=pbt_mutations,
        perturbation_interval=perturbation_interval,
        seed=seed,
        storage=storage or f"sqlite:///{root / 'study.db'}",
        study_name=study,
        poll_seconds=poll_seconds,
    )
    result, parent = sweep_with_jaxjobs(
        cfg,
        data_dir=str(stage_dataset(dataset_path, workspace_path, root)),
        trials_root=str(root / "trials"),
        hyperparameters={
            **with_settings(
                hyperparameters or {},
                mesh=mesh,
                peft=peft,
                lora_rank=lora_rank,
                lora_alpha=lora_alpha,
                lora_targets=lora_targets,
                lora_dropout=lora_dropout,
            ),
            "model": base_model,
        },
        image=image or IMAGE,
        replicas=replicas,
        devices_per_worker=devices_per_worker,
        backend=backend,
        task_config=task_config,
        mlflow_tracking_uri=mlflow_tracking_uri,
        mlflow_experiment=mlflow_experiment,
        tags={"kfp.run_id": run_id, "kfp.task_name": task_name},
        workspace=workspace_path,
        queue_name=queue_name,
        priority_class=priority_class,
        log=log_to_stdout,
    )
    write_trials(result, trials_path)
    write_report(result, cfg, report_path)
    metrics = {
        "best_value": result.best_value,
        "best_trial": result.best_trial,
        "trial_steps": result.trial_steps,
        **{f"trials_{state}": n for state, n in result.counts.items()},
    }
    return SweepOutcome(result, metrics, parent)
