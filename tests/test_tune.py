"""The sweep: search, pruning, failures, resume, bad spaces, and a real sweep of the trainer."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import pytest

from kubejax.jobs.client import JAXJobClient
from kubejax.jobs.spec import JAXJobSpec
from kubejax.launchers.sweep import sweep_with_jaxjobs
from kubejax.tune import SweepConfig, SweepError, parse_space, tune

PROGRAM = Path(__file__).parent / "trial_program.py"


def factory(steps=10, fail_above=2.0, sleep=0.02):
    def make(number, params, out, name):
        params = dict(params)
        replicas = int(params.pop("replicas", 1))
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
        command = [sys.executable, str(PROGRAM)]
        return JAXJobSpec(name=name, image="i", command=command, args=args, replicas=replicas)

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


def test_a_trial_hanging_past_its_timeout_fails_and_its_job_is_deleted(client, tmp_path):
    space = {"x": {"type": "categorical", "choices": [0.1, 0.3, 0.9]}}
    quick = factory(steps=2)

    def hang_at_09(number, params, out, name):
        spec = quick(number, params, out, name)
        if params["x"] == 0.9:  # this trial never finishes on its own
            spec.args[spec.args.index("--sleep") + 1] = "600"
        return spec

    started = time.monotonic()
    r = tune(
        _cfg(space, algorithm="grid", max_trials=3, parallelism=3, trial_timeout=3),
        hang_at_09,
        tmp_path / "t",
        client=client,
        log=lambda _: None,
    )
    assert time.monotonic() - started < 60
    assert r.counts == {"complete": 2, "pruned": 0, "failed": 1}
    hung = next(t for t in r.trials if t["state"] == "failed")
    assert hung["params"] == {"x": 0.9}
    assert client.list_jobs() == []  # its job (and worker process) deleted


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
    # (Its artifacts in tmp_path, as a server's own root would hold them: MLflow's default for
    # an sqlite store is ./mlruns of the working directory, the repository's.)
    kfp_exp = MlflowClient(uri).create_experiment(
        "kfp-pipeline-run", artifact_location=(tmp_path / "kfp-artifacts").as_uri()
    )
    task_run = MlflowClient(uri).create_run(kfp_exp).info.run_id
    monkeypatch.setenv("MLFLOW_RUN_ID", task_run)
    # KFP sets the task's server beside its run (another test's server may linger in this
    # process's environment).
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
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
        "bucket_multiple": 64,
        "max_eval_examples": 64,
        "eval_batch_size": 32,
    }
    lines: list[str] = []
    result, parent = sweep_with_jaxjobs(
        cfg,
        data_dir=str(prepared),
        trials_root=str(tmp_path / "trials"),
        hyperparameters=fixed,
        image="local",
        backend="local",
        mlflow_tracking_uri=uri,
        mlflow_experiment="sweep",
        default_settings={"learning_rate": 5e-3},  # the final training's, outside the space
        log=lines.append,
    )
    assert sum(result.counts.values()) == 4 and result.counts["failed"] == 0
    assert set(result.best_params) == {"learning_rate"}
    # The final training's setting ran first (the range widened to hold it), every trial's
    # evaluation scored 64 examples with its standard error, and the choice is in the log.
    assert result.defaults_trial == 0 and result.trials[0]["params"] == {"learning_rate": 5e-3}
    assert any("widened to [0.0001, 0.005]" in line for line in lines)
    first = result.trials[0]
    assert first["eval_examples"] == 64
    assert first["se"] == pytest.approx(math.sqrt(first["value"] * (1 - first["value"]) / 64))
    assert any(line == f"sweep: {result.reason}" for line in lines)
    assert result.chosen_params == (
        {"learning_rate": 5e-3} if result.choice == "defaults" else result.best_params
    )
    client = MlflowClient(uri)
    assert parent == task_run  # the sweep logs into the task's run, left running for KFP
    assert client.get_run(parent).info.status == "RUNNING"
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
    assert parent_run.data.metrics["defaults_value"] == first["value"]
    assert parent_run.data.tags["kubejax.sweep_choice"] == result.choice


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
    assert tags == {"team": "search", "kubejax.trial": "3", "kubejax.jobs": "trial-3-x"}


def test_the_tune_component_mirrors_sweep_task_and_sweep_config():
    """The component's parameters are sweep_task's, with the same defaults, and its sweep
    settings default as SweepConfig does (no hand-copied default can drift)."""
    import dataclasses
    import inspect

    from kubejax.components.tune import tune_sweep

    from kubejax.launchers.sweep import sweep_task

    artifacts = {"dataset", "trials", "report", "summary", "metrics"}
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
    for name in ("hyperparameters", "default_settings"):
        assert component.pop(name) == {} and library.pop(name) is None
    assert component == library
    names = {"space": "search_space", "trial_timeout": "trial_timeout_seconds"}
    for f in dataclasses.fields(SweepConfig):
        name = names.get(f.name, f.name)
        if name in component and f.default is not dataclasses.MISSING:
            assert component[name] == f.default, f.name


def _peak_workers(trials: list[dict]) -> int:
    """The most workers running at once, from the trials' job start and end times."""
    events = sorted(
        [(t["start"], t["workers"]) for t in trials] + [(t["end"], -t["workers"]) for t in trials],
        key=lambda e: (e[0], e[1]),  # an end before a start at the same instant
    )
    peak = running = 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    return peak


