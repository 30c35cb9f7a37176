"""The cluster quickstart (deploy/), checked here without a cluster: every manifest against the
Kubernetes schemas of the pinned version (kubernetes-validate, offline), the Trainer runtimes
the TrainJobs use (Trainer's jax-distributed, kubejax's jax-tpu) against their CRD, the Kueue
queues (kind's, and the TPU flavors' for GKE), every version from one file, the kustomizations'
files, the Dockerfile with its TPU variant (hadolint) and the scripts (shellcheck). The security
scan (checkov) is `make deploy-check`, part of `make test`."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).parents[1]
DEPLOY = ROOT / "deploy"
DATA = Path(__file__).parent / "data" / "trainer-v2.3.0"
VERSIONS = dict(
    line.split("=", 1)
    for line in (DEPLOY / "versions.env").read_text().splitlines()
    if line and not line.startswith("#")
)
#: Files that are not Kubernetes objects: kustomize's, kind's and Kueue's own configuration.
NOT_OBJECTS = {"kustomization.yaml", "kind-config.yaml", "controller_manager_config.yaml"}
#: Kueue's objects (their CRDs are not the core schemas kubernetes-validate holds): the kind
#: quickstart's queue, and the TPU flavors' for GKE.
KUEUE_OBJECTS = DEPLOY / "kueue" / "queues.yaml"
TPU_KUEUE_OBJECTS = DEPLOY / "kueue" / "tpu-queues.yaml"
#: kubejax's Kubeflow Trainer runtime for TPU slices (validated against Trainer's CRD below).
TPU_RUNTIME = DEPLOY / "trainer" / "jax-tpu.yaml"
MANIFESTS = sorted(
    p
    for p in DEPLOY.rglob("*.yaml")
    if p.name not in NOT_OBJECTS and p not in (KUEUE_OBJECTS, TPU_KUEUE_OBJECTS, TPU_RUNTIME)
)
# The quickstart's scripts and the GPU benchmark's.
SCRIPTS = [*sorted(DEPLOY.glob("*.sh")), ROOT / "bench" / "gpu.sh"]


def _tool(name: str) -> str:
    """A linter installed in this interpreter's environment (the dev extras ship them)."""
    path = Path(sys.executable).parent / name
    found = str(path) if path.exists() else shutil.which(name)
    assert found, f"{name} is missing: make test installs it (dev extras)"
    return found


def test_every_version_is_pinned_once_in_versions_env():
    assert set(VERSIONS) >= {
        "KIND_NODE_IMAGE",
        "KUBERNETES_VERSION",
        "TRAINER_VERSION",
        "TRAINING_OPERATOR_VERSION",
        "KFP_VERSION",
        "KUEUE_VERSION",
    }
    assert VERSIONS["KIND_NODE_IMAGE"].endswith(f":v{VERSIONS['KUBERNETES_VERSION']}")
    assert VERSIONS["TRAINER_VERSION"] == "v2.3.0" and VERSIONS["KFP_VERSION"] == "2.17.0"
    assert VERSIONS["TRAINING_OPERATOR_VERSION"].startswith("v1.9.")
    # The script takes them from the file, never a literal of its own.
    for script in SCRIPTS:
        text = script.read_text()
        for value in VERSIONS.values():
            assert value not in text, (script.name, value)
    # A kustomization that must name a remote ref names the pinned one.
    for kustomization in DEPLOY.rglob("kustomization.yaml"):
        for ref in re.findall(r"\?ref=([\w.\-]+)", kustomization.read_text()):
            assert ref in VERSIONS.values(), (kustomization, ref)


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_manifest_validates_against_the_pinned_kubernetes_schemas(path):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, VERSIONS["KUBERNETES_VERSION"], strict=True)
        assert doc["metadata"].get("namespace") in (None, "kubeflow") or doc["kind"].startswith(
            "Cluster"
        )


