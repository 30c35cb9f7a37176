"""TPUs: the slice table (`kubejax.tpu`), the accelerator settings through the launchers
(table-driven refusals, before anything is created), TPU TrainJobs and JAXJobs against their CRD
schemas (one worker a host), a TPU TrainJob and a TPU sweep against a FAKE API server, a TPU
training's trainer code path on this machine, and a 2-host slice's environment faked at the
process boundary."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

import jsonschema
import pytest
import yaml

from kubejax import cli, tpu
from kubejax.errors import InfeasibleError
from kubejax.jobs.spec import build_manifest
from kubejax.jobs.trainjob import TPU_RUNTIME, build_trainjob_manifest
from kubejax.launchers.common import TPU_TOLERATION, build_train_spec, place_workers
from tests.jobs.test_spec import unknown_fields

DATA = Path(__file__).parent / "data"
V5E, V6E, V5P, V4 = "tpu-v5-lite-podslice", "tpu-v6e-slice", "tpu-v5p-slice", "tpu-v4-podslice"
SCRATCH = json.dumps(
    {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
     "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300}
)  # fmt: skip
HP = {"model": "scratch", "tokenizer": "-", "scratch_config": SCRATCH, "mesh": "fsdp=-1"}
COMMON = {"name": "tpu-job", "image": "", "data_dir": "/ws/d", "output_dir": "/ws/o"}


def _schema(path: Path, version: str) -> dict:
    crd = yaml.safe_load(path.read_text())
    return next(v for v in crd["spec"]["versions"] if v["name"] == version)["schema"][
        "openAPIV3Schema"
    ]


@pytest.fixture(scope="module")
def trainjob_schema() -> dict:
    return _schema(DATA / "trainer-v2.3.0" / "trainer.kubeflow.org_trainjobs.yaml", "v1alpha1")


@pytest.fixture(scope="module")
def jaxjob_schema() -> dict:
    return _schema(DATA / "kubeflow.org_jaxjobs.yaml", "v1")


# --- the table


def test_every_slice_of_the_table_holds_together():
    """Chips are the topology's product and hosts × chips a host; the GKE machine type names
    the chips of its host (ct5lp-hightpu-4t: 4); every type's chip memory is known to the
    plan; a type's topologies are listed once each, smallest first."""
    assert tpu.TPU_TYPES == (V5E, V6E, V5P, V4)
    for s in tpu.SLICES:
        assert s.chips == tpu.chip_count(s.topology) == s.hosts * s.chips_per_host, s
        assert s.machine_type.endswith(f"-{s.chips_per_host}t"), s
    for accelerator in tpu.TPU_TYPES:
        assert tpu.chip_memory(accelerator) and tpu.generation(accelerator) is not None
        sizes = [tpu.chip_count(t) for t in tpu.topologies(accelerator)]
        assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes)


class Row(NamedTuple):
    accelerator: str
    topology: str
    chips_per_host: int  # asked; 0: the default
    chips: int
    hosts: int


#: Rows read from Google's pages (the module's sources): v5e multi-host on 4-chip nodes (a
#: 16x16 pool "always has either 64 nodes"), v6e's 2x4 on one 8-chip VM or two 4-chip VMs,
#: v5p's and v4's 4-chip hosts (GKE's 2x2x2 example: two ct4p-hightpu-4t machines).
KNOWN = [
    Row(V5E, "1x1", 0, 1, 1),
    Row(V5E, "2x4", 0, 8, 1),
    Row(V5E, "4x4", 0, 16, 4),
    Row(V5E, "16x16", 0, 256, 64),
    Row(V6E, "2x4", 8, 8, 1),
    Row(V6E, "2x4", 4, 8, 2),
    Row(V6E, "8x16", 0, 128, 32),
    Row(V5P, "2x2x1", 0, 4, 1),
    Row(V5P, "4x4x4", 0, 64, 16),
    Row(V4, "2x2x2", 0, 8, 2),
]


