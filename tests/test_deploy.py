"""The cluster quickstart (deploy/), checked here without a cluster: every manifest against the
Kubernetes schemas of the pinned version (kubernetes-validate, offline), the Trainer runtime
the TrainJobs use against its CRD, every version from one file, the kustomizations' files, the
Dockerfile (hadolint) and the scripts (shellcheck). The security scan (checkov) is `make
deploy-check`, part of `make test`."""

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
#: Kueue's objects (their CRDs are not the core schemas kubernetes-validate holds).
KUEUE_OBJECTS = DEPLOY / "kueue" / "queues.yaml"
MANIFESTS = sorted(
    p for p in DEPLOY.rglob("*.yaml") if p.name not in NOT_OBJECTS and p != KUEUE_OBJECTS
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


def test_the_jax_distributed_runtime_validates_against_its_crd():
    crd = yaml.safe_load((DATA / "trainer.kubeflow.org_clustertrainingruntimes.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    runtime = yaml.safe_load((DATA / "jax_distributed.yaml").read_text())
    jsonschema.validate(runtime, schema)
    assert runtime["metadata"]["name"] == "jax-distributed"


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
