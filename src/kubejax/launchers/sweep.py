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

from kubejax import report, tpu, tracking
from kubejax.data.dataset import METADATA_FILE
from kubejax.errors import InfeasibleError
from kubejax.jobs.client import JAXJobClient
from kubejax.jobs.spec import JAXJobSpec, job_name
from kubejax.launchers.common import (
    RESERVED,
    build_train_spec,
    check_hyperparameters,
    check_job,
    log_to_stdout,
    place_workers,
    stage_dataset,
    task_config_fields,
    task_root,
    with_mlflow_tags,
    with_settings,
    worker_env,
)
from kubejax.launchers.katib import sweep_with_katib
from kubejax.launchers.optimizationjob import sweep_with_optimizationjob
from kubejax.outputs import read_metrics
from kubejax.trainer.config import TrainConfig
from kubejax.tune import katib, optimizationjob, ray_tune
from kubejax.tune.controller import (
    SweepConfig,
    SweepResult,
    TrialSpecFactory,
    decide,
    tag_trial_run,
    tune,
)
from kubejax.tune.report import summary_markdown, sweep_figures, write_report, write_trials
from kubejax.tune.space import RESOURCE_PARAMS, SweepError, default_point, lowest_point


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
    accelerator: str = "",
    tpu_topology: str = "",
    queue_name: str = "",
    priority_class: str = "",
) -> TrialSpecFactory:
    """Trial jobs that train with the fixed `hyperparameters` plus the trial's params; a
    `replicas` or `devices_per_worker` param sets the trial's resources instead (on a TPU
    slice of `tpu_topology`: its hosts and chips per host, `place_workers`)."""

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
            accelerator=accelerator,
            tpu_topology=tpu_topology,
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
    image: str = "",
    replicas: int = 1,
    devices_per_worker: int = 0,
    accelerator: str = "",
    tpu_topology: str = "",
    backend: str = "auto",
    task_config=None,
    mlflow_tracking_uri: str = "",
    mlflow_experiment: str = "kubejax",
    tags: dict | None = None,
    workspace: str = "",
    queue_name: str = "",
    priority_class: str = "",
    default_settings: dict | None = None,
    log: Callable[[str], None] = print,
) -> tuple[SweepResult, str]:
    """A sweep whose trials train the kubejax trainer; an MLflow parent run with one nested
    run per trial. Returns the result and the parent run id ('' without tracking). With a
    Kueue `queue_name` every trial job waits in that queue: up to `parallelism` are submitted
    and Kueue admits those its quota holds (`max_workers` is then Kueue's to enforce). On a
    TPU `accelerator` every trial runs on a slice of `tpu_topology` (`replicas` 0: its hosts);
    `image` empty: kubejax's for the accelerator.

    The study's first trial runs the defaults (`with_defaults`: the final training's
    `default_settings`, else the trials' fixed settings, else the trainer's defaults), and the
    result keeps them unless its best trial beats them beyond the noise (`decide`)."""
    # The search space's names, the accelerator settings, the fixed settings, and each
    # dimension at its lower end, before anything is created.
    check_space_settings(cfg.space)
    placement = {"accelerator": accelerator, "tpu_topology": tpu_topology}
    replicas, _, _ = place_workers(
        {}, replicas=replicas, devices_per_worker=devices_per_worker, **placement
    )
    cfg = with_defaults(
        cfg,
        {**hyperparameters, **(default_settings or {})},
        replicas=replicas,
        devices_per_worker=devices_per_worker,
        data_dir=data_dir,
        fixed=hyperparameters,
        log=log,
    )
    if cfg.tuner == "optimizationjob":
        optimizationjob.check_sweep(cfg)  # before any cluster is asked
    client = JAXJobClient(backend)
    if cfg.tuner == "optimizationjob":
        optimizationjob.check_sweep(cfg, client.engine)
    if cfg.tuner == "katib":
        katib.check_sweep(cfg, client.engine)
        hyperparameters = {**hyperparameters, "katib_metrics": True}
    if cfg.tuner == "ray":
        cfg, hyperparameters = _for_ray(cfg, hyperparameters)
    check_some_point_fits(
        cfg.space, hyperparameters, replicas, devices_per_worker, task_config, placement,
        defaults=cfg.defaults,
    )  # fmt: skip
    if cfg.max_workers and "replicas" not in cfg.space and replicas > cfg.max_workers:
        raise SweepError(
            f"max_workers: {cfg.max_workers} is below the {replicas} workers of every trial"
        )
    tracker = tracking.create_tracker(
        mlflow_tracking_uri,
        mlflow_experiment,
        run_name=cfg.study_name,
        tags=tracking.kfp_tags({"kubejax.step": "tune-sweep", **(tags or {})}),
        # Under KFP's MLflow integration the sweep logs into the task's run, its trials
        # nested under it.
        **tracking.kfp_task_tracking(mlflow_tracking_uri),
    )
    tracker.log_params({"sweep": _sweep_params(cfg), "fixed": hyperparameters})
    factory = trainer_trial_spec(
        image=tpu.image_for(accelerator, image),
        replicas=replicas,
        data_dir=data_dir,
        hyperparameters={"mlflow_experiment": mlflow_experiment, **hyperparameters},
        parent_run_id=tracker.run_id or "",
        task_config=task_config,
        trial_timeout=cfg.trial_timeout,
        extra_env=worker_env(workspace, tracker.tracking_uri or ""),
        devices_per_worker=devices_per_worker,
        **placement,
        queue_name=queue_name,
        priority_class=priority_class,
    )
    status = "FAILED"
    try:
        if cfg.tuner == "katib":
            result = sweep_with_katib(
                cfg, factory, client, trials_root, tracker=tracker, replicas=replicas, log=log
            )
        elif cfg.tuner == "optimizationjob":
            result = sweep_with_optimizationjob(
                cfg, factory, client, trials_root, tracker=tracker, replicas=replicas, log=log
            )
        elif cfg.tuner == "ray":
            result = _sweep_with_ray(cfg, factory, trials_root, backend, hyperparameters,
                                     tracker=tracker, replicas=replicas, log=log)  # fmt: skip
        else:
            result = tune(cfg, factory, trials_root, client=client, tracker=tracker, log=log)
        result = decide(result, cfg)
        log(f"sweep: {result.reason}")
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


