"""The Yelp pipelines.

`yelp_pipeline`: prepare → tune sweep → train with the best params → evaluate → register the
model when the metric clears a threshold. `train_eval_pipeline`: prepare → train → evaluate,
the same components without the sweep. Defaults suit a real cluster (the hub dataset, a
bert-base-size model, GPU workers); `kubejax run --local` overrides them for this machine.
`accelerator` set to a GKE TPU type (with `tpu_topology`, and the GPU counts at 0) puts the
workers on TPU slices instead: the launchers derive the node selectors, chips and workers
(`kubejax.tpu`).
"""

import json

from kfp import dsl, kubernetes
from kubejax.components import evaluate, prepare_yelp, register_model, train, tune_sweep

#: The Kubernetes secret with MLflow credentials (keys `username`, `password`, optional
#: `token`); mounted as env on the steps that talk to MLflow, never a pipeline parameter.
MLFLOW_SECRET = "mlflow-credentials"
_SECRET_ENV = {
    "username": "MLFLOW_TRACKING_USERNAME",
    "password": "MLFLOW_TRACKING_PASSWORD",
    "token": "MLFLOW_TRACKING_TOKEN",
}

#: The Kubernetes secret with a Hugging Face token (key `token`), for gated hub models (Llama,
#: Gemma): mounted as HF_TOKEN on the steps that download a model or tokenizer and, through the
#: launchers' env passthrough, on their jobs' workers; never a pipeline parameter.
HF_SECRET = "hf-token"

DEFAULT_SPACE = json.dumps(
    {
        "learning_rate": {"type": "float", "low": 1e-5, "high": 1e-4, "log": True},
        "warmup_ratio": {"type": "float", "low": 0.0, "high": 0.2},
        "weight_decay": {"type": "float", "low": 0.0, "high": 0.1},
    }
)
DEFAULT_TRIAL_HP = {
    "max_steps": 600,
    "eval_every": 200,
    "global_batch_size": 32,
    "max_eval_examples": 2000,
    "dtype": "auto",
}
DEFAULT_TRAIN_HP = {
    "epochs": 2,
    "global_batch_size": 32,
    "learning_rate": 3e-5,
    "eval_every": 2000,
    "checkpoint_every": 1000,
    "max_eval_examples": 5000,
    "dtype": "auto",
}
#: Worker placement defaults: any node, no toleration (pipeline parameters only read them).
ANY_NODE: dict = {}
NO_TOLERATIONS: list = []
WORKSPACE = dsl.PipelineConfig(workspace=dsl.WorkspaceConfig(size="100Gi"))


def _with_mlflow_secret(task: dsl.PipelineTask) -> dsl.PipelineTask:
    return kubernetes.use_secret_as_env(
        task, secret_name=MLFLOW_SECRET, secret_key_to_env=_SECRET_ENV, optional=True
    )


def _with_hf_token(task: dsl.PipelineTask) -> dsl.PipelineTask:
    return kubernetes.use_secret_as_env(
        task, secret_name=HF_SECRET, secret_key_to_env={"token": "HF_TOKEN"}, optional=True
    )


def _gpu_workers(task: dsl.PipelineTask, gpus: int, node_selector, tolerations) -> dsl.PipelineTask:
    # RESOURCES, NODE_SELECTOR and TOLERATIONS are passed through (not applied to the
    # launcher): they land on the job's worker pods. All three are pipeline parameters (0 GPUs
    # on CPU-only nodes and TPU slices; a GPU node pool's label and taint). A TPU slice's
    # selectors, chips and toleration come from the launcher (`accelerator`, `tpu_topology`):
    # they depend on run-time parameters that no compile-time setting here can compute.
    task.set_accelerator_type("nvidia.com/gpu").set_accelerator_limit(gpus)
    kubernetes.add_node_selector_json(task, node_selector)
    kubernetes.add_toleration_json(task, tolerations)
    return task


def _prepare(base_model: str, **inputs) -> dsl.PipelineTask:
    """The prepare step, tokenizing with the model's tokenizer."""
    task = prepare_yelp(tokenizer=base_model, **inputs)
    task.set_display_name("prepare-yelp").set_caching_options(True)
    task.set_cpu_limit("4").set_memory_limit("16Gi")
    return _with_hf_token(task)


