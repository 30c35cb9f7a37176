"""Test-set evaluation of a trained model folder: batched, jitted, data-parallel over the
local devices; accuracy, macro-F1, per-class precision/recall/F1, loss, confusion matrix."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kubejax import report
from kubejax.data import dataset
from kubejax.errors import KubejaxError
from kubejax.models import weights
from kubejax.trainer import precision
from kubejax.trainer.predict import predict_logits, use_cpu_cores_as_devices


class EvaluationError(KubejaxError, ValueError):
    """Evaluation inputs that do not fit; the message names the setting."""


def check_model_dir(model_dir: str | Path) -> Path:
    """A model folder with config, weights and labels, or EvaluationError listing what lacks."""
    path = Path(model_dir)
    needed = ["config.json", weights.LABELS_FILE]
    missing = [n for n in needed if not (path / n).is_file()]
    if not (path / weights.SAFETENSORS).is_file() and not (path / weights.PYTORCH_BIN).is_file():
        missing.append(weights.SAFETENSORS)
    if missing:
        raise EvaluationError(f"model: {path} lacks {', '.join(missing)}")
    return path


def classification_metrics(labels: np.ndarray, preds: np.ndarray, num_labels: int) -> dict:
    """Accuracy, macro-F1, per-class precision/recall/F1/support and the confusion matrix."""
    cm = np.zeros((num_labels, num_labels), dtype=np.int64)
    np.add.at(cm, (labels, preds), 1)
    tp = np.diag(cm).astype(float)
    precision = np.divide(tp, cm.sum(0), out=np.zeros_like(tp), where=cm.sum(0) > 0)
    recall = np.divide(tp, cm.sum(1), out=np.zeros_like(tp), where=cm.sum(1) > 0)
    denom = precision + recall
    f1 = np.divide(2 * precision * recall, denom, out=np.zeros_like(tp), where=denom > 0)
    return {
        "accuracy": float(tp.sum() / max(cm.sum(), 1)),
        "macro_f1": float(f1.mean()),
        "precision": precision.tolist(),
        "recall": recall.tolist(),
        "f1": f1.tolist(),
        "support": cm.sum(1).tolist(),
        "confusion_matrix": cm.tolist(),
    }


def evaluate_model(
    model_dir: str | Path,
    data_dir: str | Path,
    split: str = "test",
    batch_size: int = 64,
    dtype: str = "auto",
) -> dict:
    """Metrics of the model on a split, with predictions and throughput. In a process whose JAX
    has not started, on CPU it computes on one device per core (`use_cpu_cores_as_devices`).

    `dtype` is the compute dtype, as the trainer's (`auto`: bfloat16 where the device
    multiplies it natively, `kubejax.trainer.precision`): `bfloat16` multiplies bfloat16 operands
    into float32 sums, faster than float32 where the hardware has bfloat16 products (a CPU
    with AVX512-BF16, a GPU), and may turn a prediction whose top two logits nearly tie.
    """
    try:
        precision.check("dtype", dtype)
    except precision.PrecisionError as err:
        raise EvaluationError(str(err)) from None
    use_cpu_cores_as_devices(batch_size)
    if dtype == precision.AUTO:
        device = jax.devices()[0]
        dtype = precision.choose(dtype, dtype, "none", device.platform, device).dtype
    model_dir = check_model_dir(model_dir)
    meta = dataset.read_metadata(data_dir)
    try:
        data = dataset.load_split(data_dir, split, with_text=True)
    except dataset.DatasetError as err:
        raise EvaluationError(f"dataset: {err}") from err
    model, label_names = weights.load_model_dir(model_dir, getattr(jnp, dtype))
    num_labels = len(label_names)
    if int(meta["num_labels"]) != num_labels:
        raise EvaluationError(
            f"num_labels: the model has {num_labels} classes, the dataset {meta['num_labels']}"
        )
    answers = _answers(weights.read_settings(model_dir), meta)
    t0 = time.perf_counter()
    max_length = int(meta.get("max_length", 512))
    logits = predict_logits(model, data, batch_size, max_length, progress=True, answers=answers)
    elapsed = time.perf_counter() - t0
    preds = logits.argmax(-1)
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    loss = float(-logp[np.arange(len(preds)), data.labels].mean())
    result = classification_metrics(data.labels, preds, num_labels)
    counts = np.bincount(data.labels, minlength=num_labels)
    result.update(
        loss=loss,
        examples=len(preds),
        examples_per_s=len(preds) / elapsed,
        majority_baseline=float(counts.max() / counts.sum()),
        label_names=label_names,
        predictions=preds.tolist(),
        max_length=int(meta.get("max_length", 512)),
        dtype=dtype,
    )
    return result


def _answers(settings: dict, meta: dict) -> list[list[int]] | None:
    """A language model's answers, which the dataset's prompts must have been built for."""
    if settings["task"] != "causal-lm":
        if meta.get("task", "classification") != "classification":
            raise EvaluationError(
                "dataset: prepared for task causal-lm (prompts), but the model is a classifier"
            )
        return None
    same = (meta.get("prompt_template"), meta.get("answers")) == (
        settings["prompt_template"],
        settings["answers"],
    )
    if not same:
        raise EvaluationError(
            "dataset: its prompts or answers are not the model's (prepare it with the model's "
            f"tokenizer, task causal-lm and prompt_template {settings['prompt_template']!r})"
        )
    return settings["answers"]


def write_eval_report(result: dict, path: str | Path) -> None:
    """An HTML report: headline figures, per-class table, confusion matrix."""
    names = result["label_names"]
    per_class = [
        {"class": n, "precision": p, "recall": r, "f1": f, "support": s}
        for n, p, r, f, s in zip(
            names,
            result["precision"],
            result["recall"],
            result["f1"],
            result["support"],
            strict=True,
        )
    ]
    cm_rows = [
        {"true \\ predicted": n, **dict(zip(names, row, strict=True))}
        for n, row in zip(names, result["confusion_matrix"], strict=True)
    ]
    head = {
        k: result[k]
        for k in ("accuracy", "macro_f1", "loss", "majority_baseline", "examples", "examples_per_s")
    }
    figures = evaluation_figures(result)
    sections = [
        report.table([head]),
        *(report.svg(fig) for fig in figures.values()),
        "<h2>Per class</h2>" + report.table(per_class),
        "<h2>Confusion matrix</h2>" + report.table(cm_rows),
    ]
    report.close(figures.values())
    Path(path).write_text(report.page("Evaluation", sections))


def evaluation_figures(result: dict) -> dict:
    """The evaluation's figures by file name: the confusion matrix as heat maps (counts, and
    each true class's row normalised to 1) and F1 per class."""
    names = result["label_names"]
    counts = np.asarray(result["confusion_matrix"], dtype=float)
    rows = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
    figures = {}
    for key, values, fmt, label in (
        ("confusion_matrix.svg", counts, "{:.0f}", "examples"),
        ("confusion_matrix_normalized.svg", rows, "{:.2f}", "share of the true class"),
    ):
        size = (1.2 + 0.75 * len(names), 0.9 + 0.65 * len(names))
        title = "Confusion matrix" + (" (row-normalised)" if values is rows else " (counts)")
        fig, ax = report.new_figure(title, "predicted label", "true label", size=size)
        ax.grid(False)
        image = ax.imshow(values, cmap="Blues")
        ax.set_xticks(range(len(names)), names, rotation=45, ha="right")
        ax.set_yticks(range(len(names)), names)
        top = values.max() or 1
        for (i, j), v in np.ndenumerate(values):
            colour = "white" if v > top / 2 else "black"
            ax.text(j, i, fmt.format(v), ha="center", va="center", color=colour, fontsize=8)
        fig.colorbar(image, ax=ax, label=label)
        figures[key] = fig
    fig, ax = report.new_figure("F1 per class", "class", "F1 (test split)")
    ax.bar(names, result["f1"])
    ax.set_ylim(0, 1)
    figures["f1_per_class.svg"] = fig
    return figures


