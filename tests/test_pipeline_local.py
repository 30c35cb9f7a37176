"""The whole Yelp pipeline end to end under kfp.local, and the compiled pipelines."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest
import yaml
from google.protobuf import json_format

from kubejax.compile import compile_all
from tests.helpers import assert_self_contained_report

ROOT = Path(__file__).parents[1]
SECRET_ENV = ("MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")
SECRET_MARKER = "kubejax-secret-marker-5b1f0c"


@pytest.fixture(scope="module")
def local_run(tmp_path_factory, tiny_model_dir):
    from kubejax.local_run import run_local

    workdir = tmp_path_factory.mktemp("pipeline") / "run"
    # A model under a virtualenv-like path: kfp.local used to rewrite 'python3' inside it.
    model = tmp_path_factory.mktemp("venv") / "lib" / "python3.11" / "site-packages" / "tiny-bert"
    model.parent.mkdir(parents=True)
    model.symlink_to(tiny_model_dir)
    common = {
        "global_batch_size": 8,
        "max_length": 64,
        "bucket_multiple": 64,  # one padded length: each program compiles once
        "eval_batch_size": 32,
        "log_every": 2,
        "learning_rate": 3e-3,
    }
    overrides = [
        f"base_model={model}",
        "max_trials=2",
        "parallelism=2",
        f"trial_hyperparameters={json.dumps({**common, 'max_steps': 6, 'eval_every': 3})}",
        f"train_hyperparameters={json.dumps({**common, 'max_steps': 30, 'eval_every': 10})}",
        "register_threshold=0.0",
        "max_test_samples=200",
    ]
    terminal = io.StringIO()
    # MLflow credentials set as a user would (they reach the steps through the environment):
    # test_no_secret_* looks for the marker everywhere the run wrote.
    saved = {name: os.environ.get(name) for name in SECRET_ENV}
    os.environ.update(dict.fromkeys(SECRET_ENV, SECRET_MARKER))
    try:
        summary = run_local(workdir, overrides, terminal=terminal)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return workdir, summary, terminal.getvalue()


@pytest.mark.slow
def test_no_secret_in_files_logs_or_the_mlflow_store(local_run):
    """Every file the run wrote (artifacts, logs of the tasks and workers, the sqlite MLflow
    store with its params and tags, summary.json), the terminal and compiled/: no secret."""
    workdir, _, printed = local_run
    marker = SECRET_MARKER.encode()
    files = [f for f in [*workdir.rglob("*"), *(ROOT / "compiled").rglob("*")] if f.is_file()]
    assert any(f.name.endswith(".db") for f in files) and any(f.suffix == ".log" for f in files)
    leaked = [str(f) for f in files if marker in f.read_bytes()]
    assert leaked == [] and SECRET_MARKER not in printed


def _artifact(workdir: Path, task: str, name: str) -> Path:
    found = sorted((workdir / "pipeline-root").glob(f"*/{task}/{name}"))
    assert found, f"no {task}/{name} artifact"
    return found[-1]


@pytest.mark.slow
def test_pipeline_summary_and_outputs(local_run):
    workdir, summary, _ = local_run
    on_disk = json.loads((workdir / "summary.json").read_text())
    assert on_disk == summary
    for key in (
        "accuracy",
        "macro_f1",
        "majority_baseline",
        "best_params",
        "trials",
        "mlflow_tracking_uri",
        "model_uri",
        "wall_s",
    ):
        assert key in summary, key
    assert 0.0 <= summary["accuracy"] <= 1.0 and 0.0 < summary["majority_baseline"] < 0.5
    assert sum(summary["trials"].values()) == 2 and summary["trials"]["failed"] == 0
    assert set(summary["best_params"]) == {"learning_rate", "warmup_ratio"}
    assert summary["model_uri"].startswith("models:/")
    for task, name in [
        ("prepare-yelp", "dataset"),
        ("prepare-yelp", "report"),
        ("tune-sweep", "trials"),
        ("tune-sweep", "report"),
        ("train", "model"),
        ("train", "report"),
        ("evaluate", "report"),
        ("evaluate", "mlflow_model"),
    ]:
        assert _artifact(workdir, task, name).exists()
    assert (_artifact(workdir, "train", "model") / "model.safetensors").is_file()


@pytest.mark.slow
def test_pipeline_html_reports_hold_the_figures(local_run):
    """Each step's HTML report embeds its matplotlib/Optuna figures and nothing from outside
    (the KFP UI's viewer is sandboxed)."""
    workdir, _, _ = local_run
    train = _artifact(workdir, "train", "report").read_text()
    assert_self_contained_report(train, figures=6)
    assert "train loss (batch)" in train and "eval accuracy (validation)" in train
    assert "Throughput per worker" in train and "worker 1" in train
    assert "optimizer step" in train and "Resources per worker" in train
    sweep = _artifact(workdir, "tune-sweep", "report").read_text()
    assert_self_contained_report(sweep, figures=4)
    assert "Optimization History Plot" in sweep and "worker-seconds" in sweep
    evaluation = _artifact(workdir, "evaluate", "report").read_text()
    assert_self_contained_report(evaluation, figures=3)
    assert "Confusion matrix (row-normalised)" in evaluation and "predicted label" in evaluation
    prepared = _artifact(workdir, "prepare-yelp", "report").read_text()
    assert_self_contained_report(prepared, figures=2)


@pytest.mark.slow
def test_the_mlflow_runs_hold_the_figures(local_run):
    from mlflow.tracking import MlflowClient

    _, summary, _ = local_run
    client = MlflowClient(summary["mlflow_tracking_uri"])
    runs = client.search_runs(
        [e.experiment_id for e in client.search_experiments()], max_results=100
    )

    def files(run, folder):
        return {Path(a.path).name for a in client.list_artifacts(run.info.run_id, folder)}

    final = [
        r for r in runs if "training" in {a.path for a in client.list_artifacts(r.info.run_id)}
    ]
    shown = {"loss.svg", "learning_rate.svg", "worker_throughput.svg", "worker_memory.svg"}
    assert any(shown <= files(r, "training") for r in final)
    evaluated = [r for r in runs if "confusion_matrix.svg" in files(r, "evaluation")]
    assert evaluated and all(r.data.tags["kubejax.eval_dtype"] == "float32" for r in evaluated)
    assert any("optimization_history.svg" in files(r, "sweep") for r in runs)


@pytest.mark.slow
def test_pipeline_mlflow_store(local_run):
    from mlflow.tracking import MlflowClient

    _, summary, _ = local_run
    client = MlflowClient(summary["mlflow_tracking_uri"])
    exp = client.get_experiment_by_name(summary["mlflow_experiment"])
    runs = client.search_runs([exp.experiment_id])
    sweep = client.get_run(summary["sweep_run_id"])
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == sweep.info.run_id]
    assert len(children) == 2
    train = client.get_run(summary["training_run_id"])
    assert train.data.tags["kfp.task_name"] == "train"
    assert train.data.tags["kfp.run_id"] and train.data.tags["kubejax.jobs"]
    assert sweep.data.tags["kfp.run_id"] == train.data.tags["kfp.run_id"]
    assert {"loss", "eval_accuracy", "test_accuracy", "test_macro_f1"} <= set(train.data.metrics)
    assert any(k.startswith("system/") for k in train.data.metrics)
    assert train.data.params["num_processes"] == "2"
    assert "/python3.11/site-packages/tiny-bert" in train.data.params["model"]
    versions = client.search_model_versions("name='kubejax-yelp-local'")
    assert len(versions) == 1


