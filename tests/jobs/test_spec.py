"""JAXJob manifests against the real CRD's openAPIV3Schema and the webhook's rules."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import pytest
import yaml

from kubejax.jobs.spec import JAXJobSpec, SpecError, build_manifest, job_name, resources

CRD = Path(__file__).parents[1] / "data" / "kubeflow.org_jaxjobs.yaml"


@pytest.fixture(scope="module")
def schema() -> dict:
    crd = yaml.safe_load(CRD.read_text())
    return next(v for v in crd["spec"]["versions"] if v["name"] == "v1")["schema"][
        "openAPIV3Schema"
    ]


def unknown_fields(obj, schema: dict, path: str = "") -> list[str]:
    """Keys the structural schema does not know (the API server would prune them)."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    out = []
    if isinstance(obj, dict):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        for k, v in obj.items():
            if props is not None and k in props:
                out += unknown_fields(v, props[k], f"{path}.{k}")
            elif isinstance(extra, dict):
                out += unknown_fields(v, extra, f"{path}.{k}")
            elif props is not None:
                out.append(f"{path}.{k}")
    elif isinstance(obj, list) and "items" in schema:
        for i, v in enumerate(obj):
            out += unknown_fields(v, schema["items"], f"{path}[{i}]")
    return out


def webhook_errors(manifest: dict) -> list[str]:
    """The Training Operator v1.9 webhook's checks of a JAXJob."""
    import re

    errors = []
    if not re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", manifest["metadata"]["name"]):
        errors.append("name is not DNS-1035")
    specs = manifest["spec"]["jaxReplicaSpecs"]
    if set(specs) != {"Worker"}:
        errors.append("only Worker replicas")
    containers = specs["Worker"]["template"]["spec"]["containers"]
    if not any(c["name"] == "jax" for c in containers):
        errors.append("no container named jax")
    if not all(c.get("image") for c in containers):
        errors.append("container without image")
    return errors


FULL = JAXJobSpec(
    name="kubejax-train-0123456789",
    image="ghcr.io/kubejax/kubejax:0.1.0",
    command=["python", "-m", "kubejax.trainer"],
    args=["--model", "bert", "--data-dir", "/kfp-workspace/d"],
    replicas=4,
    namespace="team-a",
    resources=resources(cpu="8", memory="32Gi", gpus=1),
    env=[
        {"name": "A", "value": "1"},
        {
            "name": "MLFLOW_TRACKING_PASSWORD",
            "valueFrom": {"secretKeyRef": {"name": "mlflow-credentials", "key": "password"}},
        },
    ],
    volumes=[
        {"name": "kfp-workspace", "persistentVolumeClaim": {"claimName": "run-1-kfp-workspace"}}
    ],
    volume_mounts=[{"name": "kfp-workspace", "mountPath": "/kfp-workspace"}],
    node_selector={"cloud.google.com/gke-accelerator": "nvidia-l4"},
    tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    affinity={
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["gpu"]}]}
                ]
            }
        }
    },
    restart_policy="OnFailure",
    backoff_limit=3,
    active_deadline_seconds=3600,
    clean_pod_policy="All",
    ttl_seconds_after_finished=600,
    scheduling_policy={"queue": "research", "minAvailable": 4},
    labels={"pipelines.kubeflow.org/run-id": "abc"},
    annotations={"kubejax.dev/kfp-task": "train"},
    service_account="pipeline-runner",
)
MINIMAL = JAXJobSpec(name="j", image="i", command=["python", "-m", "kubejax.trainer"])


