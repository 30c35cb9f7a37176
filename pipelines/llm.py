"""The LLM pipeline: a decoder fine-tuned with LoRA, tuned first.

prepare → tune sweep (learning rate, LoRA rank and alpha; its first trial the pipeline's own
settings, which the final training keeps unless a trial beats them beyond the evaluations'
noise; trials the memory plan says cannot fit are skipped) → train with the chosen settings
(LoRA on a frozen base, sharded over the workers' GPUs) → evaluate → register the merged
model. The same components as the Yelp pipelines: a pipeline of its own because every default
differs (a decoder base, the task causal-lm, LoRA, the machine's precision, GPU workers with an FSDP
mesh, a search space over what matters for adapters), and a user of the BERT pipeline should
not meet a dozen settings that do nothing for BERT. Defaults suit a cluster; `kubejax run
--local` overrides them for this machine. On TPUs (`accelerator`, `tpu_topology`,
`trial_tpu_topology`) the trials may take a smaller slice than the final training:
docs/tpu.md.
"""

import json

from kfp import dsl
from kubejax.pipelines.yelp import (
    ANY_NODE,
    NO_TOLERATIONS,
    WORKSPACE,
    _prepare,
    _register,
    _sweep,
    _train_and_evaluate,
)

LLM_SPACE = json.dumps(
    {
        "learning_rate": {"type": "float", "low": 5e-5, "high": 5e-4, "log": True},
        "lora_rank": {"type": "categorical", "choices": [8, 16, 32]},
        "lora_alpha": {"type": "categorical", "choices": [16, 32, 64]},
    }
)
#: The machine's precision (`kubejax.trainer.precision`): bfloat16 weights and compute where the
#: device multiplies bfloat16 natively (GPUs from Ampere, TPUs, CPUs with AMX), else float32;
#: the adapters and their moments stay float32.
LLM_TRIAL_HP = {
    "max_steps": 300,
    "eval_every": 100,
    "global_batch_size": 16,
    "max_eval_examples": 1000,
    "dtype": "auto",
    "param_dtype": "auto",
}
LLM_TRAIN_HP = {
    "epochs": 1,
    "global_batch_size": 32,
    "learning_rate": 2e-4,
    "eval_every": 1000,
    "checkpoint_every": 1000,
    "max_eval_examples": 2000,
    "dtype": "auto",
    "param_dtype": "auto",
}


