"""Resource utilisation per worker, and the training-progress report shown in the KFP UI.

Every worker samples its own CPU, memory (and device memory, where the device reports it) in a
background thread and writes a summary to `<output_dir>/resources/worker-<i>.json` when it
ends; process 0 also streams MLflow's system metrics into the training run (through the
tracker).
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from kubejax import report

SAMPLE_SECONDS = 2.0


class ResourceSampler:
    """Samples this process's CPU and memory use (and JAX device memory) until stopped."""

    def __init__(self, interval: float = SAMPLE_SECONDS):
        import psutil

        self.interval = interval
        self._proc = psutil.Process()
        self._proc.cpu_percent(None)
        self._stop = threading.Event()
        self.samples: list[dict] = []
        self._thread = threading.Thread(target=self._run, name="resource-sampler", daemon=True)
        self._start = time.monotonic()

    def start(self) -> ResourceSampler:
        self._thread.start()
        return self

    def _sample(self) -> dict:
        mem = self._proc.memory_info()
        s = {
            "t": round(time.monotonic() - self._start, 2),
            "cpu_percent": self._proc.cpu_percent(None),
            "rss_mb": mem.rss / 2**20,
        }
        s.update(_device_memory())
        return s

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.samples.append(self._sample())

    def stop(self) -> dict:
        """Stop sampling; return the summary (peak memory, mean utilisation)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.samples.append(self._sample())
        cpu = [s["cpu_percent"] for s in self.samples[:-1]] or [self.samples[-1]["cpu_percent"]]
        summary = {
            "samples": len(self.samples),
            "wall_s": round(time.monotonic() - self._start, 2),
            "cpu_percent_mean": sum(cpu) / len(cpu),
            "cpu_count": os.cpu_count(),
            "peak_rss_mb": max(s["rss_mb"] for s in self.samples),
        }
        if "device_bytes_in_use" in self.samples[-1]:
            summary["peak_device_mb"] = (
                max(s.get("device_peak_bytes", 0) for s in self.samples) / 2**20
            )
        return summary


def _device_memory() -> dict:
    try:
        import jax

        stats = jax.local_devices()[0].memory_stats()
    except Exception:  # CPU backends may report nothing
        return {}
    if not stats:
        return {}
    return {
        "device_bytes_in_use": stats.get("bytes_in_use", 0),
        "device_peak_bytes": stats.get("peak_bytes_in_use", 0),
    }


def write_worker_summary(output_dir: str | Path, process_id: int, summary: dict) -> Path:
    """Write one worker's resource summary."""
    path = Path(output_dir) / "resources" / f"worker-{process_id}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=1))
    return path


def read_worker_summaries(output_dir: str | Path) -> list[dict]:
    """All workers' resource summaries, by worker index."""
    folder = Path(output_dir) / "resources"
    files = sorted(folder.glob("worker-*.json"), key=lambda p: int(p.stem.split("-")[1]))
    return [{"worker": int(p.stem.split("-")[1]), **json.loads(p.read_text())} for p in files]


def training_report(metrics: dict, resources: list[dict], title: str = "Training") -> str:
    """HTML: loss, eval, learning-rate and throughput curves, and per-worker resources."""
    train = metrics.get("train", [])
    evals = metrics.get("evals", [])
    sections = [
        f"<p>Status <b>{metrics.get('status', '?')}</b>, step {metrics.get('step', 0)} of "
        f"{metrics.get('total_steps', '?')}.</p>"
    ]
    sections.append(
        report.line_chart(
            "Loss",
            {
                "train loss": [(r["step"], r["loss"]) for r in train],
                "eval loss": [(r["step"], r["eval_loss"]) for r in evals],
            },
        )
    )
    sections.append(
        report.line_chart(
            "Accuracy",
            {
                "train accuracy": [(r["step"], r["accuracy"]) for r in train],
                "eval accuracy": [(r["step"], r["eval_accuracy"]) for r in evals],
            },
        )
    )
    sections.append(
        report.line_chart("Learning rate", {"lr": [(r["step"], r["learning_rate"]) for r in train]})
    )
    sections.append(
        report.line_chart(
            "Throughput (examples/s)",
            {"examples/s": [(r["step"], r["examples_per_s"]) for r in train]},
        )
    )
    if resources:
        sections.append("<h2>Resources per worker</h2>" + report.table(resources))
    if metrics.get("final"):
        sections.append("<h2>Final</h2>" + report.table([metrics["final"]]))
    return report.page(title, sections)
