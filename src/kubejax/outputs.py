"""What a training job leaves in its output folder: the contract between the trainer (in the
workers) and what reads it (the launchers in the KFP tasks, the sweeps). Importable without
jax."""

import json
from pathlib import Path

#: Progress and final figures: {status, step, total_steps, mlflow_run_id, train, evals, final}.
METRICS_FILE = "metrics.json"
#: The trained model in the Hugging Face layout, with its tokenizer and labels.
MODEL_DIR = "model"
#: Metric values the MLflow server never took (an outage past the retries), with the run id.
UNDELIVERED_FILE = "mlflow-undelivered.json"
#: Under LoRA, the adapter in PEFT's format, inside MODEL_DIR (which holds the merged model).
ADAPTER_DIR = "adapter"


def read_metrics(output_dir: str | Path) -> dict:
    """A job's metrics.json; {} while it is not written yet (or being replaced): the sweeps
    read it as the job writes it."""
    try:
        return json.loads((Path(output_dir) / METRICS_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return {}