def _sweep(
    dataset, *, trial_gpus_per_worker, worker_node_selector, worker_tolerations, **inputs
) -> dsl.PipelineTask:
    """The tune-sweep step (its trials on GPU workers where asked); `inputs`: the component's."""
    sweep = tune_sweep(
        dataset=dataset,
        **inputs,
        workspace_path=dsl.WORKSPACE_PATH_PLACEHOLDER,
        run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER,
        task_name=dsl.PIPELINE_TASK_NAME_PLACEHOLDER,
    )
    sweep.set_display_name("tune-sweep").set_caching_options(False)
    sweep.set_retry(num_retries=2, backoff_duration="60s")
    _with_hf_token(sweep)
    return _with_mlflow_secret(
        _gpu_workers(sweep, trial_gpus_per_worker, worker_node_selector, worker_tolerations)
    )


def _register(evaluated, threshold, name, mlflow_tracking_uri) -> None:
    """Register the evaluated model when its test accuracy clears `threshold`."""
    # kfp.local resolves conditions on a task's single `Output` only: evaluate returns the
    # accuracy as that, and hands the model URI over as an artifact.
    with dsl.If(evaluated.outputs["Output"] >= threshold, name="accuracy-clears-bar"):
        reg = register_model(
            mlflow_model=evaluated.outputs["mlflow_model"],
            model_name=name,
            mlflow_tracking_uri=mlflow_tracking_uri,
        )
        reg.set_display_name("register-model").set_caching_options(False)
        _with_mlflow_secret(reg)


def _train_and_evaluate(
    dataset,
    *,
    gpus_per_worker,
    worker_node_selector,
    worker_tolerations,
    mlflow_tracking_uri,
    mlflow_experiment,
    **train_inputs,
) -> dsl.PipelineTask:
    """The train step (a job with `replicas` workers) and the evaluate step after it; returns
    the evaluate task."""
    mlflow = {"mlflow_tracking_uri": mlflow_tracking_uri, "mlflow_experiment": mlflow_experiment}
    trained = train(
        dataset=dataset,
        **train_inputs,
        **mlflow,
        workspace_path=dsl.WORKSPACE_PATH_PLACEHOLDER,
        run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER,
        task_name=dsl.PIPELINE_TASK_NAME_PLACEHOLDER,
    )
    trained.set_display_name("train").set_caching_options(False)
    trained.set_retry(num_retries=2, backoff_duration="60s")
    _with_hf_token(trained)
    _with_mlflow_secret(
        _gpu_workers(trained, gpus_per_worker, worker_node_selector, worker_tolerations)
    )
    evaluated = evaluate(
        model=trained.outputs["model"],
        dataset=dataset,
        mlflow_run_id=trained.outputs["mlflow_run_id"],
        **mlflow,
    )
    evaluated.set_display_name("evaluate").set_caching_options(False)
    return _with_mlflow_secret(evaluated)