def test_the_kueue_queue_and_integrations_are_what_kubejax_jobs_need():
    """The LocalQueue the quickstart's run names (kubejax, in the pipelines' namespace) backed
    by a ClusterQueue over the resources worker pods request; TrainJob and JAXJob managed."""
    docs = {d["kind"]: d for d in yaml.safe_load_all(KUEUE_OBJECTS.read_text())}
    assert {d["apiVersion"] for d in docs.values()} == {"kueue.x-k8s.io/v1beta2"}
    local, cluster = docs["LocalQueue"], docs["ClusterQueue"]
    assert local["metadata"] == {"name": "kubejax", "namespace": "kubeflow"}
    assert local["spec"]["clusterQueue"] == cluster["metadata"]["name"]
    group = cluster["spec"]["resourceGroups"][0]
    assert group["coveredResources"] == ["cpu", "memory", "nvidia.com/gpu"]
    (flavor,) = group["flavors"]
    assert flavor["name"] == docs["ResourceFlavor"]["metadata"]["name"]
    assert [r["name"] for r in flavor["resources"]] == group["coveredResources"]
    config = yaml.safe_load((DEPLOY / "kueue" / "controller_manager_config.yaml").read_text())
    assert config["apiVersion"] == "config.kueue.x-k8s.io/v1beta2"
    frameworks = config["integrations"]["frameworks"]
    assert {"trainer.kubeflow.org/trainjob", "kubeflow.org/jaxjob"} <= set(frameworks)
    script = (DEPLOY / "cluster-up.sh").read_text()
    assert "$KUEUE_VERSION" in script and '"queue_name=kubejax"' in script


def test_a_broken_manifest_is_caught():
    bad = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"}, "spec": {}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, VERSIONS["KUBERNETES_VERSION"], strict=True)


def test_kustomizations_name_files_that_exist():
    for kustomization in DEPLOY.rglob("kustomization.yaml"):
        spec = yaml.safe_load(kustomization.read_text())
        local = [r for r in spec.get("resources", []) if "://" not in r and "?ref=" not in r]
        local += [f for g in spec.get("configMapGenerator", []) for f in g.get("files", [])]
        for name in local:
            assert (kustomization.parent / name).exists(), (kustomization, name)


def test_the_kfp_api_server_gets_a_default_workspace_claim():
    import json

    config = json.loads((DEPLOY / "kfp" / "config.json").read_text())
    claim = config["Workspace"]["VolumeClaimTemplateSpec"]
    assert claim["accessModes"] and claim["storageClassName"]
    assert "plugins" not in config


