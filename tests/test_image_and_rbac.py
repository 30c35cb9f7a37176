"""The image agrees with pyproject; the RBAC Role grants exactly what the launcher uses."""

from __future__ import annotations

import contextlib
import re
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from kubejax.jobs.client import JAXJobClient, JobFailedError
from kubejax.jobs.launch import run_job
from kubejax.jobs.spec import JAXJobSpec
from kubejax.tune import SweepError
from kubejax.version import IMAGE, IMAGE_REPOSITORY, __version__
from tests.jobs.fake_k8s import FakeKubernetes, condition, resumed

ROOT = Path(__file__).parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
DOCKERFILE = (ROOT / "trainer_image" / "Dockerfile").read_text()


def test_image_python_is_allowed_by_pyproject():
    base = re.search(r"^FROM python:(\d+\.\d+)", DOCKERFILE, re.M).group(1)
    assert base == "3.12"
    assert Version(f"{base}.0") in SpecifierSet(PYPROJECT["project"]["requires-python"])


def test_image_installs_the_package_with_pyprojects_pins():
    # The image installs `.[server,ray]` (or `.[cuda,server,ray]`), so every version comes
    # from pyproject.toml; any explicit pin in the Dockerfile must satisfy pyproject's range.
    assert 'pip install ".[server,ray]"' in DOCKERFILE
    assert 'pip install ".[cuda,server,ray]"' in DOCKERFILE
    assert PYPROJECT["project"]["optional-dependencies"]["ray"] == ["ray[tune]==2.60.0"]
    server = PYPROJECT["project"]["optional-dependencies"]["server"]
    mlflow = next(d for d in PYPROJECT["project"]["dependencies"] if d.startswith("mlflow>="))
    assert server == [mlflow.replace("mlflow", "mlflow[auth]", 1)]
    deps = {re.split(r"[<>=\[ ]", d)[0]: d for d in PYPROJECT["project"]["dependencies"]}
    for name, version in re.findall(r"([A-Za-z0-9_.-]+)==([0-9][\w.]*)", DOCKERFILE):
        spec = SpecifierSet(deps[name][len(name) :].split(";")[0])
        assert Version(version) in spec, (name, version)
    cuda = PYPROJECT["project"]["optional-dependencies"]["cuda"]
    jax = next(d for d in PYPROJECT["project"]["dependencies"] if d.startswith("jax>="))
    assert any(d.startswith("jax[cuda12]") and d.endswith(jax.removeprefix("jax")) for d in cuda)


def test_image_sets_the_workers_malloc_tunable():
    from kubejax.launchers.common import MALLOC_TUNABLE

    # Every process of the image (components and workers of jobs it runs) gets it, as the
    # workers of local jobs do through worker_env.
    assert re.search(rf"^\s+GLIBC_TUNABLES={re.escape(MALLOC_TUNABLE)} \\$", DOCKERFILE, re.M)


def test_image_runs_as_non_root_on_a_pinned_base_and_tag_follows_the_version():
    assert re.search(r"^USER 1000$", DOCKERFILE, re.M)
    # A Python patch release on a named Debian release, not a moving tag such as 3.12-slim.
    assert re.search(
        r"^FROM python:3\.12\.\d+-slim-(bookworm|trixie)(@sha256:[0-9a-f]{64})?$", DOCKERFILE, re.M
    )
    assert f"{IMAGE_REPOSITORY}:{__version__}" == IMAGE
    makefile = (ROOT / "Makefile").read_text()
    assert "src/kubejax/version.py" in makefile and "kubejax:$(VERSION)" in makefile
    compiled = (ROOT / "compiled" / "kubejax-yelp.yaml").read_text()
    assert f"image: {IMAGE}" in compiled


