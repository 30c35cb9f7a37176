"""tuner=ray: Ray Tune's ASHA stopping weak trials early and deleting their jobs, PBT restarting
a bottom trial from a top trial's checkpoint with a mutated learning rate, a cancelled sweep
leaving no job, and what it refuses. The trials are local jobs of a cheap program that
checkpoints and resumes as the trainer does (tests/pbt_program.py)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from kubejax.jobs.spec import JAXJobSpec
from kubejax.tune import SweepConfig, SweepError, ray_tune

PROGRAM = Path(__file__).parent / "pbt_program.py"


def factory(steps: int, sleep: float = 0.03, gate: Path | None = None):
    def make(number, params, out, name):
        args = ["--output-dir", out, "--learning-rate", str(params["learning_rate"]),
                "--steps", str(steps), "--eval-every", "2", "--sleep", str(sleep)]  # fmt: skip
        if gate is not None:
            args += ["--gate", str(gate)]
        return JAXJobSpec(name=name, image="i", command=[sys.executable, str(PROGRAM)], args=args)

    return make


@pytest.fixture(autouse=True)
def _short_ray_folder(monkeypatch):
    """Ray's sockets go under its temporary folder, and a socket's path holds at most 107
    bytes: under the folder of a pytest-xdist worker's test (/tmp/pytest-of-USER/pytest-N/
    popen-gw0/tmp0) Ray's `.../sockets/plasma_store` is longer and `ray.init` fails."""
    folder = tempfile.mkdtemp(prefix="kj-ray-", dir="/tmp")
    monkeypatch.setenv("RAY_TMPDIR", folder)
    yield
    shutil.rmtree(folder, ignore_errors=True)


SPACE = {"learning_rate": {"type": "float", "low": 0.01, "high": 0.6, "log": True}}


def _cfg(**kw) -> SweepConfig:
    kw = {"space": SPACE, "tuner": "ray", "algorithm": "random", "max_trials": 4,
          "parallelism": 4, "poll_seconds": 0.05, "study_name": "s", **kw}  # fmt: skip
    return SweepConfig(**kw)


def _program_processes(root: Path) -> list[int]:
    """Processes still running the program for a trial under `root`."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmd = (proc / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if "pbt_program.py" in cmd and str(root) in cmd:
                found.append(int(proc.name))
    return found


def _run(cfg, tmp_path, steps, grace=2, sleep=0.03, gate=None):
    return ray_tune.run(
        cfg,
        factory(steps, sleep, gate),
        str(tmp_path / "trials"),
        backend="local",
        backend_options={"log_root": str(tmp_path / "logs")},
        workers_of=lambda config: 1,
        max_steps=steps,
        grace_steps=grace,
        log=lambda _: None,
    )


class _Decisions:
    """The scheduler's decisions as it makes them, (trial id, step, decision), and a condition
    a test's thread waits on. Tune pickles the scheduler, which holds this: it pickles as a
    reference to the module's one instance (`DECISIONS`), whose lock cannot be pickled."""

    def __init__(self):
        self.made: list[tuple[str, int, str]] = []
        self.changed = threading.Condition()

    def __reduce__(self):
        return (_decisions, ())


def _decisions() -> _Decisions:
    return DECISIONS


DECISIONS = _Decisions()