@dsl.pipeline(
    name="kubejax-yelp",
    description="Yelp review stars: prepare, tune (trials are TrainJobs or JAXJobs), train "
    "(a TrainJob or JAXJob), evaluate, register in MLflow.",
    pipeline_config=WORKSPACE,
)
def yelp_pipeline(
    source: str = "Yelp/yelp_review_full",
    base_model: str = "google-bert/bert-base-uncased",
    text_column: str = "text",
    label_column: str = "label",
    max_length: int = 256,
    task: str = "classification",
    prompt_template: str = "",
    max_train_samples: int = 0,
    max_validation_samples: int = 10000,
    max_test_samples: int = 0,
    search_space: str = DEFAULT_SPACE,
    tuner: str = "optuna",
    scheduler: str = "none",
    algorithm: str = "tpe",
    objective: str = "eval_accuracy",
    direction: str = "maximize",
    max_trials: int = 8,
    parallelism: int = 2,
    max_workers: int = 0,
    pruner: str = "median",
    trial_hyperparameters: dict = DEFAULT_TRIAL_HP,
    trial_replicas: int = 1,
    trial_gpus_per_worker: int = 1,
    trial_mesh: str = "",
    trial_tpu_topology: str = "",
    train_hyperparameters: dict = DEFAULT_TRAIN_HP,
    replicas: int = 2,
    gpus_per_worker: int = 1,
    mesh: str = "",
    accelerator: str = "nvidia",
    tpu_topology: str = "",
    worker_node_selector: dict = ANY_NODE,
    worker_tolerations: list = NO_TOLERATIONS,
    queue_name: str = "",
    priority_class: str = "",
    image: str = "",
    backend: str = "auto",
    timeout_seconds: int = 86400,
    mlflow_tracking_uri: str = "",
    mlflow_experiment: str = "kubejax-yelp",
    register_threshold: float = 0.6,
    registered_model_name: str = "kubejax-yelp",
    seed: int = 0,
):
    """Prepare → tune sweep → train with the best params → evaluate → register.

    Args:
        source: Hub dataset id, or a file/folder/URI of reviews (csv, tsv, json, jsonl, parquet).
        base_model: HF hub id or folder of the model (also the tokenizer): BERT family, or a
            decoder (Llama, Mistral, Qwen2, Qwen3, Gemma 3).
        text_column: Column with the review text.
        label_column: Column with the stars / label.
        max_length: Token truncation length.
        task: classification (a classification head on the model) or causal-lm (a decoder
            fine-tuned to write each review's label after `prompt_template`).
        prompt_template: causal-lm: the prompt, with {review} where the review goes; empty:
            kubejax's default ("Review: {review}", then "Rating:" on the next line).
        max_train_samples: Stratified cap on train rows (0: all).
        max_validation_samples: Stratified cap on validation rows (0: all).
        max_test_samples: Stratified cap on test rows (0: all).
        search_space: JSON search space over trainer settings (optimizer, learning_rate,
            global_batch_size, ...) and `replicas` (workers per trial); "when" makes a
            dimension conditional.
        tuner: optuna (the study runs in the sweep step), katib (a Katib Experiment of the
            same trial jobs; needs Katib ≥ 0.19 on the cluster; deprecated upstream in favour
            of OptimizationJob), ray (Ray Tune in the sweep step, for its schedulers) or
            optimizationjob (a Kubeflow Trainer OptimizationJob of the same TrainJobs: random
            or grid, pruner none, at most 100 trials).
        scheduler: tuner ray: none, asha or pbt (PBT mutates the learning rate).
        algorithm: grid, random, tpe or cmaes; with katib also multivariate-tpe,
            bayesianoptimization or hyperband; with optimizationjob random or grid.
        objective: eval_accuracy or eval_loss.
        direction: maximize (eval_accuracy) or minimize (eval_loss).
        max_trials: Trials in the sweep.
        parallelism: Trials at once.
        max_workers: Workers the running trials may use together (a trial that would exceed
            it waits); 0: no limit beyond parallelism.
        pruner: none, median, successive_halving or hyperband.
        trial_hyperparameters: Fixed trainer settings of every trial.
        trial_replicas: Workers per trial (unless search_space has `replicas`).
        trial_gpus_per_worker: nvidia.com/gpu limit of each trial worker (0: CPU only).
        trial_mesh: Device mesh of every trial (see mesh).
        trial_tpu_topology: The TPU slice of every trial (may be smaller than
            tpu_topology's); required with a TPU accelerator.
        train_hyperparameters: Trainer settings of the final training (the best params win).
        replicas: Workers of the final training (the sweep's best `replicas` wins when
            searched, off TPUs); on a TPU, 0 or the slice's hosts.
        gpus_per_worker: nvidia.com/gpu limit of each worker of the final training (0: CPU
            only).
        mesh: Device mesh of the final training over replicas × gpus_per_worker devices (a
            TPU slice's chips), e.g. "fsdp=-1" to shard parameters and optimizer state;
            empty: data-parallel.
        accelerator: nvidia (GPU workers, as gpus_per_worker says; CPU with 0), cpu, or a GKE
            TPU type: tpu-v5-lite-podslice, tpu-v5p-slice, tpu-v6e-slice or tpu-v4-podslice.
            On a TPU every training and trial worker is a host of a slice (`tpu_topology`,
            `trial_tpu_topology`), with its chips and GKE's node selectors, on kubejax's TPU
            image; set the GPU counts to 0 and the worker counts to 0 (the slice's hosts).
        tpu_topology: The final training's TPU slice, e.g. 2x4 (8 chips, one v5e host) or
            4x4 (16 chips, four hosts); required with a TPU accelerator.
        worker_node_selector: Node labels every training and trial worker pod requires, e.g.
            {"nvidia.com/gpu.present": "true"} for a GPU node pool.
        worker_tolerations: Tolerations of every training and trial worker pod, e.g.
            [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}].
        queue_name: Kueue LocalQueue of every training and trial job: they wait, suspended,
            for Kueue to admit them, and their timeouts count from admission; empty: none.
        priority_class: Kueue WorkloadPriorityClass of those jobs; empty: none.
        image: The image of every training and trial worker; empty: kubejax's of this
            version for the accelerator (its TPU variant on a TPU).
        backend: The engine of the training jobs: auto (in a cluster, the one it serves,
            TrainJob first; elsewhere local), trainjob, jaxjob, kubernetes or local.
        timeout_seconds: Limit of the final training job.
        mlflow_tracking_uri: MLflow tracking URI (credentials come from the secret).
        mlflow_experiment: MLflow experiment of this pipeline's runs.
        register_threshold: Register the model when test accuracy reaches this.
        registered_model_name: Name in the MLflow Model Registry.
        seed: Seed of the splits and the sweep.
    """
    prep = _prepare(
        base_model,
        source=source,
        text_column=text_column,
        label_column=label_column,
        max_length=max_length,
        task=task,
        prompt_template=prompt_template,
        max_train_samples=max_train_samples,
        max_validation_samples=max_validation_samples,
        max_test_samples=max_test_samples,
        seed=seed,
    )
    sweep = _sweep(
        prep.outputs["dataset"],
        trial_gpus_per_worker=trial_gpus_per_worker,
        worker_node_selector=worker_node_selector,
        worker_tolerations=worker_tolerations,
        queue_name=queue_name,
        priority_class=priority_class,
        base_model=base_model,
        search_space=search_space,
        hyperparameters=trial_hyperparameters,
        default_settings=train_hyperparameters,
        objective=objective,
        direction=direction,
        tuner=tuner,
        scheduler=scheduler,
        algorithm=algorithm,
        max_trials=max_trials,
        parallelism=parallelism,
        max_workers=max_workers,
        pruner=pruner,
        seed=seed,
        replicas=trial_replicas,
        mesh=trial_mesh,
        accelerator=accelerator,
        tpu_topology=trial_tpu_topology,
        image=image,
        backend=backend,
        mlflow_tracking_uri=mlflow_tracking_uri,
        mlflow_experiment=mlflow_experiment,
    )
    evaluated = _train_and_evaluate(
        prep.outputs["dataset"],
        base_model=base_model,
        hyperparameters=train_hyperparameters,
        best_params=sweep.outputs["best_params"],
        replicas=replicas,
        mesh=mesh,
        accelerator=accelerator,
        tpu_topology=tpu_topology,
        gpus_per_worker=gpus_per_worker,
        worker_node_selector=worker_node_selector,
        worker_tolerations=worker_tolerations,
        queue_name=queue_name,
        priority_class=priority_class,
        image=image,
        backend=backend,
        timeout_seconds=timeout_seconds,
        mlflow_tracking_uri=mlflow_tracking_uri,
        mlflow_experiment=mlflow_experiment,
    )
    _register(evaluated, register_threshold, registered_model_name, mlflow_tracking_uri)


