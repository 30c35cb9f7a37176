"""The memory plan: its figures against XLA's compiled memory analysis, the refusal of what
does not fit (naming each figure and the smallest setting that fits), before any job."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import yaml

from kubejax.cli import main
from kubejax.errors import InfeasibleError
from kubejax.trainer import plan
from kubejax.trainer.config import ConfigError, TrainConfig
from tests.helpers import side_by_side

SMALL = json.dumps(
    {"model_type": "qwen2", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
     "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 2000}
)  # fmt: skip
DEEPER = json.dumps({**json.loads(SMALL), "num_hidden_layers": 8})


@pytest.mark.slow
def test_the_plan_is_within_a_quarter_of_what_xla_allocates():
    """Replicated, FSDP, FSDP × tensor and data × FSDP in bfloat16, on 4 CPU devices: the plan
    per device within 25 % of the compiled step's arguments plus temporaries."""
    cases = {
        "replicated": {"scratch_config": DEEPER, "global_batch_size": 8, "max_length": 128},
        "fsdp": {"scratch_config": DEEPER, "mesh": "fsdp=4", "global_batch_size": 16,
                 "max_length": 128},
        "fsdp-tensor": {"scratch_config": SMALL, "mesh": "fsdp=2,tensor=2",
                        "global_batch_size": 8, "max_length": 128},
        "bfloat16": {"scratch_config": SMALL, "mesh": "data=2,fsdp=2", "global_batch_size": 8,
                     "max_length": 256, "dtype": "bfloat16", "param_dtype": "bfloat16"},
    }  # fmt: skip
    script = Path(__file__).with_name("plan_vs_xla.py")
    # Two processes of two cases each, side by side: XLA compiles a program on one core.
    names = list(cases)
    outs = side_by_side(
        [[sys.executable, str(script), json.dumps({n: cases[n] for n in half})]
         for half in (names[0::2], names[1::2])],
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )  # fmt: skip
    figures = {k: v for out in outs for k, v in json.loads(out.strip().splitlines()[-1]).items()}
    assert figures.keys() == cases.keys()
    for name, (planned, compiled) in figures.items():
        assert 0.75 <= planned / compiled <= 1.25, (name, planned, compiled)


def _cfg(**settings) -> TrainConfig:
    return TrainConfig(model="scratch", scratch_config=DEEPER, tokenizer="-", data_dir="-",
                       output_dir="-", **settings)  # fmt: skip


def test_fsdp_divides_the_state_and_bfloat16_halves_the_weights():
    model_cfg = plan.model_config(_cfg())
    one = plan.plan_memory(_cfg(), model_cfg, 5, 4)
    fsdp = plan.plan_memory(_cfg(mesh="fsdp=4"), model_cfg, 5, 4)
    half = plan.plan_memory(_cfg(param_dtype="bfloat16"), model_cfg, 5, 4)
    # Every matrix has a hidden axis 4 divides; the norms (a few kB) stay whole.
    assert 0.25 <= fsdp.params / one.params < 0.26
    assert 0.25 <= fsdp.optimizer / one.optimizer < 0.26
    assert 0.5 <= half.params / one.params < 0.51
    assert half.optimizer == one.optimizer  # moments stay float32
    mu16 = plan.plan_memory(_cfg(mu_dtype="bfloat16"), model_cfg, 5, 4)
    assert mu16.optimizer == one.optimizer * 3 // 4  # Adam's first moment in 2 bytes of 8
    assert fsdp.micro_batch == one.micro_batch == 8  # 32 rows over 4 devices


def test_a_run_that_does_not_fit_is_refused_naming_each_figure_and_what_fits():
    # Set explicitly, so kept: `auto` would take the micro-batches that fit
    # (tests/trainer/test_plan_auto.py).
    cfg = _cfg(global_batch_size=32, max_length=512, grad_accum_steps=1, remat="none")
    model_cfg = plan.model_config(cfg)
    with pytest.raises(InfeasibleError) as err:
        plan.check_fits(cfg, model_cfg, 5, 4, plan.parse_bytes("250MiB"))
    message = str(err.value)
    assert message.startswith("device_memory: the run needs")
    assert "\n" not in message
    for figure in ("params", "grads", "optimizer", "activations", "gathered", "on mesh"):
        assert figure in message
    # "fits with mesh=…, grad_accum_steps=N (… per device), or with attention=…, …"
    first, second = message.split("fits with ")[1].split(", or with ")
    changes = dict(part.split("=", 1) for part in first.split(" (")[0].split(", ", 1))
    assert set(changes) == {"mesh", "grad_accum_steps"}, message
    fit = plan.plan_memory(
        _cfg(global_batch_size=32, max_length=512, mesh=changes["mesh"], remat="none",
             grad_accum_steps=int(changes["grad_accum_steps"])),
        model_cfg, 5, 4, plan.parse_bytes("250MiB"),
    )  # fmt: skip
    assert fit.fits
    # The other way changes a setting the run does not have (its attention is the reference).
    assert second.startswith("attention=chunked"), message
    with pytest.raises(InfeasibleError, match=r"nothing on 4 device\(s\) fits even one row"):
        plan.check_fits(cfg, model_cfg, 5, 4, plan.parse_bytes("10MiB"))


