"""`grad_accum_steps` and `remat` `auto`, the defaults: the memory plan settles them on the
device's memory (faked here by the `device_memory` setting, a GPU's reported `bytes_limit`, or a
TPU chip's table figure) — the run as it asks where it fits, else the fewest micro-batches of the
same global batch, else the cheapest remat policy, else a refusal naming the two nearest
changes — in the trainer (its first line says what it chose and why), the sweep's trial
planning, `kubejax plan` and `kubejax render`, before any weight is read."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import pytest
import yaml

from kubejax.cli import main
from kubejax.errors import InfeasibleError
from kubejax.flags import to_flags
from kubejax.launchers.common import check_hyperparameters
from kubejax.launchers.sweep import point_error
from kubejax.trainer import plan
from kubejax.trainer.config import ConfigError, TrainConfig, from_args
from kubejax.trainer.train import main as trainer_main
from kubejax.tune.space import default_point
from tests.helpers import tiny_args

DECODER = json.dumps(
    {"model_type": "qwen2", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 8,
     "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 2000}
)  # fmt: skip
BERT = json.dumps({"hidden_size": 64, "num_attention_heads": 2, "num_hidden_layers": 2,
                   "intermediate_size": 128})  # fmt: skip


def _cfg(scratch: str = DECODER, **settings) -> TrainConfig:
    base = {"global_batch_size": 8, "max_length": 128, "attention": "xla", **settings}
    return TrainConfig(model="scratch", scratch_config=scratch, tokenizer="-", data_dir="-",
                       output_dir="-", **base)  # fmt: skip


def _total(cfg: TrainConfig, devices: int = 1, **settings) -> int:
    """The plan's bytes a device of `cfg` with `settings` (micro-batches, remat) set."""
    trial = dataclasses.replace(cfg, **settings)
    return plan.plan_memory(trial, plan.model_config(trial), 5, devices).total


def _fit(cfg: TrainConfig, memory: int | None, devices: int = 1):
    return plan.fit_memory(cfg, plan.model_config(cfg), 5, devices, memory)


def _between(low: int, high: int) -> int:
    assert low < high, (low, high)
    return (low + high) // 2


# --- the rule, on the plan's own figures


def test_defaults_are_auto_and_a_run_that_fits_as_it_asks_is_unchanged():
    cfg = TrainConfig()
    assert (cfg.grad_accum_steps, cfg.remat) == ("auto", "auto")
    cfg = _cfg()
    settled, fitting = _fit(cfg, 64 * 2**30)
    assert (settled.grad_accum_steps, settled.remat) == (1, "none")
    assert fitting.plan.total == _total(cfg, grad_accum_steps=1, remat="none")
    assert fitting.describe().startswith("one batch of 8 × 128, remat none (auto: ")
    assert fitting.describe().endswith("of the 64.0 GiB device)")


def test_two_micro_batches_are_chosen_where_one_batch_does_not_fit():
    cfg = _cfg()
    one, two = _total(cfg, grad_accum_steps=1), _total(cfg, grad_accum_steps=2)
    settled, fitting = _fit(cfg, _between(two, one))
    assert (settled.grad_accum_steps, settled.remat) == (2, "none")
    assert fitting.plan.micro_batch == 4 and fitting.as_asked == one
    said = fitting.describe()
    assert said.startswith("2 micro-batches of 4 × 128, remat none (auto: ")
    assert f"{one / 2**20:.0f} MiB as one batch" in said and " device)" in said


def test_the_fewest_micro_batches_that_fit_are_taken():
    cfg = _cfg()
    four, eight = _total(cfg, grad_accum_steps=4), _total(cfg, grad_accum_steps=8)
    settled, fitting = _fit(cfg, _between(eight, four))
    assert settled.grad_accum_steps == 8 and fitting.plan.micro_batch == 1


def test_a_remat_policy_is_chosen_where_no_count_of_micro_batches_fits():
    """One row a device (no micro-batch to split off): the cheapest policy that fits,
    `minimal` before `full`."""
    cfg = _cfg(global_batch_size=1, max_length=512)
    none, minimal, full = (_total(cfg, remat=r) for r in ("none", "minimal", "full"))
    settled, fitting = _fit(cfg, _between(minimal, none))
    assert (settled.grad_accum_steps, settled.remat) == (1, "minimal")
    assert "remat minimal (auto: " in fitting.describe()
    assert "as one batch without remat" in fitting.describe()
    settled, _ = _fit(cfg, _between(full, minimal))
    assert settled.remat == "full"