def point_error(
    point: dict, space, hyperparameters, replicas, devices_per_worker, task_config, placement
) -> InfeasibleError | None:
    """Why the devices cannot run a trial of `point` (the mesh, the accelerator, the memory
    plan), or None: the trainer's settings (`hyperparameters` and the point's) checked on the
    point's resources, a searched resource the point lacks at its most. Micro-batches and remat
    left `auto` are settled as the trial's trainer will settle them (`plan.fit_memory`): a
    point that fits in more micro-batches, or under a remat policy, runs."""
    point = dict(point)
    for name in RESOURCE_PARAMS:
        entry = space.get(name)
        if entry is not None and name not in point:
            point[name] = max(entry["choices"]) if "choices" in entry else entry["high"]
    settings = {k: v for k, v in point.items() if k not in RESOURCE_PARAMS}
    checked = check_hyperparameters({**hyperparameters, **settings})
    workers, pod, shape = place_workers(
        task_config_fields(task_config),
        replicas=int(point.get("replicas", replicas)),
        devices_per_worker=int(point.get("devices_per_worker", devices_per_worker)),
        **placement,
    )
    try:
        check_job(checked, workers, pod, shape)
    except InfeasibleError as err:
        return err
    return None


def check_some_point_fits(
    space, hyperparameters, replicas, devices_per_worker, task_config, placement, defaults=None
) -> None:
    """Refuse a space none of whose points the devices can run, before any job: the points
    most likely to fit — the space's lowest (every setting at its first value) and the
    defaults' (`defaults`), each with every resource at its most — are checked
    (`point_error`). Other points that do not fit are skipped one by one as the sweep meets
    them."""
    lowest = {k: v for k, v in lowest_point(space).items() if k not in RESOURCE_PARAMS}
    candidates = [lowest] + ([dict(defaults)] if defaults else [])
    failure = None
    for point in candidates:
        for name in RESOURCE_PARAMS:  # the most resources, the defaults' own included
            entry = space.get(name)
            if entry is not None:
                point[name] = max(entry["choices"]) if "choices" in entry else entry["high"]
        err = point_error(
            point, space, hyperparameters, replicas, devices_per_worker, task_config, placement
        )
        if err is None:
            return
        failure = failure or err
    tried = " nor the defaults' " + str(candidates[1]) if len(candidates) > 1 else ""
    raise InfeasibleError(
        f"search_space: no point can run, not even {candidates[0]}{tried} with the most "
        f"resources: {failure}"
    ) from failure


def check_space_settings(space: dict[str, dict]) -> None:
    """Every searched name is a trainer setting or a trial resource: SweepError naming the
    first that is not, before anything starts."""
    known = {f.name for f in dataclasses.fields(TrainConfig)} - set(RESERVED)
    for name in space:
        if name not in known and name not in RESOURCE_PARAMS:
            raise SweepError(
                f"search_space.{name}: not a setting the trainer takes; search trainer settings "
                f"(learning_rate, lora_rank, lora_alpha, warmup_ratio, ...: `python -m "
                f"kubejax.trainer --help`) or {' or '.join(RESOURCE_PARAMS)}"
            )


def eval_examples(data_dir: str, hyperparameters: dict) -> int:
    """Validation examples each trial's evaluation scores: the prepared dataset's validation
    rows (its metadata), capped by `max_eval_examples`; 0 where the metadata is not there."""
    try:
        meta = json.loads((Path(data_dir) / METADATA_FILE).read_text())
        rows = int(meta["splits"]["validation"]["rows"])
    except (OSError, KeyError, TypeError, ValueError):
        return 0
    cap = int(hyperparameters.get("max_eval_examples") or 0)
    return min(rows, cap) if cap > 0 else rows


