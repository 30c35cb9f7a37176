"""The sweep: search, pruning, failures, resume, bad spaces, and a real sweep of the trainer."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kubejax.jaxjob.client import JAXJobClient
from kubejax.jaxjob.spec import JAXJobSpec
from kubejax.launchers.sweep import sweep_with_jaxjobs
from kubejax.tune import SweepConfig, SweepError, parse_space, tune

PROGRAM = Path(__file__).parent / "trial_program.py"


def factory(steps=10, fail_above=2.0, sleep=0.02):
    def make(number, params, out, name):
        args = [
            "--output-dir",
            out,
            "--steps",
            str(steps),
            "--fail-above",
            str(fail_above),
            "--sleep",
            str(sleep),
        ]
        for k, v in params.items():
            args += [f"--{k}", str(v)]
        return JAXJobSpec(name=name, image="i", command=[sys.executable, str(PROGRAM)], args=args)

    return make


@pytest.fixture
def client(tmp_path):
    c = JAXJobClient("local", log_root=tmp_path / "logs")
    yield c
    c.close()


def _cfg(space, **kw):
    kw.setdefault("poll_seconds", 0.05)
    kw.setdefault("pruner", "none")
    return SweepConfig(space=space, **kw)


GRID = {"x": {"type": "float", "low": 0.0, "high": 1.0, "step": 0.1}}


def test_grid_finds_the_known_best(client, tmp_path):
    r = tune(
        _cfg(GRID, algorithm="grid", max_trials=50, parallelism=3),
        factory(steps=2),
        tmp_path / "t",
        client=client,
        log=lambda _: None,
    )
    assert len(r.trials) == 11 and r.counts["complete"] == 11
    assert r.best_params["x"] == pytest.approx(0.3)
    assert r.best_value == pytest.approx(1.0)


@pytest.mark.parametrize("algorithm", ["tpe", "cmaes", "random"])
def test_seeded_samplers_get_close_to_the_best(client, tmp_path, algorithm):
    space = {
        "x": {"type": "float", "low": 0.0, "high": 1.0},
        "y": {"type": "float", "low": 0.0, "high": 1.0},
    }
    r = tune(
        _cfg(space, algorithm=algorithm, max_trials=16, parallelism=1, seed=1),
        factory(steps=1, sleep=0),
        tmp_path / "t",
        client=client,
        log=lambda _: None,
    )
    assert abs(r.best_params["x"] - 0.3) < 0.15 and r.best_value > 0.97


def test_pruning_stops_bad_trials_and_saves_steps(client, tmp_path):
    space = {"x": {"type": "float", "low": 0.0, "high": 1.0}}
    results = {}
    for pruner in ("none", "median"):
        results[pruner] = tune(
            _cfg(
                space,
                algorithm="random",
                max_trials=10,
                parallelism=1,
                seed=3,
                pruner=pruner,
                study_name=f"p-{pruner}",
            ),
            factory(steps=10, sleep=0.05),
            tmp_path / pruner,
            client=client,
            log=lambda _: None,
        )
    none, median = results["none"], results["median"]
    assert none.counts["pruned"] == 0 and median.counts["pruned"] >= 3
    assert median.best_value == pytest.approx(none.best_value)
    assert none.trial_steps == 100
    assert median.trial_steps < none.trial_steps
    pruned = [t for t in median.trials if t["state"] == "pruned"]
    assert all(t["steps"] < 10 for t in pruned)


def test_a_failing_trial_is_tolerated(client, tmp_path):
    space = {"x": {"type": "categorical", "choices": [0.1, 0.3, 0.9]}}
    r = tune(
        _cfg(space, algorithm="grid", max_trials=3, parallelism=3, max_failed_trials=1),
        factory(steps=2, fail_above=0.5),
        tmp_path / "t",
        client=client,
        log=lambda _: None,
    )
    assert r.counts == {"complete": 2, "pruned": 0, "failed": 1}
    assert r.best_params == {"x": 0.3}


def test_too_many_failures_stop_the_sweep(client, tmp_path):
    with pytest.raises(SweepError, match="max_failed_trials: 2 trials failed") as err:
        tune(
            _cfg(GRID, algorithm="grid", max_trials=6, parallelism=1, max_failed_trials=1),
            factory(steps=1, fail_above=-1),
            tmp_path / "t",
            client=client,
            log=lambda _: None,
        )
    assert "trial 0: JAXJobFailed" in str(err.value) and "too large" in str(err.value)
    assert client.list_jobs() == []


def test_a_resumed_study_continues(client, tmp_path):
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    space = {"x": {"type": "float", "low": 0.0, "high": 1.0}}
    first = tune(
        _cfg(space, algorithm="random", max_trials=3, storage=storage, seed=0),
        factory(steps=1),
        tmp_path / "t",
        client=client,
        log=lambda _: None,
    )
    again = tune(
        _cfg(space, algorithm="random", max_trials=5, storage=storage, seed=0),
        factory(steps=1),
        tmp_path / "t",
        client=client,
        log=lambda _: None,
    )
    assert len(first.trials) == 3 and len(again.trials) == 5
    assert [t["params"] for t in again.trials[:3]] == [t["params"] for t in first.trials]


BAD_SPACES = [
    ("not json", "{x", "search_space: not valid JSON"),
    ("empty", "{}", "non-empty"),
    ("unknown type", {"lr": {"type": "normal"}}, "search_space.lr.type"),
    ("low above high", {"lr": {"type": "float", "low": 1, "high": 0}}, "search_space.lr: low"),
    ("log of zero", {"lr": {"type": "float", "low": 0, "high": 1, "log": True}}, "lr.low"),
    ("int bounds", {"n": {"type": "int", "low": 0.5, "high": 3}}, "search_space.n.low"),
    ("no choices", {"c": {"type": "categorical", "choices": []}}, "search_space.c.choices"),
    ("unknown key", {"c": {"type": "categorical", "choices": [1], "low": 0}}, "unknown keys"),
]


@pytest.mark.parametrize(("name", "space", "message"), BAD_SPACES, ids=[c[0] for c in BAD_SPACES])
def test_invalid_spaces_are_rejected(name, space, message):
    with pytest.raises(SweepError, match=message):
        parse_space(space)


def test_config_errors_name_the_setting():
    with pytest.raises(SweepError, match="algorithm:"):
        SweepConfig(space=GRID, algorithm="annealing")
    with pytest.raises(SweepError, match="cmaes cannot search categorical"):
        tune(
            SweepConfig(space={"c": {"type": "categorical", "choices": [1, 2]}}, algorithm="cmaes"),
            factory(),
            "/tmp/unused",
        )
    with pytest.raises(SweepError, match="grid search needs"):
        tune(
            SweepConfig(space={"x": {"type": "float", "low": 0, "high": 1}}, algorithm="grid"),
            factory(),
            "/tmp/unused",
        )


@pytest.mark.slow
def test_real_sweep_of_the_trainer_4_trials_2_parallel(
    tmp_path, tiny_model_dir, prepared, monkeypatch
):
    from mlflow.tracking import MlflowClient

    from kubejax.tracking import local_tracking_uri

    uri = local_tracking_uri(tmp_path)
    # As under KFP's MLflow integration: the task has its own run; the sweep nests under it.
    kfp_exp = MlflowClient(uri).create_experiment("kfp-pipeline-run")
    task_run = MlflowClient(uri).create_run(kfp_exp).info.run_id
    monkeypatch.setenv("MLFLOW_RUN_ID", task_run)
    cfg = SweepConfig(
        space={"learning_rate": {"type": "float", "low": 1e-4, "high": 3e-3, "log": True}},
        max_trials=4,
        parallelism=2,
        pruner="median",
        poll_seconds=0.2,
        study_name="real",
    )
    fixed = {
        "model": str(tiny_model_dir),
        "max_steps": 8,
        "eval_every": 4,
        "global_batch_size": 8,
        "max_length": 64,
        "max_eval_examples": 64,
        "eval_batch_size": 32,
    }
    result, parent = sweep_with_jaxjobs(
        cfg,
        data_dir=str(prepared),
        trials_root=str(tmp_path / "trials"),
        hyperparameters=fixed,
        image="local",
        backend="local",
        mlflow_tracking_uri=uri,
        mlflow_experiment="sweep",
        log=lambda _: None,
    )
    assert sum(result.counts.values()) == 4 and result.counts["failed"] == 0
    assert set(result.best_params) == {"learning_rate"}
    client = MlflowClient(uri)
    assert client.get_run(parent).data.tags["mlflow.parentRunId"] == task_run
    assert client.get_experiment_by_name("sweep") is None  # all in the task run's experiment
    runs = client.search_runs([kfp_exp])
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent]
    assert len(children) == 4
    states = sorted(r.data.tags["kubejax.trial_state"] for r in children)
    assert states.count("complete") == result.counts["complete"]
    parent_run = client.get_run(parent)
    assert parent_run.data.params["best.learning_rate"]
    assert parent_run.data.tags["kubejax.best_trial"] == str(result.best_trial)
    assert sum(r.data.tags.get("kubejax.best_trial") == "true" for r in children) == 1
    assert json.loads(json.dumps(result.best_params))


def test_a_retried_sweep_reattaches_to_a_running_trial(client, tmp_path):
    import optuna

    from kubejax.tune.controller import JOB_ATTR, OUTPUT_ATTR

    storage = f"sqlite:///{tmp_path / 'study.db'}"
    study = optuna.create_study(study_name="s", storage=storage, direction="maximize")
    trial = study.ask({"x": optuna.distributions.FloatDistribution(0.0, 1.0)})
    out = str(tmp_path / "t" / "trial-000")
    trial.set_user_attr(JOB_ATTR, "trial-0-running")
    trial.set_user_attr(OUTPUT_ATTR, out)
    # The previous controller started this trial's job, then died.
    client.create_job(factory(steps=5)(0, {"x": trial.params["x"]}, out, "trial-0-running"))
    space = {"x": {"type": "float", "low": 0.0, "high": 1.0}}
    lines = []
    r = tune(
        _cfg(space, algorithm="random", max_trials=2, storage=storage, study_name="s"),
        factory(steps=1),
        tmp_path / "t",
        client=client,
        log=lines.append,
    )
    assert any("re-attached to trial 0" in line for line in lines)
    assert [t["state"] for t in r.trials] == ["complete", "complete"]
    assert r.trials[0]["steps"] == 5


def test_trial_jobs_keep_the_users_mlflow_tags():
    from kubejax.launchers.sweep import trainer_trial_spec

    make = trainer_trial_spec(
        image="i",
        replicas=1,
        data_dir="/d",
        hyperparameters={"model": "m", "mlflow_tags": json.dumps({"team": "search"})},
    )
    args = make(3, {"learning_rate": 1e-4}, "/o", "trial-3-x").args
    tags = json.loads(args[args.index("--mlflow-tags") + 1])
    assert tags == {"team": "search", "kubejax.trial": "3", "kubejax.jaxjob": "trial-3-x"}


def test_the_tune_component_mirrors_sweep_task_and_sweep_config():
    """The component's parameters are sweep_task's, with the same defaults, and its sweep
    settings default as SweepConfig does (no hand-copied default can drift)."""
    import dataclasses
    import inspect

    from kubejax.components.tune import tune_sweep

    from kubejax.launchers.sweep import sweep_task

    artifacts = {"dataset", "trials", "report", "metrics"}
    component = {
        n: p.default
        for n, p in inspect.signature(tune_sweep.python_func).parameters.items()
        if n not in artifacts
    }
    library = {
        n: p.default
        for n, p in inspect.signature(sweep_task).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    }
    assert sorted(component) == sorted(library)
    assert component.pop("hyperparameters") == {} and library.pop("hyperparameters") is None
    assert component == library
    names = {"space": "search_space", "trial_timeout": "trial_timeout_seconds"}
    for f in dataclasses.fields(SweepConfig):
        name = names.get(f.name, f.name)
        if name in component and f.default is not dataclasses.MISSING:
            assert component[name] == f.default, f.name