@dsl.pipeline(
    name="kubejax-train-eval",
    description="Prepare Yelp reviews, fine-tune as a TrainJob or JAXJob, evaluate; no sweep.",
    pipeline_config=WORKSPACE,
)
def train_eval_pipeline(
    source: str = "Yelp/yelp_review_full",
    base_model: str = "google-bert/bert-base-uncased",
    text_column: str = "text",
    label_column: str = "label",
    max_length: int = 256,
    task: str = "classification",
    prompt_template: str = "",
    max_train_samples: int = 0,
    max_validation_samples: int = 10000,
    max_test_samples: int = 0,
    train_hyperparameters: dict = DEFAULT_TRAIN_HP,
    replicas: int = 2,
    gpus_per_worker: int = 1,
    mesh: str = "",
    accelerator: str = "nvidia",
    tpu_topology: str = "",
    worker_node_selector: dict = ANY_NODE,
    worker_tolerations: list = NO_TOLERATIONS,
    queue_name: str = "",
    priority_class: str = "",
    image: str = "",
    backend: str = "auto",
    timeout_seconds: int = 86400,
    mlflow_tracking_uri: str = "",
    mlflow_experiment: str = "kubejax-yelp",
    seed: int = 0,
):
    """Prepare → train → evaluate, reusing the Yelp pipeline's components.

    Args:
        source: Hub dataset id, or a file/folder/URI of reviews.
        base_model: HF hub id or folder of the model (also the tokenizer).
        text_column: Column with the review text.
        label_column: Column with the stars / label.
        max_length: Token truncation length.
        task: classification (a classification head on the model) or causal-lm (a decoder
            fine-tuned to write each review's label after `prompt_template`).
        prompt_template: causal-lm: the prompt, with {review} where the review goes; empty:
            kubejax's default ("Review: {review}", then "Rating:" on the next line).
        max_train_samples: Stratified cap on train rows (0: all).
        max_validation_samples: Stratified cap on validation rows (0: all).
        max_test_samples: Stratified cap on test rows (0: all).
        train_hyperparameters: Trainer settings.
        replicas: Workers of the training job; on a TPU, 0 or the slice's hosts.
        gpus_per_worker: nvidia.com/gpu limit of each worker (0: CPU only, and on a TPU).
        mesh: Device mesh over replicas × gpus_per_worker devices (a TPU slice's chips), e.g.
            "fsdp=-1" (see kubejax-yelp); empty: data-parallel.
        accelerator: nvidia, cpu or a GKE TPU type (see kubejax-yelp).
        tpu_topology: The TPU slice of the training job, e.g. 2x4; required on a TPU.
        worker_node_selector: Node labels every worker pod requires (see kubejax-yelp).
        worker_tolerations: Tolerations of every worker pod (see kubejax-yelp).
        queue_name: Kueue LocalQueue of the training job (see kubejax-yelp).
        priority_class: Kueue WorkloadPriorityClass of the training job.
        image: The image of the training workers; empty: kubejax's for the accelerator.
        backend: auto, trainjob, jaxjob, kubernetes or local (see kubejax-yelp).
        timeout_seconds: Limit of the training job.
        mlflow_tracking_uri: MLflow tracking URI.
        mlflow_experiment: MLflow experiment.
        seed: Seed of the splits.
    """
    prep = _prepare(
        base_model,
        source=source,
        text_column=text_column,
        label_column=label_column,
        max_length=max_length,
        task=task,
        prompt_template=prompt_template,
        max_train_samples=max_train_samples,
        max_validation_samples=max_validation_samples,
        max_test_samples=max_test_samples,
        seed=seed,
    )
    _train_and_evaluate(
        prep.outputs["dataset"],
        base_model=base_model,
        hyperparameters=train_hyperparameters,
        best_params={},
        replicas=replicas,
        mesh=mesh,
        accelerator=accelerator,
        tpu_topology=tpu_topology,
        gpus_per_worker=gpus_per_worker,
        worker_node_selector=worker_node_selector,
        worker_tolerations=worker_tolerations,
        queue_name=queue_name,
        priority_class=priority_class,
        image=image,
        backend=backend,
        timeout_seconds=timeout_seconds,
        mlflow_tracking_uri=mlflow_tracking_uri,
        mlflow_experiment=mlflow_experiment,
    )
