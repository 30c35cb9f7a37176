"""The loop's figures: the first step's time said apart, the ETA and throughput without it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kubejax import tracking
from kubejax.trainer import progress as progress_mod
from kubejax.trainer.config import TrainConfig
from kubejax.trainer.progress import Progress


class _Sampler:
    def count(self, examples: int) -> None:
        pass


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _metrics(tokens: float = 100.0) -> dict:
    return {"loss": np.float32(1.0), "accuracy": np.float32(0.5), "tokens": np.float32(tokens)}


def _run(monkeypatch, tmp_path, log_every: int, step_times: list[float], total: int = 10):
    """A Progress fed steps taking `step_times` seconds each. A step's metrics are read when
    the next one is dispatched (or at the flush), which is when it has run."""
    clock = _Clock()
    monkeypatch.setattr(progress_mod.time, "monotonic", clock)
    cfg = TrainConfig(global_batch_size=8, log_every=log_every)
    host_lr = np.zeros(total + 1, np.float32)
    history = {"train": [], "evals": []}
    progress = Progress(cfg, tmp_path, tracking.Tracker(), total, host_lr, history, _Sampler())
    progress.dispatched(0, _metrics())
    for step, dt in enumerate(step_times[:-1], start=1):
        clock.now += dt
        progress.dispatched(step, _metrics())
    clock.now += step_times[-1]
    progress.flush()
    return progress, history


def test_the_eta_and_throughput_leave_the_first_steps_compile_out(monkeypatch, tmp_path, capsys):
    # A first step of 80 s (its compile), then steps of 1 s: the first row (steps 2 to 5) runs
    # at 8 examples a second and 5 steps remain, 5 s; the compile is said once, apart.
    progress, history = _run(monkeypatch, tmp_path, 5, [80.0] + [1.0] * 9)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "first step 80.0 s (compile included)"
    assert out[1].startswith("step 5/10 |") and out[1].endswith("| ETA 0m05s")
    first = history["train"][0]
    assert first["examples_per_s"] == pytest.approx(8.0)
    assert first["tokens_per_s"] == pytest.approx(100.0)
    assert progress.first_step_s == pytest.approx(80.0)
    final = progress.final(10, {"eval_loss": 1.0, "eval_accuracy": 0.5}, 89.0)
    assert final["first_step_s"] == pytest.approx(80.0)
    progress.completed(10, final, {"eval_loss": 1.0, "eval_accuracy": 0.5})
    saved = json.loads((tmp_path / "metrics.json").read_text())["final"]
    assert saved["first_step_s"] == pytest.approx(80.0)


def test_a_row_of_the_first_step_alone_has_no_eta(monkeypatch, tmp_path, capsys):
    # log_every 1: the first row is the first step's own (compile and all) with no ETA; the
    # next one's ETA counts compiled steps only (8 steps left at 2 s).
    _, history = _run(monkeypatch, tmp_path, 1, [60.0, 2.0], total=10)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "first step 60.0 s (compile included)"
    assert out[1].startswith("step 1/10 |") and "ETA" not in out[1]
    assert history["train"][0]["examples_per_s"] == pytest.approx(8 / 60)
    assert out[2].startswith("step 2/10 |") and out[2].endswith("| ETA 0m16s")
    assert history["train"][1]["examples_per_s"] == pytest.approx(4.0)
