"""Resource utilisation per worker, and the training-progress report shown in the KFP UI.

Every worker samples its own CPU, memory (and device memory, where the device reports it) and
the examples it has trained on in a background thread, and writes the series and a summary to
`<output_dir>/resources/worker-<i>.json` when it ends; process 0 also streams MLflow's system
metrics into the training run (through the tracker).
"""

from __future__ import annotations

import itertools
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
#: At most this many samples per worker are kept in the summary (evenly thinned).
MAX_SERIES = 400


class ResourceSampler:
    """Samples this process's CPU and memory use (and JAX device memory) until stopped, with
    the number of examples this worker has trained on so far (`count`)."""

    def __init__(self, interval: float = SAMPLE_SECONDS):
        import psutil

        self.interval = interval
        self._proc = psutil.Process()
        self._proc.cpu_percent(None)
        self._stop = threading.Event()
        self.samples: list[dict] = []
        self.examples = 0
        self._counted: list[float] = []  # when the first and the latest examples were counted
        self._first = 0
        self._thread = threading.Thread(target=self._run, name="resource-sampler", daemon=True)
        self._start = time.monotonic()

    def start(self) -> ResourceSampler:
        self._thread.start()
        return self

    def count(self, examples: int) -> None:
        """Add examples this worker has finished training on."""
        self.examples += examples
        now = time.monotonic()
        self._counted[1:] = [now]
        if len(self._counted) == 1:
            self._first = examples

    def _sample(self) -> dict:
        mem = self._proc.memory_info()
        s = {
            "t": round(time.monotonic() - self._start, 2),
            "cpu_percent": self._proc.cpu_percent(None),
            "rss_mb": mem.rss / 2**20,
            "examples": self.examples,
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
        wall = time.monotonic() - self._start
        summary = {
            "samples": len(self.samples),
            "wall_s": round(wall, 2),
            "cpu_percent_mean": sum(cpu) / len(cpu),
            "cpu_count": os.cpu_count(),
            "peak_rss_mb": max(s["rss_mb"] for s in self.samples),
            "examples": self.examples,
            "series": _thin(self.samples, MAX_SERIES),
        }
        if len(self._counted) == 2 and self._counted[1] > self._counted[0]:
            # From the end of the first step (its compile excluded) to the end of the last.
            trained = self.examples - self._first
            summary["examples_per_s"] = trained / (self._counted[1] - self._counted[0])
        if "device_bytes_in_use" in self.samples[-1]:
            summary["peak_device_mb"] = (
                max(s.get("device_peak_bytes", 0) for s in self.samples) / 2**20
            )
        return summary


def _thin(samples: list[dict], most: int) -> list[dict]:
    """At most `most` samples, evenly spaced, the last one kept."""
    if len(samples) <= most:
        return samples
    stride = len(samples) / most
    return [samples[int(i * stride)] for i in range(most - 1)] + [samples[-1]]


def worker_rates(series: list[dict]) -> tuple[list[float], list[float]]:
    """Times and examples/s between consecutive samples of one worker's series."""
    times, rates = [], []
    for a, b in itertools.pairwise(series):
        if b["t"] > a["t"]:
            times.append(b["t"])
            rates.append((b["examples"] - a["examples"]) / (b["t"] - a["t"]))
    return times, rates


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
    figures.update(worker_figures(resources))
    return figures


def worker_figures(resources: list[dict]) -> dict[str, Figure]:
    """Each worker's throughput and resident memory over the run's time."""
    if not resources:
        return {}
    series = [(f"worker {r['worker']}", r.get("series", [])) for r in resources]
    fig, ax = report.new_figure("Throughput per worker", "time (s)", "examples / s (this worker)")
    for label, points in series:
        ax.plot(*worker_rates(points), marker=".", label=label)
    ax.legend()
    figures = {"worker_throughput.svg": fig}
    fig, ax = report.new_figure("Memory per worker", "time (s)", "resident memory (MiB)")
    for label, points in series:
        ax.plot([p["t"] for p in points], [p["rss_mb"] for p in points], label=label)
    ax.legend()
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
        rows = [{k: v for k, v in r.items() if k != "series"} for r in resources]
        sections.append("<h2>Resources per worker</h2>" + report.table(rows))
    if metrics.get("final"):
        sections.append("<h2>Final</h2>" + report.table([metrics["final"]]))
    return report.page(title, sections)


def matmul_gflops(dtype: str = "float32", n: int = 1024, seconds: float = 0.5) -> float:
    """An n×n `dtype` matmul through XLA on this process's default device, timed for about
    `seconds`: its median's GFLOP/s (as benchmarks/common.py's `matmul_peak_gflops` measures
    it, but robust to a moment's neighbour). Float32 sums, as the trainer's products."""
    import statistics

    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    f = jax.jit(lambda x: jnp.matmul(x, x, preferred_element_type=jnp.float32))
    f(a).block_until_ready()
    times, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 5:
        t = time.perf_counter()
        f(a).block_until_ready()
        times.append(time.perf_counter() - t)
    return 2 * n**3 / statistics.median(times) / 1e9