@pytest.mark.parametrize("row", KNOWN, ids=lambda r: f"{r.accelerator}-{r.topology}-{r.hosts}")
def test_the_slices_google_documents(row):
    shape = tpu.tpu_slice(row.accelerator, row.topology, row.chips_per_host)
    assert (shape.chips, shape.hosts) == (row.chips, row.hosts)
    assert shape.node_selector == {
        tpu.ACCELERATOR_LABEL: row.accelerator,
        tpu.TOPOLOGY_LABEL: row.topology,
    }


def test_the_image_follows_the_accelerator():
    assert tpu.image_for(V5E) == tpu.TPU_IMAGE and tpu.TPU_IMAGE.endswith("-tpu")
    assert tpu.image_for("nvidia") == tpu.image_for("") == tpu.image_for("cpu") == tpu.IMAGE
    assert tpu.image_for(V5E, "registry/mine:1") == "registry/mine:1"


# --- the accelerator settings through the launchers


class Case(NamedTuple):
    name: str
    settings: dict
    pod: dict
    error: str | None  # a regex of the refusal; None: accepted


CASES = [
    Case("unknown-type", {"accelerator": "tpu-v9-slice"}, {},
         r"^accelerator: 'tpu-v9-slice' is not one of cpu, nvidia, tpu-v5-lite-podslice, "),
    Case("topology-missing", {"accelerator": V5E}, {},
         r"^tpu_topology: required with accelerator tpu-v5-lite-podslice; one of 1x1, 2x2, 2x4"),
    Case("topology-not-offered", {"accelerator": V5E, "tpu_topology": "2x2x2"}, {},
         r"^tpu_topology: '2x2x2' is not a tpu-v5-lite-podslice slice; one of 1x1, 2x2, 2x4"),
    Case("topology-without-tpu", {"accelerator": "nvidia", "tpu_topology": "2x4"}, {},
         r"^tpu_topology: '2x4' needs a TPU accelerator \(one of tpu-v5-lite-podslice, "),
    Case("chips-per-host-not-offered", {"accelerator": V5E, "tpu_topology": "4x4",
                                        "devices_per_worker": 8}, {},
         r"^devices_per_worker: a tpu-v5-lite-podslice 4x4 slice has 4 chips on each host "
         r"\(google.com/tpu per worker\), not 8; set 4, or 0"),
    Case("chips-per-host-from-the-task", {"accelerator": V6E, "tpu_topology": "2x4"},
         {"resources": {"limits": {"google.com/tpu": 2}}},
         r"^devices_per_worker: a tpu-v6e-slice 2x4 slice has 8 or 4 chips on each host"),
    Case("workers-contradict-the-topology", {"accelerator": V5P, "tpu_topology": "2x2x2",
                                             "replicas": 4}, {},
         r"^replicas: 4 workers contradict the tpu-v5p-slice 2x2x2 \(8 chips: 2 hosts × 4\) "
         r"slice, one worker a host; set 2 or 0"),
    Case("tpu-with-gpus", {"accelerator": V5E, "tpu_topology": "2x4"},
         {"resources": {"limits": {"nvidia.com/gpu": 1}}},
         r"^gpus_per_worker: accelerator tpu-v5-lite-podslice takes no GPUs, but the workers ask "
         r"nvidia.com/gpu: 1; set it to 0"),
    Case("cpu-with-gpus", {"accelerator": "cpu", "devices_per_worker": 2}, {},
         r"^gpus_per_worker: accelerator cpu takes no GPUs"),
    Case("node-selector-contradicts", {"accelerator": V5E, "tpu_topology": "2x4"},
         {"node_selector": {tpu.TOPOLOGY_LABEL: "4x4"}},
         r"^worker_node_selector: cloud.google.com/gke-tpu-topology=4x4 contradicts"),
    Case("tpu-two-4-chip-hosts", {"accelerator": V6E, "tpu_topology": "2x4",
                                  "devices_per_worker": 4, "replicas": 2}, {}, None),
    Case("nvidia-as-before", {"accelerator": "nvidia", "devices_per_worker": 2}, {}, None),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_accelerator_settings_are_checked_by_name(case):
    settings = {"replicas": 0, **case.settings}
    if case.error is not None:
        with pytest.raises(tpu.TPUError, match=case.error) as err:
            place_workers(case.pod, **settings)
        assert "\n" not in str(err.value)
        return
    workers, pod, shape = place_workers(case.pod, **settings)
    if shape is None:
        assert pod["resources"] == {"limits": {"nvidia.com/gpu": 2}} and workers == 1
    else:
        assert (workers, shape.chips_per_host) == (2, 4)
        assert pod["resources"]["limits"] == {"google.com/tpu": 4}


def test_a_mesh_that_does_not_make_the_slices_chips_is_refused_naming_the_slice():
    with pytest.raises(InfeasibleError) as err:
        build_train_spec(**COMMON, replicas=0, hyperparameters={**HP, "mesh": "fsdp=8"},
                         accelerator=V5E, tpu_topology="4x4")  # fmt: skip
    assert str(err.value).startswith("mesh: fsdp=8 makes 8 devices, but the job has 16")
    assert str(err.value).endswith("the slice is tpu-v5-lite-podslice 4x4 (16 chips: 4 hosts × 4)")
    # The -1 axis takes every chip of the slice, whatever the fixed axes.
    spec = build_train_spec(**COMMON, replicas=4, hyperparameters={**HP, "mesh": "data=2,fsdp=-1"},
                            accelerator=V5E, tpu_topology="4x4")  # fmt: skip
    assert spec.replicas == 4


def test_a_model_the_chip_cannot_hold_is_refused_from_the_slices_memory():
    """No `device_memory` given: the plan takes the chip's from the TPU node selector. A
    Llama-3.2-1B-shaped model trained whole in float32 (its weights, gradients and Adam moments
    alone 18 GiB) on one v5e chip is refused; on a v5p 2x2x1 slice, sharded four ways, it fits."""
    llama = json.dumps(
        {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192,
         "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
         "vocab_size": 128256, "tie_word_embeddings": True}
    )  # fmt: skip
    hp = {**HP, "scratch_config": llama, "max_length": 256, "global_batch_size": 4}
    with pytest.raises(InfeasibleError, match=r"more than the 15\.75 GiB of the device"):
        build_train_spec(**COMMON, replicas=0, hyperparameters=hp, accelerator=V5E,
                         tpu_topology="1x1")  # fmt: skip
    spec = build_train_spec(**COMMON, replicas=0, hyperparameters=hp, accelerator=V5P,
                            tpu_topology="2x2x1")  # fmt: skip
    assert spec.resources == {"limits": {"google.com/tpu": 4}}


# --- TPU manifests against the CRDs


def _pod_of_trainjob(manifest: dict) -> dict:
    (patch,) = manifest["spec"]["runtimePatches"]
    (job,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    return job["template"]["spec"]["template"]["spec"]


@pytest.mark.slow
def test_a_multi_host_tpu_job_renders_one_worker_a_host_on_both_engines(
    trainjob_schema, jaxjob_schema
):
    """A v5e 4x4 slice: 4 workers of 4 chips, GKE's node selectors, the TPU toleration beside
    the task's, every pod in one node pool; the TrainJob on the jax-tpu runtime, the JAXJob's
    workers with the TPU environment GKE would give an Indexed Job's pods; the task's volumes
    and secret env kept; kubejax's TPU image; both valid against their CRDs."""
    task_config = SimpleNamespace(
        env=[{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "t"}}}],
        volumes=[{"name": "ws", "persistentVolumeClaim": {"claimName": "c"}}],
        volume_mounts=[{"name": "ws", "mountPath": "/ws"}],
        tolerations=[{"key": "pool", "operator": "Exists"}],
        resources=None,
        node_selector=None,
        affinity=None,
    )
    spec = build_train_spec(**COMMON, replicas=0, hyperparameters=HP, task_config=task_config,
                            accelerator=V5E, tpu_topology="4x4")  # fmt: skip
    selector = {tpu.ACCELERATOR_LABEL: V5E, tpu.TOPOLOGY_LABEL: "4x4"}
    same_pool = {
        "labelSelector": {"matchLabels": {"kubejax.dev/job-name": "tpu-job"}},
        "topologyKey": "cloud.google.com/gke-nodepool",
    }

    trainjob = build_trainjob_manifest(spec)
    jsonschema.validate(trainjob, trainjob_schema)
    assert unknown_fields(trainjob, trainjob_schema) == []
    assert trainjob["spec"]["runtimeRef"]["name"] == TPU_RUNTIME == "jax-tpu"
    trainer = trainjob["spec"]["trainer"]
    assert trainer["numNodes"] == 4 and trainer["image"] == tpu.TPU_IMAGE
    assert trainer["resourcesPerNode"] == {"limits": {"google.com/tpu": 4}}
    pod = _pod_of_trainjob(trainjob)
    assert pod["nodeSelector"] == selector
    assert pod["tolerations"] == [{"key": "pool", "operator": "Exists"}, TPU_TOLERATION]
    assert pod["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] == [
        same_pool
    ]

    jaxjob = build_manifest(spec)
    jsonschema.validate(jaxjob, jaxjob_schema)
    assert unknown_fields(jaxjob, jaxjob_schema) == []
    worker = jaxjob["spec"]["jaxReplicaSpecs"]["Worker"]
    pod = worker["template"]["spec"]
    (container,) = pod["containers"]
    assert worker["replicas"] == 4 and container["image"] == tpu.TPU_IMAGE
    assert container["resources"] == {"limits": {"google.com/tpu": 4}}
    assert pod["nodeSelector"] == selector and pod["tolerations"][-1] == TPU_TOLERATION
    assert pod["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] == [
        same_pool
    ]
    env = {e["name"]: e for e in container["env"]}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "hf"
    assert env["TPU_WORKER_HOSTNAMES"]["value"] == ",".join(f"tpu-job-worker-{i}" for i in range(4))
    assert env["TPU_WORKER_ID"]["valueFrom"] == {
        "fieldRef": {"fieldPath": "metadata.labels['training.kubeflow.org/replica-index']"}
    }