def test_trials_on_different_worker_counts_stay_within_the_worker_budget(client, tmp_path):
    space = {
        "x": {"type": "float", "low": 0.0, "high": 1.0},
        "replicas": {"type": "categorical", "choices": [1, 2, 3]},
    }
    cfg = _cfg(space, algorithm="random", max_trials=10, parallelism=3, max_workers=3, seed=3)
    r = tune(cfg, factory(steps=3, sleep=0.05), tmp_path / "t", client=client, log=lambda _: None)
    assert r.counts["complete"] == 10
    assert {t["workers"] for t in r.trials} == {1, 2, 3}
    assert all(t["workers"] == t["params"]["replicas"] for t in r.trials)
    assert _peak_workers(r.trials) <= 3
    assert all(t["worker_seconds"] > 0 for t in r.trials)


def test_a_space_whose_trials_cannot_fit_the_budget_is_refused():
    space = {"replicas": {"type": "int", "low": 1, "high": 4}}
    with pytest.raises(SweepError, match="max_workers: 2 is below the 4 workers"):
        SweepConfig(space=space, max_workers=2)
    with pytest.raises(SweepError, match=r"search_space\.replicas: workers per trial"):
        parse_space({"replicas": {"type": "categorical", "choices": [1, 0.5]}})


def test_conditional_dimensions_exist_only_where_they_apply(client, tmp_path):
    space = {
        "kind": {"type": "categorical", "choices": ["a", "b"]},
        "x": {"type": "float", "low": 0.0, "high": 1.0, "when": {"kind": "b"}},
    }
    r = tune(
        _cfg({**space}, algorithm="random", max_trials=8, parallelism=2, seed=0),
        lambda n, params, out, name: factory(steps=1)(n, {"x": params.get("x", 0.9)}, out, name),
        tmp_path / "t",
        client=client,
        log=lambda _: None,
    )
    kinds = {t["params"]["kind"] for t in r.trials}
    assert kinds == {"a", "b"}
    for t in r.trials:
        assert ("x" in t["params"]) == (t["params"]["kind"] == "b")
    with pytest.raises(SweepError, match=r"search_space.x.when: 'kind' is not an entry above"):
        parse_space({"x": space["x"], "kind": space["kind"]})
    with pytest.raises(SweepError, match=r"search_space.x.when.kind: 'c' is not one of"):
        parse_space({"kind": space["kind"], "x": {**space["x"], "when": {"kind": "c"}}})
    with pytest.raises(SweepError, match="grid search runs every combination"):
        SweepConfig(space=space, algorithm="grid")


