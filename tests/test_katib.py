"""tuner=katib: the Experiment rendered for TrainJob and JAXJob trials against the rules Katib's
webhook enforces (and its trial jobs against their CRDs once Katib fills them in), the
refusals before anything is created, and a whole sweep against a FAKE API server with the real
kubernetes client: create, follow, best params, trials, report, nested MLflow runs, re-attach,
a failed Experiment's reason, and deletion on a cancelled run."""

from __future__ import annotations

import copy
import json
import signal
import threading
from pathlib import Path

import jsonschema
import pytest
import yaml

from kubejax.cli import main
from kubejax.launchers.katib import trial_job
from kubejax.launchers.sweep import sweep_with_jaxjobs, trainer_trial_spec
from kubejax.trainer.config import TrainConfig
from kubejax.trainer.config import parser as trainer_parser
from kubejax.tune import SweepConfig, SweepError, katib
from tests.jobs.fake_k8s import FakeKubernetes

DATA = Path(__file__).parent / "data"
SPACE = {
    "learning_rate": {"type": "float", "low": 1e-5, "high": 1e-3, "log": True},
    "warmup_ratio": {"type": "float", "low": 0.0, "high": 0.2, "step": 0.05},
    "lora_rank": {"type": "categorical", "choices": [8, 16]},
    "optimizer": {"type": "categorical", "choices": ["adamw", "lion"]},
}
SAMPLE = {"learning_rate": "0.0003", "warmup_ratio": "0.1", "lora_rank": "16",
          "optimizer": "lion", katib.TRIAL_NAME: "sweep-a-x7k2p9"}  # fmt: skip


def _cfg(**kw) -> SweepConfig:
    kw = {"space": SPACE, "tuner": "katib", "max_trials": 6, "parallelism": 2,
          "study_name": "sweep-a", "poll_seconds": 0.05, **kw}  # fmt: skip
    return SweepConfig(**kw)


def _factory():
    return trainer_trial_spec(
        image="ghcr.io/kubejax/kubejax:test",
        replicas=2,
        data_dir="/ws/data",
        hyperparameters={"model": "m", "max_steps": 50, "katib_metrics": True},
        parent_run_id="parent-run",
    )


def _crd_schema(path: Path, version: str) -> dict:
    crd = yaml.safe_load(path.read_text())
    spec = next(v for v in crd["spec"]["versions"] if v["name"] == version)
    return spec["schema"]["openAPIV3Schema"]


def _filled(manifest: dict) -> dict:
    """The trial's job as Katib creates it: every placeholder replaced."""
    text = json.dumps(manifest)
    for name, value in SAMPLE.items():
        text = text.replace(katib.placeholder(name), value)
    return {**json.loads(text), "metadata": {"name": SAMPLE[katib.TRIAL_NAME], "namespace": "ns"}}