@pytest.mark.slow
def test_the_jax_distributed_runtime_validates_against_its_crd():
    crd = yaml.safe_load((DATA / "trainer.kubeflow.org_clustertrainingruntimes.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    runtime = yaml.safe_load((DATA / "jax_distributed.yaml").read_text())
    jsonschema.validate(runtime, schema)
    assert runtime["metadata"]["name"] == "jax-distributed"


def test_the_tpu_kueue_flavors_match_the_slices_kubejax_asks_for():
    """One ResourceFlavor per slice shape, labelled as GKE labels the slice's nodes (a TPU job's
    node selectors pick its flavor), each a slice GKE offers; the ClusterQueue counts
    google.com/tpu in whole slices of its flavors; a LocalQueue of its own beside kind's."""
    from kubejax import tpu

    docs = list(yaml.safe_load_all(TPU_KUEUE_OBJECTS.read_text()))
    assert {d["apiVersion"] for d in docs} == {"kueue.x-k8s.io/v1beta2"}
    flavors = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ResourceFlavor"}
    shapes = {}
    for name, flavor in flavors.items():
        labels = flavor["spec"]["nodeLabels"]
        assert set(labels) == {tpu.ACCELERATOR_LABEL, tpu.TOPOLOGY_LABEL}, name
        shapes[name] = tpu.slice_of(labels)  # raises on a slice GKE does not offer
    (cluster,) = [d for d in docs if d["kind"] == "ClusterQueue"]
    (group,) = cluster["spec"]["resourceGroups"]
    assert group["coveredResources"] == ["cpu", "memory", tpu.RESOURCE]
    assert {f["name"] for f in group["flavors"]} == set(flavors)
    for f in group["flavors"]:
        assert [r["name"] for r in f["resources"]] == group["coveredResources"]
        chips = next(int(r["nominalQuota"]) for r in f["resources"] if r["name"] == tpu.RESOURCE)
        assert chips and chips % shapes[f["name"]].chips == 0, f["name"]
    (local,) = [d for d in docs if d["kind"] == "LocalQueue"]
    assert local["spec"]["clusterQueue"] == cluster["metadata"]["name"] == "kubejax-tpu"
    assert local["metadata"]["name"] != "kubejax"  # kind's queue keeps its name


@pytest.mark.slow
def test_the_jax_tpu_runtime_validates_against_its_crd_and_mirrors_jax_distributed():
    """kubejax's TPU runtime: valid against Trainer v2.3.0's CRD, Trainer's JAX plugin and job
    shape as jax-distributed's (what the TrainJob's patches and the trainer's environment
    expect), on kubejax's TPU image of this version; cluster-up.sh installs it."""
    from kubejax import tpu
    from kubejax.jobs import trainjob
    from tests.jobs.test_spec import unknown_fields

    crd = yaml.safe_load((DATA / "trainer.kubeflow.org_clustertrainingruntimes.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    runtime = yaml.safe_load(TPU_RUNTIME.read_text())
    jsonschema.validate(runtime, schema)
    assert unknown_fields(runtime, schema) == []
    assert runtime["metadata"]["name"] == trainjob.TPU_RUNTIME
    builtin = yaml.safe_load((DATA / "jax_distributed.yaml").read_text())
    assert runtime["spec"]["mlPolicy"] == builtin["spec"]["mlPolicy"]
    (job,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    assert job["name"] == trainjob.REPLICATED_JOB
    assert (
        job["template"]["metadata"]
        == builtin["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["metadata"]
    )
    pod = job["template"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container == {"name": trainjob.CONTAINER, "image": tpu.TPU_IMAGE}
    assert {"key": tpu.RESOURCE, "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    script = (DEPLOY / "cluster-up.sh").read_text()
    assert '"$here/trainer/jax-tpu.yaml"' in script


def test_the_dockerfile_builds_a_tpu_variant_in_pyprojects_jax_range():
    """JAX_VARIANT=tpu installs jax[tpu] in pyproject's jax range beside the same extras as the
    CPU image (the CUDA and TPU backends never share an image)."""
    import tomllib

    dockerfile = (ROOT / "trainer_image" / "Dockerfile").read_text()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    jax = next(d for d in pyproject["project"]["dependencies"] if d.startswith("jax>="))
    line = next(x for x in dockerfile.splitlines() if x.strip().startswith("tpu)"))
    assert f'pip install ".[server,ray]" "jax[tpu]{jax.removeprefix("jax")}"' in line
    assert "cuda" not in line
    assert "cpu, cuda or tpu" in dockerfile


def test_the_dockerfile_passes_hadolint():
    dockerfile = ROOT / "trainer_image" / "Dockerfile"
    out = subprocess.run([_tool("hadolint"), str(dockerfile)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_the_scripts_pass_shellcheck(script):
    out = subprocess.run(
        [_tool("shellcheck"), "-x", str(script)], capture_output=True, text=True, cwd=ROOT
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert script.stat().st_mode & 0o111  # executable


def test_shellcheck_would_catch_a_bad_script(tmp_path):
    bad = tmp_path / "bad.sh"
    bad.write_text("#!/usr/bin/env bash\nrm -rf $1/*\n")
    out = subprocess.run([_tool("shellcheck"), str(bad)], capture_output=True, text=True)
    assert out.returncode != 0 and "SC2086" in out.stdout


def test_cluster_up_refuses_an_unknown_engine():
    out = subprocess.run(
        ["bash", str(DEPLOY / "cluster-up.sh"), "--engine", "slurm"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2
    assert "--engine must be trainer or training-operator, got slurm" in out.stderr