@pytest.mark.slow
def test_the_wheel_holds_every_module_and_the_compiled_pipelines(tmp_path):
    """What the image installs (`pip install .`, not editable): every module of the source
    tree, and the compiled YAMLs that `kubejax submit` uploads."""
    import shutil
    import subprocess
    import sys
    import zipfile

    # Built from a copy: setuptools' build/ folder would otherwise sit in the checkout, and
    # stale files there would end up in later wheels.
    source = tmp_path / "source"
    skip = shutil.ignore_patterns(".*", "build", "*.egg-info", "__pycache__", "demo-run", "bench")
    shutil.copytree(ROOT, source, ignore=skip)
    pip = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    subprocess.run(
        [*pip, "-w", str(tmp_path), str(source)],
        check=True,
        capture_output=True,
    )
    names = set(zipfile.ZipFile(next(tmp_path.glob("kubejax-*.whl"))).namelist())
    trees = {"src/kubejax": "kubejax", "components": "kubejax/components"}
    trees |= {"pipelines": "kubejax/pipelines", "compiled": "kubejax/compiled"}
    expected = {
        f"{prefix}/{path.relative_to(ROOT / folder).as_posix()}"
        for folder, prefix in trees.items()
        for path in (ROOT / folder).rglob("*")
        if path.suffix in (".py", ".yaml") and "__pycache__" not in path.parts
    }
    assert expected - names == set()
    assert "kubejax/compiled/components/tune-sweep.yaml" in names


#: Discovery (/apis/<group>/<version>) is open to every authenticated user (system:discovery).
_DISCOVERY = ("/apis/kubeflow.org/v1", "/apis/trainer.kubeflow.org/v1alpha1")
_RESOURCES = (
    "jaxjobs", "optimizationjobs", "trainjobs", "clustertrainingruntimes", "workloads",
    "experiments", "trials", "pods"
)  # fmt: skip


def _verb(method: str, path: str) -> tuple[str, str] | None:
    """The RBAC (resource, verb) of a request to the fake API server."""
    path = path.split("?")[0].rstrip("/")
    if path in _DISCOVERY:
        return None
    if path.endswith("/log"):
        return "pods/log", "get"
    parts = path.split("/")
    resource = next(r for r in _RESOURCES if r in parts)
    named = parts[-1] != resource
    verb = {"POST": "create", "DELETE": "delete"}.get(method, "get" if named else "list")
    return resource, verb


