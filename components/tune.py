"""The `tune-sweep` component: a sweep (Optuna, Katib or Ray Tune) whose trials are training
jobs."""

from typing import NamedTuple

from kfp import dsl
from kfp.dsl import HTML, Artifact, Dataset, Input, Markdown, Metrics, Output
from kubejax.components.train import PASSTHROUGHS

from kubejax.version import IMAGE


@dsl.component(base_image=IMAGE, install_kfp_package=False, task_config_passthroughs=PASSTHROUGHS)
def tune_sweep(
    dataset: Input[Dataset],
    trials: Output[Artifact],
    report: Output[HTML],
    summary: Output[Markdown],
    metrics: Output[Metrics],
    base_model: str,
    search_space: str,
    hyperparameters: dict = {},
    default_settings: dict = {},
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
    mesh: str = "",
    devices_per_worker: int = 0,
    accelerator: str = "nvidia",
    tpu_topology: str = "",
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
    task_config: dsl.TaskConfig = None,
) -> NamedTuple("Outputs", best_params=dict, best_value=float):
    """Search hyperparameters; every trial is a TrainJob or JAXJob running the kubejax trainer.

    The first trial runs the defaults (`default_settings`, the settings the final training
    takes without the sweep), so the sweep can only replace them with something it measured
    better: the best trial's settings come out only when they beat the defaults' trial by more
    than `min_gain_se` standard errors of the difference (an accuracy's binomial error over
    the evaluation's examples); otherwise the defaults' settings do, and the log says so.

    Args:
        dataset: Prepared dataset (prepare-yelp).
        trials: Output: every trial (params, state, value, intermediate values, steps) as JSON.
        report: Output: HTML with the best trial beside the defaults' trial, the trials
            table (each value with its standard error), optimization history, intermediate
            curves and parameter importance.
        summary: Output: Markdown of the best trial beside the defaults' trial, the sweep's
            gain and what the final training takes.
        metrics: Output: best value, the defaults' value, the sweep gain (best − defaults)
            and its standard error, kept_defaults (1 or 0), trial counts (complete, pruned,
            failed), trial-steps.
        base_model: HF hub id or folder to fine-tune.
        search_space: JSON object: name → {"type": "float"|"int"|"categorical", "low",
            "high", "log", "step", "choices", "when"}; names are trainer settings (optimizer,
            learning_rate, global_batch_size, ...), `replicas` (workers per trial) or
            `devices_per_worker` (GPUs a trial worker); "when":
            {earlier name: value(s)} makes a dimension conditional (define-by-run).
        hyperparameters: Fixed trainer settings for every trial (e.g. max_steps, eval_every).
        default_settings: The final training's settings (its hyperparameters): the searched
            ones among them are the defaults' trial (with the adapter settings below; those
            not given: the trials' fixed settings, then the trainer's defaults). A default
            outside the search space joins it (said in the log).
        min_gain_se: The best trial replaces the defaults only when its gain exceeds this
            many standard errors of the difference (0: any gain).
        objective: Eval metric to optimise (eval_accuracy or eval_loss).
        direction: maximize or minimize.
        tuner: optuna (the study runs in this step), katib (a Katib Experiment of the same
            trial jobs, watched in the Kubeflow dashboard; it outlives the step, which
            re-attaches to it after a retry and deletes it when the run is cancelled; Katib is
            deprecated upstream in favour of OptimizationJob), ray (Ray Tune in this step, for
            its ASHA and PBT schedulers) or optimizationjob (a Kubeflow Trainer OptimizationJob
            of the same TrainJobs, re-attached and deleted as Katib's; random or grid, pruner
            none, at most 100 trials; needs Trainer's OptimizationJob controller).
        algorithm: grid, random, tpe or cmaes; with katib also multivariate-tpe,
            bayesianoptimization or hyperband (with an int max_steps dimension); with
            optimizationjob random or grid only.
        max_trials: Trials in the study in all (a retried task counts the earlier ones).
        parallelism: Trials running at once.
        max_workers: Workers all running trials may use together; a trial that would exceed
            it waits for running ones to end (0: no limit beyond parallelism).
        max_failed_trials: More failed trials than this fail the sweep.
        trial_timeout_seconds: Per-trial limit.
        pruner: none, median, successive_halving or hyperband (fed by the trials' evals).
        pruner_min_steps: No pruning before this eval step.
        scheduler: tuner ray: none, asha (stops weak trials early) or pbt (Population Based
            Training: the weakest trials restart from the best ones' checkpoints with mutated
            settings; needs eval_every in the hyperparameters).
        pbt_mutations: tuner ray, pbt: the searched settings PBT mutates, comma-separated.
        perturbation_interval: tuner ray, pbt: training steps between exploits (0: eval_every).
        seed: Sampler seed.
        replicas: Workers per trial (unless the search space has `replicas`); on a TPU, 0 or
            the slice's hosts.
        mesh: Device mesh of every trial (see the train component), e.g. "fsdp=-1".
        devices_per_worker: GPUs of each trial worker (nvidia.com/gpu; unless the search
            space has `devices_per_worker`); 0: as the task's resources say. On a TPU: the
            chips of each host (0: the slice's).
        accelerator: nvidia, cpu or a GKE TPU type (see the train component): every trial
            on a slice of `tpu_topology`.
        tpu_topology: The trials' TPU slice (may be smaller than the final training's, e.g.
            2x4 for trials and 4x4 for the training); required with a TPU accelerator.
        peft: Every trial's none or lora (see the train component); empty: hyperparameters'.
        lora_rank: LoRA's rank of every trial unless searched (0: hyperparameters' or 16).
        lora_alpha: LoRA's alpha unless searched (0: 32).
        lora_targets: LoRA's projections unless searched (empty: attention).
        lora_dropout: LoRA's dropout unless searched (0: hyperparameters' or 0).
        queue_name: Kueue LocalQueue of the job(s) (label kueue.x-k8s.io/queue-name): they
            wait, suspended, until Kueue admits them; their timeout counts from admission.
            Empty: no queue (Kueue's default LocalQueue, if the namespace has one).
        priority_class: Kueue WorkloadPriorityClass of the job(s); empty: none.
        image: Image of the trial pods; empty: the kubejax image of this version for the
            accelerator.
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
        best_params: what the final training takes (trainer settings, as the train step takes
            them): the best trial's, or the defaults' when they were kept; best_value: the
            best trial's objective.
    """
    settings = dict(locals())  # the parameters by name, taken before any import adds names
    from kubejax.launchers.sweep import sweep_task

    paths = [settings.pop(name).path for name in ("dataset", "trials", "report", "summary")]
    del settings["metrics"]
    outcome = sweep_task(*paths, **settings)
    for key, value in outcome.metrics.items():
        metrics.log_metric(key, value)
    result = outcome.result
    trials.metadata.update(
        {"mlflow_parent_run_id": outcome.parent_run_id, "counts": result.counts,
         "choice": result.choice, "reason": result.reason}
    )  # fmt: skip
    outputs = NamedTuple("Outputs", best_params=dict, best_value=float)
    return outputs(result.chosen_params, result.best_value)
