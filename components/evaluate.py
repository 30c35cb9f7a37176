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
        log_model: Log the model as an MLflow pyfunc model.

    Returns:
        The test accuracy (what the pipeline's registration gate compares).
    """
    import time

    import pandas as pd

    from kubejax import tracking
    from kubejax.evaluate import evaluate_model, save_predictions, write_eval_report

    t0 = time.monotonic()
    result = evaluate_model(model.path, dataset.path, split=split, batch_size=batch_size)
    names = result["label_names"]
    for key in ("accuracy", "macro_f1", "loss", "majority_baseline", "examples_per_s"):
        metrics.log_metric(key, float(result[key]))
    for name, f1 in zip(names, result["f1"]):
        metrics.log_metric(f"f1_{name}", float(f1))
    metrics.log_metric("wall_s", round(time.monotonic() - t0, 2))
    confusion_matrix.log_confusion_matrix(names, result["confusion_matrix"])
    print(
        f"evaluate: {split} accuracy {result['accuracy']:.4f}, macro-F1 {result['macro_f1']:.4f} "
        f"on {int(sum(map(sum, result['confusion_matrix'])))} rows",
        flush=True,
    )
    write_eval_report(result, report.path)

    tracker = tracking.create_tracker(
        mlflow_tracking_uri,
        mlflow_experiment,
        run_id=mlflow_run_id or None,
        run_name=None if mlflow_run_id else "evaluate",
        tags=tracking.kfp_tags({"kubejax.step": "evaluate"}),
    )
    tracker.log_metrics(
        {
            f"{split}_{k}": float(result[k])
            for k in ("accuracy", "macro_f1", "loss", "majority_baseline")
        }
    )
    tracker.log_metrics({f"{split}_f1_{n}": float(v) for n, v in zip(names, result["f1"])})
    preds_path = report.path + ".predictions.json"
    save_predictions(result, preds_path)
    tracker.log_artifact(preds_path, "evaluation")
    tracker.log_artifact(report.path, "evaluation")
    model_uri = ""
    if log_model and tracker.run_id:
        from kubejax.data.dataset import load_split

        texts = load_split(dataset.path, split, with_text=True).texts or ["example review"]
        model_uri = tracker.log_pyfunc_model(model.path, pd.DataFrame({"text": texts[:2]}))
    tracker.finish()
    import json

    with open(mlflow_model.path, "w") as f:
        json.dump({"model_uri": model_uri, "mlflow_run_id": tracker.run_id or ""}, f)
    mlflow_model.metadata.update({"model_uri": model_uri, "mlflow_run_id": tracker.run_id or ""})
    return float(result["accuracy"])
