"""dtype `auto`: bfloat16 where the device multiplies it natively, float32 elsewhere."""

from __future__ import annotations

import dataclasses

import pytest

from kubejax.trainer import precision
from kubejax.trainer.config import ConfigError, TrainConfig

AMX = frozenset({"avx2", "avx512f", "amx_bf16", "amx_tile"})
AVX512_BF16 = frozenset({"avx2", "avx512f", "avx512_bf16"})
AVX2 = frozenset({"avx2", "fma"})


@dataclasses.dataclass
class FakeGpu:
    """A JAX CUDA device's one attribute the rule reads."""

    compute_capability: str


@pytest.fixture(autouse=True)
def unpinned(monkeypatch):
    """The suite pins `auto` to float32 (conftest); these tests check the rule itself."""
    monkeypatch.delenv(precision.PIN_ENV, raising=False)


@pytest.mark.parametrize(
    "platform, device, flags, native",
    [
        ("tpu", None, None, True),
        ("gpu", FakeGpu("9.0"), None, True),  # Hopper
        ("gpu", FakeGpu("8.0"), None, True),  # Ampere
        ("gpu", FakeGpu("7.5"), None, False),  # Turing: no bfloat16 tensor cores
        ("gpu", None, None, True),  # a cluster's GPU, not seen here
        ("cpu", None, AMX, True),
        ("cpu", None, AVX512_BF16, True),
        ("cpu", None, AVX2, False),
        ("cpu", None, frozenset(), False),  # a CPU whose flags are not known
    ],
)
def test_auto_takes_bfloat16_only_where_the_device_multiplies_it(platform, device, flags, native):
    chosen = precision.choose("auto", "auto", "lora", platform, device, flags)
    expected = "bfloat16" if native else "float32"
    assert (chosen.dtype, chosen.param_dtype, chosen.native) == (expected, expected, native)
    assert chosen.why.startswith("auto: ")


def test_the_reason_names_what_was_seen():
    assert precision.choose("auto", "auto", "none", "cpu", flags=AMX).why == (
        "auto: amx_bf16 on this CPU"
    )
    assert "neither AMX nor AVX512_BF16" in precision.choose("auto", "auto", "none", "cpu",
                                                             flags=AVX2).why  # fmt: skip
    assert "7.5 < 8.0" in precision.choose("auto", "auto", "none", "gpu", FakeGpu("7.5")).why


def test_full_fine_tuning_keeps_its_trained_weights_in_float32():
    chosen = precision.choose("auto", "auto", "none", "tpu")
    assert (chosen.dtype, chosen.param_dtype) == ("bfloat16", "float32")
    assert precision.choose("auto", "auto", "qlora", "tpu").param_dtype == "bfloat16"


@pytest.mark.parametrize(
    "dtype, param_dtype, flags, expected",
    [
        ("bfloat16", "auto", AVX2, ("bfloat16", "bfloat16")),  # explicit compute wins
        ("float32", "auto", AMX, ("float32", "float32")),  # weights follow the compute
        ("auto", "bfloat16", AVX2, ("float32", "bfloat16")),
        ("float32", "bfloat16", AMX, ("float32", "bfloat16")),
    ],
)
def test_an_explicit_setting_wins(dtype, param_dtype, flags, expected):
    chosen = precision.choose(dtype, param_dtype, "lora", "cpu", flags=flags)
    assert (chosen.dtype, chosen.param_dtype) == expected
    if "auto" not in (dtype, param_dtype):
        assert chosen.why == "as set"


def test_the_pin_decides_what_auto_takes(monkeypatch):
    monkeypatch.setenv(precision.PIN_ENV, "bfloat16")
    chosen = precision.choose("auto", "auto", "lora", "cpu", flags=AVX2)
    assert (chosen.dtype, chosen.why) == ("bfloat16", "auto: KUBEJAX_AUTO_DTYPE=bfloat16")
    monkeypatch.setenv(precision.PIN_ENV, "fp16")
    with pytest.raises(precision.PrecisionError, match="KUBEJAX_AUTO_DTYPE: 'fp16' is not"):
        precision.choose("auto", "auto", "lora", "cpu", flags=AVX2)


def test_settle_resolves_a_config_and_leaves_an_explicit_one_as_it_is():
    cfg = TrainConfig(model="m", peft="lora")
    settled, _ = precision.settle(cfg, "cpu", flags=AMX)
    assert (settled.dtype, settled.param_dtype) == ("bfloat16", "bfloat16")
    assert (cfg.dtype, cfg.param_dtype) == ("auto", "auto")  # the user's config untouched
    explicit = TrainConfig(model="m", dtype="float32", param_dtype="float32")
    assert precision.settle(explicit, "tpu")[0] is explicit


@pytest.mark.parametrize("setting", ["dtype", "param_dtype"])
def test_an_unknown_dtype_is_refused_by_name(setting):
    cfg = TrainConfig(model="m", data_dir="d", output_dir="o", **{setting: "float16"})
    with pytest.raises(ConfigError, match=f"^{setting}: 'float16' is not one of float32, "
                       "bfloat16, auto$"):  # fmt: skip
        cfg.validate(check_paths=False)


def test_the_cpu_flags_are_read_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 amx_bf16 amx_tile\nbugs\t: x\n")
    assert precision.cpu_flags(str(info)) == {"fpu", "avx2", "amx_bf16", "amx_tile"}
    assert precision.cpu_flags(str(tmp_path / "missing")) == frozenset()


def test_the_memory_plan_counts_what_auto_takes():
    from kubejax.models.decoder import DecoderConfig
    from kubejax.trainer import plan

    model_cfg = DecoderConfig.from_dict(
        {"model_type": "qwen2", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    )  # fmt: skip
    cfg = TrainConfig(model="m", task="classification", peft="lora", max_length=64,
                      global_batch_size=4)  # fmt: skip
    on_tpu = plan.plan_memory(cfg, model_cfg, 2, 1, platform="tpu")
    pinned_f32 = plan.plan_memory(dataclasses.replace(cfg, dtype="float32",
                                                      param_dtype="float32"), model_cfg, 2, 1,
                                  platform="tpu")  # fmt: skip
    as_bf16 = plan.plan_memory(dataclasses.replace(cfg, dtype="bfloat16",
                                                   param_dtype="bfloat16"), model_cfg, 2, 1,
                               platform="tpu")  # fmt: skip
    assert on_tpu == as_bf16 != pinned_f32
