"""The decoder families' configs read without transformers (`hf_config`) read as transformers'
own config classes read them, over a matrix of configs of each family."""

from __future__ import annotations

import copy
import json
import random
import re
import subprocess
import sys

import pytest

from kubejax.models import hf_config
from kubejax.models.decoder import FAMILIES, DecoderConfig
from tests.models.decoders import TINY

#: Every attribute `DecoderConfig` takes from the config object.
READ = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "hidden_act", "hidden_activation",
    "max_position_embeddings", "tie_word_embeddings", "attention_bias", "mlp_bias",
    "layer_types", "sliding_window", "query_pre_attn_scalar", "rope_parameters",
    "final_logit_softcapping", "attn_logit_softcapping", "use_bidirectional_attention",
    "pad_token_id", "bos_token_id", "eos_token_id",
)  # fmt: skip
LLAMA3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
#: Hub configs' fields as their checkpoints ship them (transformers 4.x layout).
HUB = {
    "llama": {  # Llama-3.2-1B
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu",
        "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
        "max_position_embeddings": 131072, "mlp_bias": False, "num_attention_heads": 32,
        "num_hidden_layers": 16, "num_key_value_heads": 8, "pretraining_tp": 1,
        "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": True,
        "rope_scaling": {**LLAMA3, "original_max_position_embeddings": 8192},
        "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 128256,
    },
    "mistral": {  # Mistral-7B-v0.3
        "architectures": ["MistralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
        "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
        "max_position_embeddings": 32768, "num_attention_heads": 32, "num_hidden_layers": 32,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
        "sliding_window": None, "tie_word_embeddings": False, "vocab_size": 32768,
    },
    "qwen2": {  # Qwen2.5-0.5B
        "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
        "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 896,
        "initializer_range": 0.02, "intermediate_size": 4864, "max_position_embeddings": 32768,
        "max_window_layers": 24, "num_attention_heads": 14, "num_hidden_layers": 24,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
        "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
    },
    "qwen3": {  # Qwen3-0.6B
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
        "hidden_size": 1024, "intermediate_size": 3072, "max_position_embeddings": 40960,
        "max_window_layers": 28, "num_attention_heads": 16, "num_hidden_layers": 28,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None,
        "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
        "use_sliding_window": False, "vocab_size": 151936,
    },
    "gemma3_text": {  # gemma-3-1b-it
        "architectures": ["Gemma3ForCausalLM"], "attention_bias": False,
        "attn_logit_softcapping": None, "bos_token_id": 2, "eos_token_id": [1, 106],
        "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 1152, "intermediate_size": 6912, "max_position_embeddings": 32768,
        "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
        "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
        "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000,
        "sliding_window": 512, "sliding_window_pattern": 6, "vocab_size": 262144,
    },
}  # fmt: skip


def _matrix() -> list[tuple[str, dict]]:
    """(case, config.json dict) over every family: its defaults, the tiny test models, the hub
    configs, both rope layouts and the variants each family's reader branches on."""
    cases = []
    for family in FAMILIES:
        variants = [
            ("defaults", {}),
            ("tiny", TINY[family]),
            ("hub", HUB[family]),
            ("rope_theta", {"rope_theta": 123456.0}),
            ("llama3 rope", {"rope_scaling": LLAMA3, "max_position_embeddings": 512}),
            ("linear, legacy type key", {"rope_scaling": {"type": "linear", "factor": 4.0}}),
            ("5.x layout", {"rope_parameters": {"rope_type": "default", "rope_theta": 7.0}}),
        ]  # fmt: skip
        cases += [(f"{family} {case}", {"model_type": family, **c}) for case, c in variants]
    sliding = {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 2}
    cases += [
        ("llama rope at top-level pretraining length", {
            "model_type": "llama", "rope_scaling": LLAMA3, "original_max_position_embeddings": 64}),
        ("llama partial rotary factor", {"model_type": "llama", "partial_rotary_factor": 1.0}),
        ("mistral no window", {"model_type": "mistral", "sliding_window": None}),
        ("qwen2 sliding", {"model_type": "qwen2", "num_hidden_layers": 4, **sliding}),
        ("qwen3 sliding", {"model_type": "qwen3", "num_hidden_layers": 4, **sliding}),
        ("qwen2 window off", {"model_type": "qwen2", "sliding_window": 16}),
        ("qwen2 legacy layer type", {"model_type": "qwen2", "num_hidden_layers": 2,
                                     "layer_types": ["attention", "full_attention"]}),
        ("qwen2 nested rope", {"model_type": "qwen2", "num_hidden_layers": 2, "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 2.0}}}),
        ("gemma pattern", {"model_type": "gemma3_text", "num_hidden_layers": 5,
                           "sliding_window_pattern": 2}),
        ("gemma layer types", {"model_type": "gemma3_text", "num_hidden_layers": 2,
                               "layer_types": ["full_attention", "sliding_attention"]}),
        ("gemma 5.x", {"model_type": "gemma3_text", "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}),
        ("gemma llama3 global", {"model_type": "gemma3_text", "rope_scaling": LLAMA3}),
        ("gemma softcapping", {"model_type": "gemma3_text", "final_logit_softcapping": 30.0}),
    ]  # fmt: skip
    return cases


MATRIX = _matrix()


@pytest.mark.parametrize("values", [v for _, v in MATRIX], ids=[case for case, _ in MATRIX])
def test_configs_read_as_transformers_reads_them(values):
    from transformers import AutoConfig

    theirs = AutoConfig.for_model(**copy.deepcopy(values))
    ours = hf_config.resolve(values)
    for name in READ:
        assert getattr(ours, name, None) == getattr(theirs, name, None), name
    family = values["model_type"]
    expected = DecoderConfig._from_hf(family, theirs, values)
    assert DecoderConfig.from_dict(values) == expected


#: Values of the fields the readers branch on, for random combinations.
CHOICES = {
    "num_hidden_layers": [1, 3, 6, 8], "num_attention_heads": [4, 8], "hidden_size": [64, 128],
    "num_key_value_heads": [None, 1, 2, 4], "head_dim": [None, 16, 32],
    "sliding_window": [None, 8, 4096], "use_sliding_window": [True, False],
    "max_window_layers": [0, 2, 5], "rope_theta": [5e5, 10000],
    "rope_scaling": [None, {"rope_type": "linear", "factor": 2.0},
                     {"type": "linear", "factor": 3.0}, {**LLAMA3, "factor": 8.0}],
    "rope_local_base_freq": [5000.0], "sliding_window_pattern": [2, 3],
    "tie_word_embeddings": [True, False], "attention_bias": [True], "mlp_bias": [True],
    "max_position_embeddings": [512], "pad_token_id": [None, 0, 5],
    "final_logit_softcapping": [None, 30.0], "query_pre_attn_scalar": [64],
}  # fmt: skip


def test_random_combinations_read_as_transformers_reads_them():
    """300 seeded random combinations of CHOICES over the families: the same attributes, and
    the same DecoderConfig or the same refusal. (A combination transformers cannot read, such
    as a null that its strict fields refuse, is no checkpoint's: left out, and counted.)"""
    rng = random.Random(0)
    compared = 0
    for _ in range(300):
        values = {"model_type": rng.choice(list(FAMILIES))}
        for name, choices in CHOICES.items():
            if rng.random() < 0.4:
                values[name] = copy.deepcopy(rng.choice(choices))
        compared += _check_against_transformers(values)
    assert compared > 200


def _check_against_transformers(values: dict) -> bool:
    """Whether transformers read `values` (then ours reads them alike)."""
    from transformers import AutoConfig

    try:
        theirs = AutoConfig.for_model(**copy.deepcopy(values))
    except Exception:  # transformers' strict fields raise errors of their own types
        return False
    ours = hf_config.resolve(values)
    for name in READ:
        assert getattr(ours, name, None) == getattr(theirs, name, None), (name, values)
    outcomes = []
    for read in (
        lambda: DecoderConfig._from_hf(values["model_type"], theirs, values),
        lambda: DecoderConfig.from_dict(values),
    ):
        try:
            outcomes.append(read())
        except ValueError as err:
            outcomes.append(str(err))
    assert outcomes[0] == outcomes[1], values
    return True


def test_a_multimodal_gemma_reads_its_text_config_as_transformers_does():
    """Gemma 3 4B and up ship `Gemma3ForConditionalGeneration` configs: the text model's fields
    under `text_config` (here gemma-3-4b's, with its linear rope scaling)."""
    from transformers import AutoConfig

    text = {
        "model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240,
        "num_hidden_layers": 34, "num_attention_heads": 8, "num_key_value_heads": 4,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024,
    }  # fmt: skip
    values = {
        "model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": text, "vision_config": {"model_type": "siglip_vision_model"},
    }  # fmt: skip
    theirs = AutoConfig.for_model(**copy.deepcopy(values)).text_config
    expected = DecoderConfig._from_hf("gemma3_text", theirs, text)
    assert DecoderConfig.from_dict(values) == expected
    assert expected.rope["full_attention"].params == {"factor": 8.0}


def test_reading_a_config_leaves_the_dict_as_it_was():
    values = {"model_type": "gemma3_text", **TINY["gemma3_text"]}
    before = json.dumps(values, sort_keys=True)
    DecoderConfig.from_dict(values)
    assert json.dumps(values, sort_keys=True) == before


@pytest.mark.parametrize(
    "values, message",
    [
        ({"hidden_size": "wide"}, "hidden_size: must be a positive integer, got 'wide'"),
        ({"num_hidden_layers": 0}, "num_hidden_layers: must be a positive integer, got 0"),
        ({"head_dim": 2.5}, "head_dim: must be a positive integer, got 2.5"),
        ({"rms_norm_eps": "1e-6"}, "rms_norm_eps: must be a positive number, got '1e-6'"),
        ({"rope_scaling": "linear"}, "rope_scaling: must be an object or null, got 'linear'"),
        ({"num_key_value_heads": 3}, "num_attention_heads: 32 is not a multiple of"),
        ({"hidden_size": 100}, "hidden_size: 100 is not a multiple of num_attention_heads 32"),
        ({"hidden_act": "relu2"}, "hidden_act: 'relu2' is not supported (silu, "),
        ({"hidden_act": None}, "hidden_act: None is not supported (silu, "),
        ({"rope_parameters": [1.0]}, "rope_parameters: must be an object, got [1.0]"),
        ({"num_hidden_layers": 1, "layer_types": ["full_attention"],
          "rope_parameters": {"full_attention": 5}}, "rope_parameters: each layer type's must be"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}},
         "rope_scaling: type 'yarn' is not supported (default, linear, llama3)"),
        ({"rope_scaling": {"rope_type": "linear"}},
         "rope_scaling: 'linear' needs factor as a positive number, got None"),
        ({"rope_theta": "1e6"}, "rope_scaling: 'default' needs rope_theta as a positive number"),
        ({"rope_scaling": {**LLAMA3, "high_freq_factor": 1.0}},
         "rope_scaling: high_freq_factor must exceed low_freq_factor"),
        ({"layer_types": ["full_attention"]}, "layer_types: 32 of 'full_attention' or "),
        ({"num_hidden_layers": 1, "layer_types": ["mamba"]}, "got ['mamba']"),
    ],
)  # fmt: skip
def test_a_bad_field_is_named(values, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        DecoderConfig.from_dict({"model_type": "llama", **values})


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_a_rope_scaling_that_is_not_an_object_is_named_for_every_layout(model_type):
    """Gemma 3's per-layer-type rope dicts take `rope_scaling` into the global layers' one."""
    values = {"model_type": model_type, **TINY.get(model_type, {}), "rope_scaling": ["linear"]}
    with pytest.raises(ValueError, match=re.escape("rope_scaling: must be an object or null")):
        DecoderConfig.from_dict(values)


def test_what_the_decoder_does_not_compute_is_refused():
    """Settings of these families' configs that would make another model than ours."""
    gemma = {"model_type": "gemma3_text"}
    for extra, message in [
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention: only causal"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping: not supported"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            DecoderConfig.from_dict({**gemma, **extra})


def test_a_gemma_sliding_window_pattern_must_be_a_positive_integer():
    with pytest.raises(ValueError, match="sliding_window_pattern: must be a positive integer"):
        DecoderConfig.from_dict({"model_type": "gemma3_text", "sliding_window_pattern": None})


@pytest.mark.slow
def test_reading_a_decoder_config_imports_neither_transformers_nor_torch(tmp_path):
    """Every trainer process and sweep trial reads one: transformers' import costs 1.7 s, 3.8 s
    where torch is installed."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", **TINY["qwen3"]}))
    code = (
        "import sys; from pathlib import Path; from kubejax.models import weights; "
        f"weights.load_config(Path({str(tmp_path)!r})); "
        "print(sorted({'transformers', 'torch'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