def _run_in_fixed_order(cfg, tmp_path, monkeypatch, steps: int, trials: int):
    """`_run` with the results reaching the scheduler in a fixed order, whatever the machine
    runs first: each evaluation waits at a gate (tests/pbt_program.py --gate); at each
    evaluation step, once every trial still running waits there, they are released one at a
    time, the highest learning rate (the strongest trial) first, each once the scheduler has
    decided on the one before. Asynchronous halving decides on each result as it arrives, so
    its decisions are then the same on every run. Returns the trial records and the
    scheduler's decisions as (trial id, step, decision), in the order it made them."""
    gate = tmp_path / "gate"
    gate.mkdir()
    record = DECISIONS
    record.made.clear()
    decisions, decided = record.made, record.changed
    real = ray_tune.scheduler

    def recording(*args):
        sched = real(*args)
        decide = sched.on_trial_result

        def on_trial_result(controller, trial, result):
            decision = decide(controller, trial, result)
            with record.changed:
                record.made.append((trial.trial_id, result.get("step"), decision))
                record.changed.notify_all()
            return decision

        sched.on_trial_result = on_trial_result
        return sched

    monkeypatch.setattr(ray_tune, "scheduler", recording)

    def waiting(step: int) -> set[str]:
        return {p.name.split("@")[0].split("-")[1] for p in gate.glob(f"*@{step}.ready")}

    def learning_rate(trial_id: str) -> float:
        record = next((tmp_path / "trials").glob(f"trial-{trial_id}-0/trial.json"))
        return json.loads(record.read_text())["params"]["learning_rate"]

    finished, failure = threading.Event(), []

    def release() -> None:
        # The deadlines only turn a hang into a failure; nothing asserts on time.
        try:
            running: set[str] = set()  # every trial at the first evaluation
            for step in range(2, steps + 1, 2):
                deadline = time.monotonic() + 300
                while not (running <= waiting(step) if running else len(waiting(step)) == trials):
                    assert time.monotonic() < deadline, f"trials waiting at {step}: {waiting(step)}"
                    if finished.wait(0.02):  # the sweep ended (failed) before
                        return
                running = running or waiting(step)
                for trial_id in sorted(running, key=learning_rate, reverse=True):
                    (gate / f"trial-{trial_id}-0@{step}.go").touch()
                    with decided:
                        assert decided.wait_for(
                            lambda key=(trial_id, step): any(d[:2] == key for d in decisions), 300
                        ), f"no decision on {trial_id} at step {step}"
                stopped = {d[0] for d in decisions if d[2] == "STOP" and d[1] < steps}
                running -= stopped
        except BaseException as err:  # let the sweep end, then fail the test
            failure.append(err)
            while not finished.wait(0.05):
                for ready in gate.glob("*.ready"):
                    ready.with_suffix(".go").touch()

    thread = threading.Thread(target=release, daemon=True)
    thread.start()
    try:
        records, _ = _run(cfg, tmp_path, steps=steps, sleep=0.0, gate=gate)
    finally:
        finished.set()
        thread.join()
    if failure:
        raise failure[0]
    return records, list(decisions)


@pytest.mark.slow
def test_asha_stops_the_weak_trials_early_and_deletes_their_jobs(tmp_path, monkeypatch):
    cfg = _cfg(scheduler="asha", max_trials=6, parallelism=6, reduction_factor=3, seed=3)
    trials, decisions = _run_in_fixed_order(cfg, tmp_path, monkeypatch, steps=12, trials=6)
    states = sorted(t["state"] for t in trials)
    assert len(trials) == 6 and "complete" in states and "pruned" in states, trials
    stopped = {d[0] for d in decisions if d[2] == "STOP" and d[1] < 12}
    assert stopped == {t["trial_id"] for t in trials if t["state"] == "pruned"}, decisions
    best = max((t for t in trials if t["state"] == "complete"), key=lambda t: t["value"])
    for t in trials:
        if t["state"] == "pruned":  # stopped at a rung, below the best at that rung
            assert t["steps"] < 12
            rung = str(t["steps"])
            assert t["intermediate"][rung] < best["intermediate"][rung]
        else:
            assert t["steps"] == 12
    assert _program_processes(tmp_path) == []


@pytest.mark.slow
def test_pbt_restarts_a_bottom_trial_from_a_top_trials_checkpoint(tmp_path):
    """A trial restarted by PBT resumes from its donor's checkpoint: its job's first step is
    past 0, its folder holds the donor's checkpoint of that step, and it trains with the
    mutated learning rate."""
    cfg = _cfg(scheduler="pbt", perturbation_interval=2, pbt_mutations="learning_rate", seed=0)
    # Trials long enough to run side by side (Ray starts them one by one, and PBT compares a
    # trial only with the population still running): 6 s each, so that a start delayed by a
    # busy machine still overlaps the others.
    trials, _ = _run(cfg, tmp_path, steps=24, sleep=0.25)
    exploits = [
        (t, i)
        for t in trials
        for i, run in enumerate(t["history"])
        if run["donor"]
        and not Path(run["donor"]).name.startswith(f"trial-{t['trial_id']}-")
        and run["start_step"] < 24
    ]  # restarts from another trial's checkpoint (PBT also pauses and resumes trials)
    assert exploits, [t["history"] for t in trials]
    t, i = exploits[0]
    before, after = t["history"][i - 1], t["history"][i]
    assert after["start_step"] > 0
    assert after["params"]["learning_rate"] != before["params"]["learning_rate"]
    run_dir = next((tmp_path / "trials").glob(f"trial-{t['trial_id']}-{i}"))
    assert (run_dir / "checkpoints" / str(after["start_step"]) / "state.json").is_file()
    donor_state = Path(after["donor"]) / "checkpoints" / str(after["start_step"]) / "state.json"
    assert (run_dir / "checkpoints" / str(after["start_step"]) / "state.json").read_text() == (
        donor_state.read_text()
    )
    rows = json.loads((run_dir / "metrics.json").read_text())["train"]
    assert rows[0]["step"] == after["start_step"] + 1
    assert rows[0]["learning_rate"] == pytest.approx(after["params"]["learning_rate"])
    assert all(t["state"] == "complete" for t in trials), [t["state"] for t in trials]
    # Every start's job was deleted, those PBT paused too (their function stopped without its
    # finally; the next start, or the sweep's end, deletes them).
    starts = list((tmp_path / "trials").glob("trial-*/trial.json"))
    assert all("end" in json.loads(p.read_text()) for p in starts)
    assert _program_processes(tmp_path) == []


