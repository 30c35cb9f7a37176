"""Where the loop's figures go: the MLflow run, metrics.json, the console and a TrainJob's
status, with the throughput window and the ETA."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import jax
import numpy as np

from kubejax import monitoring, report, tracking
from kubejax.errors import KubejaxError
from kubejax.outputs import METRICS_FILE, UNDELIVERED_FILE
from kubejax.trainer.config import TrainConfig
from kubejax.trainer.inputs import TrainData
from kubejax.trainer.trainer_status import StatusReporter


class DivergedError(KubejaxError, RuntimeError):
    """The loss became NaN or infinite; the message names the step."""


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def _window(t: float | None = None) -> dict:
    """A throughput window opened at `t` (now by default): what it has counted since."""
    return {"t": time.monotonic() if t is None else t, "examples": 0, "tokens": 0.0, "steps": 0}


def _eta(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return (
        f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
        if seconds >= 3600
        else (f"{seconds // 60}m{seconds % 60:02d}s")
    )


def _mean_after_first(rows: list[dict], key: str) -> float:
    """Mean of a throughput column, leaving out the first row: the first step alone (its
    compile) when log_every is 1, else a window where length buckets' first shapes compile."""
    values = [r[key] for r in rows[1:]] or [r[key] for r in rows] or [0.0]
    return float(np.mean(values))


def start_tracker(cfg: TrainConfig, data: TrainData, resumed: bool) -> tracking.Tracker:
    """Process 0's MLflow run (a no-op tracker on the other processes); parameters are logged
    once, by the attempt that starts the run."""
    if jax.process_index() != 0:
        return tracking.Tracker()
    tracker = tracking.create_tracker(
        cfg.tracking_uri,
        cfg.mlflow_experiment,
        run_name=cfg.mlflow_run_name or None,
        run_id=cfg.mlflow_run_id or None,
        parent_run_id=cfg.mlflow_parent_run_id or None,
        tags=tracking.kfp_tags(tracking.parse_tags(cfg.mlflow_tags)),
    )
    if not resumed:
        tracker.log_params(
            {
                **cfg.to_dict(),
                "num_labels": data.num_labels,
                "total_steps": data.total_steps,
                "num_processes": jax.process_count(),
                "num_devices": jax.device_count(),
                "train_rows": len(data.train),
            }
        )
    return tracker


