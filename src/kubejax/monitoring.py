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
from typing import TYPE_CHECKING

from kubejax import report

if TYPE_CHECKING:
    from matplotlib.figure import Figure

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


def training_figures(metrics: dict, resources: list[dict]) -> dict[str, Figure]:
    """The training run's figures by file name: loss and accuracy (eval points as markers),
    the learning rate (log scale), throughput, and each worker's memory and CPU."""
    train, evals = metrics.get("train", []), metrics.get("evals", [])
    steps = [r["step"] for r in train]
    figures = {}
    for key, label in (("loss", "cross-entropy loss"), ("accuracy", "accuracy")):
        fig, ax = report.new_figure(label.capitalize(), "optimizer step", label)
        ax.plot(steps, [r.get(key) for r in train], label=f"train {key} (batch)")
        ax.plot(
            [r["step"] for r in evals],
            [r[f"eval_{key}"] for r in evals],
            "o-",
            label=f"eval {key} (validation)",
        )
        ax.legend()
        figures[f"{key}.svg"] = fig
    fig, ax = report.new_figure("Learning rate", "optimizer step", "learning rate")
    rates = [(r["step"], r["learning_rate"]) for r in train if r.get("learning_rate")]
    if rates:
        ax.plot(*zip(*rates, strict=True))
        ax.set_yscale("log")
    figures["learning_rate.svg"] = fig
    fig, ax = report.new_figure("Throughput", "optimizer step", "examples / s (all workers)")
    ax.plot(steps, [r.get("examples_per_s", 0) for r in train], marker=".")
    figures["throughput.svg"] = fig
    if resources:
        fig, ax = report.new_figure("Memory per worker", "worker", "peak resident memory (MiB)")
        ax.bar([str(r["worker"]) for r in resources], [r["peak_rss_mb"] for r in resources])
        figures["worker_memory.svg"] = fig
    return figures


def training_report(metrics: dict, resources: list[dict], title: str = "Training") -> str:
    """HTML: the training figures, per-worker resources and the final figures."""
    figures = training_figures(metrics, resources)
    sections = [
        f"<p>Status <b>{metrics.get('status', '?')}</b>, step {metrics.get('step', 0)} of "
        f"{metrics.get('total_steps', '?')}.</p>",
        *(report.svg(fig) for fig in figures.values()),
    ]
    report.close(figures.values())
    if resources:
        sections.append("<h2>Resources per worker</h2>" + report.table(resources))
    if metrics.get("final"):
        sections.append("<h2>Final</h2>" + report.table([metrics["final"]]))
    return report.page(title, sections)
