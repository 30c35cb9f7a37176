"""The real model's training step timed on this machine before a local LLM run, so that the
run's budget comes from that step, not from a matmul times a constant.

A matmul's speed times the share of it the trainer reached on one CPU (`budget.EFFICIENCY`)
missed 6× on another CPU for another model (an AVX2-only EPYC, a 270M decoder in bfloat16):
what a step costs depends on the CPU's kernels for that model's shapes and dtype. So before a
run whose estimate is long enough for its speed to matter (`PROBE_FROM_S`), kubejax runs the
trainer itself for a few steps of the trials' settings on a sample of the source, in one
padded shape, and times them: the job's start (process, model load), the first step's
compile and the median step. The probe's programs are the trials' for that shape, so JAX's
persistent cache serves them to the first trial.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kubejax.models.shape import ModelShape
from kubejax.tune.budget import StepTiming

#: Steps the probe runs: the first compiles, the median of the others is the step.
PROBE_STEPS = 4
#: A run whose first estimate is shorter is not probed: its steps' FLOPs are not where its
#: time goes (the embedded decoder's run is its starts and compiles), and a probe would cost
#: a good share of it.
PROBE_FROM_S = 300.0
#: Validation and test rows of the probe's sample (its evaluation is one small batch).
PROBE_EVAL_ROWS = 8


class ProbeError(RuntimeError):
    """The probe's trainer failed (the run's own jobs would fail the same way)."""


def sample_source(frames: dict, text: str, label: str, rows: int, folder: Path) -> Path:
    """A folder of train.csv with `rows` of the source's longest training texts (every label
    kept, so the head has the run's shape), and validation.csv and test.csv of a few rows."""
    import pandas as pd

    train = frames.get("train", next(iter(frames.values())))[[text, label]].dropna()
    # The longest reviews: every row fills the probe's one padded shape.
    longest = train.assign(_n=train[text].astype(str).str.len()).sort_values("_n", ascending=False)
    each = longest.groupby(label, sort=False).head(1)
    chosen = pd.concat([each, longest.drop(each.index).head(max(0, rows - len(each)))])
    folder.mkdir(parents=True, exist_ok=True)
    chosen.drop(columns="_n").to_csv(folder / "train.csv", index=False)
    # Validation and test files of their own: nothing is carved out of the training rows.
    held = pd.concat([train.drop(chosen.index).head(PROBE_EVAL_ROWS), each.drop(columns="_n")])
    for split in ("validation", "test"):
        held.to_csv(folder / f"{split}.csv", index=False)
    return folder


def probe_settings(trial: dict, rows: int, length: int) -> dict:
    """The trainer settings of the probe: the trials' (`trial`, adapters and task included),
    `PROBE_STEPS` steps of `rows` × `length` tokens in one padded shape, one small
    evaluation, nothing saved, no tracking."""
    return {
        **trial,
        "global_batch_size": rows,
        "max_steps": PROBE_STEPS,
        "epochs": 1,
        "eval_every": 0,
        "checkpoint_every": 0,
        "save_final": False,
        "log_every": 1,
        "max_length": length,
        "bucket_multiple": length,
        "max_eval_examples": PROBE_EVAL_ROWS,
        "eval_batch_size": PROBE_EVAL_ROWS,
        "mlflow_tracking_uri": "",
    }


def read_timing(metrics: dict, rows: int, length: int, shape: ModelShape, peft: str,
                wall_s: float) -> StepTiming:  # fmt: skip
    """The step's timing from the probe's metrics.json: the median step after the first (each
    a row of its own: `log_every` 1), the first step's compile beyond it, and the job's start
    (its setup phase: the process, the data, the model)."""
    steps = [rows / r["examples_per_s"] for r in metrics["train"] if r["step"] > 1]
    if not steps:
        raise ProbeError("the probe timed no step after the first")
    step_s = statistics.median(steps)
    final = metrics["final"]
    tokens = rows * length
    return StepTiming(
        rows=rows,
        length=length,
        step_s=step_s,
        flop_s=tokens * shape.train_flops(length, peft) / step_s,
        job_start_s=float(final.get("phases_s", {}).get("setup", 0.0)),
        compile_s=max(0.0, float(final["first_step_s"]) - step_s),
        wall_s=wall_s,
    )


def probe_step(
    *,
    model: str,
    frames: dict,
    prepare: dict,
    trial: dict,
    rows: int,
    length: int,
    shape: ModelShape,
    peft: str,
    env: dict[str, str] | None = None,
) -> StepTiming:
    """Time the trials' step of `rows` × `length` tokens on this machine: a sample of the
    source (`frames`, as `prepare.load_source` read it) prepared as the prepare step prepares
    it (`prepare`: its PrepareConfig fields), then the trainer for `PROBE_STEPS` steps with
    the trials' settings (`trial`). ProbeError where the trainer fails."""
    from kubejax.data.prepare import PrepareConfig, prepare_yelp
    from kubejax.launchers.common import trainer_args, worker_env

    t0 = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="kubejax-probe-"))
    try:
        source = sample_source(frames, prepare["text_column"], prepare["label_column"], rows,
                               work / "source")  # fmt: skip
        cfg = PrepareConfig(tokenizer=model, **{**prepare, "source": str(source),
                                                "validation_split": "validation",
                                                "max_length": length})  # fmt: skip
        prepare_yelp(cfg, work / "data", progress=False)
        settings = probe_settings(trial, rows, length)
        flags = trainer_args({**settings, "model": model, "data_dir": str(work / "data"),
                              "output_dir": str(work / "out")})  # fmt: skip
        environ = {**os.environ, **worker_env("", ""), **(env or {})}
        environ.pop("MLFLOW_TRACKING_URI", None)
        proc = subprocess.run([sys.executable, "-m", "kubejax.trainer", *flags], env=environ,
                              capture_output=True, text=True, check=False)  # fmt: skip
        if proc.returncode:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise ProbeError(f"the step's probe failed ({proc.returncode}): {' | '.join(tail)}")
        metrics = json.loads((work / "out" / "metrics.json").read_text())
        return read_timing(metrics, rows, length, shape, peft, time.monotonic() - t0)
    finally:
        shutil.rmtree(work, ignore_errors=True)