@pytest.mark.parametrize(
    "engine,crd,version",
    [("trainjob", DATA / "trainer-v2.3.0" / "trainer.kubeflow.org_trainjobs.yaml", "v1alpha1"),
     ("jaxjob", DATA / "kubeflow.org_jaxjobs.yaml", "v1")],
)  # fmt: skip
@pytest.mark.slow
def test_rendered_experiment_passes_katibs_webhook_rules_and_its_trials_their_crd(
    engine, crd, version
):
    cfg = _cfg(pruner="median", pruner_min_steps=2)
    manifest, flags = trial_job(cfg, _factory(), engine, "/ws/trials")
    exp = katib.experiment(cfg, "sweep-a", manifest, engine, flags)
    katib.check_experiment(exp)
    spec = exp["spec"]
    params = {p["name"]: p for p in spec["parameters"]}
    log_uniform = {"min": "1e-05", "max": "0.001", "distribution": "logUniform"}
    assert params["learning_rate"] == {"name": "learning_rate", "parameterType": "double",
                                       "feasibleSpace": log_uniform}  # fmt: skip
    assert params["warmup_ratio"]["feasibleSpace"]["step"] == "0.05"
    assert params["lora_rank"] == {"name": "lora_rank", "parameterType": "discrete",
                                   "feasibleSpace": {"list": ["8", "16"]}}  # fmt: skip
    assert params["optimizer"]["parameterType"] == "categorical"
    assert spec["objective"]["objectiveMetricName"] == "eval_accuracy"
    assert spec["objective"]["additionalMetricNames"] == ["eval_loss"]
    assert spec["earlyStopping"]["algorithmName"] == "medianstop"
    assert {"name": "start_step", "value": "2"} in spec["earlyStopping"]["algorithmSettings"]
    assert spec["metricsCollectorSpec"] == {"collector": {"kind": "StdOut"}}
    template = spec["trialTemplate"]
    assert template["primaryContainerName"] == ("node" if engine == "trainjob" else "jax")
    assert "metadata" not in manifest or "name" not in manifest["metadata"]

    job = _filled(manifest)
    jsonschema.validate(job, _crd_schema(crd, version))
    args = (
        job["spec"]["trainer"]["args"]
        if engine == "trainjob"
        else job["spec"]["jaxReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["args"]
    )
    cfg_in_pod = TrainConfig(**vars(trainer_parser().parse_args(args)))
    assert cfg_in_pod.learning_rate == 3e-4 and cfg_in_pod.lora_rank == 16
    assert cfg_in_pod.optimizer == "lion" and cfg_in_pod.warmup_ratio == 0.1
    assert cfg_in_pod.output_dir == "/ws/trials/sweep-a-x7k2p9"
    assert cfg_in_pod.katib_metrics and cfg_in_pod.mlflow_parent_run_id == "parent-run"
    assert cfg_in_pod.mlflow_run_name == "trial-sweep-a-x7k2p9"
    assert job["metadata"]["name"] == "sweep-a-x7k2p9"
    assert json.dumps(job).count("sweep-a-x7k2p9") >= 3  # labels, output, run name, tags


def test_the_trial_name_replaces_the_job_name_alone_not_the_study_in_a_path():
    """Under a pipeline workspace the data and trials folders hold the study's name
    (`<workspace>/kubejax/<study>/...`): a trial still reads that data and writes under it."""
    cfg = _cfg()
    factory = trainer_trial_spec(image="img", replicas=1, data_dir="/ws/kubejax/sweep-a/data",
                                 hyperparameters={"model": "m", "max_steps": 5},
                                 parent_run_id="p")  # fmt: skip
    manifest, _ = trial_job(cfg, factory, "trainjob", "/ws/kubejax/sweep-a/trials")
    args = _filled(manifest)["spec"]["trainer"]["args"]
    assert args[args.index("--data-dir") + 1] == "/ws/kubejax/sweep-a/data"
    out = args[args.index("--output-dir") + 1]
    assert out == "/ws/kubejax/sweep-a/trials/sweep-a-x7k2p9"
    assert "kubejax-katib-trial-name" not in json.dumps(manifest)


def _valid() -> dict:
    cfg = _cfg()
    manifest, flags = trial_job(cfg, _factory(), "trainjob", "/ws/trials")
    return katib.experiment(cfg, "sweep-a", manifest, "trainjob", flags)


BROKEN = {
    "metadata.name": lambda e: e["metadata"].update(name="Sweep_A"),
    "spec.parallelTrialCount must not exceed": lambda e: e["spec"].update(parallelTrialCount=9),
    "spec.maxFailedTrialCount must be in": lambda e: e["spec"].update(maxFailedTrialCount=-1),
    "must not hold the objective": lambda e: e["spec"]["objective"].update(
        additionalMetricNames=["eval_accuracy"]
    ),
    "medianstop only": lambda e: e["spec"].update(earlyStopping={"algorithmName": "hyperband"}),
    "min and max (no list)": lambda e: e["spec"]["parameters"][0]["feasibleSpace"].update(
        list=["1"]
    ),
    "a list only": lambda e: e["spec"]["parameters"][2]["feasibleSpace"].update(min="1"),
    "is not used": lambda e: e["spec"]["trialTemplate"]["trialParameters"].append(
        {"name": "dropout", "reference": "learning_rate"}
    ),
    "are not trial parameters": lambda e: e["spec"]["trialTemplate"]["trialSpec"]["spec"][
        "trainer"]["args"].append("${trialParameters.seed}"),
    "metadata.name and namespace must be unset": lambda e: e["spec"]["trialTemplate"][
        "trialSpec"]["metadata"].update(name="x"),
    "successCondition and failureCondition": lambda e: e["spec"]["trialTemplate"].pop(
        "successCondition"
    ),
}  # fmt: skip


@pytest.mark.parametrize("expected", list(BROKEN))
def test_each_webhook_rule_catches_its_break(expected):
    exp = copy.deepcopy(_valid())
    BROKEN[expected](exp)
    with pytest.raises(ValueError, match=expected.replace(".", r"\.").replace("(", r"\(")
                       .replace(")", r"\)").replace("[", r"\[")):  # fmt: skip
        katib.check_experiment(exp)


def test_what_katib_cannot_run_is_refused_in_one_line_before_anything(tmp_path, capsys):
    refusals = {
        "search_space.optimizer.when: Katib has no conditional parameters": {
            "space": {**SPACE, "b1": {"type": "float", "low": 0.8, "high": 0.99,
                                      "when": {"optimizer": "lion"}}}},
        "search_space.replicas: Katib substitutes parameters": {
            "space": {**SPACE, "replicas": {"type": "int", "low": 1, "high": 2}}},
        "pruner: 'successive_halving' has no Katib counterpart": {"pruner": "successive_halving"},
        "Katib's hyperband needs a resource dimension": {"algorithm": "hyperband"},
        "hyperband with max_steps up to 100 runs 81 trials at once": {
            "algorithm": "hyperband",
            "space": {"max_steps": {"type": "int", "low": 10, "high": 100}}},
    }  # fmt: skip
    for expected, kw in refusals.items():
        with pytest.raises(SweepError) as err:
            katib.check_sweep(_cfg(**kw), "trainjob")
        assert expected.replace("optimizer.when", "b1.when") in str(err.value), str(err.value)
    with pytest.raises(SweepError, match=r"algorithm: 'sobol' is not one of .*\(Katib's\)"):
        _cfg(algorithm="sobol")
    bools = _cfg(space={"nesterov": {"type": "categorical", "choices": [True, False]}})
    with pytest.raises(SweepError, match=r"search_space\.nesterov: a true/false trainer setting"):
        trial_job(bools, _factory(), "trainjob", "/ws")
    argv = ["tune", "--tuner", "katib", "--backend", "local", "--data-dir", str(tmp_path),
            "--model", "m", "--output-dir", str(tmp_path / "o"),
            "--space", json.dumps(SPACE)]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("use tuner=optuna there") and len(err.splitlines()) == 1
    assert not (tmp_path / "o" / "trials").exists()


def _trial(name: str, lr: str, state: str, accuracy: str | None, start: str, end: str,
           rank: str = "8", warmup: str = "0.05") -> dict:  # fmt: skip
    metrics = [] if accuracy is None else [
        {"name": "eval_accuracy", "latest": accuracy, "min": "0.1", "max": accuracy},
        {"name": "eval_loss", "latest": "1.2", "min": "1.2", "max": "1.6"},
    ]  # fmt: skip
    return {
        "metadata": {"name": name, "creationTimestamp": start,
                     "labels": {katib.EXPERIMENT_LABEL: "sweep-a"}},
        "spec": {"parameterAssignments": [
            {"name": "learning_rate", "value": lr}, {"name": "warmup_ratio", "value": warmup},
            {"name": "lora_rank", "value": rank}, {"name": "optimizer", "value": "adamw"}]},
        "status": {"conditions": [{"type": "Created", "status": "True"},
                                  {"type": state, "status": "True"}],
                   "observation": {"metrics": metrics},
                   "startTime": start, "completionTime": end},
    }  # fmt: skip


#: The trainer's defaults for SPACE (learning_rate 5e-5, warmup_ratio 0.1, lora_rank 16,
#: optimizer adamw): the Trial kubejax creates before the Experiment, its oldest.
DEFAULTS = {"learning_rate": 5e-5, "warmup_ratio": 0.1, "lora_rank": 16, "optimizer": "adamw"}
TRIALS = [
    _trial("sweep-a-defaults", "5e-05", "Succeeded", "0.65", "2026-12-05T09:59:59Z",
           "2026-12-05T10:04:30Z", rank="16", warmup="0.1"),
    _trial("sweep-a-aaaa", "0.0001", "Succeeded", "0.62", "2026-12-05T10:00:00Z",
           "2026-12-05T10:05:00Z"),
    _trial("sweep-a-bbbb", "0.0005", "Succeeded", "0.71", "2026-12-05T10:00:01Z",
           "2026-12-05T10:04:00Z"),
    _trial("sweep-a-cccc", "0.00002", "EarlyStopped", "0.30", "2026-12-05T10:05:01Z",
           "2026-12-05T10:06:00Z"),
]  # fmt: skip
DONE = {
    "trials": 4, "trialsSucceeded": 3, "trialsEarlyStopped": 1,
    "conditions": [{"type": "Created", "status": "True"},
                   {"type": "Succeeded", "status": "True", "reason": "ExperimentMaxTrialsReached"}],
    "currentOptimalTrial": {"bestTrialName": "sweep-a-bbbb", "parameterAssignments": []},
}  # fmt: skip


def _kubeconfig(tmp_path, host: str) -> str:
    from tests.test_cli import _kubeconfig as write

    return write(tmp_path, host)


def _trainers(trials_root: Path, tracking_uri: str):
    """What each trial's trainer leaves behind, made when the Experiment is created: its
    metrics.json and its MLflow run, nested under the sweep's parent run (from the args)."""
    import mlflow

    def on_create(body: dict):
        if body["kind"] == "Trial":  # the defaults' Trial: the Experiment's trials come next
            return
        args = body["spec"]["trialTemplate"]["trialSpec"]["spec"]["trainer"]["args"]
        parent = args[args.index("--mlflow-parent-run-id") + 1]
        client = mlflow.MlflowClient(tracking_uri)
        experiment = client.get_run(parent).info.experiment_id
        for t in TRIALS:
            run = client.create_run(experiment, tags={"mlflow.parentRunId": parent},
                                    run_name=f"trial-{t['metadata']['name']}")  # fmt: skip
            out = trials_root / t["metadata"]["name"]
            out.mkdir(parents=True)
            evals = [{"step": 25, "eval_accuracy": 0.5}, {"step": 50, "eval_accuracy": 0.6}]
            (out / "metrics.json").write_text(json.dumps(
                {"step": 50, "evals": evals, "mlflow_run_id": run.info.run_id}))  # fmt: skip

    return on_create


@pytest.mark.slow
def test_fake_katib_sweep_gives_the_optuna_paths_outputs(tmp_path, monkeypatch):
    """Create → running → succeeded: the best params are Katib's optimal trial's, in the
    space's types; the trial table, report and MLflow runs (parent, nested trials tagged with
    their state) as the Optuna path writes them; a second attempt re-attaches."""
    import mlflow

    from kubejax.tune import write_report, write_trials

    trials_root = tmp_path / "trials"
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    script = [{}, {"trials": 2, "trialsRunning": 2}, DONE]
    with FakeKubernetes(served=("trainjob",), experiment_script=script,
                        katib_trials=TRIALS) as fake:  # fmt: skip
        fake.on_experiment = _trainers(trials_root, uri)
        monkeypatch.setenv("KUBECONFIG", _kubeconfig(tmp_path, fake.host))
        lines: list[str] = []
        kw = {"data_dir": "/ws/data", "trials_root": str(trials_root),
              "hyperparameters": {"model": "m"}, "backend": "kubernetes", "replicas": 2,
              "mlflow_tracking_uri": uri, "log": lines.append}  # fmt: skip
        result, parent = sweep_with_jaxjobs(_cfg(), **kw)
        assert fake.count("POST", "/experiments") == 1 and fake.count("POST", "/trials") == 1
        kinds = [b["kind"] for b in fake.bodies if b["kind"] in ("Trial", "Experiment")]
        assert kinds == ["Trial", "Experiment"]  # Katib's controller finds it at its first look
        body = next(b for b in fake.bodies if b["kind"] == "Experiment")
        katib.check_experiment(body)
        assert body["metadata"]["namespace"] == "default"  # the kubeconfig context's
        sweep_with_jaxjobs(_cfg(), **kw)  # a retried step: the same Experiment
        assert fake.count("POST", "/experiments") == 1 and fake.count("POST", "/trials") == 1
    assert any("re-attached to Katib Experiment default/sweep-a" in line for line in lines)
    assert any("trials 2 created, 2 running" in line for line in lines)
    assert result.best_params == {"learning_rate": 0.0005, "warmup_ratio": 0.05,
                                  "lora_rank": 8, "optimizer": "adamw"}  # fmt: skip
    assert result.best_value == 0.71 and result.best_trial == 2
    assert result.defaults_trial == 0 and result.trials[0]["params"] == DEFAULTS
    assert result.choice == "best" and result.gain == pytest.approx(0.06)
    assert result.chosen_params == result.best_params
    assert result.counts == {"complete": 3, "pruned": 1, "failed": 0}
    assert result.trials[1]["worker_seconds"] == 2 * 300.0 and result.trial_steps == 200
    assert result.trials[2]["intermediate"] == {"25": 0.5, "50": 0.6}
    write_trials(result, tmp_path / "trials.json")
    write_report(result, _cfg(), tmp_path / "report.html")
    assert json.loads((tmp_path / "trials.json").read_text())["trials"][2]["job"] == "sweep-a-bbbb"
    assert "learning_rate" in (tmp_path / "report.html").read_text()
    client = mlflow.MlflowClient(uri)
    nested = client.search_runs(
        [client.get_run(parent).info.experiment_id],
        f"tags.mlflow.parentRunId = '{parent}'",
    )
    states = sorted(r.data.tags.get("kubejax.trial_state") for r in nested)
    assert states == ["complete", "complete", "complete", "pruned"]
    sweep_run = client.get_run(parent).data
    assert sweep_run.params["best.learning_rate"] == "0.0005"
    assert sweep_run.metrics["defaults_value"] == 0.65 and sweep_run.metrics["kept_defaults"] == 0
    assert sweep_run.tags["kubejax.sweep_choice"] == "best"


@pytest.mark.slow
def test_the_defaults_trial_is_the_trial_katib_would_make_of_them():
    """The defaults' Trial as Katib's controller builds one from a suggestion: labelled into
    the Experiment, its objective, collector, primary pod and conditions, every placeholder
    of the template filled with the defaults (the trainer reads them back) and its name."""
    cfg = _cfg()
    manifest, flags = trial_job(cfg, _factory(), "trainjob", "/ws/trials")
    exp = katib.experiment(cfg, "sweep-a", manifest, "trainjob", flags)
    trial = katib.defaults_trial(exp, DEFAULTS)
    assert trial["kind"] == "Trial" and trial["metadata"]["name"] == "sweep-a-defaults"
    assert trial["metadata"]["labels"][katib.EXPERIMENT_LABEL] == "sweep-a"
    spec, template = trial["spec"], exp["spec"]["trialTemplate"]
    assert spec["objective"] == exp["spec"]["objective"]
    assert spec["metricsCollector"] == {"collector": {"kind": "StdOut"}}
    for key in ("primaryPodLabels", "primaryContainerName", "successCondition",
                "failureCondition"):  # fmt: skip
        assert spec[key] == template[key], key
    assigned = {a["name"]: a["value"] for a in spec["parameterAssignments"]}
    assert assigned == {"learning_rate": "5e-05", "warmup_ratio": "0.1", "lora_rank": "16",
                        "optimizer": "adamw"}  # fmt: skip
    job = spec["runSpec"]
    assert "${trialParameters" not in json.dumps(job)
    assert job["metadata"]["name"] == "sweep-a-defaults"
    crd = DATA / "trainer-v2.3.0" / "trainer.kubeflow.org_trainjobs.yaml"
    jsonschema.validate(job, _crd_schema(crd, "v1alpha1"))
    args = job["spec"]["trainer"]["args"]
    in_pod = TrainConfig(**vars(trainer_parser().parse_args(args)))
    assert (in_pod.learning_rate, in_pod.warmup_ratio, in_pod.lora_rank) == (5e-5, 0.1, 16)
    assert in_pod.output_dir == "/ws/trials/sweep-a-defaults"
    assert in_pod.mlflow_run_name == "trial-sweep-a-defaults"


def test_fake_failed_experiment_reaches_the_user_in_one_line(tmp_path, monkeypatch):
    failed = {"conditions": [{"type": "Failed", "status": "True", "reason": "ExperimentFailed",
                              "message": "max failed trials 2 reached"}]}  # fmt: skip
    with FakeKubernetes(served=("trainjob",), experiment_script=[{}, failed]) as fake:
        monkeypatch.setenv("KUBECONFIG", _kubeconfig(tmp_path, fake.host))
        with pytest.raises(SweepError) as err:
            sweep_with_jaxjobs(_cfg(), data_dir="/d", trials_root=str(tmp_path / "t"),
                               hyperparameters={"model": "m"}, backend="kubernetes",
                               log=lambda _: None)  # fmt: skip
    assert str(err.value) == (
        "tuner: Katib Experiment sweep-a failed: ExperimentFailed: max failed trials 2 reached"
    )


def test_fake_cancelled_sweep_deletes_its_experiment(tmp_path, monkeypatch):
    """SIGTERM (a cancelled KFP run) while the Experiment runs: it is deleted (its trials and
    their jobs with it), and the step exits 143."""
    with FakeKubernetes(served=("trainjob",), experiment_script=[{"trials": 1}]) as fake:
        monkeypatch.setenv("KUBECONFIG", _kubeconfig(tmp_path, fake.host))
        threading.Timer(0.5, lambda: signal.raise_signal(signal.SIGTERM)).start()
        with pytest.raises(SystemExit) as exit_:
            sweep_with_jaxjobs(_cfg(), data_dir="/d", trials_root=str(tmp_path / "t"),
                               hyperparameters={"model": "m"}, backend="kubernetes",
                               log=lambda _: None)  # fmt: skip
        assert exit_.value.code == 143
        assert fake.count("DELETE", "/experiments/sweep-a") == 1
        assert fake.count("DELETE", "/trials/sweep-a-defaults") == 1  # it has no owner
        assert fake.experiments == {}  # the fake keeps Trials posted beside Experiments