@pytest.mark.slow
def test_a_sweep_over_optimizers_and_replicas_feeds_the_final_training(
    tmp_path, tiny_model_dir, prepared
):
    """Trainer trials on 1 or 2 workers, with AdamW or Lion (Lion's b1 only for Lion), within
    a budget of 2 workers; the best params, replicas included, reach the final training."""
    from kubejax.launchers.train import train_task

    space = {
        "optimizer": {"type": "categorical", "choices": ["adamw", "lion"]},
        "b1": {"type": "float", "low": 0.85, "high": 0.95, "when": {"optimizer": "lion"}},
        "learning_rate": {"type": "float", "low": 1e-4, "high": 3e-3, "log": True},
        "replicas": {"type": "categorical", "choices": [1, 2]},
    }
    cfg = SweepConfig(
        space=space,
        algorithm="random",
        max_trials=3,  # the defaults (adamw on 1 worker), then seed 4 draws adamw, lion on 2
        parallelism=2,
        max_workers=2,
        pruner="none",
        seed=4,
        poll_seconds=0.2,
        study_name="resources",
    )
    fixed = {
        "model": str(tiny_model_dir),
        "max_steps": 4,
        "global_batch_size": 8,
        "max_length": 64,
        "bucket_multiple": 64,
        "max_eval_examples": 32,
        "eval_batch_size": 32,
    }
    result, _ = sweep_with_jaxjobs(
        cfg,
        data_dir=str(prepared),
        trials_root=str(tmp_path / "trials"),
        hyperparameters=fixed,
        image="local",
        backend="local",
        log=lambda _: None,
    )
    assert result.counts["complete"] == 3
    assert result.trials[0]["defaults"] and result.trials[0]["workers"] == 1
    assert result.trials[0]["params"]["optimizer"] == "adamw"
    assert {t["workers"] for t in result.trials} == {1, 2}
    assert {t["params"]["optimizer"] for t in result.trials} == {"adamw", "lion"}
    assert all(("b1" in t["params"]) == (t["params"]["optimizer"] == "lion") for t in result.trials)
    assert _peak_workers(result.trials) <= 2
    outcome = train_task(
        str(prepared),
        str(tmp_path / "model"),
        base_model=str(tiny_model_dir),
        hyperparameters={k: v for k, v in fixed.items() if k != "model"},
        best_params=result.best_params,
        mlflow_tracking_uri="",
        backend="local",
    )
    workers = {k for k in outcome.metrics if k.endswith("_peak_rss_mb")}
    assert len(workers) == result.best_params["replicas"]


def test_trial_jobs_take_booleans_and_their_own_worker_count():
    from kubejax.launchers.sweep import trainer_trial_spec

    make = trainer_trial_spec(
        image="i", replicas=1, data_dir="/d", hyperparameters={"model": "m", "optimizer": "sgd"}
    )
    spec = make(0, {"nesterov": True, "momentum": 0.8, "replicas": 2}, "/o", "trial-0-x")
    assert "--nesterov" in spec.args and spec.replicas == 2
    assert "--replicas" not in spec.args
    # Trials are never resumed and their model is not used: no final checkpoint, no export,
    # unless the fixed settings ask for them.
    assert "--no-save-final" in spec.args
    keep = trainer_trial_spec(
        image="i", replicas=1, data_dir="/d", hyperparameters={"model": "m", "save_final": True}
    )
    assert "--save-final" in keep(1, {}, "/o", "trial-1-x").args


@pytest.mark.slow
def test_a_trial_whose_loss_diverges_fails_and_the_sweep_goes_on(
    tmp_path, tiny_model_dir, prepared
):
    """SGD at a learning rate of 1e8 without clipping: that trial's loss becomes non-finite, the
    trainer stops naming the step, the trial is marked failed (its MLflow run FAILED, with the
    non-finite loss logged) and the others complete."""
    from mlflow.tracking import MlflowClient

    from kubejax.tracking import local_tracking_uri

    uri = local_tracking_uri(tmp_path)
    cfg = SweepConfig(
        space={"learning_rate": {"type": "categorical", "choices": [0.05, 1e8]}},
        algorithm="grid",
        max_trials=3,  # the defaults' (the trainer's 5e-5, joining the choices), then the grid
        parallelism=2,
        pruner="none",
        poll_seconds=0.2,
        study_name="nan",
    )
    fixed = {
        "model": str(tiny_model_dir),
        "optimizer": "sgd",
        "max_grad_norm": 0,
        "warmup_ratio": 0.0,
        "max_steps": 6,
        "global_batch_size": 8,
        "max_length": 64,
        "bucket_multiple": 64,
        "max_eval_examples": 32,
        "eval_batch_size": 32,
    }
    lines = []
    result, parent = sweep_with_jaxjobs(
        cfg,
        data_dir=str(prepared),
        trials_root=str(tmp_path / "trials"),
        hyperparameters=fixed,
        image="local",
        backend="local",
        mlflow_tracking_uri=uri,
        mlflow_experiment="nan",
        log=lines.append,
    )
    assert result.counts == {"complete": 2, "pruned": 0, "failed": 1}
    failed = next(t for t in result.trials if t["state"] == "failed")
    assert failed["params"]["learning_rate"] == 1e8
    assert any("training stopped" in line and "at step" in line for line in lines), lines
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("nan").experiment_id])
    trial_runs = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent]
    bad = next(r for r in trial_runs if r.data.tags.get("kubejax.trial_state") == "failed")
    assert bad.info.status == "FAILED"
    losses = [m.value for m in client.get_metric_history(bad.info.run_id, "loss")]
    assert losses and not all(math.isfinite(v) for v in losses)