class Progress:
    """Where the loop's figures go: the history (kept in checkpoints), MLflow, metrics.json
    (which the launcher and the sweep read) and the console, with a throughput window.

    A step's metrics are read one step late (`dispatched`), so that reading them never waits
    for the device while the next step could already be running.
    """

    def __init__(self, cfg, out: Path, tracker, total_steps: int, host_lr, history: dict, sampler):
        self.cfg, self.out, self.tracker, self.sampler = cfg, out, tracker, sampler
        self.total_steps, self.host_lr, self.history = total_steps, host_lr, history
        self.is_main = jax.process_index() == 0
        # A TrainJob's progress in its status, where Trainer asks for it (worker 0 only).
        self.status = StatusReporter.from_env() if self.is_main else None
        self.pending = None
        self.window = _window()
        #: seconds of this run's first step, its compile included (None until recorded)
        self.first_step_s: float | None = None
        self.step_program: dict | None = None
        #: The compilation cache's lookups of the first step ("compilation cache: 3 hits, …").
        self.cache = ""

    def say(self, text: str) -> None:
        if self.is_main:
            print(text, flush=True)

    def program(self, figures: dict) -> None:
        """The compiled train step's memory on each device (`train.step_program`): said once,
        and kept for metrics.json's `final` (`step_program_bytes`)."""
        self.step_program = figures
        gib = {k: f"{v / 2**30:.2f} GiB" for k, v in figures.items()}
        self.say(
            f"step program: {gib['total']} a device (arguments {gib['arguments']}, "
            f"temporaries {gib['temporaries']}, outputs {gib['outputs']})"
        )

    def dispatched(self, step: int, metrics) -> None:
        """Record the previous step's metrics, keep this step's for later."""
        self.flush()
        self.pending = (step, metrics)

    def flush(self) -> None:
        """Record the step whose metrics are still pending."""
        if self.pending is not None:
            self._record(*self.pending)
            self.pending = None

    def _record(self, step: int, metrics) -> None:
        m = {k: float(v) for k, v in jax.device_get(metrics).items()}
        if not math.isfinite(m["loss"]):
            self.diverged(step + 1, m["loss"])
        # Reviews, not rows: a packed row holds several.
        examples = round(m.pop("examples", self.cfg.global_batch_size))
        self.sampler.count(examples // jax.process_count())
        w = self.window
        w["examples"] += examples
        w["tokens"] += m.pop("tokens")
        w["steps"] += 1
        if self.first_step_s is None:
            # The first step holds the compile (tens of seconds on an accelerator): said once
            # apart, and the window restarts after it so that the ETA and the throughput
            # shown are those of compiled steps.
            now = time.monotonic()
            self.first_step_s = now - w["t"]
            cache = f"; {self.cache}" if self.cache else ""
            self.say(f"first step {self.first_step_s:.1f} s (compile included{cache})")
            self.window = _window(now)
        done = step + 1
        if done % self.cfg.log_every and done != self.total_steps:
            return
        # A row of the first step alone (`w` is then its window) has only its own figures,
        # compile and all, and no ETA yet.
        alone = not self.window["steps"]
        dt = max(time.monotonic() - w["t"], 1e-9)
        row = {
            "step": done,
            **m,
            "learning_rate": float(self.host_lr[step]),
            "examples_per_s": w["examples"] / dt,
            "tokens_per_s": w["tokens"] / dt,
        }
        self.history["train"].append(row)
        self.tracker.log_metrics({k: v for k, v in row.items() if k != "step"}, step=done)
        eta = None if alone else (self.total_steps - done) * dt / w["steps"]
        if self.status is not None and eta is not None:  # the first step's waits for an ETA
            shown = ("loss", "accuracy", "learning_rate", "examples_per_s")
            self.status.update(done, self.total_steps, eta, {k: row[k] for k in shown})
        self.say(
            f"step {done}/{self.total_steps} | loss {m['loss']:.4f} | lr {row['learning_rate']:.2e}"
            f" | {row['examples_per_s']:.1f} ex/s | {row['tokens_per_s']:.0f} tok/s"
            + ("" if eta is None else f" | ETA {_eta(eta)}")
        )
        self.window = _window()

    def diverged(self, step: int, loss: float) -> None:
        """Stop on a non-finite loss: it is logged (visible in MLflow and metrics.json), and
        the run fails naming the step instead of training on to a NaN model."""
        self.tracker.log_metrics({"loss": loss}, step=step)
        self.history["train"].append({"step": step, "loss": loss})
        self.write("failed", step)
        raise DivergedError(
            f"loss: {loss} at step {step}; training stopped (lower learning_rate, raise "
            "warmup_ratio or max_grad_norm clipping, or check the data)"
        )

    def evaluated(self, step: int, result: dict) -> dict:
        """Record an evaluation of the validation split."""
        result = {"step": step, **result}
        self.history["evals"].append(result)
        self.tracker.log_metrics({k: v for k, v in result.items() if k != "step"}, step=step)
        self.write("running", step)
        if self.status is not None:
            figures = {k: v for k, v in result.items() if k.startswith("eval_")}
            self.status.update(step, self.total_steps, None, figures)
        self.say(
            f"eval step {step}: loss {result['eval_loss']:.4f} "
            f"accuracy {result['eval_accuracy']:.4f}"
        )
        if self.cfg.katib_metrics:  # Katib's StdOut collector: name=value, one line an eval
            self.say(" ".join(f"{k}={v:.6g}" for k, v in result.items() if k.startswith("eval_")))
        return result

    def last_eval(self, step: int) -> dict | None:
        evals = self.history["evals"]
        return evals[-1] if evals and evals[-1]["step"] == step else None

    def final(self, step: int, final_eval: dict, wall_s: float) -> dict:
        """The run's final figures (metrics.json's `final`)."""
        rows = self.history["train"]
        return {
            "train_loss": rows[-1]["loss"] if rows else float("nan"),
            "train_accuracy": rows[-1]["accuracy"] if rows else float("nan"),
            "eval_loss": final_eval["eval_loss"],
            "eval_accuracy": final_eval["eval_accuracy"],
            "examples_per_s": _mean_after_first(rows, "examples_per_s"),
            "tokens_per_s": _mean_after_first(rows, "tokens_per_s"),
            "steps": step,
            "wall_s": wall_s,
            "first_step_s": self.first_step_s,
            "step_program_bytes": (self.step_program or {}).get("total"),
            "num_processes": jax.process_count(),
            "num_devices": jax.device_count(),
        }

    def log_final(self, final: dict) -> None:
        """The final figures, and the run's curves (loss, accuracy, learning rate,
        throughput) as MLflow figures: process 0's."""
        if jax.process_index() != 0:
            return
        self.tracker.log_summary({f"final_{k}": v for k, v in final.items()})
        if self.tracker.run_id is None:
            return
        figures = monitoring.training_figures(self.history, [])
        for name, fig in figures.items():
            self.tracker.log_figure(fig, f"training/{name}")
        report.close(figures.values())

    def completed(self, step: int, final: dict, final_eval: dict) -> None:
        """metrics.json's last state, and the TrainJob's last progress (100 %)."""
        self.write("completed", step, final)
        if self.status is not None:
            evals = {k: v for k, v in final_eval.items() if k.startswith("eval_")}
            self.status.finish(step, {"loss": final["train_loss"], **evals})

    def write(self, status: str, step: int, final: dict | None = None) -> None:
        """metrics.json, replaced atomically (process 0 only)."""
        if not self.is_main:
            return
        data = {
            "status": status,
            "step": step,
            "total_steps": self.total_steps,
            "mlflow_run_id": self.tracker.run_id or "",
            **self.history,
        }
        if final is not None:
            data["final"] = final
        _write_json(self.out / METRICS_FILE, data)

    def undelivered(self, lost: list[tuple]) -> None:
        """Metric values MLflow never took (a long outage): kept in a file beside
        metrics.json, counted there and reported, never silently dropped."""
        if not (self.is_main and lost):
            return
        path = self.out / UNDELIVERED_FILE
        rows = [dict(zip(("key", "value", "timestamp_ms", "step"), m, strict=True)) for m in lost]
        _write_json(path, {"run_id": self.tracker.run_id, "metrics": rows})
        metrics_path = self.out / METRICS_FILE
        if metrics_path.exists():
            data = json.loads(metrics_path.read_text())
            _write_json(metrics_path, {**data, "mlflow_undelivered": len(lost)})
        print(
            f"kubejax trainer: warning: {len(lost)} metric values could not be delivered to "
            f"MLflow run {self.tracker.run_id}; they are kept in {path}",
            file=sys.stderr,
            flush=True,
        )
