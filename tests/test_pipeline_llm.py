"""The LLM pipeline end to end under kfp.local, as `kubejax run --local --profile llm` runs
it: one shortened run that the tests share."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_pipeline_local import _artifact

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm_run(tmp_path_factory):
    """`kubejax run --local --profile llm` (the command a user runs), shortened, started when
    a test first asks for it; returns a function that waits for it and gives its workdir,
    summary and terminal output. (This module is a unit of its own under pytest-xdist, so
    this run and the Yelp pipeline's, tests/test_pipeline_local.py, go side by side.)"""
    workdir = tmp_path_factory.mktemp("llm") / "run"
    trial = {"max_steps": 4, "eval_every": 2, "log_every": 2, "device_memory": "1GiB",
             "global_batch_size": 8, "max_length": 64, "bucket_multiple": 64,
             "max_eval_examples": 32}  # fmt: skip
    train = {"max_steps": 8, "eval_every": 4, "log_every": 4, "global_batch_size": 8,
             "max_length": 64, "bucket_multiple": 64, "max_eval_examples": 32,
             "learning_rate": 3e-3}  # fmt: skip
    space = {"lora_rank": {"type": "categorical", "choices": [4, 100000]}}
    overrides = [
        "algorithm=grid", f"search_space={json.dumps(space)}", "max_trials=3",
        f"trial_hyperparameters={json.dumps(trial)}", f"train_hyperparameters={json.dumps(train)}",
        "max_test_samples=100", "max_validation_samples=64",
    ]  # fmt: skip
    cmd = [Path(sys.executable).parent / "kubejax", "run", "--local", "--profile", "llm",
           "--workdir", str(workdir), *(f"--param={o}" for o in overrides)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def finish():
        printed, _ = proc.communicate(timeout=900)
        assert proc.returncode == 0, printed[-5000:]
        return workdir, json.loads((workdir / "summary.json").read_text()), printed

    yield finish
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


def test_the_llm_profile_runs_the_llm_pipeline_with_lora_end_to_end(llm_run):
    """`kubejax run --local --profile llm`'s pipeline, shortened: the defaults' trial first
    (the profile's rank 8, which joins the grid of ranks 4 and 100,000), rank 4, and rank
    100,000, whose memory plan exceeds the trials' 1 GiB (pruned before it starts, not
    failed); the final training keeps the defaults unless rank 4 beat them beyond the noise,
    in one process with every core; the merged model evaluated and registered, its PEFT
    adapter beside it and in the training's MLflow run; the random weights said everywhere."""
    from mlflow.tracking import MlflowClient

    from kubejax.local_run import EMBEDDED_DECODER_NOTE, RANDOM_WEIGHTS_TAG

    workdir, summary, printed = llm_run()
    assert summary["pipeline"] == "kubejax-llm" and summary["profile"] == "llm"
    assert summary["trials"] == {"complete": 2, "pruned": 1, "failed": 0}
    sweep = summary["sweep"]
    assert sweep["defaults_trial"] == 0 and sweep["kept"] in ("defaults", "best")
    assert (
        "sweep: search_space.lora_rank: the default 8 joins the choices [4, 100000, 8]" in printed
    )
    assert "sweep: trial 0 started" in printed and "{'lora_rank': 8}" in printed
    assert f"sweep: {sweep['reason']}" in printed
    kept = 8 if sweep["kept"] == "defaults" else summary["best_params"]["lora_rank"]
    assert isinstance(summary["best_params"]["lora_rank"], int)  # a rank, not 4.0
    assert summary["base_model_note"] == EMBEDDED_DECODER_NOTE and EMBEDDED_DECODER_NOTE in printed
    assert "trial 2 pruned before it started: device_memory: the run needs" in printed
    assert "kubejax trainer: 1 process(es)" in printed
    model = _artifact(workdir, "train", "model")
    config = json.loads((model / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == kept and config["task_type"] == "CAUSAL_LM"
    assert (model / "model.safetensors").is_file()
    assert summary["model_uri"].startswith("models:/")
    client = MlflowClient(summary["mlflow_tracking_uri"])
    names = [f.path for f in client.list_artifacts(summary["training_run_id"], "adapter")]
    assert names == ["adapter/adapter_config.json", "adapter/adapter_model.safetensors"]
    train = client.get_run(summary["training_run_id"])
    assert train.data.tags["kubejax.base_model_weights"] == RANDOM_WEIGHTS_TAG
    sweep_run = client.get_run(summary["sweep_run_id"])
    assert sweep_run.data.tags["kubejax.sweep_choice"] == sweep["kept"]
    summary_md = _artifact(workdir, "tune-sweep", "summary").read_text()
    assert "| defaults |" in summary_md and "sweep gain" in summary_md


def test_the_llm_runs_budget_is_printed_before_it_and_recorded_beside_its_wall(llm_run):
    """The budget printed before the run (each step from the model's FLOPs and the matmul
    measured then, the fixed costs measured for kubejax) is what the summary records, beside
    the wall the run measured. How close the two come is a benchmark's figure
    (bench/llm-hpo.sh), not this test's: the wall depends on what else the cores run; the
    prediction's arithmetic from given speeds is tests/test_budget.py's."""
    _, summary, printed = llm_run()
    before = printed.split("prepare-yelp: started")[0]
    for step in ("prepare", "sweep", "final training", "evaluation", "register", "total"):
        assert f"kubejax:   {step}" in before, step
    assert "matmul measured now" in before and "(2 trials × 4 steps, as given)" in before
    budget = summary["budget_s"]
    assert budget["measured_total"] == summary["wall_s"] > 0
    predicted = budget["predicted"]
    assert set(predicted) == {"prepare", "sweep", "final training", "evaluation", "register"}
    assert all(v > 0 for v in predicted.values()), predicted
    assert budget["predicted_total"] == pytest.approx(sum(predicted.values()), abs=0.3)
    # The figures printed before the run, in whole seconds.
    for step, seconds in [*predicted.items(), ("total", budget["predicted_total"])]:
        shown = re.search(rf"kubejax:   {step} +~ *(\d+) s", before)
        assert shown and abs(int(shown[1]) - seconds) <= 1, (step, seconds)