def test_trials_the_devices_cannot_run_are_pruned_before_they_start(client, tmp_path):
    """A point whose memory plan does not fit (`InfeasibleError` from the trial's spec) is
    pruned without a job, its reason in the trial's line and record; the failure budget stays
    whole (max_failed_trials 0) and the other points run."""
    from kubejax.errors import InfeasibleError

    runs = factory(steps=2)

    def make(number, params, out, name):
        if params["x"] > 0.5:
            raise InfeasibleError("device_memory: the run needs 9.00 GiB per device, more ...")
        return runs(number, params, out, name)

    lines = []
    space = {"x": {"type": "categorical", "choices": [0.2, 0.9, 0.4]}}
    result = tune(_cfg(space, algorithm="grid", max_trials=3, max_failed_trials=0), make,
                  tmp_path / "t", client=client, log=lines.append)  # fmt: skip
    assert result.counts == {"complete": 2, "pruned": 1, "failed": 0}
    (skipped,) = [t for t in result.trials if t["state"] == "pruned"]
    assert skipped["params"] == {"x": 0.9} and skipped["job"] == "" and skipped["steps"] == 0
    assert skipped["skipped"].startswith("device_memory: the run needs 9.00 GiB")
    assert any("trial 1 pruned before it started: device_memory" in line for line in lines)