def test_pbt_copies_the_pointed_checkpoint_or_the_donors_latest_when_it_is_gone(tmp_path):
    """A donor's job keeps its last `keep_checkpoints` only: when PBT exploits it after the
    pointed checkpoint was deleted, the restart copies the donor's latest and starts there."""
    from kubejax.tune.ray_tune import copy_donor_checkpoint

    donor = tmp_path / "donor"
    for step in (32, 40):
        (donor / "checkpoints" / str(step)).mkdir(parents=True)
        (donor / "checkpoints" / str(step) / "state").write_text(str(step))
    (donor / "checkpoints" / "48.orbax-checkpoint-tmp-1").mkdir()  # still being written
    assert copy_donor_checkpoint(donor, 32, tmp_path / "a") == 32
    assert copy_donor_checkpoint(donor, 24, tmp_path / "b") == 40
    assert (tmp_path / "b" / "checkpoints" / "40" / "state").read_text() == "40"
    assert [p.name for p in (tmp_path / "b" / "checkpoints").iterdir()] == ["40"]
    with pytest.raises(FileNotFoundError, match="no checkpoint left"):
        copy_donor_checkpoint(tmp_path / "gone", 24, tmp_path / "c")


def test_a_trial_is_matched_to_its_result_by_its_folder_not_its_metrics(tmp_path):
    """Tune's Result of a trial PBT restored can carry its donor's `trial_id` in its metrics:
    each trial's record still takes its own Result (complete, its value), none is failed."""
    from types import SimpleNamespace

    from kubejax.tune.ray_tune import records

    results = []
    for n, trial_id in enumerate(("ab123_00000", "ab123_00001")):
        out = tmp_path / "trials" / f"trial-{trial_id}-0"
        out.mkdir(parents=True)
        (out / "trial.json").write_text(json.dumps(
            {"trial_id": trial_id, "params": {"learning_rate": 0.1}, "job": f"j{n}",
             "restart": 0, "donor": "", "start_step": 0, "start": n, "end": n + 1}))  # fmt: skip
        evals = [{"step": 4, "eval_accuracy": 0.5 + n / 10}]
        (out / "metrics.json").write_text(json.dumps({"status": "completed", "evals": evals}))
        ray_dir = tmp_path / "ray" / f"run_{trial_id}_{n}_learning_rate=0.1_2026-12-06"
        # The second trial's metrics name the first (its donor's checkpoint's result).
        results.append(SimpleNamespace(path=str(ray_dir), error=None,
                                       metrics={"trial_id": "ab123_00000"}))  # fmt: skip
    trials = records(_cfg(scheduler="pbt"), str(tmp_path / "trials"), results, lambda c: 1)
    assert [(t["trial_id"], t["state"], t["value"]) for t in trials] == [
        ("ab123_00000", "complete", 0.5),
        ("ab123_00001", "complete", 0.6),
    ]


@pytest.mark.slow
def test_a_cancelled_ray_sweep_leaves_no_job(tmp_path):
    cfg = _cfg(scheduler="none", max_trials=2, parallelism=2)

    ended = threading.Event()

    def cancel_once_a_job_runs():  # SIGTERM, as KFP sends a cancelled run's step
        # Only while this test's sweep runs: a stray SIGTERM would end a later test.
        while not ended.wait(0.1):
            if _program_processes(tmp_path):
                signal.raise_signal(signal.SIGTERM)
                return

    threading.Thread(target=cancel_once_a_job_runs, daemon=True).start()
    try:
        with pytest.raises(SystemExit) as exit_:
            _run(cfg, tmp_path, steps=400)
    finally:
        ended.set()
    assert exit_.value.code == 143
    assert list((tmp_path / "trials").glob("trial-*/trial.json"))  # trials had started
    assert _program_processes(tmp_path) == []


def test_what_the_ray_path_cannot_run_is_refused(monkeypatch):
    for kw, expected in [
        ({"algorithm": "cmaes"}, r"algorithm: 'cmaes' is not one of random, grid, tpe"),
        ({"scheduler": "pbt", "pbt_mutations": "weight_decay"},
         "pbt_mutations: weight_decay is not in search_space"),
        ({"space": {**SPACE, "x": {"type": "float", "low": 0, "high": 1,
                                   "when": {"learning_rate": 0.1}}}},
         "search_space.x.when: tuner=ray has no conditional dimensions"),
    ]:  # fmt: skip
        with pytest.raises(SweepError, match=expected):
            ray_tune.check_sweep(_cfg(**kw))
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(SweepError) as err:
        ray_tune.check_sweep(_cfg())
    assert str(err.value).endswith("install it with pip install 'kubejax[ray]'")
    assert os.environ.get("RAY_ADDRESS") is None  # nothing was started