def test_device_memory_from_the_setting_or_the_gpu_product():
    assert plan.parse_bytes("80GiB") == 80 * 2**30
    assert plan.parse_bytes("24GB") == 24 * 10**9
    assert plan.gpu_memory("NVIDIA-H100-80GB-HBM3") == 80 * 10**9
    assert plan.gpu_memory("NVIDIA-L4") == 24 * 10**9
    assert plan.gpu_memory("Some-New-Card") is None
    selector = {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB"}
    # JAX's allocator takes 75 % of a GPU unless told otherwise.
    assert plan.device_memory_of(_cfg(), selector) == 30 * 10**9
    assert plan.device_memory_of(_cfg(device_memory="16GiB"), selector) == 16 * 2**30
    with pytest.raises(ConfigError, match="device_memory: 'lots' is neither a size"):
        _cfg(device_memory="lots").validate(check_paths=False)


def test_plan_cli_prints_the_figures_and_refuses_what_does_not_fit(capsys):
    args = ["--", "--model", "scratch", "--tokenizer", "-", "--scratch-config", DEEPER,
            "--mesh", "fsdp=-1", "--max-length", "512"]  # fmt: skip
    assert main(["plan", "--replicas", "2", "--devices-per-worker", "2", *args]) == 0
    out = capsys.readouterr().out
    assert "mesh data=1,fsdp=4,tensor=1" in out and "activations" in out
    as_set = [*args, "--grad-accum-steps", "1", "--remat", "none"]  # `auto` would fit it
    assert main(["plan", "--replicas", "2", "--device-memory", "400MiB", *as_set]) == 2
    err = capsys.readouterr().err
    assert "device_memory: the run needs" in err and "fits with mesh=" in err


def test_render_refuses_a_mesh_the_workers_do_not_make(capsys):
    """Before any manifest: the mesh against replicas × GPUs, the tensor axis against heads."""
    trainer = ["--", "--model", "scratch", "--tokenizer", "-", "--scratch-config", SMALL]
    assert main(["render", "--replicas", "3", *trainer, "--mesh", "fsdp=2"]) == 2
    assert "makes 2 devices, but the job has 3" in capsys.readouterr().err
    assert main(["render", "--replicas", "2", *trainer, "--mesh", "tensor=8"]) == 2
    err = capsys.readouterr().err
    assert "makes 8 devices, but the job has 2" in err and "devices_per_worker 1" in err
    argv = ["render", "--replicas", "2", "--gpus", "4", *trainer, "--mesh", "fsdp=4,tensor=2"]
    assert main(argv) == 0  # 2 workers of 4 GPUs: 8 devices; 4 heads and 2 KV heads split in 2
    trainer_spec = yaml.safe_load(capsys.readouterr().out)["spec"]["trainer"]
    assert trainer_spec["numNodes"] == 2
    assert trainer_spec["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == 4
    assert main(["render", "--replicas", "1", "--gpus", "8", *trainer, "--mesh", "tensor=8"]) == 2
    assert "tensor=8 does not divide the model's num_attention_heads (4)" in (
        capsys.readouterr().err
    )


def test_lora_settings_are_refused_before_any_job(capsys):
    """A rank of 0, a target the model's family lacks, a dropout of 1: one line naming the
    setting, exit status 2, no manifest."""
    decoder = ["--model", "scratch", "--tokenizer", "-", "--scratch-config", SMALL]
    tiny_bert = json.dumps({"hidden_size": 32, "num_attention_heads": 2})
    bert = ["--model", "scratch", "--tokenizer", "-", "--scratch-config", tiny_bert]
    cases = {
        "lora_rank: must be at least 1, got 0": [*decoder, "--peft", "lora", "--lora-rank", "0"],
        "lora_targets: query matches no module of the qwen2 model; its projections are q_proj":
            [*decoder, "--peft", "lora", "--lora-targets", "attention,query"],
        "lora_targets: q_proj matches no module of the bert model; its projections are query, "
        "key, value, attn_out, intermediate, output": [*bert, "--peft", "lora",
                                                       "--lora-targets", "q_proj"],
        "lora_dropout: must be in [0, 1), got 1.0": [*bert, "--peft", "lora",
                                                     "--lora-dropout", "1"],
        "peft: 'qlora2' is not one of none, lora": [*decoder, "--peft", "qlora2"],
    }  # fmt: skip
    for expected, args in cases.items():
        assert main(["render", "--", *args]) == 2, expected
        out, err = capsys.readouterr()
        assert expected in err and out == "", (expected, err)


def _tpu_cases() -> dict:
    sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
    import bench_tpu

    return {case.name: case for case in bench_tpu.cases()}


def _tpu_cfg(model: dict, settings: dict) -> TrainConfig:
    fields = {k: v for k, v in settings.items() if k in TrainConfig.__dataclass_fields__}
    return TrainConfig(model="scratch", scratch_config=json.dumps(model), tokenizer="-",
                       data_dir="-", output_dir="-", device_memory="v5e", **fields)  # fmt: skip


@pytest.mark.slow
def test_the_plan_agrees_with_the_step_programs_measured_on_a_tpu():
    """Each case of the TPU benchmark (bench/tpu-results.json, a v5e chip, the trainer as a job
    runs it): the plan of its settings within 15 % of what its compiled step needs there (XLA's
    memory analysis: arguments, outputs, temporaries), and a run that ran out of the chip's
    memory refused."""
    result = json.loads((Path(__file__).parents[2] / "bench" / "tpu-results.json").read_text())
    cases = _tpu_cases()
    checked = 0
    for row in result["cases"]:
        if not row.get("step_program_bytes"):
            continue
        cfg = _tpu_cfg(cases[row["case"]].model, row["settings"])
        planned = plan.plan_memory(cfg, plan.model_config(cfg), 5, 1, None, platform="tpu")
        assert 0.85 <= planned.total / row["step_program_bytes"] <= 1.15, (row["what"], planned)
        if "error" in row:
            assert planned.total > plan.device_memory_of(cfg), row["what"]
        checked += 1
    assert checked >= 6


@pytest.mark.parametrize(
    ("shape", "settings", "fits_with", "never"),
    [
        # Llama-3.2-1B LoRA at 4 × 2,048 with the reference attention: 38 GB of temporaries on
        # the chip (../shared/TPU.md).
        ("LLAMA_1B", {"peft": "lora", "attention": "xla", "global_batch_size": 4},
         ["grad_accum_steps=4", "attention=splash"], ["param_dtype", "peft="]),
        # Its full fine-tuning with bfloat16 weights and remat minimal: out of memory at the
        # optimizer's initialisation.
        ("LLAMA_1B", {"remat": "minimal", "global_batch_size": 4}, ["peft=lora"],
         ["param_dtype", "remat=minimal", "attention="]),
        ("QWEN_05B", {"peft": "lora", "global_batch_size": 16}, ["grad_accum_steps=2"],
         ["peft=", "attention=", "param_dtype"]),
    ],
)  # fmt: skip
def test_what_does_not_fit_a_tpu_chip_is_refused_naming_what_would(shape, settings, fits_with,
                                                                    never):  # fmt: skip
    """Refused before anything starts, naming the least changes that fit (a smaller
    micro-batch, a memory-efficient attention, remat, LoRA), never a setting the run has."""
    import bench_tpu  # noqa: F401  (_tpu_cases puts benchmarks/ on the path)

    _tpu_cases()
    model = getattr(sys.modules["bench_tpu"], shape)
    # The run's micro-batches and remat as set (one batch, no remat where the case says
    # nothing), so refused; `auto` would fit some of them (tests/trainer/test_plan_auto.py).
    cfg = _tpu_cfg(model, {"max_length": 2048, "dtype": "bfloat16", "param_dtype": "bfloat16",
                           "grad_accum_steps": 1, "remat": "none", **settings})  # fmt: skip
    with pytest.raises(InfeasibleError) as err:
        plan.check_fits(cfg, plan.model_config(cfg), 5, 1, plan.device_memory_of(cfg), "tpu")
    message = str(err.value)
    assert "more than the 15.75 GiB of the device" in message, message
    advice = message.split("; ", 1)[1]
    for change in fits_with:
        assert change in advice, message
    for setting in never:
        assert setting not in advice, message


def test_device_memory_takes_a_tpu_type_and_the_node_selector_a_slice():
    cfg = _cfg(device_memory="tpu-v6e-slice")
    assert plan.device_memory_of(cfg) == int(32 * 2**30 * 15.75 / 16)
    selector = {"cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice"}
    assert plan.device_memory_of(_cfg(), selector) == int(16 * 2**30 * 15.75 / 16)
    assert plan.platform_of(_cfg(), selector) == "tpu"
    with pytest.raises(ConfigError, match="device_memory: 'tpu-v9' is neither a size"):
        _cfg(device_memory="tpu-v9").validate(check_paths=False)
