"""The local JAXJob backend: the operator's env contract, group restarts, backoff, deadlines,
and no process left behind."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from kubejax.jobs.client import FAILED, RESTARTING, SUCCEEDED, JAXJobClient, JobFailedError
from kubejax.jobs.launch import run_job
from kubejax.jobs.spec import JAXJobSpec
from tests.helpers import tiny_args, trainer_cmd


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0): read its state.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _kill_and_check_workers_die(launcher, pids: list[int]) -> None:
    """SIGKILL the launcher process; its workers must be gone within 10 s."""
    import signal

    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids)


def _pids(client, name: str, n: int) -> list[int]:
    """The job's worker pids, once all `n` workers have started."""
    deadline = time.monotonic() + 30
    while len(pids := client._backend.worker_pids(name)) < n:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return pids


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


@pytest.fixture
def client(tmp_path):
    c = JAXJobClient("local", log_root=tmp_path / "logs")
    yield c
    c.close()


def test_workers_get_the_operator_environment(client, tmp_path):
    code = (
        "import json, os; print(json.dumps({k: os.environ[k] for k in ('COORDINATOR_ADDRESS',"
        " 'COORDINATOR_PORT', 'NUM_PROCESSES', 'PROCESS_ID', 'PYTHONUNBUFFERED', 'EXTRA')}))"
    )
    spec = JAXJobSpec(name="env", image="i", command=_py(code), replicas=3, env={"EXTRA": "x"})
    status = run_job(client, spec, timeout=30, polling_interval=0.05, delete="never", log=None)
    assert status.state == SUCCEEDED
    envs = [json.loads(next(iter(client.get_job_logs("env", worker=i)))) for i in range(3)]
    assert [e["PROCESS_ID"] for e in envs] == ["0", "1", "2"]
    assert {e["NUM_PROCESSES"] for e in envs} == {"3"}
    assert {e["COORDINATOR_ADDRESS"] for e in envs} == {"127.0.0.1"}
    assert len({e["COORDINATOR_PORT"] for e in envs}) == 1
    assert {e["PYTHONUNBUFFERED"] for e in envs} == {"1"} and envs[0]["EXTRA"] == "x"
    types = [c["type"] for c in client.get_job("env").conditions]
    assert types == ["Created", "Running", "Succeeded"]


@pytest.mark.parametrize(("contract", "key", "port"), [("jaxjob", "COORDINATOR_PORT", "6666"),
                          ("trainjob", "JAX_COORDINATOR_ADDRESS", "127.0.0.1:29500")])  # fmt: skip
def test_one_worker_opens_no_socket_for_a_port_it_never_uses(tmp_path, monkeypatch, contract,
                                                             key, port):  # fmt: skip
    """A TPU VM's sandbox refuses every TCP socket: a one-worker job's environment names the
    engine's default port without probing for a free one."""
    from kubejax.jobs import local

    def refused():
        raise OSError(97, "Address family not supported by protocol")

    monkeypatch.setattr(local, "free_port", refused)
    one = JAXJobClient("local", log_root=tmp_path / "logs", env_contract=contract)
    spec = JAXJobSpec(name="one", image="i", command=_py(f"import os; print(os.environ['{key}'])"))
    status = run_job(one, spec, timeout=30, polling_interval=0.05, delete="never", log=None)
    assert status.state == SUCCEEDED
    assert next(iter(one.get_job_logs("one", worker=0))).strip() == port


def test_log_lines_are_prefixed_with_the_worker_index(tmp_path):
    lines = []
    c = JAXJobClient("local", log_root=tmp_path / "l", echo=lines.append)
    spec = JAXJobSpec(name="echo", image="i", command=_py("print('hello')"), replicas=2)
    run_job(c, spec, timeout=30, polling_interval=0.05, log=None)
    assert sorted(lines) == ["[worker-0] hello", "[worker-1] hello"]


def test_never_fails_the_job_with_the_workers_error(client):
    code = (
        "import os, sys, time; pid = int(os.environ['PROCESS_ID']); time.sleep(0.2 * pid); "
        "print('worker', pid, 'bad input'); sys.exit(3 if pid == 1 else 0)"
    )
    spec = JAXJobSpec(
        name="never", image="i", command=_py(code), replicas=2, restart_policy="Never"
    )
    with pytest.raises(JobFailedError) as err:
        run_job(client, spec, timeout=30, polling_interval=0.05, log=None)
    assert err.value.reason == "JAXJobFailed"
    assert "worker 1 exited with code 3" in err.value.message
    # The failure log is the failed worker's, as on a cluster (not worker 0's).
    assert err.value.log_tail.startswith("[never-worker-1]")
    assert "worker 1 bad input" in err.value.log_tail