@dsl.pipeline(
    name="kubejax-llm",
    description="Fine-tune a decoder LLM (Llama, Mistral, Qwen, Gemma 3) with LoRA on Yelp "
    "reviews: prepare, tune (rank, alpha, learning rate), train sharded over GPU workers, "
    "evaluate, register the merged model with its PEFT adapter.",
    pipeline_config=WORKSPACE,
)
def llm_pipeline(
    source: str = "Yelp/yelp_review_full",
    base_model: str = "Qwen/Qwen2.5-1.5B",
    text_column: str = "text",
    label_column: str = "label",
    max_length: int = 256,
    task: str = "causal-lm",
    prompt_template: str = "",
    max_train_samples: int = 0,
    max_validation_samples: int = 10000,
    max_test_samples: int = 0,
    peft: str = "lora",
    lora_rank: int = 16,
    lora_alpha: float = 32.0,
    lora_targets: str = "attention",
    lora_dropout: float = 0.05,
    search_space: str = LLM_SPACE,
    tuner: str = "optuna",
    scheduler: str = "none",
    algorithm: str = "tpe",
    objective: str = "eval_accuracy",
    direction: str = "maximize",
    max_trials: int = 8,
    parallelism: int = 2,
    max_workers: int = 0,
    pruner: str = "median",
    trial_hyperparameters: dict = LLM_TRIAL_HP,
    trial_replicas: int = 1,
    trial_gpus_per_worker: int = 1,
    trial_mesh: str = "",
    trial_tpu_topology: str = "",
    train_hyperparameters: dict = LLM_TRAIN_HP,
    replicas: int = 2,
    gpus_per_worker: int = 4,
    mesh: str = "fsdp=-1",
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
    mlflow_experiment: str = "kubejax-llm",
    register_threshold: float = 0.5,
    registered_model_name: str = "kubejax-llm",
    seed: int = 0,
):
    """Prepare → tune sweep → train with LoRA and the best settings → evaluate → register.

    Args:
        source: Hub dataset id, or a file/folder/URI of reviews (csv, tsv, json, jsonl, parquet).
        base_model: HF hub id or folder of a decoder (Llama 3, Mistral, Qwen 2.5/3, Gemma 3),
            also the tokenizer; gated models read the `hf-token` secret.
        text_column: Column with the review text.
        label_column: Column with the stars / label.
        max_length: Token truncation length.
        task: causal-lm (the decoder writes each review's label after `prompt_template`) or
            classification (a `score` head on the last token, trained whole).
        prompt_template: causal-lm: the prompt, with {review} where the review goes; empty:
            kubejax's default ("Review: {review}", then "Rating:" on the next line).
        max_train_samples: Stratified cap on train rows (0: all).
        max_validation_samples: Stratified cap on validation rows (0: all).
        max_test_samples: Stratified cap on test rows (0: all).
        peft: lora (adapters on the frozen base), qlora (the same on a base stored as nf4 or
            int8 codes: `weight_qtype` in the hyperparameters) or none (full fine-tuning).
        lora_rank: The adapters' rank (a searched lora_rank wins).
        lora_alpha: The adapters' scale is lora_alpha / lora_rank (a searched one wins).
        lora_targets: Projections adapted: attention, mlp, all, or names (q_proj,v_proj).
        lora_dropout: Dropout on the adapters' inputs in training (PEFT's lora_dropout).
        search_space: JSON search space over trainer settings (learning_rate, lora_rank,
            lora_alpha, lora_targets, optimizer, ...) and resources (`replicas`,
            `devices_per_worker`); trials whose memory plan does not fit are skipped.
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
        max_workers: Workers the running trials may use together; 0: no limit.
        pruner: none, median, successive_halving or hyperband.
        trial_hyperparameters: Fixed trainer settings of every trial (`device_memory`, e.g.
            "80GiB", makes the plan check trials where the GPU type is not labelled).
        trial_replicas: Workers per trial (unless searched).
        trial_gpus_per_worker: nvidia.com/gpu limit of each trial worker.
        trial_mesh: Device mesh of every trial (see mesh).
        trial_tpu_topology: The TPU slice of every trial, e.g. 2x4 while the final training
            takes 4x4; required with a TPU accelerator.
        train_hyperparameters: Trainer settings of the final training (the best params win).
        replicas: Workers of the final training; on a TPU, 0 or the slice's hosts.
        gpus_per_worker: nvidia.com/gpu limit of each worker of the final training (0 on a
            TPU).
        mesh: Device mesh of the final training over replicas × gpus_per_worker devices (a
            TPU slice's chips); "fsdp=-1" shards the frozen base over all of them.
        accelerator: nvidia (GPU workers), cpu, or a GKE TPU type (tpu-v5-lite-podslice,
            tpu-v5p-slice, tpu-v6e-slice, tpu-v4-podslice): every worker a host of a slice,
            with its chips, GKE's node selectors and kubejax's TPU image; the memory plan
            checks the chip's memory. Set the GPU counts to 0 and the worker counts to 0.
        tpu_topology: The final training's TPU slice, e.g. 4x4; required on a TPU.
        worker_node_selector: Node labels every worker pod requires (a GPU pool's; its
            `nvidia.com/gpu.product` gives the memory plan the GPU's memory).
        worker_tolerations: Tolerations of every worker pod.
        queue_name: Kueue LocalQueue of every training and trial job (see kubejax-yelp).
        priority_class: Kueue WorkloadPriorityClass of those jobs.
        image: The image of every training and trial worker; empty: kubejax's of this
            version for the accelerator (its TPU variant on a TPU).
        backend: auto, trainjob, jaxjob, kubernetes or local.
        timeout_seconds: Limit of the final training job.
        mlflow_tracking_uri: MLflow tracking URI (credentials come from the secret).
        mlflow_experiment: MLflow experiment of this pipeline's runs.
        register_threshold: Register the merged model when test accuracy reaches this.
        registered_model_name: Name in the MLflow Model Registry.
        seed: Seed of the splits, the sweep and the adapters' initialisation.
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
    adapters = {"peft": peft, "lora_rank": lora_rank, "lora_alpha": lora_alpha,
                "lora_targets": lora_targets, "lora_dropout": lora_dropout}  # fmt: skip
    placement = {"worker_node_selector": worker_node_selector,
                 "worker_tolerations": worker_tolerations}  # fmt: skip
    queue = {"queue_name": queue_name, "priority_class": priority_class}
    common = {"base_model": base_model, "image": image, "backend": backend,
              "accelerator": accelerator, "mlflow_tracking_uri": mlflow_tracking_uri,
              "mlflow_experiment": mlflow_experiment}  # fmt: skip
    sweep = _sweep(
        prep.outputs["dataset"],
        trial_gpus_per_worker=trial_gpus_per_worker,
        **placement,
        **queue,
        **common,
        **adapters,
        search_space=search_space,
        hyperparameters=trial_hyperparameters,
        # The final training's settings: the sweep's first trial, kept unless beaten.
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
        tpu_topology=trial_tpu_topology,
    )
    evaluated = _train_and_evaluate(
        prep.outputs["dataset"],
        **placement,
        **queue,
        **common,
        **adapters,
        hyperparameters=train_hyperparameters,
        best_params=sweep.outputs["best_params"],
        replicas=replicas,
        mesh=mesh,
        tpu_topology=tpu_topology,
        gpus_per_worker=gpus_per_worker,
        timeout_seconds=timeout_seconds,
    )
    _register(evaluated, register_threshold, registered_model_name, mlflow_tracking_uri)