@pytest.mark.slow
def test_pipeline_terminal_shows_progress_and_the_log_keeps_everything(local_run):
    workdir, summary, printed = local_run
    tasks = ["prepare-yelp", "tune-sweep", "train", "evaluate", "register-model"]
    assert [t["task"] for t in summary["tasks"]] == tasks
    for t in summary["tasks"]:
        assert t["status"] == "SUCCESS" and t["seconds"] == pytest.approx(t["end_s"] - t["start_s"])
        assert f"{t['task']}: started" in printed and f"{t['task']}: SUCCESS in" in printed
    assert "budget: profile demo" in printed
    assert "sweep: trial 0 started" in printed and "[worker-0] step 30/30" in printed
    assert "evaluate: test accuracy" in printed
    assert "executor_input" not in printed and "KFP Executor" not in printed
    log = (workdir / "logs" / "pipeline.log").read_text()
    assert "executor_input" in log and "[worker-0] step 30/30" in log
    assert summary["logs"]["pipeline"] == str(workdir / "logs" / "pipeline.log")
    assert any((workdir / "logs" / "jobs").glob("trial-0-*/worker-0.log"))


def test_compiled_matches_a_fresh_compile(tmp_path):
    compile_all(tmp_path)
    fresh = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.yaml"))
    committed = sorted(
        p.relative_to(ROOT / "compiled") for p in (ROOT / "compiled").rglob("*.yaml")
    )
    assert fresh == committed
    for rel in fresh:
        assert (tmp_path / rel).read_text() == (ROOT / "compiled" / rel).read_text(), rel


