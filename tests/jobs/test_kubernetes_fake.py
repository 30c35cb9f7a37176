"""The kubernetes backend through the real kubeflow-training and kubernetes clients, against a
FAKE API server on 127.0.0.1."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest

from kubejax.jobs.client import FAILED, SUCCEEDED, JAXJobClient, JobFailedError
from kubejax.jobs.launch import run_job
from kubejax.jobs.spec import JAXJobSpec
from tests.jobs.fake_k8s import FakeKubernetes, condition


def _client(fake: FakeKubernetes) -> JAXJobClient:
    return JAXJobClient(
        "kubernetes", namespace="ns", client_configuration=fake.client_configuration()
    )


def _spec(name="train-1") -> JAXJobSpec:
    return JAXJobSpec(
        name=name,
        image="kubejax:test",
        command=["python", "-m", "kubejax.trainer"],
        args=["--model", "m"],
        replicas=2,
    )


def test_fake_create_wait_logs_delete():
    with FakeKubernetes() as fake:
        client = _client(fake)
        lines = []
        status = run_job(client, _spec(), timeout=30, polling_interval=0.05, log=lines.append)
        assert status.state == SUCCEEDED
        assert fake.count("POST", "/jaxjobs") == 1
        body = fake.bodies[0]
        assert body["kind"] == "JAXJob" and body["metadata"]["namespace"] == "ns"
        worker = body["spec"]["jaxReplicaSpecs"]["Worker"]
        assert worker["replicas"] == 2
        assert worker["template"]["spec"]["containers"][0]["name"] == "jax"
        assert any("loss 0.5" in line and "train-1-worker-0" in line for line in lines)
        assert fake.count("DELETE", "/jaxjobs/train-1") == 1  # on_success


def test_fake_failure_raises_with_reason_and_failed_pod_log():
    script = [
        [condition("Created")],
        [condition("Created"), condition("Failed", "JAXJobFailed", "worker 1 exited 1")],
    ]
    with FakeKubernetes(
        script=script, log_lines=["Traceback", "ValueError: boom"], failed_pod=1
    ) as fake:
        with pytest.raises(JobFailedError) as err:
            run_job(_client(fake), _spec(), timeout=30, polling_interval=0.05, log=None)
        assert err.value.reason == "JAXJobFailed"
        assert "worker 1 exited 1" in str(err.value)
        assert "train-1-worker-1" in err.value.log_tail and "ValueError: boom" in err.value.log_tail
        assert fake.count("DELETE") == 0  # kept for inspection under on_success
        assert _client(fake).get_job("train-1").state == FAILED


def test_fake_retried_launcher_reattaches():
    with FakeKubernetes() as fake:
        client = _client(fake)
        assert client.create_job(_spec()) == "train-1"
        assert client.create_job(_spec()) == "train-1"
        assert fake.count("POST") == 1
        assert [j.name for j in client.list_jobs()] == ["train-1"]
        client.delete_job("train-1")
        client.delete_job("train-1")  # already gone: no error
        with pytest.raises(KeyError):
            client.get_job("train-1")


def test_fake_timeout_deletes_the_job():
    script = [[condition("Created"), condition("Running")]]
    with FakeKubernetes(script=script) as fake:
        with pytest.raises(TimeoutError):
            run_job(_client(fake), _spec(), timeout=1, polling_interval=0.1, log=None)
        assert fake.count("DELETE", "/jaxjobs/train-1") == 1


@pytest.mark.parametrize(("engine", "plural"), [("jaxjob", "jaxjobs"), ("trainjob", "trainjobs")])
def test_fake_sigterm_deletes_the_job(engine, plural):
    script = [[condition("Created"), condition("Running")]]
    with FakeKubernetes(script=script, served=(engine,)) as fake:
        code = textwrap.dedent(f"""
            from kubernetes import client
            from kubejax.jobs.client import JAXJobClient
            from kubejax.jobs.launch import run_job
            from kubejax.jobs.spec import JAXJobSpec
            cfg = client.Configuration(); cfg.host = {fake.host!r}
            c = JAXJobClient("kubernetes", namespace="ns", client_configuration=cfg)
            spec = JAXJobSpec(name="cancel-me", image="i", command=["python"], replicas=1)
            run_job(c, spec, timeout=120, polling_interval=0.1, log=None)
        """)
        proc = subprocess.Popen([sys.executable, "-c", code])
        deadline = time.monotonic() + 60
        while fake.count("GET", f"/{plural}/cancel-me") < 2:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 128 + signal.SIGTERM
        assert fake.count("DELETE", f"/{plural}/cancel-me") == 1