@pytest.mark.slow
def test_fake_cluster_ray_sweep_runs_trainjob_trials_and_deletes_them(tmp_path, monkeypatch):
    """The launcher's Ray path on a cluster backend: each trial a TrainJob (rendered with the
    trial's settings) that the trial deletes when it ends; the Optuna path's outputs."""
    from kubejax.launchers.sweep import sweep_with_jaxjobs
    from tests.jobs.fake_k8s import FakeKubernetes, condition
    from tests.test_katib import _kubeconfig

    def trainer(body):  # what the trial's trainer leaves in its output folder
        args = body["spec"]["trainer"]["args"]
        out = Path(args[args.index("--output-dir") + 1])
        lr = float(args[args.index("--learning-rate") + 1])
        evals = [{"step": 5, "eval_accuracy": lr}, {"step": 10, "eval_accuracy": 2 * lr}]
        (out / "metrics.json").write_text(json.dumps(
            {"status": "completed", "step": 10, "total_steps": 10, "evals": evals}))  # fmt: skip

    script = [[], [], [condition("Complete", kind="TrainJob")]]
    with FakeKubernetes(served=("trainjob",), script=script) as fake:
        fake.on_job = trainer
        monkeypatch.setenv("KUBECONFIG", _kubeconfig(tmp_path, fake.host))
        cfg = _cfg(max_trials=2, parallelism=2, scheduler="asha")
        result, _ = sweep_with_jaxjobs(
            cfg, data_dir="/ws/data", trials_root=str(tmp_path / "trials"),
            hyperparameters={"model": "m", "max_steps": 10, "eval_every": 5},
            backend="kubernetes", log=lambda _: None,
        )  # fmt: skip
        assert fake.count("POST", "/trainjobs") == 2 and fake.count("DELETE", "/trainjobs/") == 2
    assert result.counts == {"complete": 2, "pruned": 0, "failed": 0}
    best = max(result.trials, key=lambda t: t["value"])
    assert result.best_params == best["params"] and result.best_value == best["value"]
    assert best["value"] == pytest.approx(2 * best["params"]["learning_rate"])


@pytest.mark.slow
def test_the_defaults_trial_runs_first_and_asha_never_stops_it(tmp_path, monkeypatch):
    """Ray's search evaluates the defaults' point first (`points_to_evaluate`): trial 0, marked;
    at learning rate 0.01 it is the weakest, and its results reach ASHA after every stronger
    trial's (a fixed order), yet ASHA lets it run to the end (the reference the sweep's choice
    weighs the others against)."""
    from kubejax.tune.controller import SweepResult, decide

    cfg = _cfg(scheduler="asha", max_trials=6, parallelism=6, reduction_factor=3, seed=3,
               defaults={"learning_rate": 0.01})  # fmt: skip
    trials, decisions = _run_in_fixed_order(cfg, tmp_path, monkeypatch, steps=12, trials=6)
    assert len(trials) == 6 and trials[0]["number"] == 0 and trials[0].get("defaults"), trials
    assert trials[0]["params"] == {"learning_rate": 0.01}
    assert not any(t.get("defaults") for t in trials[1:])
    assert trials[0]["state"] == "complete" and trials[0]["steps"] == 12, trials[0]
    # At the first rung its result came last, after stronger ones ASHA stopped: spared.
    first_rung = [d for d in decisions if d[1] == 2]
    assert first_rung[-1] == (trials[0]["trial_id"], 2, "CONTINUE"), first_rung
    assert any(d[2] == "STOP" for d in first_rung[:-1]), first_rung
    assert any(t["state"] == "pruned" for t in trials), trials
    best = max((t for t in trials if t["state"] == "complete"), key=lambda t: t["value"])
    result = decide(SweepResult(best["params"], best["value"], best["number"], trials), cfg)
    assert result.defaults_trial == 0 and result.choice == "best" and result.gain > 0


@pytest.mark.slow
def test_a_ray_grid_runs_the_defaults_then_the_whole_grid(tmp_path):
    cfg = _cfg(algorithm="grid", max_trials=8, parallelism=3, defaults={"learning_rate": 0.3},
               space={"learning_rate": {"type": "categorical", "choices": [0.1, 0.5]}})  # fmt: skip
    trials, _ = _run(cfg, tmp_path, steps=4)
    assert trials[0]["params"]["learning_rate"] == 0.3 and trials[0]["defaults"]
    assert sorted(t["params"]["learning_rate"] for t in trials) == [0.1, 0.3, 0.5]
