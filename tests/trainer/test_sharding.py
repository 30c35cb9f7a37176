"""The named mesh: FSDP and tensor parallelism give the replicated run's losses and updates
with each device holding its share; the trainer runs, checkpoints, resumes on another mesh and
exports on it (4 CPU devices in processes of their own)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kubejax.models import weights
from kubejax.trainer import sharding
from tests.helpers import beside, side_by_side, tiny_args

HERE = Path(__file__).parent


@pytest.mark.parametrize(
    ("text", "devices", "expected"),
    [
        ("", 4, {"data": 4, "fsdp": 1, "tensor": 1}),
        ("fsdp=-1", 8, {"data": 1, "fsdp": 8, "tensor": 1}),
        ("data=2, fsdp=-1, tensor=2", 8, {"data": 2, "fsdp": 2, "tensor": 2}),
        ("tensor=2", 2, {"data": 1, "fsdp": 1, "tensor": 2}),
    ],
)
def test_mesh_sizes(text, devices, expected):
    assert sharding.parse_mesh(text, devices) == expected


@pytest.mark.parametrize(
    ("text", "devices", "message"),
    [
        ("fsdp=3", 4, "mesh: fsdp=3 makes 3 devices, but the job has 4"),
        ("fsdp=-1,data=-1", 4, "only one axis may be -1, got data, fsdp"),
        ("model=2", 2, "'model=2' is not AXIS=SIZE with AXIS one of data, fsdp, tensor"),
        ("fsdp=3,data=-1", 4, "3 does not divide the 4 devices"),
        ("fsdp=0", 4, "fsdp=0; a size is positive or -1"),
    ],
)
def test_a_mesh_that_does_not_fit_is_refused_naming_the_numbers(text, devices, message):
    with pytest.raises(sharding.MeshError, match=message):
        sharding.parse_mesh(text, devices)


def test_a_tensor_axis_must_divide_heads_and_mlp(tiny_decoder_dir):
    from kubejax.models import weights

    cfg = weights.load_config(tiny_decoder_dir)  # 4 heads, 2 KV heads, MLP 80
    sharding.check_model(cfg, {"data": 1, "fsdp": 1, "tensor": 2})
    with pytest.raises(
        sharding.MeshError, match=r"tensor=4 does not divide .*key_value_heads \(2\)"
    ):
        sharding.check_model(cfg, {"data": 1, "fsdp": 1, "tensor": 4})


@pytest.fixture(scope="module")
def sharded_runs(tiny_decoder_dir):
    """Three train steps of the tiny decoder on each mesh, 4 CPU devices."""
    script = [sys.executable, str(HERE / "sharded_steps.py"), str(tiny_decoder_dir)]
    outs = side_by_side(  # two processes of two meshes each
        [[*script, "", "fsdp=4"], [*script, "fsdp=2,tensor=2", "data=2,tensor=2", "qlora:fsdp=4"]],
        env={**os.environ, "PYTHONPATH": str(HERE.parents[1])},
    )
    return {k: v for out in outs for k, v in json.loads(out.strip().splitlines()[-1]).items()}


@pytest.mark.parametrize("mesh", ["fsdp=4", "fsdp=2,tensor=2", "data=2,tensor=2"])
@pytest.mark.slow
def test_sharded_steps_equal_the_replicated_ones(sharded_runs, mesh):
    base, run = sharded_runs[""], sharded_runs[mesh]
    assert run["devices"] == 4
    np.testing.assert_allclose(run["losses"], base["losses"], rtol=1e-4)
    for name, expected in base["params"].items():
        got, expected = np.asarray(run["params"][name]), np.asarray(expected)
        scale = np.abs(expected).max()
        assert np.abs(got - expected).max() <= 2e-4 * scale, name


@pytest.mark.parametrize(("mesh", "share"), [("fsdp=4", 0.25), ("fsdp=2,tensor=2", 0.25)])
@pytest.mark.slow
def test_each_device_holds_its_share(sharded_runs, mesh, share):
    """Loaded straight into shards, trained in them: the weight matrices a quarter each, the
    moments likewise; only vectors (norms) and the 5-label head stay whole."""
    run = sharded_runs[mesh]
    sizes = {k: np.asarray(v).size for k, v in sharded_runs[""]["params"].items()}
    held = sum(run["state_fraction"][k] * n for k, n in sizes.items()) / sum(sizes.values())
    assert share <= held < share + 0.02
    assert run["moment_fraction"] == share
    matrices = {k: v for k, v in run["loaded_fraction"].items() if k.endswith(("kernel", "ing"))}
    assert min(matrices.values()) == share and matrices["model.embed_tokens.embedding"] == share
    assert sharded_runs[""]["moment_fraction"] == 1.0


def test_qlora_loads_each_projection_in_its_shards(sharded_runs, tiny_decoder_dir):
    """QLoRA's load on fsdp=4: each read of the checkpoint takes one device's quarter of a
    projection (so a worker reads only its own devices' parts), quantized there into codes a
    quarter a device, equal to quantizing the whole model after a plain load."""
    run = sharded_runs["qlora:fsdp=4"]
    cfg = weights.load_config(tiny_decoder_dir)
    assert run["equal"]
    assert run["reads"] == 4 * 7 * cfg.num_hidden_layers and run["largest_read"] == 0.25
    assert run["codes_fraction"] == 0.25


def _trainer_cmd(args: list[str], devices: int = 4) -> tuple[list[str], dict[str, str]]:
    env = {**os.environ, "JAX_NUM_CPU_DEVICES": str(devices)}
    return [sys.executable, "-m", "kubejax.trainer", *args], env


def _trainer(args: list[str], devices: int = 4) -> None:
    cmd, env = _trainer_cmd(args, devices)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


@pytest.mark.slow
def test_trainer_resumes_on_another_mesh_and_exports(tiny_decoder_dir, prepared_decoder, tmp_path):
    """Saved on fsdp=4, resumed on fsdp=2 × tensor=2: the steps after the checkpoint give the
    uninterrupted run's losses; the model folder is gathered from the shards."""
    from safetensors.numpy import load_file

    common = {"schedule": "constant", "warmup_ratio": 0.0, "max_eval_examples": 32}
    whole, part = tmp_path / "whole", tmp_path / "part"
    with beside(*_trainer_cmd(tiny_args(tiny_decoder_dir, prepared_decoder, whole, max_steps=4,
                                        **common))):  # fmt: skip
        first = {"max_steps": 2, "mesh": "fsdp=4", **common}
        _trainer(tiny_args(tiny_decoder_dir, prepared_decoder, part, **first))
        (part / "model").rename(tmp_path / "model-at-2")
        _trainer(
            tiny_args(
                tiny_decoder_dir,
                prepared_decoder,
                part,
                max_steps=4,
                mesh="fsdp=2,tensor=2",
                **common,
            )
        )
    losses = {
        run: [row["loss"] for row in json.loads((run / "metrics.json").read_text())["train"]]
        for run in (whole, part)
    }
    assert len(losses[part]) == 4  # steps 1-2 from the first run's history, 3-4 resumed
    np.testing.assert_allclose(losses[part], losses[whole], rtol=1e-4)
    ours, expected = (
        load_file(part / "model" / "model.safetensors"),
        load_file(whole / "model" / "model.safetensors"),
    )
    assert ours.keys() == expected.keys()
    for name, value in expected.items():
        assert np.abs(ours[name] - value).max() <= 2e-4 * np.abs(value).max(), name


@pytest.mark.slow
@pytest.mark.parametrize("contract", ["jaxjob", "trainjob"])
def test_two_processes_give_one_process_losses(
    contract, tiny_decoder_dir, prepared_decoder, tmp_path
):
    """2 local workers (gloo between them) under either engine's environment give the single
    process's losses; the model is gathered from the shards the two processes hold.
    jaxjob: data=2 × fsdp=2 over 2 devices a worker (a pod's 2 GPUs, emulated by the local
    backend as 2 CPU devices). trainjob, under QLoRA (nf4): resumes the checkpoint a 1-process
    fsdp=4 run saved at step 1 on fsdp=2 over 2 processes of one device; each process
    quantizes the projections as they load and keeps its shards of the codes (quantizing the
    loaded kernels once gathered what other processes held, and failed); its export replaces
    the adapter the first run exported into the same output_dir (which once failed)."""
    from safetensors.numpy import load_file

    from kubejax.jobs.client import JAXJobClient
    from kubejax.jobs.launch import run_job
    from kubejax.jobs.spec import JAXJobSpec, resources
    from tests.helpers import trainer_cmd

    flags = {"max_steps": 3, "max_eval_examples": 32, "global_batch_size": 8}
    if contract == "trainjob":
        flags.update(peft="qlora", weight_qtype="nf4")
    one, two = tmp_path / "one", tmp_path / "two"
    with beside(*_trainer_cmd(tiny_args(tiny_decoder_dir, prepared_decoder, one, **flags), 1)):
        if contract == "jaxjob":
            mesh, gpus = "data=2,fsdp=2", 2
        else:
            mesh, gpus = "fsdp=2", 0
            saved = {**flags, "max_steps": 1, "mesh": "fsdp=4"}
            _trainer(tiny_args(tiny_decoder_dir, prepared_decoder, two, **saved), devices=4)
        args = tiny_args(tiny_decoder_dir, prepared_decoder, two, mesh=mesh, **flags)
        client = JAXJobClient("local", log_root=tmp_path / "logs", env_contract=contract)
        job = JAXJobSpec(name=f"fsdp-{contract}", image="local", command=trainer_cmd()[:3],
                         args=args, replicas=2, resources=resources(gpus=gpus))  # fmt: skip
        run_job(client, job, timeout=300, polling_interval=0.2, log=None)
    metrics = {run: json.loads((run / "metrics.json").read_text()) for run in (one, two)}
    assert metrics[two]["final"]["num_processes"] == 2
    assert metrics[two]["final"]["num_devices"] == 2 * max(gpus, 1)
    np.testing.assert_allclose(
        [r["loss"] for r in metrics[two]["train"]],
        [r["loss"] for r in metrics[one]["train"]],
        rtol=1e-4,
    )
    ours, expected = (load_file(run / "model" / "model.safetensors") for run in (two, one))
    for name, value in expected.items():
        assert np.abs(ours[name] - value).max() <= 2e-4 * np.abs(value).max(), name


@pytest.mark.slow
def test_lora_on_a_sharded_mesh_gives_the_replicated_losses(
    tiny_decoder_dir, prepared_prompts, tmp_path
):
    """peft=lora with the task causal-lm: the frozen base in its shards (fsdp=2 × tensor=2),
    the adapters replicated, the losses of the data-parallel run on the same 4 devices."""
    common = {"peft": "lora", "lora_targets": "all", "max_steps": 3, "max_eval_examples": 16,
              "save_final": False}  # fmt: skip
    runs = {mesh: tmp_path / (mesh or "replicated") for mesh in ("", "fsdp=2,tensor=2")}
    for mesh, out in runs.items():
        _trainer(tiny_args(tiny_decoder_dir, prepared_prompts, out, mesh=mesh, **common))
    losses = [
        [row["loss"] for row in json.loads((out / "metrics.json").read_text())["train"]]
        for out in runs.values()
    ]
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-4)