def with_defaults(
    cfg: SweepConfig,
    settings: dict,
    *,
    replicas: int,
    devices_per_worker: int,
    data_dir: str,
    fixed: dict,
    log: Callable[[str], None] = print,
) -> SweepConfig:
    """`cfg` with its defaults' point (`cfg.defaults`, completed from `settings` over the
    trainer's own defaults; the resources from `replicas` and `devices_per_worker`), its space
    widened where a default lies outside it (said in the log), and its evaluations' size
    (`eval_examples`, from the dataset and the trials' `fixed` settings) unless given."""
    trainer = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    values = {
        **trainer,
        **settings,
        "replicas": replicas,
        "devices_per_worker": devices_per_worker,
        **cfg.defaults,
    }
    try:
        point, space, notes = default_point(cfg.space, values)
    except KeyError as err:  # check_space_settings named every unknown one before
        raise SweepError(f"search_space.{err.args[0]}: no default value is known") from err
    for note in notes:
        log(f"sweep: search_space.{note}")
    return dataclasses.replace(
        cfg,
        space=space,
        defaults=point,
        eval_examples=cfg.eval_examples or eval_examples(data_dir, fixed),
    )


def _sweep_params(cfg: SweepConfig) -> dict:
    names = ("algorithm", "objective", "direction", "max_trials", "parallelism", "pruner", "seed")
    return {**{n: getattr(cfg, n) for n in names}, "space": json.dumps(cfg.space)}


def _record_best(tracker: tracking.Tracker, result: SweepResult, trials_root: str) -> None:
    """The best trial on the sweep's run (params, tags, summary) beside the defaults' trial
    (its value, the sweep's gain over it and that gain's standard error, what the final
    training keeps), and on the trial's own run."""
    tracker.log_params({f"best.{k}": v for k, v in result.best_params.items()})
    tracker.log_summary({**outcome_metrics(result), "trial_steps": result.trial_steps})
    best_job = next(t["job"] for t in result.trials if t["number"] == result.best_trial)
    tracker.set_tags(
        {
            "kubejax.best_trial": str(result.best_trial),
            "kubejax.best_jaxjob": best_job,
            "kubejax.defaults_trial": str(result.defaults_trial),
            "kubejax.sweep_choice": result.choice,
            "kubejax.sweep_reason": result.reason[:5000],
        }
    )
    best_dir = Path(trials_root) / f"trial-{result.best_trial:03d}"
    best_run = read_metrics(best_dir).get("mlflow_run_id")
    if best_run:
        tracker.update_run(best_run, {"kubejax.best_trial": "true"})


def outcome_metrics(result: SweepResult) -> dict[str, float]:
    """The sweep's figures for MLflow and the KFP UI: the best value, the defaults' value, the
    gain and its standard error (where known), whether the defaults were kept, the counts."""
    figures = {
        "best_value": result.best_value,
        "best_trial": result.best_trial,
        "kept_defaults": float(result.choice == "defaults"),
        **{f"trials_{state}": n for state, n in result.counts.items()},
    }
    best = result.trial(result.best_trial)
    optional = {
        "best_value_se": best.get("se") if best else None,
        "defaults_value": result.defaults_value,
        "defaults_trial": result.defaults_trial,
        "sweep_gain": result.gain,
        "sweep_gain_se": result.gain_se,
    }
    return {**figures, **{k: v for k, v in optional.items() if v is not None}}


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
    summary_path: str = "",
    *,
    base_model: str,
    search_space: str,
    hyperparameters: dict | None = None,
    default_settings: dict | None = None,
    min_gain_se: float = 2.0,
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
    accelerator: str = "nvidia",
    tpu_topology: str = "",
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
    `trials_path` as JSON, the HTML report to `report_path` and the Markdown summary (the
    best trial beside the defaults') to `summary_path`."""
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
        min_gain_se=min_gain_se,
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
        image=image,
        replicas=replicas,
        devices_per_worker=devices_per_worker,
        accelerator=accelerator,
        tpu_topology=tpu_topology,
        backend=backend,
        task_config=task_config,
        mlflow_tracking_uri=mlflow_tracking_uri,
        mlflow_experiment=mlflow_experiment,
        tags={"kfp.run_id": run_id, "kfp.task_name": task_name},
        workspace=workspace_path,
        queue_name=queue_name,
        priority_class=priority_class,
        default_settings=with_settings(
            default_settings or {},
            peft=peft,
            lora_rank=lora_rank,
            lora_alpha=lora_alpha,
            lora_targets=lora_targets,
            lora_dropout=lora_dropout,
        ),
        log=log_to_stdout,
    )
    write_trials(result, trials_path)
    write_report(result, cfg, report_path)
    if summary_path:
        Path(summary_path).write_text(summary_markdown(result, cfg))
    metrics = {**outcome_metrics(result), "trial_steps": result.trial_steps}
    return SweepOutcome(result, metrics, parent)