def test_a_single_host_tpu_job_needs_no_slice_wide_settings(trainjob_schema, jaxjob_schema):
    spec = build_train_spec(**COMMON, replicas=1, hyperparameters=HP, accelerator=V6E,
                            tpu_topology="2x4")  # fmt: skip
    assert spec.replicas == 1 and spec.resources == {"limits": {"google.com/tpu": 8}}
    assert not spec.affinity
    jaxjob = build_manifest(spec)
    jsonschema.validate(jaxjob, jaxjob_schema)
    container = jaxjob["spec"]["jaxReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    assert not any(e["name"].startswith("TPU_") for e in container.get("env", []))
    # Off TPUs the TrainJob stays on Trainer's own runtime.
    gpu = build_train_spec(**COMMON, replicas=1, hyperparameters=HP, devices_per_worker=8)
    assert build_trainjob_manifest(gpu)["spec"]["runtimeRef"]["name"] == "jax-distributed"


@pytest.mark.parametrize("engine", ["trainjob", "jaxjob"])
def test_cli_render_of_a_tpu_slice_validates(engine, trainjob_schema, jaxjob_schema, capsys):
    argv = ["render", "--engine", engine, "--accelerator", V4, "--tpu-topology", "2x2x2"]
    scratch = ["--model", "scratch", "--tokenizer", "-", "--scratch-config", SCRATCH]
    assert cli.main([*argv, "--", *scratch, "--mesh", "fsdp=-1"]) == 0
    manifest = yaml.safe_load(capsys.readouterr().out)
    schema = trainjob_schema if engine == "trainjob" else jaxjob_schema
    jsonschema.validate(manifest, schema)
    assert unknown_fields(manifest, schema) == []
    if engine == "trainjob":
        assert manifest["spec"]["trainer"]["numNodes"] == 2
        assert manifest["spec"]["runtimeRef"]["name"] == "jax-tpu"
    else:
        assert manifest["spec"]["jaxReplicaSpecs"]["Worker"]["replicas"] == 2


def test_cli_plan_names_the_slice_and_checks_the_mesh_against_its_chips(capsys):
    flags = ["--", "--model", "scratch", "--tokenizer", "-", "--scratch-config", SCRATCH]
    argv = ["plan", "--accelerator", V5P, "--tpu-topology", "2x2x2"]
    assert cli.main([*argv, *flags, "--mesh", "fsdp=-1"]) == 0
    out = capsys.readouterr().out
    assert "slice: tpu-v5p-slice 2x2x2 (8 chips: 2 hosts × 4), ct5p-hightpu-4t hosts" in out
    assert "mesh data=1,fsdp=8,tensor=1" in out
    assert cli.main([*argv, *flags, "--mesh", "fsdp=3"]) == 2
    assert "the slice is tpu-v5p-slice 2x2x2 (8 chips" in capsys.readouterr().err


# --- against FAKE servers: nothing created on a refusal; the TPU runtime; a TPU sweep


def test_fake_kfp_submit_refuses_tpu_settings_before_any_request(capsys):
    from tests.fake_kfp import FakeKFP

    tpu_run = ["--param", f"accelerator={V5E}", "--param", "tpu_topology=4x4"]
    gpus_off = ["--param", "gpus_per_worker=0", "--param", "trial_gpus_per_worker=0"]
    bad = {
        "gpus_per_worker: accelerator tpu-v5-lite-podslice takes no GPUs": tpu_run,
        "replicas: 2 workers contradict the tpu-v5-lite-podslice 4x4": [*tpu_run, *gpus_off],
        "trial_tpu_topology: required with accelerator": [*tpu_run, *gpus_off,
                                                          "--param", "replicas=0"],
    }  # fmt: skip
    with FakeKFP() as fake:
        for message, params in bad.items():
            assert cli.main(["submit", "--host", fake.host, *params]) == 2
            err = capsys.readouterr().err
            assert message in err and len(err.strip().splitlines()) == 1, err
        assert fake.requests == []
        ok = [*tpu_run, *gpus_off, "--param", "replicas=4", "--param", "trial_tpu_topology=2x4"]
        assert cli.main(["submit", "--host", fake.host, *ok]) == 0
        run = json.loads(fake.posted("/apis/v2beta1/runs")[0])
        assert run["runtime_config"]["parameters"]["trial_tpu_topology"] == "2x4"


def _fake_client(fake):
    from kubejax.jobs.client import JAXJobClient

    return JAXJobClient(
        "trainjob", namespace="ns", client_configuration=fake.client_configuration()
    )


def test_fake_tpu_trainjob_runs_on_the_jax_tpu_runtime_and_names_it_when_missing():
    from kubejax.jobs.launch import run_job
    from tests.jobs.fake_k8s import FakeKubernetes, condition

    spec = build_train_spec(**COMMON, replicas=0, hyperparameters=HP, accelerator=V5E,
                            tpu_topology="2x4")  # fmt: skip
    with FakeKubernetes(served=("trainjob",)) as fake:  # Trainer's runtimes only
        with pytest.raises(RuntimeError) as err:
            _fake_client(fake).create_job(spec)
        assert "'jax-tpu' is not installed" in str(err.value)
        assert "kubectl apply --server-side -f deploy/trainer/jax-tpu.yaml" in str(err.value)
        assert fake.count("POST") == 0
    script = [[], [condition("Complete", kind="TrainJob")]]
    runtimes = ("jax-distributed", "jax-tpu")
    with FakeKubernetes(served=("trainjob",), runtimes=runtimes, script=script) as fake:
        status = run_job(_fake_client(fake), spec, timeout=30, polling_interval=0.05, log=None)
        assert status.state == "Succeeded"
        (body,) = fake.bodies
        assert body["spec"]["runtimeRef"]["name"] == "jax-tpu"


@pytest.mark.slow
def test_fake_tpu_sweep_runs_its_trials_as_trainjobs_on_the_trials_slice(
    tmp_path, monkeypatch, trainjob_schema
):
    """The Optuna sweep on a cluster backend with a TPU accelerator: every trial a TrainJob on
    the trials' slice (v5e 2x4, one 8-chip host), schema-valid, on the jax-tpu runtime; the
    best trial as the CPU/GPU path reports it."""
    from kubejax.launchers.sweep import sweep_with_jaxjobs
    from kubejax.tune import SweepConfig
    from tests.jobs.fake_k8s import FakeKubernetes, condition
    from tests.test_katib import _kubeconfig

    def trainer(body):  # what the trial's trainer leaves in its output folder
        args = body["spec"]["trainer"]["args"]
        out = Path(args[args.index("--output-dir") + 1])
        lr = float(args[args.index("--learning-rate") + 1])
        out.mkdir(parents=True, exist_ok=True)
        evals = [{"step": 10, "eval_accuracy": lr}]
        (out / "metrics.json").write_text(json.dumps(
            {"status": "completed", "step": 10, "total_steps": 10, "evals": evals,
             "final": {"eval_accuracy": lr}}))  # fmt: skip

    space = {"learning_rate": {"type": "categorical", "choices": [0.1, 0.2]}}
    # Three trials: the defaults' first (the trainer's learning rate joins the space), then
    # the grid's two points.
    cfg = SweepConfig(space=space, algorithm="grid", max_trials=3, parallelism=2,
                      study_name="sweep-tpu", storage=f"sqlite:///{tmp_path / 's.db'}",
                      poll_seconds=0.05)  # fmt: skip
    script = [[], [condition("Complete", kind="TrainJob")]]
    runtimes = ("jax-distributed", "jax-tpu")
    with FakeKubernetes(served=("trainjob",), runtimes=runtimes, script=script) as fake:
        fake.on_job = trainer
        monkeypatch.setenv("KUBECONFIG", _kubeconfig(tmp_path, fake.host))
        result, _ = sweep_with_jaxjobs(
            cfg, data_dir="/ws/data", trials_root=str(tmp_path / "trials"),
            hyperparameters={**HP, "max_steps": 10}, replicas=0, accelerator=V5E,
            tpu_topology="2x4", backend="kubernetes", log=lambda _: None,
        )  # fmt: skip
        bodies = [b for b in fake.bodies if b.get("kind") == "TrainJob"]
    assert len(bodies) == 3
    for body in bodies:
        jsonschema.validate(body, trainjob_schema)
        assert unknown_fields(body, trainjob_schema) == []
        assert body["spec"]["runtimeRef"]["name"] == "jax-tpu"
        assert body["spec"]["trainer"]["numNodes"] == 1
        assert body["spec"]["trainer"]["resourcesPerNode"] == {"limits": {"google.com/tpu": 8}}
        assert _pod_of_trainjob(body)["nodeSelector"][tpu.TOPOLOGY_LABEL] == "2x4"
    assert result.counts == {"complete": 3, "pruned": 0, "failed": 0}
    assert result.trial(result.defaults_trial)["number"] == 0
    assert result.best_params == {"learning_rate": 0.2}


def test_a_sweep_on_a_tpu_slice_is_refused_before_any_job(tmp_path):
    from kubejax.launchers.sweep import sweep_with_jaxjobs
    from kubejax.tune import SweepConfig

    cfg = SweepConfig(space={"learning_rate": {"type": "float", "low": 1e-5, "high": 1e-3}},
                      storage=f"sqlite:///{tmp_path / 's.db'}")  # fmt: skip
    with pytest.raises(tpu.TPUError, match=r"^replicas: 2 workers contradict the tpu-v5-lite"):
        sweep_with_jaxjobs(cfg, data_dir="/d", trials_root=str(tmp_path / "t"), hyperparameters=HP,
                           replicas=2, accelerator=V5E, tpu_topology="2x4",
                           backend="slurm")  # fmt: skip
    assert not (tmp_path / "s.db").exists() and not (tmp_path / "t").exists()


# --- the trainer's code path


@pytest.mark.slow
def test_a_tpu_training_runs_the_trainer_with_the_slices_chips(tmp_path, tiny_model_dir, prepared):
    """A v5e 2x2 slice (one host of 4 chips) launched on the local backend: the worker gets as
    many devices as the host has chips (CPU devices here, the same mesh and shards), and the
    trainer runs through to its model."""
    from kubejax.launchers.train import train_with_jaxjob
    from tests.helpers import tiny_args

    flags = tiny_args(tiny_model_dir, prepared, tmp_path / "unused", max_steps=2)
    hp = {flags[i][2:].replace("-", "_"): flags[i + 1] for i in range(0, len(flags), 2)}
    for key in ("data_dir", "output_dir"):
        hp.pop(key)
    lines = []
    result = train_with_jaxjob(
        dataset_path=str(prepared), model_path=str(tmp_path / "model"),
        hyperparameters={**hp, "mesh": "data=-1"}, replicas=0, accelerator=V5E,
        tpu_topology="2x2", backend="local", log=lines.append,
    )  # fmt: skip
    assert result["final"]["num_devices"] == 4 and result["final"]["num_processes"] == 1
    assert (tmp_path / "model" / "config.json").is_file()
    assert any("1 worker(s), tpu-v5-lite-podslice 2x2" in line for line in lines)


# --- a 2-host slice's environment, faked at the process boundary


TWO_HOSTS = {"TPU_WORKER_HOSTNAMES": "j-node-0-0.j,j-node-0-1.j", "TPU_WORKER_ID": "1"}


@pytest.fixture
def fake_jax_initialize(monkeypatch):
    """jax.distributed.initialize replaced by a recorder (the boundary: the real one would
    dial the slice's other host); the trainer's once-only flag reset."""
    import jax

    from kubejax.trainer import distributed

    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    monkeypatch.setattr(distributed, "_INITIALIZED", False)
    return calls


def test_fake_two_host_slice_joins_through_jaxs_cloud_tpu_detection(fake_jax_initialize):
    """GKE's TPU environment alone (no engine contract): `jax.distributed.initialize()` with
    no coordinator, count or id (JAX's GKE TPU cluster reads them), only the wait."""
    from kubejax.trainer import distributed

    penv = distributed.initialize(dict(TWO_HOSTS), timeout_s=42)
    assert (penv.coordinator, penv.num_processes, penv.process_id, penv.contract) == (
        None, 2, 1, "tpu",
    )  # fmt: skip
    assert fake_jax_initialize == [{"initialization_timeout": 42}]
    distributed.initialize(dict(TWO_HOSTS))  # once only
    assert len(fake_jax_initialize) == 1


def test_fake_two_host_slice_under_an_engine_takes_the_engines_contract(fake_jax_initialize):
    """A TrainJob on jax-tpu gives both its JAX plugin's variables and GKE's TPU ones: the
    engine's, explicit, win (the same processes either way)."""
    from kubejax.trainer import distributed

    env = {**TWO_HOSTS, "JAX_COORDINATOR_ADDRESS": "j-node-0-0.j:29500",
           "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}  # fmt: skip
    assert distributed.initialize(env, timeout_s=5).contract == "trainjob"
    assert fake_jax_initialize == [
        {"coordinator_address": "j-node-0-0.j:29500", "num_processes": 2, "process_id": 1,
         "initialization_timeout": 5}
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        # What a single-host TPU VM sets (read on the v5e VM the device tool lends): one process.
        ({"TPU_WORKER_HOSTNAMES": "localhost", "TPU_WORKER_ID": "0"}, (1, 0, "none")),
        ({"TPU_PROCESS_ADDRESSES": "a:8476,b:8476", "TPU_WORKER_ID": "0"}, (2, 0, "tpu")),
        ({**TWO_HOSTS, "MEGASCALE_NUM_SLICES": "2", "MEGASCALE_SLICE_ID": "1"}, (4, 3, "tpu")),
    ],
    ids=["one-host", "process-addresses", "multislice"],
)
def test_fake_tpu_environments_give_the_process_count_and_id(env, expected, fake_jax_initialize):
    from kubejax.trainer import distributed

    penv = distributed.initialize(env)
    assert (penv.num_processes, penv.process_id, penv.contract) == expected
    assert len(fake_jax_initialize) == (expected[0] > 1)


def test_a_bad_tpu_worker_id_names_the_variable():
    from kubejax.trainer.distributed import process_env

    with pytest.raises(ValueError, match=r"^TPU_WORKER_ID: 2 is not in 0\.\.1"):
        process_env({**TWO_HOSTS, "TPU_WORKER_ID": "2"})