def summary(result: dict) -> dict:
    """The headline figures (no per-example data)."""
    return {k: v for k, v in result.items() if k not in ("predictions",)}


def save_predictions(result: dict, path: str | Path) -> None:
    """Predictions as JSON (label ids, in test-row order)."""
    Path(path).write_text(
        json.dumps({"predictions": result["predictions"], "label_names": result["label_names"]})
    )


@dataclass
class EvalOutcome:
    """What the evaluate component logs: figures, the confusion matrix, the logged model."""

    accuracy: float
    metrics: dict[str, float]
    label_names: list[str]
    confusion_matrix: list[list[int]]
    model_uri: str
    mlflow_run_id: str


def evaluate_task(
    model_path: str,
    dataset_path: str,
    report_path: str,
    *,
    split: str = "test",
    batch_size: int = 64,
    dtype: str = "auto",
    mlflow_run_id: str = "",
    mlflow_tracking_uri: str = "",
    mlflow_experiment: str = "kubejax",
    log_model: bool = True,
) -> EvalOutcome:
    """Evaluate a model folder on a split; write the HTML report (and the predictions beside
    it); log metrics, report and predictions into the training's MLflow run (or a new
    `evaluate` run), and the model as a pyfunc model when `log_model`."""
    from kubejax import tracking
    from kubejax.trainer.compile_cache import use_user_dir

    use_user_dir()
    t0 = time.monotonic()
    result = evaluate_model(
        model_path, dataset_path, split=split, batch_size=batch_size, dtype=dtype
    )
    dtype = result["dtype"]  # `auto` as it resolved on this device
    names = result["label_names"]
    figures = ("accuracy", "macro_f1", "loss", "majority_baseline")
    metrics = {key: float(result[key]) for key in (*figures, "examples_per_s")}
    metrics |= {f"f1_{name}": float(f1) for name, f1 in zip(names, result["f1"], strict=True)}
    metrics["wall_s"] = round(time.monotonic() - t0, 2)
    print(
        f"evaluate: {split} accuracy {result['accuracy']:.4f}, macro-F1 {result['macro_f1']:.4f} "
        f"on {int(sum(map(sum, result['confusion_matrix'])))} rows in {dtype}",
        flush=True,
    )
    write_eval_report(result, report_path)
    predictions = report_path + ".predictions.json"
    save_predictions(result, predictions)

    # The training's run when given, else (under KFP's MLflow integration) the task's own run.
    joined = {} if mlflow_run_id else tracking.kfp_task_tracking(mlflow_tracking_uri)
    tracker = tracking.create_tracker(
        mlflow_tracking_uri,
        mlflow_experiment,
        run_id=mlflow_run_id or None,
        run_name=None if mlflow_run_id else "evaluate",
        tags=tracking.kfp_tags({"kubejax.step": "evaluate", "kubejax.eval_dtype": dtype}),
        **joined,
    )
    tracker.log_metrics({f"{split}_{k}": float(result[k]) for k in figures})
    tracker.log_metrics(
        {f"{split}_f1_{n}": float(v) for n, v in zip(names, result["f1"], strict=True)}
    )
    tracker.log_artifact(predictions, "evaluation")
    tracker.log_artifact(report_path, "evaluation")
    figures = evaluation_figures(result)
    for name, fig in figures.items():
        tracker.log_figure(fig, f"evaluation/{name}")
    report.close(figures.values())
    model_uri = ""
    if log_model and tracker.run_id:
        import pandas as pd

        texts = dataset.load_split(dataset_path, split, with_text=True).texts
        example = pd.DataFrame({"text": (texts or ["example review"])[:2]})
        model_uri = tracker.log_pyfunc_model(model_path, example)
    tracker.finish()
    return EvalOutcome(
        accuracy=float(result["accuracy"]),
        metrics=metrics,
        label_names=names,
        confusion_matrix=result["confusion_matrix"],
        model_uri=model_uri,
        mlflow_run_id=tracker.run_id or "",
    )
