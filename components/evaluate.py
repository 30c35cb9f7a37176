"""The `evaluate` component: test-set metrics, the confusion matrix in the KFP UI, the model
in MLflow."""

from kfp import dsl
from kfp.dsl import HTML, Artifact, ClassificationMetrics, Dataset, Input, Metrics, Model, Output

from kubejax.version import IMAGE


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def evaluate(
    model: Input[Model],
    dataset: Input[Dataset],
    metrics: Output[Metrics],
    confusion_matrix: Output[ClassificationMetrics],
    report: Output[HTML],
    mlflow_model: Output[Artifact],
    mlflow_run_id: str = "",
    mlflow_tracking_uri: str = "",
    mlflow_experiment: str = "kubejax",
    split: str = "test",
    batch_size: int = 64,
    dtype: str = "auto",
    log_model: bool = True,
) -> float:
    """Evaluate a trained model on the dataset's test split.

    Args:
        model: Model folder from the train step.
        dataset: Prepared dataset; its `split` is evaluated.
        metrics: Output: accuracy, macro-F1, loss, per-class F1, majority baseline, examples/s.
        confusion_matrix: Output: the confusion matrix, rendered by the KFP UI.
        report: Output: HTML with the per-class table and the confusion matrix.
        mlflow_model: Output: JSON with the MLflow model URI (`model_uri`, also in the
            artifact's metadata) for register-model; empty URI when no model was logged.
        mlflow_run_id: The training run; the figures and the model are logged into it. Empty
            creates an `evaluate` run.
        mlflow_tracking_uri: MLflow tracking URI; empty uses $MLFLOW_TRACKING_URI.
        mlflow_experiment: Experiment for a new run.
        split: The split to evaluate.
        batch_size: Examples per inference batch.
        dtype: Compute dtype, `float32`, `bfloat16` (bfloat16 products summed in float32:
            faster where the hardware has them; a near-tie prediction may turn) or `auto`
            (bfloat16 where the device multiplies it natively, else float32).
        log_model: Log the model as an MLflow pyfunc model.

    Returns:
        The test accuracy (what the pipeline's registration gate compares).
    """
    import json
    from pathlib import Path

    from kubejax.evaluate import evaluate_task

    outcome = evaluate_task(
        model.path,
        dataset.path,
        report.path,
        split=split,
        batch_size=batch_size,
        dtype=dtype,
        mlflow_run_id=mlflow_run_id,
        mlflow_tracking_uri=mlflow_tracking_uri,
        mlflow_experiment=mlflow_experiment,
        log_model=log_model,
    )
    for key, value in outcome.metrics.items():
        metrics.log_metric(key, value)
    confusion_matrix.log_confusion_matrix(outcome.label_names, outcome.confusion_matrix)
    logged = {"model_uri": outcome.model_uri, "mlflow_run_id": outcome.mlflow_run_id}
    Path(mlflow_model.path).write_text(json.dumps(logged))
    mlflow_model.metadata.update(logged)
    return outcome.accuracy
