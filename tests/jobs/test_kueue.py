"""Kueue and TrainJob progress: the queue labels on both engines' jobs, a suspended job reported
queued with its Workload's reason and timed from admission (launcher and sweep), a TrainJob's
`trainerStatus` shown, all through the real kubernetes client against a FAKE API server."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from kubejax.cli import main
from kubejax.jobs.client import JAXJobClient
from kubejax.jobs.launch import run_job
from kubejax.jobs.spec import JAXJobSpec, SpecError, build_manifest
from kubejax.jobs.trainjob import build_trainjob_manifest
from kubejax.tune import SweepConfig, tune
from tests.jobs.fake_k8s import FakeKubernetes, condition, resumed

QUEUE = {"kueue.x-k8s.io/queue-name": "team-a", "kueue.x-k8s.io/priority-class": "high"}


def _spec(**kw) -> JAXJobSpec:
    return JAXJobSpec(name="train-1", image="i", command=["python"], **kw)


def _client(fake: FakeKubernetes) -> JAXJobClient:
    cfg = fake.client_configuration()
    return JAXJobClient("kubernetes", namespace="ns", client_configuration=cfg)


def test_queue_labels_land_on_both_engines_jobs_not_their_pods():
    spec = _spec(queue_name="team-a", priority_class="high", replicas=2)
    jaxjob, trainjob = build_manifest(spec), build_trainjob_manifest(spec)
    for manifest in (jaxjob, trainjob):
        assert QUEUE.items() <= manifest["metadata"]["labels"].items()
    pods = [
        jaxjob["spec"]["jaxReplicaSpecs"]["Worker"]["template"]["metadata"]["labels"],
        trainjob["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"][
            "replicatedJobs"][0]["template"]["spec"]["template"]["metadata"]["labels"],
    ]  # fmt: skip
    assert all(not set(QUEUE) & set(labels) for labels in pods)
    assert "kueue.x-k8s.io/queue-name" not in build_manifest(_spec())["metadata"]["labels"]
    with pytest.raises(SpecError, match="queue_name: 'team a' is not a Kubernetes name"):
        _spec(queue_name="team a")


def test_render_puts_the_queue_on_the_job_and_refuses_a_bad_name(capsys):
    trainer = ["--", "--model", "m", "--data-dir", "d", "--output-dir", "o"]
    flags = ["--queue-name", "team-a", "--priority-class", "high"]
    assert main(["render", *flags, *trainer]) == 0
    assert QUEUE.items() <= yaml.safe_load(capsys.readouterr().out)["metadata"]["labels"].items()
    assert main(["render", "--priority-class=-high", *trainer]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "priority_class: '-high' is not a Kubernetes name" in err


def _queued_script(kind: str, waits: int, then: list[list[dict]]) -> list[list[dict]]:
    """`waits` looks at the job held by Kueue, then `then` (after Kueue resumed it)."""
    created = [condition("Created")] if kind == "JAXJob" else []
    held = [*created, condition("Suspended", "Suspended", "held by Kueue", kind)]
    return [held] * waits + [[*created, resumed(kind), *step] for step in then]


@pytest.mark.parametrize("engine,kind", [("trainjob", "TrainJob"), ("jaxjob", "JAXJob")])
def test_fake_queued_job_says_why_and_its_timeout_starts_at_admission(engine, kind):
    """Held 1.2 s by Kueue under a timeout of 1 s, then run and done: not timed out; the
    Workload's reason is said once, and the admission."""
    done = "Complete" if kind == "TrainJob" else "Succeeded"
    running = [] if kind == "TrainJob" else [condition("Running")]
    script = _queued_script(kind, 24, [running, running, [condition(done, kind=kind)]])
    reason = ("Pending", "insufficient quota for nvidia.com/gpu in flavor default-flavor")
    with FakeKubernetes(served=(engine,), script=script, queue_reason=reason) as fake:
        lines: list[str] = []
        spec = _spec(queue_name="team-a")
        status = run_job(_client(fake), spec, timeout=1.0, polling_interval=0.05, log=lines.append)
        assert status.finished and status.state != "Failed"
        assert fake.bodies[0]["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    queued = [line for line in lines if "queued" in line]
    assert queued == [
        f"kubejax: {kind} train-1 queued: Pending: insufficient quota for nvidia.com/gpu in "
        "flavor default-flavor"
    ]
    assert f"kubejax: {kind} train-1 admitted; its timeout starts now" in lines


def test_fake_admitted_job_still_times_out_and_is_deleted():
    script = _queued_script("TrainJob", 6, [[]])  # admitted, then runs forever
    with FakeKubernetes(served=("trainjob",), script=script) as fake:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=r"did not finish in 0\.5s of running"):
            run_job(_client(fake), _spec(), timeout=0.5, polling_interval=0.05, log=None)
        assert time.monotonic() - start >= 0.5 + 6 * 0.05
        assert fake.count("DELETE", "/trainjobs/train-1") == 1


def test_fake_trainjob_progress_is_shown_as_it_changes():
    progress = {"progressPercentage": 40, "estimatedRemainingSeconds": 130,
                "metrics": [{"name": "loss", "value": "0.51"}]}  # fmt: skip
    script = [[], [], [], [condition("Complete", kind="TrainJob")]]
    with FakeKubernetes(served=("trainjob",), script=script, trainer_status=progress) as fake:
        lines: list[str] = []
        run_job(_client(fake), _spec(), timeout=30, polling_interval=0.05, log=lines.append)
    shown = [line for line in lines if "% done" in line]
    assert shown == ["kubejax: TrainJob train-1: 40% done, 2m10s left, loss=0.51"]


def test_fake_queued_sweep_submits_every_trial_and_times_them_from_admission(tmp_path):
    """With a queue, the worker budget is Kueue's: three one-worker trials go in at once under
    max_workers 1; each waits 1 s in the queue under a trial timeout of 0.6 s and completes."""
    script = _queued_script("TrainJob", 20, [[], [condition("Complete", kind="TrainJob")]])

    def make(number, params, out, name):
        # The job's output, as its trainer would leave it.
        Path(out).mkdir(parents=True, exist_ok=True)
        metrics = {"final": {"eval_accuracy": params["x"]}, "evals": [], "total_steps": 1}
        (Path(out) / "metrics.json").write_text(json.dumps(metrics))
        return JAXJobSpec(name=name, image="i", command=["python"], queue_name="team-a")

    cfg = SweepConfig(space={"x": {"type": "float", "low": 0.0, "high": 1.0}}, max_trials=3,
                      parallelism=3, max_workers=1, trial_timeout=0.6, poll_seconds=0.05,
                      pruner="none", algorithm="random")  # fmt: skip
    lines: list[str] = []
    with FakeKubernetes(served=("trainjob",), script=script) as fake:
        result = tune(cfg, make, tmp_path / "trials", client=_client(fake), log=lines.append)
        assert fake.count("POST", "/trainjobs") == 3
    assert result.counts == {"complete": 3, "pruned": 0, "failed": 0}
    assert sum("queued" in line for line in lines) == 3
    assert sum(line.endswith("admitted") for line in lines) == 3
    started = [i for i, line in enumerate(lines) if "started as job" in line]
    first_admitted = next(i for i, line in enumerate(lines) if line.endswith("admitted"))
    assert len(started) == 3 and max(started) < first_admitted
