"""tuner=optimizationjob: the OptimizationJob rendered against the shared CRD (its schema and CEL
rules), the trial TrainJob its controller would make of it against the TrainJob CRD and read
back by the trainer (KUBEFLOW_TRAINER_OPT_* env over the args), the refusals before anything is
created, and whole sweeps against a FAKE API server with the real kubernetes client: created →
succeeded (status.result, trial table, report, nested MLflow runs, re-attach) and → failed."""

from __future__ import annotations

import copy
import json
import re
import signal
import threading
from pathlib import Path

import jsonschema
import pytest
import yaml

from kubejax.cli import main
from kubejax.launchers.optimizationjob import trial_trainjob
from kubejax.launchers.sweep import sweep_with_jaxjobs, trainer_trial_spec
from kubejax.trainer.config import ConfigError, TrainConfig, assigned_flags, from_args
from kubejax.tune import SweepConfig, SweepError
from kubejax.tune import optimizationjob as oj
from tests.jobs.fake_k8s import FakeKubernetes

DATA = Path(__file__).parent / "data"
OJ_CRD = DATA / "trainer-optimizationjob-v1alpha1" / "trainer.kubeflow.org_optimizationjobs.yaml"
TJ_CRD = DATA / "trainer-v2.3.0" / "trainer.kubeflow.org_trainjobs.yaml"
SPACE = {
    "learning_rate": {"type": "float", "low": 1e-5, "high": 1e-3, "log": True},
    "warmup_ratio": {"type": "float", "low": 0.0, "high": 0.2, "step": 0.05},
    "lora_rank": {"type": "categorical", "choices": [8, 16]},
    "optimizer": {"type": "categorical", "choices": ["adamw", "lion"]},
    "max_grad_norm": {"type": "int", "low": 1, "high": 4},
}


def _cfg(**kw) -> SweepConfig:
    kw = {"space": SPACE, "tuner": "optimizationjob", "algorithm": "random", "pruner": "none",
          "max_trials": 4, "parallelism": 2, "study_name": "sweep-a", "poll_seconds": 0.05,
          "seed": 7, **kw}  # fmt: skip
    return SweepConfig(**kw)


def _factory():
    return trainer_trial_spec(
        image="ghcr.io/kubejax/kubejax:test",
        replicas=2,
        data_dir="/ws/kubejax/sweep-a/data",
        hyperparameters={"model": "m", "max_steps": 50},
        parent_run_id="parent-run",
        queue_name="team-a",
    )


def _schema(path: Path, version: str) -> dict:
    crd = yaml.safe_load(path.read_text())
    spec = next(v for v in crd["spec"]["versions"] if v["name"] == version)
    return spec["schema"]["openAPIV3Schema"]


def _render(cfg: SweepConfig, trials_root: str = "/ws/kubejax/sweep-a/trials") -> dict:
    template = trial_trainjob(cfg, _factory(), trials_root)
    return oj.optimization_job(cfg, "sweep-a", template, oj.trial_count(cfg, True))


def _controllers_trial(job: dict, name: str, assignment: dict[str, str]) -> dict:
    """A trial TrainJob as the controller makes it (the open PRs d9989e8 and c453a13): the
    template's spec, each assignment appended to the trainer's env, owned by the job."""
    spec = copy.deepcopy(job["spec"]["trainJobTemplate"]["spec"])
    spec["trainer"]["env"] += [{"name": oj.env_name(k), "value": v} for k, v in assignment.items()]
    meta = copy.deepcopy(job["spec"]["trainJobTemplate"]["metadata"])
    owner = {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "OptimizationJob",
             "name": job["metadata"]["name"], "uid": job["metadata"].get("uid", "u"),
             "controller": True}  # fmt: skip
    meta.update(name=name, namespace="default", ownerReferences=[owner])
    return {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob", "metadata": meta,
            "spec": spec}  # fmt: skip


def _in_pod(trainjob: dict) -> TrainConfig:
    """The trainer's config in the trial's pod: the env as Kubernetes sets it (the downward
    API's JobSet label is the TrainJob's name) and $(VAR) in the args expanded from it."""
    env = {e["name"]: e.get("value", "") for e in trainjob["spec"]["trainer"]["env"]}
    env[oj.TRIAL_NAME_ENV] = trainjob["metadata"]["name"]
    args = [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env[m[1]], a)
            for a in trainjob["spec"]["trainer"]["args"]]  # fmt: skip
    return from_args(args, env=env)