def test_a_space_none_of_whose_points_fits_the_devices_is_refused(tmp_path):
    """Before any job or MLflow run: even the point with the most resources needs more memory
    than the device has."""
    from kubejax.errors import InfeasibleError

    scratch = json.dumps(
        {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
         "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 2000}
    )  # fmt: skip
    fixed = {"model": "scratch", "tokenizer": "-", "scratch_config": scratch,
             "device_memory": "20MiB", "max_length": 256}  # fmt: skip
    space = {"learning_rate": {"type": "float", "low": 1e-4, "high": 1e-3},
             "replicas": {"type": "int", "low": 1, "high": 2}}  # fmt: skip
    with pytest.raises(InfeasibleError, match=r"search_space: no point can run, not even "):
        sweep_with_jaxjobs(_cfg(space), data_dir=str(tmp_path), trials_root=str(tmp_path / "t"),
                           hyperparameters=fixed, backend="local")  # fmt: skip
    assert not (tmp_path / "t").exists()


# ---------------------------------------------------------------------------------------------
# The defaults as the study's first trial, and what the sweep keeps


def test_the_defaults_run_first_and_are_kept_when_best(client, tmp_path):
    """x=0.3 is the objective's peak: the defaults' trial is trial 0, the best, and what the
    final training takes; the others searched after it."""
    space = {"x": {"type": "float", "low": 0.0, "high": 1.0}}
    r = tune(
        _cfg(space, algorithm="random", max_trials=4, parallelism=2, defaults={"x": 0.3}),
        factory(steps=2),
        tmp_path / "t",
        client=client,
        log=lambda _: None,
    )
    assert r.trials[0]["number"] == 0 and r.trials[0]["params"] == {"x": 0.3}
    assert r.trials[0]["defaults"] and not any(t.get("defaults") for t in r.trials[1:])
    assert len(r.trials) == 4 and r.best_trial == 0 and r.defaults_trial == 0
    assert r.choice == "defaults" and r.gain == 0.0 and r.chosen_params == {"x": 0.3}
    assert "the defaults' trial 0 is the best" in r.reason


def test_a_better_trial_replaces_the_defaults(client, tmp_path):
    space = {"x": {"type": "categorical", "choices": [0.9, 0.3]}}
    r = tune(
        _cfg(space, algorithm="grid", max_trials=5, parallelism=1, defaults={"x": 0.9}),
        factory(steps=2),
        tmp_path / "t",
        client=client,
        log=lambda _: None,
    )
    # The grid holds the defaults' point once: defaults first, then the rest of the grid.
    assert [t["params"]["x"] for t in r.trials] == [0.9, 0.3]
    assert r.choice == "best" and r.chosen_params == {"x": 0.3}
    assert r.gain == pytest.approx((1 - 0.0) - (1 - 0.36))  # 1 - (x-0.3)^2 at 0.3 and 0.9


def _result(best: float, defaults: float, n: int | None, direction="maximize"):
    from kubejax.tune.controller import SweepResult, decide

    trials = [
        {"number": 0, "state": "complete", "value": defaults, "params": {"x": 1},
         "defaults": True},
        {"number": 1, "state": "complete", "value": best, "params": {"x": 2}},
    ]  # fmt: skip
    cfg = _cfg({"x": {"type": "int", "low": 0, "high": 3}}, eval_examples=n or 0,
               direction=direction)  # fmt: skip
    pick = max if direction == "maximize" else min
    top = pick(trials, key=lambda t: t["value"])
    return decide(SweepResult(top["params"], top["value"], top["number"], trials), cfg)


@pytest.mark.parametrize(
    ("best", "defaults", "n", "choice"),
    [
        # 0.80 vs 0.77 on 256 examples: se 0.025 and 0.026, the difference's 0.036; a gain
        # of 0.03 is 0.8 of it: noise. On 4,000 examples (difference's se 0.0092): 3.3.
        (0.80, 0.77, 256, "defaults"),
        (0.80, 0.77, 4000, "best"),
        (0.80, 0.77, None, "best"),  # no standard error known: any gain
        (0.70, 0.77, 256, "defaults"),  # the defaults are the best
    ],
)
def test_a_gain_within_two_standard_errors_keeps_the_defaults(best, defaults, n, choice):
    r = _result(best, defaults, n)
    assert r.choice == choice, r.reason
    assert r.defaults_trial == 0 and r.gain == pytest.approx(max(best, defaults) - defaults)
    if n and best > defaults:
        se = math.hypot(math.sqrt(0.8 * 0.2 / n), math.sqrt(0.77 * 0.23 / n))
        assert r.gain_se == pytest.approx(se) and r.trials[1]["se"] > 0
    else:
        assert r.gain_se is None and (r.trials[1]["se"] is None) == (n is None)
    assert r.chosen_params == ({"x": 1} if choice == "defaults" else {"x": 2})
    if choice == "defaults" and best > defaults:
        assert "within 2 standard errors" in r.reason and "keeps the defaults" in r.reason


def test_the_gain_of_a_minimised_objective_is_the_decrease():
    r = _result(0.5, 0.9, None, direction="minimize")
    assert r.gain == pytest.approx(0.4) and r.choice == "best"


def test_defaults_outside_the_space_join_it_and_unknown_names_are_refused():
    from kubejax.launchers.sweep import check_space_settings
    from kubejax.tune.space import default_point

    space = parse_space({
        "learning_rate": {"type": "float", "low": 1e-4, "high": 1e-3, "log": True},
        "lora_rank": {"type": "categorical", "choices": [8, 16]},
        "b1": {"type": "float", "low": 0.8, "high": 0.9, "when": {"lora_rank": 16}},
    })  # fmt: skip
    point, widened, notes = default_point(space, {"learning_rate": 2e-3, "lora_rank": 32.0})
    assert point == {"learning_rate": 2e-3, "lora_rank": 32.0}  # b1 applies only at rank 16
    assert widened["learning_rate"]["high"] == 2e-3 and widened["lora_rank"]["choices"][-1] == 32
    assert len(notes) == 2 and "joins the choices" in notes[1]
    point, widened, notes = default_point(space, {"learning_rate": 5e-4, "lora_rank": 16.0,
                                                  "b1": 0.85})  # fmt: skip
    assert point == {"learning_rate": 5e-4, "lora_rank": 16, "b1": 0.85} and not notes
    assert isinstance(point["lora_rank"], int)  # the choice itself, as Optuna stores it
    with pytest.raises(SweepError, match=r"^search_space\.lora_ranks: not a setting the trainer"):
        check_space_settings({"lora_ranks": {"type": "int", "low": 1, "high": 2}})
    check_space_settings({"lora_rank": {}, "replicas": {}})


def test_a_space_naming_no_trainer_setting_exits_2_before_any_trial(tmp_path, capsys):
    from kubejax.cli import main

    space = {"learning_rat": {"type": "float", "low": 1e-5, "high": 1e-4}}
    argv = ["tune", "--data-dir", str(tmp_path), "--model", "m", "--output-dir",
            str(tmp_path / "o"), "--space", json.dumps(space)]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "search_space.learning_rat: not a setting the trainer takes" in err[0]
    assert not (tmp_path / "o" / "trials").exists()
