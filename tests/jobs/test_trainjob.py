"""Kubeflow Trainer v2: TrainJob manifests against the v2.3.0 CRD schema, the engine choice by
API discovery, and the TrainJob backend through the real kubernetes client against a FAKE API
server on 127.0.0.1."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import pytest
import yaml

from kubejax.jobs.client import (
    FAILED,
    SUCCEEDED,
    EngineNotFoundError,
    JAXJobClient,
    JobFailedError,
)
from kubejax.jobs.launch import run_job
from kubejax.jobs.spec import JAXJobSpec, resources
from kubejax.jobs.trainjob import build_trainjob_manifest
from kubejax.launchers.common import build_train_spec
from kubejax.trainer.distributed import process_env
from tests.jobs.fake_k8s import FakeKubernetes, condition
from tests.jobs.test_spec import unknown_fields

DATA = Path(__file__).parents[1] / "data" / "trainer-v2.3.0"


@pytest.fixture(scope="module")
def schema() -> dict:
    crd = yaml.safe_load((DATA / "trainer.kubeflow.org_trainjobs.yaml").read_text())
    return next(v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1")["schema"][
        "openAPIV3Schema"
    ]


def _full_spec(name="train-1") -> JAXJobSpec:
    return JAXJobSpec(
        name=name,
        image="ghcr.io/kubejax/kubejax:test",
        command=["python", "-m", "kubejax.trainer"],
        args=["--model", "m", "--data-dir", "/kfp-workspace/data"],
        replicas=4,
        namespace="team-a",
        resources=resources("4", "16Gi", gpus=1),
        env=[
            {"name": "MLFLOW_TRACKING_URI", "value": "http://mlflow:5000"},
            {
                "name": "MLFLOW_TRACKING_PASSWORD",
                "valueFrom": {"secretKeyRef": {"name": "mlflow-credentials", "key": "password"}},
            },
        ],
        volumes=[{"name": "ws", "persistentVolumeClaim": {"claimName": "run-ws"}}],
        volume_mounts=[{"name": "ws", "mountPath": "/kfp-workspace"}],
        node_selector={"pool": "gpu"},
        tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        affinity={"nodeAffinity": {}},
        active_deadline_seconds=3600,
        labels={"pipelines.kubeflow.org/run-id": "r1"},
        annotations={"kubejax.dev/kfp-task": "train"},
    )


@pytest.mark.slow
def test_manifest_validates_against_the_v2_3_crd_with_no_unknown_fields(schema):
    manifest = build_trainjob_manifest(_full_spec())
    jsonschema.validate(manifest, schema)
    assert unknown_fields(manifest, schema) == []


def test_task_config_maps_onto_the_trainjob(schema):
    # What KFP hands the launcher from the task's settings (dsl.TaskConfig).
    task_config = SimpleNamespace(
        resources={"limits": {"nvidia.com/gpu": 1}},
        env=[{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "t"}}}],
        volumes=[{"name": "ws", "persistentVolumeClaim": {"claimName": "c"}}],
        volume_mounts=[{"name": "ws", "mountPath": "/kfp-workspace"}],
        node_selector={"pool": "gpu"},
        tolerations=[{"key": "gpu", "operator": "Exists"}],
        affinity={"nodeAffinity": {}},
    )
    spec = build_train_spec(
        name="train-2",
        image="img",
        replicas=2,
        data_dir="/kfp-workspace/d",
        output_dir="/kfp-workspace/o",
        hyperparameters={"model": "m"},
        task_config=task_config,
        active_deadline_seconds=60,
    )
    m = build_trainjob_manifest(spec)
    jsonschema.validate(m, schema)
    assert unknown_fields(m, schema) == []
    trainer = m["spec"]["trainer"]
    assert trainer["numNodes"] == 2
    assert trainer["resourcesPerNode"] == {"limits": {"nvidia.com/gpu": 1}}
    assert trainer["env"][0]["name"] == "HF_TOKEN"
    assert m["spec"]["runtimeRef"] == {
        "name": "jax-distributed",
        "kind": "ClusterTrainingRuntime",
        "apiGroup": "trainer.kubeflow.org",
    }
    (patch,) = m["spec"]["runtimePatches"]
    job = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    assert job["name"] == "node"
    pod = job["template"]["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "gpu"} and pod["tolerations"][0]["key"] == "gpu"
    assert pod["affinity"] == {"nodeAffinity": {}} and pod["volumes"][0]["name"] == "ws"
    assert pod["containers"] == [
        {"name": "node", "volumeMounts": [{"name": "ws", "mountPath": "/kfp-workspace"}]}
    ]
    assert m["spec"]["activeDeadlineSeconds"] == 60


CONTRACTS = [
    ("none", {}, (None, 1, 0, "none")),
    (
        "jaxjob",
        {
            "COORDINATOR_ADDRESS": "j-worker-0",
            "COORDINATOR_PORT": "6666",
            "NUM_PROCESSES": "4",
            "PROCESS_ID": "3",
        },
        ("j-worker-0:6666", 4, 3, "jaxjob"),
    ),
    (
        "trainjob",
        {
            "JAX_COORDINATOR_ADDRESS": "j-node-0-0.j:29500",
            "JAX_NUM_PROCESSES": "2",
            "JAX_PROCESS_ID": "1",
        },
        ("j-node-0-0.j:29500", 2, 1, "trainjob"),
    ),
]


@pytest.mark.parametrize(("name", "env", "expected"), CONTRACTS, ids=[c[0] for c in CONTRACTS])
def test_trainer_reads_either_engines_contract(name, env, expected):
    p = process_env(env)
    assert (p.coordinator, p.num_processes, p.process_id, p.contract) == expected


def test_a_bad_trainjob_process_id_names_the_variable():
    with pytest.raises(ValueError, match=r"JAX_PROCESS_ID: 2 is not in 0\.\.1"):
        process_env(
            {"JAX_COORDINATOR_ADDRESS": "a:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"}
        )


def _client(fake, backend="trainjob") -> JAXJobClient:
    return JAXJobClient(backend, namespace="ns", client_configuration=fake.client_configuration())


def _spec(name="train-1") -> JAXJobSpec:
    return JAXJobSpec(
        name=name, image="kubejax:test", command=["python", "-m", "kubejax.trainer"], replicas=2
    )


@pytest.mark.parametrize(
    ("served", "expected"),
    [(("trainjob", "jaxjob"), "trainjob"), (("jaxjob",), "jaxjob"), (("trainjob",), "trainjob")],
)
def test_fake_discovery_prefers_trainjob_then_jaxjob(served, expected):
    with FakeKubernetes(served=served) as fake:
        assert _client(fake, "kubernetes").engine == expected


def test_fake_cluster_without_either_crd_names_what_to_install():
    with FakeKubernetes(served=()) as fake, pytest.raises(EngineNotFoundError) as err:
        _client(fake, "kubernetes")
    assert "Kubeflow Trainer v2.2" in str(err.value) and "Training Operator v1.9" in str(err.value)


def test_fake_missing_runtime_names_it():
    with FakeKubernetes(served=("trainjob",), runtimes=()) as fake:
        with pytest.raises(RuntimeError, match="'jax-distributed' is not installed"):
            _client(fake).create_job(_spec())
        assert fake.count("POST") == 0


def test_fake_trainjob_create_wait_logs_delete():
    with FakeKubernetes(served=("trainjob",)) as fake:
        client = _client(fake)
        lines = []
        status = run_job(
            client, _spec(), timeout=30, polling_interval=0.05, log=lines.append, delete="never"
        )
        assert status.state == SUCCEEDED
        body = fake.bodies[0]
        assert body["kind"] == "TrainJob" and body["metadata"]["namespace"] == "ns"
        assert fake.count("POST", "/trainjobs") == 1
        assert any("loss 0.5" in line for line in lines)
        assert list(client.get_job_logs("train-1", worker=1)) == fake.log_lines
        client.delete_job("train-1")
        assert fake.count("DELETE", "/trainjobs/train-1") == 1


def test_fake_trainjob_failure_carries_the_failed_nodes_log():
    script = [[], [condition("Failed", "JobSetFailed", "node 1 exited 1", kind="TrainJob")]]
    with FakeKubernetes(
        served=("trainjob",), script=script, log_lines=["ValueError: boom"], failed_pod=1
    ) as fake:
        with pytest.raises(JobFailedError) as err:
            run_job(_client(fake), _spec(), timeout=30, polling_interval=0.05, log=None)
        assert err.value.reason == "JobSetFailed" and "node 1 exited 1" in str(err.value)
        assert "train-1-node-0-1-x" in err.value.log_tail and "boom" in err.value.log_tail
        assert _client(fake).get_job("train-1").state == FAILED


def test_fake_trainjob_retried_launcher_reattaches_and_timeout_deletes():
    script = [[]]  # never finishes
    with FakeKubernetes(served=("trainjob",), script=script) as fake:
        client = _client(fake)
        assert client.create_job(_spec()) == client.create_job(_spec()) == "train-1"
        assert fake.count("POST") == 1
        with pytest.raises(TimeoutError):
            run_job(client, _spec(), timeout=1, polling_interval=0.1, log=None)
        assert fake.count("DELETE", "/trainjobs/train-1") == 1


def test_devices_per_worker_reach_both_engines_and_the_mesh_is_checked_first():
    """`devices_per_worker` is each pod's nvidia.com/gpu limit in the TrainJob
    (resourcesPerNode) and the JAXJob (its worker container); a mesh the job's devices do not
    make, or a memory plan over the node's GPU (its product label), is refused before any
    manifest."""
    from kubejax.errors import InfeasibleError
    from kubejax.jobs.spec import build_manifest

    scratch = json.dumps(
        {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 300}
    )  # fmt: skip
    hp = {"model": "scratch", "tokenizer": "-", "scratch_config": scratch, "mesh": "fsdp=-1"}
    common = {"name": "t", "image": "img", "data_dir": "/d", "output_dir": "/o"}
    spec = build_train_spec(**common, replicas=2, hyperparameters=hp, devices_per_worker=4)
    assert build_trainjob_manifest(spec)["spec"]["trainer"]["resourcesPerNode"] == {
        "limits": {"nvidia.com/gpu": 4}
    }
    worker = build_manifest(spec)["spec"]["jaxReplicaSpecs"]["Worker"]
    container = worker["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
    with pytest.raises(InfeasibleError, match=r"makes 4 devices, but the job has 6"):
        build_train_spec(**common, replicas=3, devices_per_worker=2,
                         hyperparameters={**hp, "mesh": "fsdp=4"})  # fmt: skip
    small_gpu = SimpleNamespace(node_selector={"nvidia.com/gpu.product": "Tesla-T4"})
    # One batch asked for explicitly: refused; left `auto`, the plan fits it in micro-batches.
    big = {**hp, "max_length": 4096, "global_batch_size": 4096, "grad_accum_steps": 1,
           "remat": "none"}  # fmt: skip
    with pytest.raises(InfeasibleError, match=r"more than the 11.18 GiB of the device"):
        build_train_spec(**common, replicas=1, devices_per_worker=1, hyperparameters=big,
                         task_config=small_gpu)  # fmt: skip
    auto = {k: v for k, v in big.items() if k not in ("grad_accum_steps", "remat")}
    build_train_spec(**common, replicas=1, devices_per_worker=1, hyperparameters=auto,
                     task_config=small_gpu)  # fmt: skip
