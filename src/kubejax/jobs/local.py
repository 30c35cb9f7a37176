"""The local JAXJob backend: real worker processes on this machine.

It keeps the Training Operator's contract: every worker gets COORDINATOR_ADDRESS (127.0.0.1),
COORDINATOR_PORT (a free port), NUM_PROCESSES, PROCESS_ID and PYTHONUNBUFFERED=1; with
`env_contract="trainjob"`, Kubeflow Trainer v2's instead (JAX_COORDINATOR_ADDRESS as
host:port, JAX_NUM_PROCESSES, JAX_PROCESS_ID). A JAX job is
a group: when one worker fails, the others are stopped too, and with restartPolicy OnFailure,
Always or ExitCode (retryable codes, 128 and above) the whole group restarts, up to backoffLimit
times. activeDeadlineSeconds stops every worker. Workers run in their own process sessions, so
stopping a worker stops its children too; nothing is left behind.

Each job keeps a record beside its logs (`<log_root>/<name>/job.json`: conditions, restarts,
the launcher's and the workers' pids), so a launcher restarted after its process was killed
re-attaches to the job of the same name instead of starting a second one: a finished job gives
its result at once; a running one, whose workers died with their launcher, restarts its group,
which resumes from the job's latest checkpoint.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

from kubejax.jobs.backend import Backend
from kubejax.jobs.spec import JAXJobSpec
from kubejax.jobs.types import (
    CREATED,
    FAILED,
    RESTARTING,
    RUNNING,
    SUCCEEDED,
    JobStatus,
)

_STOP_GRACE_SECONDS = 5.0
_SUPERVISE_SECONDS = 0.1
_DEFAULT_BACKOFF = 3  # the operator's default backoffLimit when restarts are allowed
_LOG_TAIL = 40
_RECORD = "job.json"


#: The coordinator's port each engine gives a job (the JAXJob's `jaxjob-port` default, the
#: TrainJob JAX plugin's): what a one-worker local job's environment names.
ENGINE_PORTS = {"jaxjob": 6666, "trainjob": 29500}


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


#: Run before a worker's command, in the worker's own process (it then execs the command, same
#: pid): the worker gets SIGKILL when the launcher that started it dies, even by SIGKILL, so no
#: orphaned worker outlives it (Linux PR_SET_PDEATHSIG, kept across exec). A launcher already
#: gone before the guard was set is caught by comparing the parent pid.
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys; "
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL); "
    "os.getppid() == int(sys.argv[1]) or os._exit(137); "
    "os.execvp(sys.argv[2], sys.argv[2:])"
)


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the worker's process group, then SIGKILL what remains after a grace period."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(_STOP_GRACE_SECONDS)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # children that outlived the leader
    proc.wait()


#: The environment each engine gives a worker: Training Operator v1 (JAXJob) or Kubeflow
#: Trainer v2's jax-distributed runtime (TrainJob).
ENV_CONTRACTS = ("jaxjob", "trainjob")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (dead, not yet reaped by its parent) still answers kill(0).
    with contextlib.suppress(OSError, IndexError):
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    return True


def read_record(log_dir: Path) -> dict | None:
    """The job record a launcher left in `log_dir`, if any."""
    with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
        return json.loads((log_dir / _RECORD).read_text())
    return None


def _kill_recorded_workers(record: dict) -> None:
    """Stop workers a dead launcher left (none on Linux, where they die with it)."""
    for pid in record.get("worker_pids", []):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


class _LocalJob:
    def __init__(
        self,
        spec: JAXJobSpec,
        log_dir: Path,
        echo: Callable[[str], None] | None,
        env_contract: str = "jaxjob",
        record: dict | None = None,
    ):
        self.spec = spec
        self.env_contract = env_contract
        self.log_dir = log_dir
        self.echo = echo
        self.conditions: list[dict] = []
        self.procs: list[subprocess.Popen] = []
        self.readers: list[threading.Thread] = []
        self.restarts = 0
        self.failed_worker: int | None = None  # the worker whose exit failed the group last
        self.tails = [collections.deque(maxlen=_LOG_TAIL) for _ in range(spec.replicas)]
        self.lock = threading.Lock()
        self.deleted = threading.Event()
        self.started = time.monotonic()
        self.replica_statuses: dict = {}
        target = self._supervise
        if record is None:
            self._condition(CREATED, "JAXJobCreated", f"JAXJob {spec.name} is created.")
        else:
            self.conditions = record["conditions"]
            self.restarts, self.failed_worker = record["restarts"], record["failed_worker"]
            for i, tail in enumerate(self.tails):
                with contextlib.suppress(FileNotFoundError):
                    text = (log_dir / f"worker-{i}.log").read_text(errors="replace")
                    tail.extend(text.splitlines())
            if self.status().finished:
                target = _nothing  # its result is on record
            else:
                _kill_recorded_workers(record)
                self._condition(
                    RESTARTING,
                    "LauncherRestarted",
                    f"the launcher of JAXJob {spec.name} (pid {record['launcher_pid']}) died "
                    "with its workers; restarting the group.",
                )
        self.thread = threading.Thread(target=target, name=f"jaxjob-{spec.name}", daemon=True)
        self.thread.start()

    def _condition(self, type_: str, reason: str, message: str) -> None:
        with self.lock:
            for c in self.conditions:
                if c["type"] in (RUNNING, RESTARTING):
                    c["status"] = "False"
            self.conditions.append(
                {
                    "type": type_,
                    "status": "True",
                    "reason": reason,
                    "message": message,
                    "lastTransitionTime": _now(),
                }
            )
            self._write_record()

    def _write_record(self) -> None:
        record = {
            "name": self.spec.name,
            "launcher_pid": os.getpid(),
            "worker_pids": [p.pid for p in self.procs],
            "restarts": self.restarts,
            "failed_worker": self.failed_worker,
            "conditions": self.conditions,
        }
        tmp = self.log_dir / f".{_RECORD}.tmp"
        tmp.write_text(json.dumps(record, indent=1))
        tmp.replace(self.log_dir / _RECORD)

    def _command(self) -> list[str]:
        cmd = [*self.spec.command, *self.spec.args]
        # The image's `python` is this interpreter here.
        if cmd and os.path.basename(cmd[0]) in ("python", "python3"):
            cmd[0] = sys.executable
        if sys.platform == "linux":
            cmd = [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *cmd]
        return cmd

    def _env(self, index: int, port: int) -> dict[str, str]:
        env = dict(os.environ)
        for e in self.spec.env:
            if "value" in e:
                env[e["name"]] = str(e["value"])
            # valueFrom (secrets, field refs) has no local meaning: the local environment
            # provides such variables itself.
        env["PYTHONUNBUFFERED"] = "1"
        limits = (self.spec.resources or {}).get("limits", {})
        devices = limits.get("nvidia.com/gpu") or limits.get("google.com/tpu")
        if devices and jax_cpu_devices_unset(env):
            # A pod's GPUs or TPU chips, here: as many CPU devices in the worker (the same mesh
            # and shards).
            env["JAX_NUM_CPU_DEVICES"] = str(devices)
        if self.env_contract == "trainjob":
            env.update(
                JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                JAX_NUM_PROCESSES=str(self.spec.replicas),
                JAX_PROCESS_ID=str(index),
            )
        else:
            env.update(
                COORDINATOR_ADDRESS="127.0.0.1",
                COORDINATOR_PORT=str(port),
                NUM_PROCESSES=str(self.spec.replicas),
                PROCESS_ID=str(index),
            )
        return env

    def _read(self, index: int, proc: subprocess.Popen, attempt: int) -> None:
        path = self.log_dir / f"worker-{index}.log"
        with path.open("a", encoding="utf-8") as f:
            if attempt:
                f.write(f"--- restart {attempt} ---\n")
            for line in proc.stdout:
                f.write(line)
                f.flush()
                self.tails[index].append(line.rstrip("\n"))
                if self.echo is not None:
                    self.echo(f"[worker-{index}] {line.rstrip()}")

    def _start_group(self) -> None:
        # One worker never opens the coordinator's port: the engine's default stands in, and
        # no socket is opened (a TPU VM's sandbox refuses every TCP socket, loopback too).
        one = self.spec.replicas == 1
        port = ENGINE_PORTS[self.env_contract] if one else free_port()
        cwd = self.spec.working_dir or None
        self.procs, self.readers = [], []
        for i in range(self.spec.replicas):
            proc = subprocess.Popen(
                self._command(),
                env=self._env(i, port),
                cwd=cwd,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                text=True,
                errors="replace",
                start_new_session=True,
            )
            self.procs.append(proc)
            reader = threading.Thread(target=self._read, args=(i, proc, self.restarts), daemon=True)
            reader.start()
            self.readers.append(reader)
        self._condition(RUNNING, "JAXJobRunning", f"JAXJob {self.spec.name} is running.")

    def stop_all(self) -> None:
        for proc in self.procs:
            _stop_group(proc)
        for reader in self.readers:
            reader.join(timeout=5)

    def _retryable(self, code: int) -> bool:
        policy = self.spec.restart_policy
        if policy in ("OnFailure", "Always"):
            return True
        # ExitCode: 1-127 are permanent errors, 128-255 (signals) retryable.
        return policy == "ExitCode" and (code < 0 or code >= 128)

    def _supervise(self) -> None:
        try:
            self._start_group()
        except OSError as err:
            self._condition(FAILED, "JAXJobFailed", f"cannot start workers: {err}")
            return
        deadline = self.spec.active_deadline_seconds
        backoff = (
            self.spec.backoff_limit if self.spec.backoff_limit is not None else _DEFAULT_BACKOFF
        )
        while not self.deleted.is_set():
            codes = [p.poll() for p in self.procs]
            self.replica_statuses = {
                "Worker": {
                    "active": sum(c is None for c in codes),
                    "succeeded": sum(c == 0 for c in codes),
                    "failed": sum(c not in (None, 0) for c in codes),
                }
            }
            if deadline is not None and time.monotonic() - self.started > deadline:
                self.stop_all()
                self._condition(
                    FAILED,
                    "DeadlineExceeded",
                    f"JAXJob {self.spec.name} has run past activeDeadlineSeconds={deadline}.",
                )
                return
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                index, code = failed[0]
                self.failed_worker = index
                self.stop_all()
                msg = f"worker {index} exited with code {code}"
                if self._retryable(code) and self.restarts < backoff:
                    self.restarts += 1
                    self._condition(
                        RESTARTING,
                        "JAXJobRestarting",
                        f"{msg}; restarting the group ({self.restarts}/{backoff}).",
                    )
                    self._start_group()
                    continue
                reason = "BackoffLimitExceeded" if self._retryable(code) else "JAXJobFailed"
                self._condition(
                    FAILED,
                    reason,
                    msg + (f" after {self.restarts} restarts" if self.restarts else ""),
                )
                return
            if all(c == 0 for c in codes):
                for reader in self.readers:
                    reader.join(timeout=5)
                self._condition(
                    SUCCEEDED, "JAXJobSucceeded", f"JAXJob {self.spec.name} successfully completed."
                )
                return
            time.sleep(_SUPERVISE_SECONDS)

    def status(self) -> JobStatus:
        with self.lock:
            return JobStatus(
                self.spec.name, [dict(c) for c in self.conditions], dict(self.replica_statuses)
            )

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]


def _nothing() -> None:
    pass


#: Where worker logs go when no log_root is given (`kubejax run --local` sets it to its
#: workdir); unset: a fresh temporary folder.
LOG_DIR_ENV = "KUBEJAX_LOCAL_JOB_LOGS"


class LocalBackend(Backend):
    """JAXJobs as local process groups; logs under `log_root/<job name>/worker-<i>.log`."""

    def __init__(
        self,
        log_root: str | Path | None = None,
        echo: bool | Callable = False,
        env_contract: str = "jaxjob",
    ):
        if env_contract not in ENV_CONTRACTS:
            raise ValueError(
                f"env_contract: {env_contract!r} is not one of {', '.join(ENV_CONTRACTS)}"
            )
        self.env_contract = env_contract
        log_root = log_root or os.environ.get(LOG_DIR_ENV)
        self.log_root = Path(log_root or tempfile.mkdtemp(prefix="kubejax-jobs-"))
        self.echo = (print if echo is True else echo) or None
        self.jobs: dict[str, _LocalJob] = {}
        atexit.register(self.close)

    def create_job(self, spec: JAXJobSpec) -> str:
        job = self.jobs.get(spec.name)
        if job is not None and not job.deleted.is_set():
            return spec.name  # attach to the job of that name
        log_dir = self.log_root / spec.name
        log_dir.mkdir(parents=True, exist_ok=True)
        record = read_record(log_dir)
        if record is not None and not JobStatus(spec.name, record["conditions"]).finished:
            pid = record["launcher_pid"]
            if pid == os.getpid() or _alive(pid):
                raise RuntimeError(
                    f"JAXJob {spec.name} is run by another launcher (pid {pid}) with the same "
                    f"log folder {log_dir}; wait for it to end or delete the job"
                )
        self.jobs[spec.name] = _LocalJob(spec, log_dir, self.echo, self.env_contract, record)
        return spec.name

    def _job(self, name: str) -> _LocalJob:
        try:
            return self.jobs[name]
        except KeyError:
            raise KeyError(f"JAXJob {name} not found") from None

    def get_job(self, name: str) -> JobStatus:
        return self._job(name).status()

    def list_jobs(self) -> list[JobStatus]:
        return [j.status() for j in self.jobs.values() if not j.deleted.is_set()]

    def get_job_logs(self, name: str, follow: bool = False, worker: int = 0) -> Iterator[str]:
        job = self._job(name)
        path = job.log_dir / f"worker-{worker}.log"
        while not path.exists() and follow and not job.status().finished:
            time.sleep(0.1)
        if not path.exists():
            return
        with path.open(encoding="utf-8", errors="replace") as f:
            while True:
                line = f.readline()
                if line:
                    yield line.rstrip("\n")
                elif follow and not job.status().finished:
                    time.sleep(0.1)
                else:
                    rest = f.read()
                    yield from rest.splitlines()
                    return

    def failure_log(self, name: str, lines: int = 40) -> str:
        job = self._job(name)
        worker = job.failed_worker or 0
        tail = list(job.tails[worker])[-lines:]
        return f"[{job.spec.name}-worker-{worker}]\n" + "\n".join(tail) if tail else ""

    def worker_pids(self, name: str) -> list[int]:
        """Process ids of the current workers of a job."""
        return self._job(name).pids()

    def delete_job(self, name: str) -> None:
        job = self.jobs.pop(name, None)
        if job is not None:
            job.deleted.set()
            job.thread.join()
            job.stop_all()
        record = read_record(self.log_root / name)
        if record is not None:
            if job is None:
                _kill_recorded_workers(record)
            (self.log_root / name / _RECORD).unlink(missing_ok=True)

    def close(self) -> None:
        """Stop every job's workers (also run at interpreter exit). The jobs' records stay, as
        a cluster's jobs outlive their launcher: a later launcher re-attaches."""
        for name in list(self.jobs):
            job = self.jobs.pop(name)
            job.deleted.set()
            job.thread.join()
            job.stop_all()


def jax_cpu_devices_unset(env: dict[str, str]) -> bool:
    """Whether the environment leaves JAX's CPU device count alone (neither the variable nor
    XLA's flag set)."""
    return "JAX_NUM_CPU_DEVICES" not in env and "device_count" not in env.get("XLA_FLAGS", "")