def test_micro_batches_come_before_remat():
    """Where both two micro-batches and `minimal` in one batch would fit, the micro-batches
    (remat costs every step its recomputation)."""
    cfg = _cfg()
    memory = max(_total(cfg, grad_accum_steps=2), _total(cfg, remat="minimal")) + 1
    assert memory < _total(cfg)
    settled, _ = _fit(cfg, memory)
    assert (settled.grad_accum_steps, settled.remat) == (2, "none")


def test_nothing_fits_refused_naming_the_two_nearest_changes():
    """On 4 devices, less than even 8 micro-batches of one row under `full` need: refused,
    naming each figure, the least auto tried, and a sharded mesh or another setting — never
    the micro-batches or remat that auto was left to choose."""
    cfg = _cfg(global_batch_size=32)
    least = _total(cfg, 4, grad_accum_steps=8, remat="full")
    with pytest.raises(InfeasibleError) as err:
        _fit(cfg, least - 2**20, devices=4)
    message = str(err.value)
    assert message.startswith("device_memory: the run needs") and "\n" not in message
    assert "at the least that auto tries (8 micro-batches of 1 × 128, remat full)" in message
    advice = message.split("; ", 1)[1]
    first, second = advice.removeprefix("fits with ").split(", or with ")
    assert first.startswith("mesh=data=") and "fsdp=" in first, message
    assert second.startswith(("attention=", "param_dtype=", "peft=")), message
    assert "grad_accum_steps=" not in advice and "remat=" not in advice


def test_an_explicit_setting_is_kept_and_refused_where_it_does_not_fit():
    cfg = _cfg()
    one, two = _total(cfg, grad_accum_steps=1), _total(cfg, grad_accum_steps=2)
    memory = _between(two, one)
    with pytest.raises(InfeasibleError, match=r"fits with .*grad_accum_steps=2"):
        _fit(dataclasses.replace(cfg, grad_accum_steps=1, remat="none"), memory)
    # Explicit micro-batches, remat left to auto: the micro-batches kept, remat none fits.
    settled, fitting = _fit(dataclasses.replace(cfg, grad_accum_steps=4), memory)
    assert (settled.grad_accum_steps, settled.remat) == (4, "none")
    # Both set: kept as set, said so.
    settled, fitting = _fit(dataclasses.replace(cfg, grad_accum_steps=2, remat="full"), memory)
    assert (settled.grad_accum_steps, settled.remat) == (2, "full")
    assert fitting.describe() == "2 micro-batches of 4 × 128, remat full (as set)"
    # An explicit remat with auto micro-batches: the policy kept, the count chosen under it.
    settled, _ = _fit(dataclasses.replace(cfg, remat="full"), _total(cfg, remat="full") + 1)
    assert (settled.grad_accum_steps, settled.remat) == (1, "full")


def test_without_a_known_memory_the_run_is_as_it_asks_and_max_micro_batch_caps_it():
    settled, fitting = _fit(_cfg(), None)
    assert (settled.grad_accum_steps, settled.remat) == (1, "none")
    assert fitting.describe().endswith("(auto: no device memory known to plan against)")
    settled, _ = _fit(_cfg(max_micro_batch=2), None)
    assert settled.grad_accum_steps == 4
    # The plan of a config left to auto is the run as it asks.
    assert plan.plan_memory(_cfg(), plan.model_config(_cfg()), 5, 1).micro_batch == 8


def test_bert_trains_without_remat():
    settled, fitting = _fit(_cfg(BERT, attention="auto"), 64 * 2**30)
    assert settled.remat == "none" and "remat" not in fitting.describe()
    with pytest.raises(ConfigError, match="remat: 'full' applies to decoder models"):
        _fit(_cfg(BERT, attention="auto", remat="full"), None)