@pytest.mark.parametrize("name", ["kubejax-yelp", "kubejax-train-eval", "kubejax-llm"])
def test_compiled_pipeline_parses_as_kfp_protos(name):
    from kfp.kubernetes import kubernetes_executor_config_pb2 as k8s_pb2
    from kfp.pipeline_spec import pipeline_spec_pb2

    docs = list(yaml.safe_load_all((ROOT / "compiled" / f"{name}.yaml").read_text()))
    spec = json_format.ParseDict(docs[0], pipeline_spec_pb2.PipelineSpec())
    assert spec.pipeline_info.name == name
    assert "workspace" in json.dumps(docs[0]).lower()
    executors = docs[1]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    configs = {
        k: json_format.ParseDict(v, k8s_pb2.KubernetesExecutorConfig())
        for k, v in executors.items()
    }
    train = configs["exec-train"]
    # Secrets as env, optional: MLflow's credentials, and the Hugging Face token for gated
    # models on the steps that download one (never a parameter).
    secrets = {s.secret_name: s for s in train.secret_as_env}
    assert set(secrets) == {"mlflow-credentials", "hf-token"}
    assert [e.env_var for e in secrets["hf-token"].key_to_env] == ["HF_TOKEN"]
    assert secrets["hf-token"].optional
    prepare = configs["exec-prepare-yelp"]
    assert [s.secret_name for s in prepare.secret_as_env] == ["hf-token"]
    # Worker placement (the GPU profile): pipeline parameters, on the train and sweep tasks.
    swept = name in ("kubejax-yelp", "kubejax-llm")
    placed = ["exec-train", "exec-tune-sweep"] if swept else ["exec-train"]
    for executor in placed:
        config = configs[executor]
        selector = config.node_selector.node_selector_json.component_input_parameter
        assert selector == "worker_node_selector"
        tolerations = [t.toleration_json.component_input_parameter for t in config.tolerations]
        assert tolerations == ["worker_tolerations"]
    train_exec = docs[0]["deploymentSpec"]["executors"]["exec-train"]["container"]
    assert train_exec["image"].startswith("ghcr.io/kubejax/kubejax:")
    passthroughs = docs[0]["components"]["comp-train"].get("taskConfigPassthroughs", [])
    fields = {p["field"] for p in passthroughs}
    assert {
        "RESOURCES",
        "ENV",
        "KUBERNETES_VOLUMES",
        "KUBERNETES_NODE_SELECTOR",
        "KUBERNETES_TOLERATIONS",
        "KUBERNETES_AFFINITY",
    } <= fields


def test_component_yamls_load_for_reuse():
    from kfp import components

    for path in (ROOT / "compiled" / "components").glob("*.yaml"):
        comp = components.load_component_from_file(str(path))
        assert comp.component_spec.implementation.container.image.startswith("ghcr.io/kubejax")