def _granted() -> set[tuple[str, str]]:
    roles = [
        d
        for d in yaml.safe_load_all((ROOT / "deploy" / "kubejax" / "rbac.yaml").read_text())
        if d["kind"] in ("Role", "ClusterRole")
    ]
    return {
        (r, v)
        for role in roles
        for rule in role["rules"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }


ENGINE_SCRIPTS = {
    "jaxjob": (
        [
            [condition("Created"), condition("Suspended")],  # held by Kueue: its Workload read
            [condition("Created"), resumed(), condition("Succeeded")],
        ],
        [[condition("Created"), condition("Failed", "X", "y")]],
    ),
    "trainjob": (
        [[condition("Suspended", kind="TrainJob")], [condition("Complete", kind="TrainJob")]],
        [[condition("Failed", "X", "y", kind="TrainJob")]],
    ),
}


def _requests_of(engine: str) -> set[tuple[str, str]]:
    """The (resource, verb) pairs the launcher uses on one engine, success and failure."""
    used = set()
    ok, bad = ENGINE_SCRIPTS[engine]
    for script, failed_pod in ((ok, None), (bad, 0)):
        with FakeKubernetes(script=script, failed_pod=failed_pod, served=(engine,)) as fake:
            client = JAXJobClient(
                "kubernetes", namespace="ns", client_configuration=fake.client_configuration()
            )
            assert client.engine == engine
            spec = JAXJobSpec(name="rbac", image="i", command=["python"])
            # The failing script raises JobFailedError.
            with contextlib.suppress(JobFailedError):
                run_job(
                    client,
                    spec,
                    timeout=30,
                    polling_interval=0.05,
                    log=lambda _: None,
                    delete="always",
                )
            client.list_jobs()
            used |= {v for m, p in fake.requests if (v := _verb(m, p)) is not None}
    return used


def _katib_requests(tmp_path) -> set[tuple[str, str]]:
    """The (resource, verb) pairs of a sweep run as a Katib Experiment, then re-attached."""
    from kubejax import tracking
    from kubejax.launchers.katib import sweep_with_katib
    from kubejax.launchers.sweep import trainer_trial_spec
    from kubejax.tune import SweepConfig, katib
    from tests.test_katib import DONE, TRIALS

    space = {"learning_rate": {"type": "float", "low": 1e-5, "high": 1e-3}}
    # With the defaults' trial, which the launcher creates itself (and deletes on cancel).
    cfg = SweepConfig(space=space, tuner="katib", study_name="sweep-a", poll_seconds=0.05,
                      defaults={"learning_rate": 1e-4})  # fmt: skip
    factory = trainer_trial_spec(
        image="i", replicas=1, data_dir="/d", hyperparameters={"model": "m"}
    )
    script = [{}, DONE]
    with FakeKubernetes(
        served=("trainjob",), experiment_script=script, katib_trials=TRIALS
    ) as fake:
        client = JAXJobClient(
            "kubernetes", namespace="ns", client_configuration=fake.client_configuration()
        )
        for _ in range(2):
            with contextlib.suppress(SweepError):  # the trials left no metrics here
                sweep_with_katib(cfg, factory, client, str(tmp_path), tracker=tracking.Tracker(),
                                 replicas=1, log=lambda _: None)  # fmt: skip
        # What a cancelled run does (SIGTERM: tests/test_katib.py).
        katib.KatibRun(*client.custom_objects(), "sweep-a").delete()
        return {v for m, p in fake.requests if (v := _verb(m, p)) is not None}


def _optimizationjob_requests(tmp_path) -> set[tuple[str, str]]:
    """The (resource, verb) pairs of a sweep run as an OptimizationJob, re-attached, cancelled."""
    from kubejax import tracking
    from kubejax.launchers.optimizationjob import sweep_with_optimizationjob
    from kubejax.launchers.sweep import trainer_trial_spec
    from kubejax.tune import SweepConfig
    from kubejax.tune.optimizationjob import OptimizationRun

    space = {"learning_rate": {"type": "float", "low": 1e-5, "high": 1e-3}}
    cfg = SweepConfig(space=space, tuner="optimizationjob", algorithm="random", pruner="none",
                      study_name="sweep-a", poll_seconds=0.05,
                      defaults={"learning_rate": 1e-4})  # fmt: skip
    factory = trainer_trial_spec(
        image="i", replicas=1, data_dir="/d", hyperparameters={"model": "m"}
    )
    done = {"conditions": [{"type": "Complete", "status": "True"}]}
    with FakeKubernetes(served=("trainjob",), optimization_script=[{}, done]) as fake:
        fake.on_job = lambda tj: tj.update(status=done)
        client = JAXJobClient(
            "kubernetes", namespace="ns", client_configuration=fake.client_configuration()
        )
        for _ in range(2):
            with contextlib.suppress(SweepError):  # no trial posted a metric here
                sweep_with_optimizationjob(cfg, factory, client, str(tmp_path),
                                           tracker=tracking.Tracker(), replicas=1,
                                           log=lambda _: None)  # fmt: skip
        OptimizationRun(*client.custom_objects(), "sweep-a").delete()  # a cancelled run's
        return {v for m, p in fake.requests if (v := _verb(m, p)) is not None}


@pytest.mark.slow
def test_fake_rbac_roles_grant_exactly_what_the_launcher_uses_on_both_engines(tmp_path):
    jaxjob, trainjob = _requests_of("jaxjob"), _requests_of("trainjob")
    assert {r for r, _ in jaxjob} >= {"jaxjobs"} and {r for r, _ in trainjob} >= {"trainjobs"}
    katib = _katib_requests(tmp_path)
    assert {r for r, _ in katib} == {"experiments", "trials"}
    optimization = _optimizationjob_requests(tmp_path)
    assert {r for r, _ in optimization} == {"optimizationjobs", "trainjobs"}
    assert jaxjob | trainjob | katib | optimization == _granted()
