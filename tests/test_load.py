"""Load: many local jobs at once. Not part of `make test` (minutes of all cores); `make load`
runs it.

- A sweep of 20 trials of the tiny model, 4 at a time, 2 workers each (8 processes, 4
  coordinators on their own ports): every trial completes (a port collision would fail a
  trial's distributed start), every trial is in MLflow, and no process outlives the sweep.
- Two `kubejax run --local` in different workdirs at the same time: both succeed, each with its
  own MLflow store and outputs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kubejax.launchers.sweep import sweep_with_jaxjobs
from kubejax.tune import SweepConfig

pytestmark = pytest.mark.load


def _processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line holds `text` (zombies excluded)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (proc / "stat").read_text().split()[2]
        except OSError:
            continue
        if text in cmdline and state != "Z":
            found.append(int(proc.name))
    return found


def test_load_20_trials_4_parallel_2_workers_each(tmp_path, tiny_model_dir, prepared):
    from mlflow.tracking import MlflowClient

    from kubejax.tracking import local_tracking_uri

    uri = local_tracking_uri(tmp_path)
    cfg = SweepConfig(
        space={"learning_rate": {"type": "float", "low": 1e-4, "high": 3e-3, "log": True}},
        algorithm="random",
        max_trials=20,
        parallelism=4,
        pruner="none",
        poll_seconds=0.2,
        study_name="load",
    )
    fixed = {
        "model": str(tiny_model_dir),
        "max_steps": 4,
        "eval_every": 2,
        "global_batch_size": 8,
        "max_length": 64,
        "max_eval_examples": 32,
        "eval_batch_size": 32,
    }
    trials_root = tmp_path / "trials"
    result, parent = sweep_with_jaxjobs(
        cfg,
        data_dir=str(prepared),
        trials_root=str(trials_root),
        hyperparameters=fixed,
        replicas=2,
        image="local",
        backend="local",
        mlflow_tracking_uri=uri,
        mlflow_experiment="load",
        log=lambda _: None,
    )
    assert result.counts["complete"] == 20, result.counts
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("load")
    children = [
        r
        for r in client.search_runs([exp.experiment_id], max_results=100)
        if r.data.tags.get("mlflow.parentRunId") == parent
    ]
    assert len(children) == 20 and all(r.info.status == "FINISHED" for r in children)
    assert {int(r.data.tags["kubejax.trial"]) for r in children} == set(range(20))
    starts = [t["start"] for t in result.trials]
    ends = [t["end"] for t in result.trials]
    peak = max(sum(s <= t < e for s, e in zip(starts, ends, strict=True)) for t in starts)
    assert peak == 4  # four trials did run at once
    assert _processes_mentioning(str(trials_root)) == []


def test_load_two_local_pipeline_runs_at_once(tmp_path):
    runs = [
        subprocess.Popen(
            [sys.executable, "-m", "kubejax.cli", "run", "--local", "--workdir", str(w)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for w in (tmp_path / "a", tmp_path / "b")
    ]
    outputs = [r.communicate(timeout=1500)[0] for r in runs]
    for run, output in zip(runs, outputs, strict=True):
        assert run.returncode == 0, output[-3000:]
    a, b = (json.loads((tmp_path / w / "summary.json").read_text()) for w in "ab")
    assert a["mlflow_tracking_uri"] != b["mlflow_tracking_uri"]
    for summary in (a, b):
        assert summary["trials"]["failed"] == 0 and summary["model_uri"].startswith("models:/")
        assert all(t["status"] == "SUCCESS" for t in summary["tasks"])
    assert _processes_mentioning(str(tmp_path)) == []