@pytest.mark.parametrize("spec", [FULL, MINIMAL], ids=["full", "minimal"])
@pytest.mark.slow
def test_manifest_validates_against_the_crd(schema, spec):
    manifest = build_manifest(spec)
    jsonschema.validate(manifest, schema)
    assert unknown_fields(manifest, schema) == []
    assert webhook_errors(manifest) == []
    container = manifest["spec"]["jaxReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    assert container["ports"] == [{"name": "jaxjob-port", "containerPort": 6666}]


def test_full_manifest_carries_every_setting():
    m = build_manifest(FULL)
    worker = m["spec"]["jaxReplicaSpecs"]["Worker"]
    pod = worker["template"]["spec"]
    assert worker["replicas"] == 4 and worker["restartPolicy"] == "OnFailure"
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == "run-1-kfp-workspace"
    assert pod["tolerations"] and pod["affinity"] and pod["nodeSelector"]
    assert m["spec"]["runPolicy"] == {
        "backoffLimit": 3,
        "activeDeadlineSeconds": 3600,
        "cleanPodPolicy": "All",
        "ttlSecondsAfterFinished": 600,
        "schedulingPolicy": {"queue": "research", "minAvailable": 4},
    }
    assert m["metadata"]["labels"]["pipelines.kubeflow.org/run-id"] == "abc"


def test_a_manifest_the_schema_rejects_is_caught(schema):
    bad = build_manifest(MINIMAL)
    bad["spec"]["jaxReplicaSpecs"]["Worker"]["replicas"] = "two"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)
    bad = build_manifest(MINIMAL)
    bad["spec"]["runPolicy"]["backofLimit"] = 3
    assert unknown_fields(bad, schema) == [".spec.runPolicy.backofLimit"]


SPEC_ERRORS = [
    ("upper-case name", {"name": "Train"}, "name:"),
    ("name starting with a digit", {"name": "1job"}, "name:"),
    ("name too long", {"name": "a" * 64}, "name:"),
    ("no image", {"image": ""}, "image:"),
    ("zero replicas", {"replicas": 0}, "replicas:"),
    ("restart policy", {"restart_policy": "Sometimes"}, "restart_policy:"),
    ("clean pod policy", {"clean_pod_policy": "Some"}, "clean_pod_policy:"),
    ("negative backoff", {"backoff_limit": -1}, "backoff_limit:"),
]


@pytest.mark.parametrize(
    ("name", "change", "message"), SPEC_ERRORS, ids=[c[0] for c in SPEC_ERRORS]
)
def test_spec_errors_name_the_field(name, change, message):
    kw = {"name": "j", "image": "i", "command": ["python"], **change}
    with pytest.raises(SpecError, match=message):
        JAXJobSpec(**kw)


def test_job_names_are_deterministic_dns_labels():
    a = job_name("run-uuid-1", "train", prefix="kubejax-train")
    assert a == job_name("run-uuid-1", "train", prefix="kubejax-train")
    assert a != job_name("run-uuid-2", "train", prefix="kubejax-train")
    JAXJobSpec(name=a, image="i", command=["python"])
    long = job_name("x", prefix="A" * 80 + "_weird")
    assert len(long) <= 63
    JAXJobSpec(name=long, image="i", command=["python"])


def test_workers_share_the_compilation_cache_through_the_workspace(monkeypatch):
    from kubejax.launchers.common import worker_env

    for name in (
        "JAX_COMPILATION_CACHE_DIR",
        "MLFLOW_TRACKING_URI",
        "MLFLOW_EXPERIMENT_ID",
        "GLIBC_TUNABLES",
    ):
        monkeypatch.delenv(name, raising=False)
    malloc = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    env = worker_env("/kfp-workspace", "")
    assert env["JAX_COMPILATION_CACHE_DIR"] == "/kfp-workspace/kubejax/jax-cache"
    assert env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "0"
    assert worker_env("", "") == malloc
    assert worker_env("", "http://mlflow:5000") == {
        "MLFLOW_TRACKING_URI": "http://mlflow:5000",
        **malloc,
    }
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/home/me/.cache/jax")
    assert worker_env("/kfp-workspace", "") == malloc  # the task's own cache is kept


def test_workers_get_the_malloc_tunable_beside_the_users_own(monkeypatch):
    from kubejax.launchers.common import MALLOC_TUNABLE, worker_env

    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    assert worker_env("", "")["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:{MALLOC_TUNABLE}"
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=0")  # the user's choice stays
    assert worker_env("", "")["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=0"
