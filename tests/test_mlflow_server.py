"""Tracking, the pyfunc model and registration against a real `mlflow server` on 127.0.0.1."""

from __future__ import annotations

import json
import subprocess
import sys

import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from kubejax import tracking
from kubejax.data.dataset import load_split
from kubejax.evaluate import evaluate_model


def test_params_and_batched_metrics_read_back(mlflow_server):
    t = tracking.create_tracker(
        mlflow_server, "tracking-test", run_name="r", tags={"kfp.run_id": "run-1"}
    )
    t.log_params({"learning_rate": 1e-4, "nested": {"a": 1}})
    for step in range(1, 1201):
        t.log_metrics({"loss": 1.0 / step, "lr": 0.1}, step=step)
    t.log_summary({"final_loss": 0.01})
    t.finish()
    run = MlflowClient(mlflow_server).get_run(t.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["learning_rate"] == "0.0001" and run.data.params["nested.a"] == "1"
    assert run.data.tags["kfp.run_id"] == "run-1"
    history = MlflowClient(mlflow_server).get_metric_history(t.run_id, "loss")
    assert len(history) == 1200 and history[-1].step == 1200
    assert run.data.metrics["final_loss"] == 0.01


@pytest.mark.slow
def test_sqlite_store_keeps_artifacts_beside_the_database(tmp_path, monkeypatch):
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    uri = tracking.local_tracking_uri(tmp_path / "work")
    t = tracking.create_tracker(uri, "artifacts-test", run_name="r")
    (tmp_path / "hello.txt").write_text("hello")
    t.log_artifact(tmp_path / "hello.txt", "notes")
    t.finish()
    assert (tmp_path / "work" / "mlartifacts").is_dir()
    assert list((tmp_path / "work" / "mlartifacts").rglob("hello.txt"))
    assert not any(elsewhere.iterdir())


def test_unreachable_server_is_a_clear_error():
    with pytest.raises(tracking.TrackingError, match="mlflow_tracking_uri: cannot use"):
        tracking.create_tracker("http://127.0.0.1:9", "x")


def test_no_uri_gives_the_noop_tracker(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    t = tracking.create_tracker("", "x")
    assert type(t) is tracking.Tracker and t.run_id is None
    t.log_metrics({"a": 1.0}, step=1)
    t.finish()


@pytest.mark.slow
def test_pyfunc_round_trip_in_a_fresh_process_and_registration(
    mlflow_server, trained_tiny, prepared
):
    model_dir = trained_tiny / "model"
    result = evaluate_model(model_dir, prepared)
    texts = load_split(prepared, "test", with_text=True).texts
    t = tracking.create_tracker(mlflow_server, "pyfunc-test", run_name="train")
    uri = t.log_pyfunc_model(model_dir, pd.DataFrame({"text": texts[:2]}))
    t.finish()
    assert uri.startswith("models:/")
    code = (
        "import json, sys, mlflow, pandas as pd\n"
        f"mlflow.set_tracking_uri({mlflow_server!r})\n"
        "texts = json.load(sys.stdin)\n"
        f"out = mlflow.pyfunc.load_model({uri!r}).predict(pd.DataFrame({{'text': texts}}))\n"
        "print(json.dumps(out['label_id'].tolist()))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        input=json.dumps(texts),
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == result["predictions"]
    version = tracking.register_model(mlflow_server, uri, "kubejax-test-model")
    assert version == "1"
    mv = MlflowClient(mlflow_server).get_model_version("kubejax-test-model", "1")
    assert mv.status == "READY"


def test_trainer_logs_params_metrics_and_system_metrics(
    mlflow_server, tmp_path, monkeypatch, tiny_model_dir, prepared
):
    from kubejax import tracking
    from kubejax.trainer.train import main
    from tests.helpers import tiny_args

    # MLflow logs system metrics once a sampling interval has passed; with its programs in the
    # compilation cache this run trains for less than the trainer's 2 s.
    monkeypatch.setattr(tracking, "SYSTEM_METRICS_SECONDS", 0.2)
    out = tmp_path / "o"
    args = tiny_args(
        tiny_model_dir,
        prepared,
        out,
        max_steps=6,
        log_every=2,
        mlflow_tracking_uri=mlflow_server,
        mlflow_experiment="trainer-test",
        mlflow_tags=json.dumps({"kubejax.jobs": "job-x"}),
    )
    assert main(args) == 0
    run_id = json.loads((out / "metrics.json").read_text())["mlflow_run_id"]
    run = MlflowClient(mlflow_server).get_run(run_id)
    assert run.data.params["global_batch_size"] == "8"
    assert {
        "loss",
        "learning_rate",
        "grad_norm",
        "examples_per_s",
        "tokens_per_s",
        "eval_loss",
        "eval_accuracy",
        "final_eval_accuracy",
    } <= set(run.data.metrics)
    assert any(k.startswith("system/") for k in run.data.metrics)
    assert run.data.tags["kubejax.jobs"] == "job-x"


def test_training_nests_under_the_kfp_task_run(
    mlflow_server, tmp_path, tiny_model_dir, prepared, monkeypatch
):
    """KFP's MLflow integration gives the task MLFLOW_RUN_ID: the JAXJob's training run is
    created under it, in its experiment, and the workers get the task's MLflow variables."""
    from kubejax.launchers.train import train_with_jaxjob
    from tests.helpers import tiny_args

    client = MlflowClient(mlflow_server)
    exp = client.create_experiment("kfp-pipeline-run")
    task_run = client.create_run(exp, tags={"mlflow.runName": "train"}).info.run_id
    monkeypatch.setenv("MLFLOW_RUN_ID", task_run)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", exp)
    flags = tiny_args(tiny_model_dir, prepared, tmp_path / "unused", max_steps=2)
    hp = {flags[i][2:].replace("-", "_"): flags[i + 1] for i in range(0, len(flags), 2)}
    for key in ("data_dir", "output_dir", "mlflow_tracking_uri"):
        hp.pop(key)
    result = train_with_jaxjob(
        dataset_path=str(prepared),
        model_path=str(tmp_path / "model"),
        hyperparameters={**hp, "mlflow_experiment": "not-this-one"},
        image="local",
        backend="local",
        run_id="kfp-run-1",
        task_name="train-a",
        mlflow_tracking_uri=mlflow_server,
        log=lambda _: None,
    )
    run = client.get_run(result["mlflow_run_id"])
    assert run.data.tags["mlflow.parentRunId"] == task_run
    assert run.info.experiment_id == exp
    assert run.data.tags["kfp.task_name"] == "train-a"
    assert client.get_experiment_by_name("not-this-one") is None