def test_a_gpus_own_memory_is_the_bound(monkeypatch):
    """The same rule on a GPU with the memory its runtime reports (a fake device whose
    `memory_stats` give a `bytes_limit`)."""
    cfg = _cfg()
    one, two = _total(cfg), _total(cfg, grad_accum_steps=2)
    fake = SimpleNamespace(platform="gpu", device_kind="NVIDIA L4",
                           memory_stats=lambda: {"bytes_limit": _between(two, one)})  # fmt: skip
    with monkeypatch.context() as m:
        m.setattr(jax, "devices", lambda *a: [fake])
        memory = plan.device_memory_of(cfg)
    assert memory == _between(two, one)
    settled, _ = plan.fit_memory(cfg, plan.model_config(cfg), 5, 1, memory, "gpu")
    assert settled.grad_accum_steps in (2, 4)  # the GPU's working set is the TPU's, larger


# --- settings as flags, KFP parameters and sweep defaults


def test_auto_and_counts_pass_through_flags_and_kfp_parameters():
    assert from_args(["--grad-accum-steps", "auto"]).grad_accum_steps == "auto"
    assert from_args(["--grad-accum-steps", "4"]).grad_accum_steps == 4
    assert to_flags(TrainConfig, {"grad_accum_steps": 2.0}) == ["--grad-accum-steps", "2"]
    assert check_hyperparameters({"model": "m", "grad_accum_steps": "auto"}).remat == "auto"
    cfg = TrainConfig(model="m", data_dir="d", output_dir="o", grad_accum_steps="2")
    assert cfg.validate(check_paths=False).grad_accum_steps == 2


def test_a_sweeps_defaults_point_stands_in_for_auto():
    space = {"grad_accum_steps": {"type": "int", "low": 1, "high": 4}}
    point, widened, notes = default_point(space, {"grad_accum_steps": "auto"})
    assert point == {"grad_accum_steps": 1} and widened == space
    assert "'auto' is no number" in notes[0]


def test_a_sweep_point_that_fits_in_micro_batches_is_not_pruned():
    cfg = _cfg()
    memory = _between(_total(cfg, grad_accum_steps=2), _total(cfg))
    fixed = {"model": "scratch", "tokenizer": "-", "scratch_config": DECODER,
             "attention": "xla", "max_length": 128, "device_memory": str(memory)}  # fmt: skip
    space = {"global_batch_size": {"type": "categorical", "choices": [8]}}
    placement = {"accelerator": "", "tpu_topology": ""}
    assert point_error({"global_batch_size": 8}, space, fixed, 1, 0, None, placement) is None
    as_set = {**fixed, "grad_accum_steps": 1, "remat": "none"}
    err = point_error({"global_batch_size": 8}, space, as_set, 1, 0, None, placement)
    assert isinstance(err, InfeasibleError) and "grad_accum_steps=2" in str(err)


# --- the command line: plan and render, with and without the weights at hand


def _bench_tpu():
    sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
    import bench_tpu

    return bench_tpu


LLAMA_RUN = ["--peft", "lora", "--dtype", "bfloat16", "--param-dtype", "bfloat16",
             "--mu-dtype", "bfloat16", "--global-batch-size", "8", "--max-length", "2048",
             "--tokenizer", "-"]  # fmt: skip
ON_A_V5E = ["--accelerator", "tpu-v5-lite-podslice", "--tpu-topology", "1x1"]


def test_plan_says_the_choice_on_a_tpu_chip(tmp_path, capsys):
    """Llama-3.2-1B shape LoRA at 2,048 × 8 on one v5e chip: refused as one batch on the
    chip (bench/tpu-results.md), two micro-batches by auto; from its config.json alone."""
    config = tmp_path / "llama-1b.json"
    config.write_text(json.dumps(_bench_tpu().LLAMA_1B))
    argv = ["plan", *ON_A_V5E, "--model-config", str(config), "--", "--model", "/models/m"]
    assert main([*argv, *LLAMA_RUN]) == 0
    out = capsys.readouterr().out
    assert "batch: 2 micro-batches of 4 × 2,048, remat none (auto: 20." in out, out
    assert "GiB as one batch, 15.8 GiB device)" in out and "total" in out
    assert main([*argv, *LLAMA_RUN, "--grad-accum-steps", "1", "--remat", "none"]) == 2
    err = capsys.readouterr().err
    assert "device_memory: the run needs 20." in err and "grad_accum_steps=2" in err


