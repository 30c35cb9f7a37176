"""The `tune-sweep` component: an Optuna study whose trials are JAXJobs."""

from typing import NamedTuple

from kfp import dsl
from kfp.dsl import HTML, Artifact, Dataset, Input, Metrics, Output
from kubejax.components.train import PASSTHROUGHS

from kubejax.version import IMAGE


@dsl.component(base_image=IMAGE, install_kfp_package=False, task_config_passthroughs=PASSTHROUGHS)
def tune_sweep(
    dataset: Input[Dataset],
    trials: Output[Artifact],
    report: Output[HTML],
    metrics: Output[Metrics],
    base_model: str,
    search_space: str,
    hyperparameters: dict = {},
    objective: str = "eval_accuracy",
    direction: str = "maximize",
    algorithm: str = "tpe",
    max_trials: int = 8,
    parallelism: int = 2,
    max_failed_trials: int = 2,
    trial_timeout_seconds: int = 7200,
    pruner: str = "median",
    pruner_min_steps: int = 1,
    seed: int = 0,
    replicas: int = 1,
    image: str = "",
    backend: str = "auto",
    workspace_path: str = "",
    storage: str = "",
    run_id: str = "",
    task_name: str = "tune-sweep",
    mlflow_tracking_uri: str = "",
    mlflow_experiment: str = "kubejax",
    poll_seconds: float = 5.0,
    task_config: dsl.TaskConfig = None,
) -> NamedTuple("Outputs", best_params=dict, best_value=float):
    """Search hyperparameters; every trial is a JAXJob running the kubejax trainer.

    Args:
        dataset: Prepared dataset (prepare-yelp).
        trials: Output: every trial (params, state, value, intermediate values, steps) as JSON.
        report: Output: HTML with the trials table, optimization history, intermediate curves
            and parameter importance.
        metrics: Output: best value, trial counts (complete, pruned, failed), trial-steps.
        base_model: HF hub id or folder to fine-tune.
        search_space: JSON object: name → {"type": "float"|"int"|"categorical", "low",
            "high", "log", "step", "choices"}; names are trainer settings.
        hyperparameters: Fixed trainer settings for every trial (e.g. max_steps, eval_every).
        objective: Eval metric to optimise (eval_accuracy or eval_loss).
        direction: maximize or minimize.
        algorithm: grid, random, tpe or cmaes.
        max_trials: Trials in the study in all (a retried task counts the earlier ones).
        parallelism: Trials running at once.
        max_failed_trials: More failed trials than this fail the sweep.
        trial_timeout_seconds: Per-trial limit.
        pruner: none, median, successive_halving or hyperband (fed by the trials' evals).
        pruner_min_steps: No pruning before this eval step.
        seed: Sampler seed.
        replicas: JAXJob workers per trial.
        image: Image of the trial pods; empty: the kubejax image of this version.
        backend: trainjob, jaxjob, kubernetes (the cluster's engine, TrainJob first), local,
            or auto (kubernetes inside a cluster, else local).
        workspace_path: Pipeline workspace (dsl.WORKSPACE_PATH_PLACEHOLDER): data, trial
            folders and the study's sqlite storage live there.
        storage: Optuna RDB URL; empty: sqlite in the workspace.
        run_id: KFP run id (dsl.PIPELINE_JOB_ID_PLACEHOLDER): names the study, so a retried
            task continues it.
        task_name: This task's name (dsl.PIPELINE_TASK_NAME_PLACEHOLDER): with run_id, names
            the study and its trial jobs, so two sweeps of one pipeline never collide.
        mlflow_tracking_uri: MLflow tracking URI; empty uses $MLFLOW_TRACKING_URI.
        mlflow_experiment: MLflow experiment of the sweep's parent run and trial runs.
        poll_seconds: How often trials are checked.
        task_config: Filled by KFP from the task's settings.

    Returns:
        best_params (trainer settings, as the train step takes them) and best_value.
    """
    import os
    from pathlib import Path

    from kubejax.jaxjob.spec import job_name
    from kubejax.launcher import compilation_cache_env, log_to_stdout, stage_dataset
    from kubejax.tune import SweepConfig, sweep_with_jaxjobs, write_report, write_trials
    from kubejax.version import IMAGE

    study = job_name(run_id, task_name, prefix="sweep") if run_id else "sweep"
    if workspace_path:
        root = Path(workspace_path) / "kubejax" / study
        data_dir = stage_dataset(dataset.path, root / "data")
    else:
        root = Path(trials.path).parent / study
        data_dir = Path(dataset.path)
    root.mkdir(parents=True, exist_ok=True)
    cfg = SweepConfig(
        space=search_space,
        objective=objective,
        direction=direction,
        algorithm=algorithm,
        max_trials=max_trials,
        parallelism=parallelism,
        max_failed_trials=max_failed_trials,
        trial_timeout=trial_timeout_seconds,
        pruner=pruner,
        pruner_min_steps=pruner_min_steps,
        seed=seed,
        storage=storage or f"sqlite:///{root / 'study.db'}",
        study_name=study,
        poll_seconds=poll_seconds,
    )
    result, parent = sweep_with_jaxjobs(
        cfg,
        data_dir=str(data_dir),
        trials_root=str(root / "trials"),
        hyperparameters={**hyperparameters, "model": base_model},
        image=image or IMAGE,
        replicas=replicas,
        backend=backend,
        task_config=task_config,
        mlflow_tracking_uri=mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", ""),
        mlflow_experiment=mlflow_experiment,
        tags={"kfp.run_id": run_id, "kfp.task_name": task_name},
        extra_env=compilation_cache_env(workspace_path),
        log=log_to_stdout,
    )
    write_trials(result, trials.path)
    write_report(result, cfg, report.path)
    metrics.log_metric("best_value", result.best_value)
    metrics.log_metric("best_trial", result.best_trial)
    metrics.log_metric("trial_steps", result.trial_steps)
    for state, n in result.counts.items():
        metrics.log_metric(f"trials_{state}", n)
    trials.metadata.update({"mlflow_parent_run_id": parent, "counts": result.counts})
    outputs = NamedTuple("Outputs", best_params=dict, best_value=float)
    return outputs(result.best_params, result.best_value)