def test_backoff_limit_stops_restarting(client):
    spec = JAXJobSpec(
        name="flaky",
        image="i",
        command=_py("import sys; sys.exit(1)"),
        replicas=2,
        restart_policy="OnFailure",
        backoff_limit=2,
    )
    with pytest.raises(JobFailedError) as err:
        run_job(client, spec, timeout=60, polling_interval=0.05, delete="never", log=None)
    assert err.value.reason == "BackoffLimitExceeded"
    conditions = client.get_job("flaky").conditions
    assert [c["type"] for c in conditions].count(RESTARTING) == 2


def test_exit_code_policy_retries_only_signals(client):
    spec = JAXJobSpec(
        name="perm",
        image="i",
        command=_py("import sys; sys.exit(2)"),
        restart_policy="ExitCode",
        backoff_limit=3,
    )
    with pytest.raises(JobFailedError, match="JAXJobFailed"):
        run_job(client, spec, timeout=30, polling_interval=0.05, log=None)


def test_deadline_stops_every_worker_and_its_children(client):
    # Each worker starts a grandchild; both must be gone after the deadline.
    code = (
        "import subprocess, sys, time; "
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
        "print('child', c.pid, flush=True); time.sleep(120)"
    )
    spec = JAXJobSpec(
        name="slow", image="i", command=_py(code), replicas=2, active_deadline_seconds=5
    )
    client.create_job(spec)
    deadline = time.monotonic() + 20
    logs = [[], []]
    while not all(logs):
        assert time.monotonic() < deadline
        time.sleep(0.05)
        logs = [list(client.get_job_logs("slow", worker=i)) for i in range(2)]
    pids = client._backend.worker_pids("slow")
    children = [int(lines[0].split()[1]) for lines in logs]
    status = client.wait_for_job_status("slow", timeout=30, polling_interval=0.05)
    assert status.state == FAILED
    assert status.condition(FAILED)["reason"] == "DeadlineExceeded"
    assert not any(_alive(p) for p in pids + children)


def test_delete_and_timeout_leave_no_process(client):
    spec = JAXJobSpec(
        name="forever", image="i", command=_py("import time; time.sleep(300)"), replicas=2
    )
    with pytest.raises(TimeoutError):
        run_job(client, spec, timeout=1, polling_interval=0.05, log=None)
    time.sleep(0.1)
    assert "forever" not in [j.name for j in client.list_jobs()]
    client.create_job(
        JAXJobSpec(name="again", image="i", command=_py("import time; time.sleep(300)"), replicas=2)
    )
    pids = _pids(client, "again", 2)
    client.delete_job("again")
    assert not any(_alive(p) for p in pids)


@pytest.mark.slow
def test_two_workers_run_the_real_trainer(client, tmp_path, tiny_model_dir, prepared):
    out = tmp_path / "out"
    spec = JAXJobSpec(
        name="real",
        image="i",
        command=trainer_cmd()[:3],
        replicas=2,
        args=tiny_args(tiny_model_dir, prepared, out),
    )
    client.create_job(spec)
    pids = _pids(client, "real", 2)
    status = client.wait_for_job_status("real", timeout=300, polling_interval=0.2)
    assert status.state == SUCCEEDED
    final = json.loads((out / "metrics.json").read_text())["final"]
    assert final["num_processes"] == 2 and final["steps"] == 10
    assert (out / "model" / "model.safetensors").is_file()
    logs = "\n".join(client.get_job_logs("real"))
    assert "2 process(es)" in logs and "step 10/10" in logs
    assert not any(_alive(p) for p in pids)


@pytest.mark.slow
def test_a_crashed_worker_restarts_the_group_which_resumes(
    client, tmp_path, tiny_model_dir, prepared
):
    out = tmp_path / "out"
    args = tiny_args(tiny_model_dir, prepared, out, max_steps=16, checkpoint_every=4)
    spec = JAXJobSpec(
        name="crash",
        image="i",
        command=trainer_cmd()[:3],
        replicas=2,
        args=args,
        restart_policy="OnFailure",
        backoff_limit=2,
    )
    client.create_job(spec)
    deadline = time.monotonic() + 180
    while not (out / "checkpoints" / "4").is_dir():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    first = client._backend.worker_pids("crash")
    os.kill(first[1], 9)  # worker 1 dies mid-run
    status = client.wait_for_job_status("crash", timeout=300, polling_interval=0.2)
    assert status.state == SUCCEEDED
    types = [c["type"] for c in status.conditions]
    assert types.count(RESTARTING) == 1
    logs = "\n".join(client.get_job_logs("crash"))
    assert "resumed at step" in logs
    assert json.loads((out / "metrics.json").read_text())["final"]["steps"] == 16
    assert not any(_alive(p) for p in first + client._backend.worker_pids("crash"))