def test_rendered_optimizationjob_is_valid_and_its_trials_read_their_assignments():
    job = _render(_cfg())
    jsonschema.validate(job, _schema(OJ_CRD, "v1alpha1"))
    oj.check_optimization_job(job)
    spec = job["spec"]
    assert spec["objectives"] == [{"metric": "eval_accuracy", "direction": "Maximize"}]
    assert spec["searchAlgorithm"] == {"random": {"seed": 7}}
    assert (spec["numTrials"], spec["parallelTrials"]) == (3, 2)  # the defaults' trial beside
    params = {p["name"]: p["searchSpace"] for p in spec["parameters"]}
    assert params == {
        "learning_rate": {"logUniform": {"min": "1e-05", "max": "0.001", "type": "Float"}},
        "warmup_ratio": {"categorical": {"choices": ["0", "0.05", "0.1", "0.15", "0.2"]}},
        "lora_rank": {"categorical": {"choices": ["8", "16"]}},
        "optimizer": {"categorical": {"choices": ["adamw", "lion"]}},
        "max_grad_norm": {"uniform": {"min": "1", "max": "4", "type": "Int"}},
    }
    template = spec["trainJobTemplate"]
    assert "name" not in template["metadata"] and "namespace" not in template["metadata"]
    assert template["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    trainer = template["spec"]["trainer"]
    assert trainer["image"] == "ghcr.io/kubejax/kubejax:test" and trainer["numNodes"] == 2
    assert not {"--learning-rate", "--lora-rank", "--optimizer"} & set(trainer["args"])

    assignment = {"learning_rate": "0.0003", "warmup_ratio": "0.15", "lora_rank": "16",
                  "optimizer": "lion", "max_grad_norm": "3"}  # fmt: skip
    trial = _controllers_trial(job, "sweep-a-trial-3", assignment)
    jsonschema.validate(trial, _schema(TJ_CRD, "v1alpha1"))
    cfg = _in_pod(trial)
    assert (cfg.learning_rate, cfg.warmup_ratio, cfg.lora_rank) == (3e-4, 0.15, 16)
    assert (cfg.optimizer, cfg.max_grad_norm, cfg.max_steps) == ("lion", 3.0, 50)
    assert cfg.data_dir == "/ws/kubejax/sweep-a/data"  # the sweep's name stays where it is
    assert cfg.output_dir == "/ws/kubejax/sweep-a/trials/sweep-a-trial-3"
    assert cfg.mlflow_run_name == "trial-sweep-a-trial-3"
    assert cfg.mlflow_parent_run_id == "parent-run"
    assert json.loads(cfg.mlflow_tags)["kubejax.jobs"] == "sweep-a-trial-3"


def test_grid_renders_every_dimension_as_choices_and_at_most_its_points():
    space = {"learning_rate": {"type": "float", "low": 1e-4, "high": 3e-4, "step": 1e-4},
             "lora_rank": {"type": "int", "low": 4, "high": 5}}  # fmt: skip
    job = _render(_cfg(space=space, algorithm="grid", max_trials=50, parallelism=8))
    jsonschema.validate(job, _schema(OJ_CRD, "v1alpha1"))
    oj.check_optimization_job(job)
    assert job["spec"]["searchAlgorithm"] == {"grid": {}}
    assert job["spec"]["parameters"] == [
        {"name": "learning_rate",
         "searchSpace": {"categorical": {"choices": ["0.0001", "0.0002", "0.0003"]}}},
        {"name": "lora_rank", "searchSpace": {"categorical": {"choices": ["4", "5"]}}},
    ]  # fmt: skip
    assert (job["spec"]["numTrials"], job["spec"]["parallelTrials"]) == (6, 6)


BROKEN = {
    "parallelTrials cannot exceed numTrials": lambda j: j["spec"].update(parallelTrials=9),
    "grid search requires all parameters to be categorical": lambda j: j["spec"].update(
        searchAlgorithm={"grid": {}}
    ),
    "min must be below max": lambda j: j["spec"]["parameters"][4]["searchSpace"]["uniform"].update(
        min="9"
    ),
    "name and namespace cannot be set": lambda j: j["spec"]["trainJobTemplate"]["metadata"].update(
        name="x"
    ),
}


@pytest.mark.parametrize("expected", list(BROKEN))
def test_each_cel_rule_of_the_crd_catches_its_break(expected):
    job = copy.deepcopy(_render(_cfg()))
    BROKEN[expected](job)
    with pytest.raises(ValueError, match=expected):
        oj.check_optimization_job(job)


def test_the_trainer_reads_optimizationjob_assignments_over_its_args():
    env = {"KUBEFLOW_TRAINER_OPT_LEARNING_RATE": "0.002", "KUBEFLOW_TRAINER_OPT_NESTEROV": "True",
           "KUBEFLOW_TRAINER_OPT_LORA_RANK": "4", "PATH": "/bin"}  # fmt: skip
    assert assigned_flags(env) == ["--learning-rate", "0.002", "--lora-rank", "4", "--nesterov"]
    cfg = from_args(["--learning-rate", "1e-5", "--no-nesterov"], env=env)
    assert (cfg.learning_rate, cfg.nesterov, cfg.lora_rank) == (0.002, True, 4)
    assert from_args(["--learning-rate", "1e-5"], env={}).learning_rate == 1e-5
    with pytest.raises(ConfigError, match=r"^KUBEFLOW_TRAINER_OPT_LR: the OptimizationJob"):
        assigned_flags({"KUBEFLOW_TRAINER_OPT_LR": "0.1"})
    with pytest.raises(ConfigError, match="nesterov must be true or false, got 'yes'"):
        assigned_flags({"KUBEFLOW_TRAINER_OPT_NESTEROV": "yes"})


REFUSALS = [
    ("tpe", {"algorithm": "tpe"}, "algorithm: 'tpe' is not one OptimizationJob runs",
     "use tuner=optuna or katib"),
    ("cmaes", {"algorithm": "cmaes"}, "algorithm: 'cmaes'", "use tuner=optuna or katib"),
    ("bayesian", {"algorithm": "bayesianoptimization"}, "kubeflow/trainer#3802", "tuner=katib"),
    ("multivariate-tpe", {"algorithm": "multivariate-tpe"}, "'multivariate-tpe'", "tuner=katib"),
    ("hyperband", {"algorithm": "hyperband"}, "'hyperband'", "scheduler=asha"),
    ("median pruning", {"pruner": "median"}, "pruner: median — OptimizationJob has no early",
     "tuner=katib (median as medianstop)"),
    ("hyperband pruning", {"pruner": "hyperband"}, "pruner: hyperband", "tuner=optuna"),
    ("asha", {"scheduler": "asha"}, "scheduler: asha is Ray Tune's", "use tuner=ray"),
    ("pbt", {"scheduler": "pbt"}, "scheduler: pbt is Ray Tune's", "use tuner=ray"),
    ("101 trials", {"max_trials": 101}, "max_trials: 101 is more than the 100 trials",
     "use tuner=optuna or katib"),
    ("second objective", {"objective": "eval_accuracy,eval_loss"}, "names 2 metrics",
     "name one"),
    ("conditional", {"space": {**SPACE, "b1": {"type": "float", "low": 0.8, "high": 0.99,
                                              "when": {"optimizer": "lion"}}}},
     "search_space.b1.when: OptimizationJob has no conditional", "use tuner=optuna"),
    ("resources", {"space": {**SPACE, "replicas": {"type": "int", "low": 1, "high": 2}}},
     "search_space.replicas: an OptimizationJob passes parameters", "use tuner=optuna"),
    ("too many steps", {"space": {"warmup_ratio": {"type": "float", "low": 0.0, "high": 0.5,
                                                   "step": 0.001}}},
     "search_space.warmup_ratio: 501 values (its steps)", "use tuner=optuna"),
    ("grid of a continuous range", {"algorithm": "grid"},
     "search_space.learning_rate: grid search needs 'choices' or a 'step'", ""),
]  # fmt: skip


@pytest.mark.parametrize("case,kw,expected,engine", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_what_optimizationjob_cannot_run_is_refused_naming_the_engine_that_can(
    case, kw, expected, engine
):
    with pytest.raises(SweepError) as err:
        oj.check_sweep(_cfg(**kw), "trainjob")
    assert expected in str(err.value) and engine in str(err.value), str(err.value)
    assert len(str(err.value).splitlines()) == 1


def test_refusals_exit_2_in_one_line_before_any_job(tmp_path, capsys):
    common = ["tune", "--tuner", "optimizationjob", "--data-dir", str(tmp_path), "--model", "m",
              "--output-dir", str(tmp_path / "o"), "--space", json.dumps(SPACE)]  # fmt: skip
    cases = {
        ("--algorithm", "tpe", "--pruner", "none", "--backend", "trainjob"): "use tuner=optuna",
        ("--algorithm", "random", "--backend", "trainjob"): "set pruner=none",
        ("--algorithm", "random", "--pruner", "none", "--backend", "local"): "use tuner=optuna "
        "there",
        ("--algorithm", "random", "--pruner", "none", "--scheduler", "pbt"): "use tuner=ray",
    }
    for extra, expected in cases.items():
        assert main([*common, *extra]) == 2, extra
        err = capsys.readouterr().err.strip()
        assert expected in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "o" / "trials").exists()


def _kubeconfig(tmp_path, host: str) -> str:
    from tests.test_cli import _kubeconfig as write

    return write(tmp_path, host)


def _done(best: str, params: dict[str, str]) -> dict:
    return {
        "conditions": [
            {"type": "Created", "status": "True", "reason": "AlgorithmServiceCreated"},
            {"type": "Complete", "status": "True", "reason": "OptimizationJobCompleted"},
        ],
        "result": {"trainJobName": best,
                   "parameters": [{"name": k, "value": v} for k, v in params.items()]},
    }  # fmt: skip


#: The trials the controller makes: (assignment, final eval_accuracy or None for a failure).
TRIALS = {
    "sweep-a-trial-0": ({"learning_rate": "0.0001", "warmup_ratio": "0.05", "lora_rank": "8",
                         "optimizer": "adamw", "max_grad_norm": "2"}, "0.62"),
    "sweep-a-trial-1": ({"learning_rate": "0.0005", "warmup_ratio": "0.1", "lora_rank": "16",
                         "optimizer": "lion", "max_grad_norm": "1"}, "0.71"),
    "sweep-a-trial-2": ({"learning_rate": "0.00002", "warmup_ratio": "0", "lora_rank": "8",
                         "optimizer": "adamw", "max_grad_norm": "4"}, None),
}  # fmt: skip


def _finished(trainjob: dict, accuracy: str | None, second: int, trials_root: Path, uri: str):
    """What a trial's trainer and Trainer leave: its status (Complete with the posted final
    evaluation, or Failed), its metrics.json and its MLflow run nested under the sweep's."""
    import mlflow

    name = trainjob["metadata"]["name"]
    ended = {"type": "Complete" if accuracy else "Failed", "status": "True", "reason": "x",
             "lastTransitionTime": f"2026-12-05T10:0{second + 5}:00Z"}  # fmt: skip
    trainjob["metadata"]["creationTimestamp"] = f"2026-12-05T10:0{second}:00Z"
    trainjob["status"] = {"conditions": [ended]}
    if accuracy:
        metrics = [
            {"name": "eval_accuracy", "value": accuracy},
            {"name": "eval_loss", "value": "1"},
        ]
        trainjob["status"]["trainerStatus"] = {"progressPercentage": 100, "metrics": metrics}
    args = trainjob["spec"]["trainer"]["args"]
    parent = args[args.index("--mlflow-parent-run-id") + 1]
    client = mlflow.MlflowClient(uri)
    experiment = client.get_run(parent).info.experiment_id
    run = client.create_run(
        experiment, tags={"mlflow.parentRunId": parent}, run_name=f"trial-{name}"
    )
    out = trials_root / name
    out.mkdir(parents=True)
    evals = [{"step": 25, "eval_accuracy": 0.5}] + (
        [{"step": 50, "eval_accuracy": float(accuracy)}] if accuracy else []
    )
    (out / "metrics.json").write_text(
        json.dumps(
            {"step": 50 if accuracy else 25, "evals": evals, "mlflow_run_id": run.info.run_id}
        )
    )


def _controller(fake: FakeKubernetes, trials_root: Path, uri: str):
    """The fake's OptimizationJob controller: on creation, its trial TrainJobs, finished."""

    def on_create(job: dict):
        for i, (name, (assignment, accuracy)) in enumerate(TRIALS.items()):
            trial = _controllers_trial(job, name, assignment)
            _finished(trial, accuracy, i + 1, trials_root, uri)
            fake.jobs[name], fake.steps[name] = trial, 0

    def on_defaults(trainjob: dict):
        _finished(trainjob, "0.65", 0, trials_root, uri)

    fake.on_optimization_job, fake.on_job = on_create, on_defaults


def test_fake_optimizationjob_sweep_gives_the_optuna_paths_outputs(tmp_path, monkeypatch):
    """Created → running → complete: the best params are status.result's, in the space's types;
    the defaults' TrainJob beside the job (owned by it, its assignment as the controller's
    env); the trial table, report and MLflow runs as the Optuna path writes them; a retried
    step re-attaches."""
    import mlflow

    from kubejax.tune import write_report, write_trials

    trials_root, uri = tmp_path / "trials", f"sqlite:///{tmp_path / 'mlflow.db'}"
    running = {"conditions": [{"type": "Created", "status": "True"},
                              {"type": "Running", "status": "True"}]}  # fmt: skip
    best = TRIALS["sweep-a-trial-1"][0]
    script = [{}, running, _done("sweep-a-trial-1", best)]
    with FakeKubernetes(served=("trainjob",), optimization_script=script) as fake:
        _controller(fake, trials_root, uri)
        monkeypatch.setenv("KUBECONFIG", _kubeconfig(tmp_path, fake.host))
        lines: list[str] = []
        kw = {"data_dir": "/ws/data", "trials_root": str(trials_root),
              "hyperparameters": {"model": "m"}, "backend": "kubernetes", "replicas": 2,
              "mlflow_tracking_uri": uri, "log": lines.append}  # fmt: skip
        result, parent = sweep_with_jaxjobs(_cfg(), **kw)
        assert fake.count("POST", "/optimizationjobs") == 1
        body = next(b for b in fake.bodies if b["kind"] == "OptimizationJob")
        assert body["metadata"]["namespace"] == "default"  # the kubeconfig context's
        posted = {k: v for k, v in body.items() if k != "status"}
        posted["metadata"] = {k: v for k, v in body["metadata"].items() if k != "uid"}
        jsonschema.validate(posted, _schema(OJ_CRD, "v1alpha1"))
        defaults = fake.jobs["sweep-a-defaults"]
        assert defaults["metadata"]["ownerReferences"][0]["uid"] == "uid-sweep-a"
        assert not defaults["metadata"]["ownerReferences"][0]["controller"]
        env = {e["name"]: e.get("value") for e in defaults["spec"]["trainer"]["env"]}
        assert env["KUBEFLOW_TRAINER_OPT_LEARNING_RATE"] == "5e-05"
        assert env["KUBEFLOW_TRAINER_OPT_OPTIMIZER"] == "adamw"
        sweep_with_jaxjobs(_cfg(), **kw)  # a retried step: the same job
        assert fake.count("POST", "/optimizationjobs") == 1
    assert any("re-attached to OptimizationJob default/sweep-a" in line for line in lines)
    assert any("created the defaults' TrainJob default/sweep-a-defaults" in line for line in lines)
    assert result.best_params == {"learning_rate": 0.0005, "warmup_ratio": 0.1, "lora_rank": 16,
                                  "optimizer": "lion", "max_grad_norm": 1}  # fmt: skip
    assert result.best_value == 0.71 and result.best_trial == 2
    assert result.defaults_trial == 0 and result.trials[0]["params"]["learning_rate"] == 5e-5
    assert result.choice == "best" and result.gain == pytest.approx(0.06)
    assert result.counts == {"complete": 3, "pruned": 0, "failed": 1}
    assert result.trials[1]["worker_seconds"] == 2 * 300.0
    assert result.trials[2]["intermediate"] == {"25": 0.5, "50": 0.71}
    write_trials(result, tmp_path / "trials.json")
    write_report(result, _cfg(), tmp_path / "report.html")
    saved = json.loads((tmp_path / "trials.json").read_text())["trials"]
    assert saved[2]["job"] == "sweep-a-trial-1"
    assert "learning_rate" in (tmp_path / "report.html").read_text()
    client = mlflow.MlflowClient(uri)
    nested = client.search_runs(
        [client.get_run(parent).info.experiment_id], f"tags.mlflow.parentRunId = '{parent}'"
    )
    states = sorted(r.data.tags.get("kubejax.trial_state") for r in nested)
    assert states == ["complete", "complete", "complete", "failed"]
    sweep_run = client.get_run(parent).data
    assert sweep_run.params["best.learning_rate"] == "0.0005"
    assert sweep_run.metrics["best_value"] == 0.71 and sweep_run.metrics["defaults_value"] == 0.65
    assert sweep_run.tags["kubejax.best_jaxjob"] == "sweep-a-trial-1"


def test_fake_failed_optimizationjob_reaches_the_user_in_one_line(tmp_path, monkeypatch):
    failed = {"conditions": [{"type": "Failed", "status": "True", "reason": "AllTrialsFailed",
                              "message": "3 out of 3 trials failed"}]}  # fmt: skip
    with FakeKubernetes(served=("trainjob",), optimization_script=[{}, failed]) as fake:
        monkeypatch.setenv("KUBECONFIG", _kubeconfig(tmp_path, fake.host))
        with pytest.raises(SweepError) as err:
            sweep_with_jaxjobs(_cfg(), data_dir="/d", trials_root=str(tmp_path / "t"),
                               hyperparameters={"model": "m"}, backend="kubernetes",
                               log=lambda _: None)  # fmt: skip
    assert str(err.value) == (
        "tuner: OptimizationJob sweep-a failed: AllTrialsFailed: 3 out of 3 trials failed"
    )


def test_fake_complete_without_a_result_names_the_feature_gate(tmp_path, monkeypatch):
    """Trials that posted no metric (Trainer's TrainJobStatus gate off): the job completes
    with no status.result, and the sweep says why in one line."""
    done = _done("", {})
    done.pop("result")
    with FakeKubernetes(served=("trainjob",), optimization_script=[done]) as fake:
        fake.on_job = lambda tj: tj.update(status={"conditions": [
            {"type": "Complete", "status": "True"}]})  # fmt: skip
        monkeypatch.setenv("KUBECONFIG", _kubeconfig(tmp_path, fake.host))
        with pytest.raises(SweepError, match="enable Trainer's TrainJobStatus feature gate"):
            sweep_with_jaxjobs(_cfg(), data_dir="/d", trials_root=str(tmp_path / "t"),
                               hyperparameters={"model": "m"}, backend="kubernetes",
                               log=lambda _: None)  # fmt: skip


def test_fake_cancelled_sweep_deletes_its_optimizationjob(tmp_path, monkeypatch):
    """SIGTERM (a cancelled KFP run) while the job runs: it and the defaults' TrainJob are
    deleted (its trials go with it), and the step exits 143."""
    with FakeKubernetes(served=("trainjob",), optimization_script=[{}]) as fake:
        monkeypatch.setenv("KUBECONFIG", _kubeconfig(tmp_path, fake.host))
        threading.Timer(0.5, lambda: signal.raise_signal(signal.SIGTERM)).start()
        with pytest.raises(SystemExit) as exit_:
            sweep_with_jaxjobs(_cfg(), data_dir="/d", trials_root=str(tmp_path / "t"),
                               hyperparameters={"model": "m"}, backend="kubernetes",
                               log=lambda _: None)  # fmt: skip
        assert exit_.value.code == 143
        assert fake.count("DELETE", "/optimizationjobs/sweep-a") == 1
        assert fake.count("DELETE", "/trainjobs/sweep-a-defaults") == 1
        assert fake.optimization_jobs == {} and "sweep-a-defaults" not in fake.jobs
