"""The `train` component: fine-tuning as a Kubeflow TrainJob or a Training Operator JAXJob."""

from typing import NamedTuple

from kfp import dsl
from kfp.dsl import HTML, Dataset, Input, Metrics, Model, Output

from kubejax.version import IMAGE

PASSTHROUGHS = [
    dsl.TaskConfigField.RESOURCES,
    dsl.TaskConfigField.ENV,
    dsl.TaskConfigField.KUBERNETES_VOLUMES,
    dsl.TaskConfigField.KUBERNETES_NODE_SELECTOR,
    dsl.TaskConfigField.KUBERNETES_TOLERATIONS,
    dsl.TaskConfigField.KUBERNETES_AFFINITY,
]


@dsl.component(base_image=IMAGE, install_kfp_package=False, task_config_passthroughs=PASSTHROUGHS)
def train(
    dataset: Input[Dataset],
    model: Output[Model],
    metrics: Output[Metrics],
    report: Output[HTML],
    base_model: str,
    hyperparameters: dict = {},
    best_params: dict = {},
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
    timeout_seconds: int = 86400,
    workspace_path: str = "",
    mlflow_tracking_uri: str = "",
    mlflow_experiment: str = "kubejax",
    run_id: str = "",
    task_name: str = "train",
    task_config: dsl.TaskConfig = None,
) -> NamedTuple("Outputs", mlflow_run_id=str, job_name=str):
    """Fine-tune a model (BERT family or a decoder LLM, whole or with LoRA) as a job of
    `replicas` workers: a Kubeflow Trainer TrainJob or a Training Operator JAXJob.

    What the pipeline sets on this task (GPU limits, env and secrets, volumes, node selector,
    tolerations, affinity) reaches the job's worker pods through `task_config`.

    Args:
        dataset: Prepared dataset (prepare-yelp).
        model: Output: the fine-tuned model folder (HF layout, tokenizer and labels included).
        metrics: Output: final train and eval loss and accuracy, examples/s, tokens/s, wall time
            and per-worker resource figures.
        report: Output: HTML with loss, accuracy, learning-rate and throughput curves.
        base_model: HF hub id or folder to fine-tune.
        hyperparameters: Trainer settings (TrainConfig field → value), e.g. learning_rate.
        best_params: Settings that override `hyperparameters` (the sweep's best params).
        replicas: Number of the job's workers (processes, pods); on a TPU, 0 or the slice's
            hosts.
        mesh: Device mesh over every worker's devices, e.g. "fsdp=-1" (shards parameters and
            optimizer state) or "data=2,fsdp=4,tensor=2"; empty: the trainer's `mesh`
            setting (data-parallel by default). Checked against replicas × devices before
            the job starts.
        devices_per_worker: GPUs of each worker pod (its nvidia.com/gpu limit); 0: as the
            task's resources say (one CPU device a worker without GPUs). On a TPU: the chips
            of each host (google.com/tpu), 0: the slice's (a v5e or v6e 2x4: 8 on one host,
            or 4 on two).
        accelerator: nvidia (GPUs, as devices_per_worker and the task's resources say), cpu
            (no GPUs) or a GKE TPU type (tpu-v5-lite-podslice, tpu-v5p-slice, tpu-v6e-slice,
            tpu-v4-podslice): the workers are the hosts of a slice of `tpu_topology`, on
            kubejax's TPU image (a TrainJob on the `jax-tpu` runtime); no GPUs then.
        tpu_topology: The TPU slice's topology (2x4, 4x4, 2x2x2, ...; GKE's
            cloud.google.com/gke-tpu-topology); required with a TPU accelerator. `replicas`
            must be 0 or its hosts.
        peft: none (full fine-tuning), lora (adapters on a frozen base, decoder or BERT; the
            model is the merged one, its PEFT adapter in the folder's `adapter/`) or qlora
            (LoRA on a base stored quantized, `weight_qtype` nf4 or int8); empty:
            hyperparameters'.
        lora_rank: LoRA's rank (0: hyperparameters' or 16).
        lora_alpha: LoRA's alpha, the adapters' scale being alpha / rank (0: 32).
        lora_targets: Projections adapted: attention, mlp, all or names (empty: attention).
        lora_dropout: Dropout on the adapters' inputs in training (0: hyperparameters' or 0).
        queue_name: Kueue LocalQueue of the job(s) (label kueue.x-k8s.io/queue-name): they
            wait, suspended, until Kueue admits them; their timeout counts from admission.
            Empty: no queue (Kueue's default LocalQueue, if the namespace has one).
        priority_class: Kueue WorkloadPriorityClass of the job(s); empty: none.
        image: Image of the worker pods; empty: the kubejax image of this version for the
            accelerator (its TPU variant on a TPU).
        backend: The engine: `trainjob` (Kubeflow Trainer v2), `jaxjob` (Training Operator
            v1), `kubernetes` (whichever the cluster serves, TrainJob first), `local`, or
            `auto` (kubernetes inside a cluster, else local).
        timeout_seconds: The job's activeDeadlineSeconds and the launcher's wait.
        workspace_path: The pipeline workspace (dsl.WORKSPACE_PATH_PLACEHOLDER); required on
            kubernetes, where the worker pods read the data and write the model there.
        mlflow_tracking_uri: MLflow tracking URI; empty uses $MLFLOW_TRACKING_URI.
        mlflow_experiment: MLflow experiment of the training run.
        run_id: KFP run id (dsl.PIPELINE_JOB_ID_PLACEHOLDER): names the job deterministically,
            so a retried task re-attaches to it, and tags the MLflow run.
        task_name: This task's name (dsl.PIPELINE_TASK_NAME_PLACEHOLDER): with run_id, names
            the job, so two train tasks of one pipeline never share a job.
        task_config: Filled by KFP from the task's settings.

    Returns:
        mlflow_run_id: the training run ('' when tracking is off); job_name: the TrainJob or JAXJob.
    """
    settings = dict(locals())  # the parameters by name, taken before any import adds names
    from pathlib import Path

    from kubejax.launchers.train import train_task

    for name in ("dataset", "model", "metrics", "report"):
        del settings[name]
    outcome = train_task(dataset.path, model.path, **settings)
    for key, value in outcome.metrics.items():
        metrics.log_metric(key, value)
    model.metadata.update(outcome.model_metadata)
    Path(report.path).write_text(outcome.report_html)
    outputs = NamedTuple("Outputs", mlflow_run_id=str, job_name=str)
    return outputs(outcome.mlflow_run_id, outcome.job_name)