_LAUNCHER = """
import sys, time
from kubejax.jobs.client import JAXJobClient
from kubejax.jobs.spec import JAXJobSpec
client = JAXJobClient("local", log_root=sys.argv[1])
code = "import time; time.sleep(120)"
client.create_job(JAXJobSpec(name="orphan", image="i", command=[sys.executable, "-c", code],
                             replicas=2))
while len(client._backend.worker_pids("orphan")) < 2:
    time.sleep(0.05)
print(*client._backend.worker_pids("orphan"), flush=True)
time.sleep(120)
"""


@pytest.mark.slow
def test_a_launcher_killed_with_sigkill_leaves_no_orphan_worker(tmp_path):
    import subprocess

    launcher = subprocess.Popen(
        [sys.executable, "-c", _LAUNCHER, str(tmp_path / "logs")],
        stdout=subprocess.PIPE,
        text=True,
    )
    pids = [int(p) for p in launcher.stdout.readline().split()]
    assert len(pids) == 2 and all(_alive(p) for p in pids)
    _kill_and_check_workers_die(launcher, pids)


_TRAIN_LAUNCHER = """
import json, sys
from kubejax.jobs.client import JAXJobClient
from kubejax.jobs.launch import run_job
from kubejax.jobs.spec import JAXJobSpec
log_root, delete, args = sys.argv[1], sys.argv[2], sys.argv[3:]
client = JAXJobClient("local", log_root=log_root)
spec = JAXJobSpec(name="resumable", image="i", command=args[:3], args=args[3:], replicas=2)
status = run_job(client, spec, timeout=600, delete=delete, log=None, polling_interval=0.2)
print("done", status.state, flush=True)
"""


@pytest.mark.slow
def test_a_restarted_launcher_reattaches_to_its_local_job(tmp_path, tiny_model_dir, prepared):
    """The launcher SIGKILLed mid-run (its workers die with it); a new launcher of the same job
    resumes that job from its checkpoint instead of starting a second one, and a launcher
    started after the job finished takes its result without running anything."""
    import subprocess

    out, logs = tmp_path / "out", tmp_path / "logs"
    args = trainer_cmd(
        *tiny_args(tiny_model_dir, prepared, out, max_steps=100, checkpoint_every=25)
    )

    def launcher(delete="never"):
        return subprocess.Popen(
            [sys.executable, "-c", _TRAIN_LAUNCHER, str(logs), delete, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    first = launcher()
    record, deadline = logs / "resumable" / "job.json", time.monotonic() + 240
    while not (out / "checkpoints" / "50").exists():
        assert first.poll() is None and time.monotonic() < deadline, first.stdout.read()
        time.sleep(0.1)
    workers = json.loads(record.read_text())["worker_pids"]
    _kill_and_check_workers_die(first, workers)
    saved = [int(c.name) for c in (out / "checkpoints").iterdir() if c.name.isdigit()]
    assert max(saved) < 100

    second = launcher()
    output, _ = second.communicate(timeout=600)
    assert second.returncode == 0 and "done Succeeded" in output, output
    reasons = [c["reason"] for c in json.loads(record.read_text())["conditions"]]
    assert reasons.count("LauncherRestarted") == 1 and reasons[-1] == "JAXJobSucceeded"
    worker0 = (logs / "resumable" / "worker-0.log").read_text()
    assert f"resumed at step {max(saved)}" in worker0
    assert json.loads((out / "metrics.json").read_text())["final"]["steps"] == 100
    assert [p.name for p in logs.iterdir()] == ["resumable"]  # one job, not a second

    # Finished: a third launcher takes the result on record, starting no worker.
    size = (logs / "resumable" / "worker-0.log").stat().st_size
    third = launcher(delete="on_success")
    output, _ = third.communicate(timeout=120)
    assert third.returncode == 0 and "done Succeeded" in output, output
    assert (logs / "resumable" / "worker-0.log").stat().st_size == size
    assert not record.exists()  # deleted on success: the next launch starts afresh