def test_render_needs_no_weights(tmp_path, capsys):
    """A model only on the cluster (a volume's path): rendered with the plan skipped and one
    line saying so; with --model-config, planned from it (and refused where it does not
    fit); a --model-config that is no config, refused."""
    render = ["render", *ON_A_V5E]
    trainer = ["--", "--model", "/models/m", *LLAMA_RUN]
    assert main([*render, *trainer]) == 0
    out, err = capsys.readouterr()
    assert yaml.safe_load(out)["kind"] == "TrainJob"
    assert len(err.strip().splitlines()) == 1, err
    assert "the memory plan was not checked (model: /models/m: neither a local folder" in err
    assert "--model-config" in err
    config = tmp_path / "config.json"
    config.write_text(json.dumps(_bench_tpu().LLAMA_1B))
    assert main([*render, "--model-config", str(tmp_path), *trainer]) == 0
    out, err = capsys.readouterr()
    assert yaml.safe_load(out)["kind"] == "TrainJob" and err == ""
    as_set = ["--grad-accum-steps", "1", "--remat", "none"]
    assert main([*render, "--model-config", str(config), *trainer, *as_set]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "device_memory: the run needs" in err
    assert main([*render, "--model-config", str(tmp_path / "nope.json"), *trainer]) == 2
    assert "model_config: " in capsys.readouterr().err
    # Launching submits a job: a model whose config cannot be read here is still refused.
    argv = ["launch", "--engine", "jaxjob", *ON_A_V5E, *trainer]
    assert main(argv) == 2
    assert "neither a local folder" in capsys.readouterr().err


def test_render_refuses_what_the_family_or_the_devices_cannot_take(capsys):
    bert = ["--", "--model", "scratch", "--tokenizer", "-", "--scratch-config", BERT]
    assert main(["render", *bert, "--remat", "full"]) == 2
    assert "remat: 'full' applies to decoder models" in capsys.readouterr().err
    decoder = ["--", "--model", "scratch", "--tokenizer", "-", "--scratch-config", DECODER]
    argv = ["render", "--replicas", "2", *decoder, "--global-batch-size", "8"]
    assert main([*argv, "--grad-accum-steps", "8"]) == 2
    err = capsys.readouterr().err
    assert "grad_accum_steps: 8 does not divide the per-device batch of 4" in err
    assert "use 1, 2, 4 or auto" in err
    assert main([*argv, "--grad-accum-steps", "2"]) == 0


# --- the trainer: its first line, and refusals before any weight is read


def test_the_trainers_first_line_says_the_micro_batches_it_chose(
    tmp_path, capsys, tiny_decoder_dir, prepared_decoder
):
    cfg = from_args(tiny_args(tiny_decoder_dir, prepared_decoder, tmp_path / "x"))
    model_cfg = plan.model_config(cfg)
    devices = jax.device_count()
    one, two = (
        plan.plan_memory(dataclasses.replace(cfg, grad_accum_steps=k), model_cfg, 5, devices,
                         platform=jax.devices()[0].platform).total
        for k in (1, 2)
    )  # fmt: skip
    memory = str(_between(two, one))
    out = tmp_path / "auto"
    argv = tiny_args(tiny_decoder_dir, prepared_decoder, out, max_steps=2, device_memory=memory)
    assert trainer_main(argv) == 0
    first = next(line for line in capsys.readouterr().out.splitlines() if "process(es)" in line)
    share = 8 // devices
    assert f"; 2 micro-batches of {share // 2} × 64, remat none (auto: " in first, first
    assert "as one batch" in first
    # Set to one batch without remat: refused before the weights load, nothing written.
    out = tmp_path / "as-set"
    argv = tiny_args(tiny_decoder_dir, prepared_decoder, out, device_memory=memory,
                     grad_accum_steps=1, remat="none")  # fmt: skip
    assert trainer_main(argv) == 2
    assert "device_memory: the run needs" in capsys.readouterr().err
    assert not (out / "checkpoints").exists()


def test_rows_past_the_models_positions_are_refused_before_the_weights_load(
    tmp_path, capsys, tiny_model_dir, prepared
):
    """A checkpoint of 32 positions whose weights are unreadable: the positions are named,
    not the weights (they are never opened)."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 32}))
    for weights in model.glob("*.safetensors"):
        weights.write_bytes(b"not weights")
    out = tmp_path / "out"
    assert trainer_main(tiny_args(model, prepared, out)) == 2
    err = capsys.readouterr().err
    assert "max_length: rows of" in err and "than the 32 positions of the model" in err
    assert "usable" not in err
