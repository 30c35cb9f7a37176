"""KFP's own MLflow runs respected, against a real `mlflow server` (sqlite, 127.0.0.1) with the
variables set as KFP 2.17's driver sets them on a task's container: the tune-sweep step logs
into its task's run (not a run beside it) and its trials nest under it, the training run nests
under the train task's run, the workers get the tracking variables and never a credential's
value, and KFP's runs are left for KFP to end. The trials' cluster is a FAKE API server.
The tree is written to $KUBEJAX_MLFLOW_TREE when set (for the lead's note)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

from mlflow.tracking import MlflowClient

from kubejax.launchers.sweep import sweep_with_jaxjobs
from kubejax.trainer.config import TrainConfig
from kubejax.trainer.progress import start_tracker
from tests.jobs.fake_k8s import FakeKubernetes
from tests.test_optimizationjob import TRIALS, _cfg, _controller, _done, _kubeconfig


def _tree(client: MlflowClient, experiment: str, root: str) -> list[str]:
    runs = client.search_runs([experiment])
    children: dict[str, list] = {}
    for r in runs:
        children.setdefault(r.data.tags.get("mlflow.parentRunId", ""), []).append(r)
    lines: list[str] = []

    def walk(run_id: str, depth: int) -> None:
        run = client.get_run(run_id)
        state = run.data.tags.get("kubejax.trial_state", "")
        lines.append(f"{'    ' * depth}{run.info.run_name} [{run.info.status}]"
                     + (f" {state}" if state else ""))  # fmt: skip
        for child in sorted(children.get(run_id, []), key=lambda r: r.info.run_name):
            walk(child.info.run_id, depth + 1)

    walk(root, 0)
    return lines


def test_kfp_task_runs_hold_the_sweep_and_the_training(mlflow_server, tmp_path, monkeypatch):
    client = MlflowClient(mlflow_server)
    exp = client.create_experiment("kfp-llm-pipeline")
    pipeline = client.create_run(exp, run_name="llm-pipeline-run",
                                 tags={"kfp.run_url": "http://kfp/#/runs/details/r1"})  # fmt: skip
    pid = pipeline.info.run_id
    tasks = {name: client.create_run(exp, run_name=name, tags={"mlflow.parentRunId": pid})
             for name in ("tune-sweep", "train")}  # fmt: skip
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", exp)
    # KFP also sets MLFLOW_WORKSPACE; MLflow's client then needs a server started with
    # --enable-workspaces, which the session's server is not: it is left out here.
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "s3cret-value")  # from KFP's Secret
    sweep_task = tasks["tune-sweep"].info.run_id
    monkeypatch.setenv("MLFLOW_RUN_ID", sweep_task)

    trials_root = tmp_path / "trials"
    best = TRIALS["sweep-a-trial-1"][0]
    script = [{}, _done("sweep-a-trial-1", best)]
    with FakeKubernetes(served=("trainjob",), optimization_script=script) as fake:
        _controller(fake, trials_root, mlflow_server)
        monkeypatch.setenv("KUBECONFIG", _kubeconfig(tmp_path, fake.host))
        _, run_id = sweep_with_jaxjobs(
            _cfg(), data_dir="/ws/data", trials_root=str(trials_root),
            hyperparameters={"model": "m"}, backend="kubernetes", replicas=2,
            mlflow_experiment="not-this-one", log=lambda _: None,
        )  # fmt: skip
        posted = json.dumps(fake.bodies)
    assert run_id == sweep_task  # logged into the task's run, not beside it
    body = next(b for b in fake.bodies if b["kind"] == "OptimizationJob")
    env = {e["name"]: e.get("value") for e in body["spec"]["trainJobTemplate"]["spec"]["trainer"][
        "env"]}  # fmt: skip
    assert env["MLFLOW_TRACKING_URI"] == mlflow_server and env["MLFLOW_EXPERIMENT_ID"] == exp
    assert "s3cret-value" not in posted and "MLFLOW_TRACKING_PASSWORD" not in env
    task = client.get_run(sweep_task)
    assert task.info.status == "RUNNING"  # KFP ends its task's run
    assert task.data.params["best.learning_rate"] == "0.0005"
    assert task.data.metrics["best_value"] == 0.71
    assert task.data.tags["kubejax.step"] == "tune-sweep"
    assert client.get_experiment_by_name("not-this-one") is None

    # The train step's job: its trainer's run (the trainer's own start_tracker, with the
    # parent the train launcher passes under KFP: the task's run) nests under the task's run.
    train_task = tasks["train"].info.run_id
    monkeypatch.setenv("MLFLOW_RUN_ID", train_task)
    cfg = TrainConfig(model="m", data_dir="/d", output_dir=str(tmp_path / "o"),
                      mlflow_run_name="training", mlflow_parent_run_id=train_task,
                      mlflow_experiment="not-this-one")  # fmt: skip
    data = SimpleNamespace(num_labels=5, total_steps=2, train=[0, 1])
    tracker = start_tracker(cfg, data, resumed=False)
    tracker.log_metrics({"loss": 1.0}, step=1)
    tracker.finish()
    training = client.get_run(tracker.run_id)
    assert training.data.tags["mlflow.parentRunId"] == train_task
    assert training.info.experiment_id == exp

    tree = _tree(client, exp, pid)
    assert tree[0] == "llm-pipeline-run [RUNNING]"
    assert "    tune-sweep [RUNNING]" in tree and "    train [RUNNING]" in tree
    trials = [line for line in tree if line.startswith("        trial-")]
    assert len(trials) == 4 and "            " not in "".join(tree)  # three levels, no deeper
    assert "        training [FINISHED]" in tree
    if os.environ.get("KUBEJAX_MLFLOW_TREE"):
        Path(os.environ["KUBEJAX_MLFLOW_TREE"]).write_text("\n".join(tree) + "\n")
