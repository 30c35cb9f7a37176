"""A decoder family's config.json read as transformers' config class of that family reads it
(its defaults, the 4.x `rope_theta` / `rope_scaling` and 5.x `rope_parameters` layouts, the
layer types it derives), without importing transformers.

Why not transformers' own classes: importing them costs every process that reads a config
1.7 s, 3.8 s where torch is installed (transformers' rope module imports it), and every trainer
process and sweep trial reads one; BERT's trainer imports neither for the same reason. What
keeps this honest: `tests/models/test_hf_config.py` reads a matrix of configs of each family
(defaults alone, both rope layouts, every rope type, sliding windows, hub configs' fields) and
300 random combinations both ways and requires the same attributes, and the parity tests
build every family's model from configs read here and match transformers' logits.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

FULL, SLIDING = "full_attention", "sliding_attention"
_SHARED = {"hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
_QWEN = {
    **_SHARED,
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 22016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "max_position_embeddings": 32768,
    "use_sliding_window": False,
    "sliding_window": 4096,
    "max_window_layers": 28,
    "layer_types": None,
    "pad_token_id": None,
    "bos_token_id": None,
    "eos_token_id": None,
}
#: Each family's defaults: the fields of its transformers config class that the decoder reads.
DEFAULTS: dict[str, dict] = {
    "llama": {
        **_SHARED,
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": None,
        "head_dim": None,
        "max_position_embeddings": 2048,
        "pad_token_id": None,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "attention_bias": False,
        "mlp_bias": False,
    },
    "mistral": {
        **_SHARED,
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": None,
        "max_position_embeddings": 4096 * 32,
        "pad_token_id": None,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "sliding_window": 4096,
    },
    "qwen2": _QWEN,
    "qwen3": {**_QWEN, "head_dim": 128, "attention_bias": False},
    "gemma3_text": {
        "vocab_size": 262_208,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 131_072,
        "rms_norm_eps": 1e-6,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "bos_token_id": 2,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "layer_types": None,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "use_bidirectional_attention": False,
    },
}
#: transformers' RoPE base where a config names none (Gemma 3: its global and local layers').
DEFAULT_THETA = 10_000.0
GEMMA_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}
#: Layer type names of older configs, as transformers renames them.
LEGACY_LAYER_TYPES = {"attention": FULL}
#: Fields that must be positive integers wherever they are set (None where the family allows).
POSITIVE = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
    "sliding_window", "query_pre_attn_scalar",
)  # fmt: skip
#: Rope types whose scaling needs the pretraining length (defaulted to max_position_embeddings).
LONG_ROPE_TYPES = ("llama3", "yarn", "longrope")


def resolve(values: dict) -> SimpleNamespace:
    """The attributes transformers' config object of `values["model_type"]` has after reading
    `values` (a config.json dict): the family's defaults, then every key of `values`, then the
    family's derived fields and the standardized `rope_parameters`. ValueError names a field
    of the wrong type."""
    model_type = values["model_type"]
    given = copy.deepcopy(values)
    rope_scaling = given.pop("rope_scaling", None)
    rope_theta = given.pop("rope_theta", None)
    local_theta = given.pop("rope_local_base_freq", None)
    # Gemma 3's older configs give their sliding layers' period (other families keep the key).
    pattern = given.pop("sliding_window_pattern", 6) if model_type == "gemma3_text" else 6
    if type(pattern) is not int or pattern < 1:
        raise ValueError(f"sliding_window_pattern: must be a positive integer, got {pattern!r}")
    hf = SimpleNamespace(**{**DEFAULTS[model_type], **given})
    _check_types(hf)
    if model_type in ("qwen2", "qwen3"):
        hf.sliding_window = hf.sliding_window if hf.use_sliding_window else None
    if getattr(hf, "head_dim", None) is None and model_type in ("llama", "mistral"):
        hf.head_dim = hf.hidden_size // hf.num_attention_heads
    if hf.num_key_value_heads is None:
        hf.num_key_value_heads = hf.num_attention_heads
    if getattr(hf, "layer_types", None) is None:
        if model_type in ("qwen2", "qwen3"):
            hf.layer_types = [
                SLIDING if hf.sliding_window is not None and i >= hf.max_window_layers else FULL
                for i in range(hf.num_hidden_layers)
            ]
        elif model_type == "gemma3_text":
            hf.layer_types = [
                SLIDING if (i + 1) % pattern else FULL for i in range(hf.num_hidden_layers)
            ]
    if getattr(hf, "layer_types", None) is not None:
        hf.layer_types = [LEGACY_LAYER_TYPES.get(t, t) for t in hf.layer_types]
    if rope_scaling is not None and not isinstance(rope_scaling, dict):
        raise ValueError(f"rope_scaling: must be an object or null, got {rope_scaling!r}")
    try:
        if model_type == "gemma3_text":
            hf.rope_parameters = _gemma_rope(hf, rope_scaling, rope_theta, local_theta)
        else:
            hf.rope_parameters = _rope(hf, rope_scaling, rope_theta)
    except (AttributeError, TypeError) as err:  # an entry that is not an object
        raise ValueError(f"rope_parameters: each layer type's must be an object ({err})") from err
    return hf


def _check_types(hf: SimpleNamespace) -> None:
    """transformers' strict fields, the way this project names a bad one."""
    for name in POSITIVE:
        value = getattr(hf, name, None)
        if value is not None and (type(value) is not int or value < 1):
            raise ValueError(f"{name}: must be a positive integer, got {value!r}")
    first = getattr(hf, "max_window_layers", 0)  # Qwen: the first layer to slide (0: all do)
    if type(first) is not int or first < 0:
        raise ValueError(f"max_window_layers: must be a non-negative integer, got {first!r}")
    eps = hf.rms_norm_eps
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not eps > 0:
        raise ValueError(f"rms_norm_eps: must be a positive number, got {eps!r}")
    layer_types = getattr(hf, "layer_types", None)
    if layer_types is not None and not (
        isinstance(layer_types, list) and all(isinstance(t, str) for t in layer_types)
    ):
        raise ValueError(f"layer_types: must be a list of strings, got {layer_types!r}")
    rope = getattr(hf, "rope_parameters", None)
    if rope is not None and not isinstance(rope, dict):
        raise ValueError(f"rope_parameters: must be an object, got {rope!r}")


def _rope(hf: SimpleNamespace, rope_scaling, rope_theta) -> dict:
    """`rope_parameters` as `RotaryEmbeddingConfigMixin` standardizes it: one dict, or one per
    layer type where the config nests them so."""
    params = rope_scaling or getattr(hf, "rope_parameters", None) or {}
    theta = DEFAULT_THETA if rope_theta is None else rope_theta
    partial = getattr(hf, "partial_rotary_factor", None)
    labels = getattr(hf, "layer_types", None) or ()
    nested = [key for key in params if key in labels]
    for p in [params[key] for key in nested] or [params]:
        if p is None:
            continue
        p.setdefault("rope_theta", theta)
        if partial is not None:
            p.setdefault("partial_rotary_factor", partial)
        # (A top-level `original_max_position_embeddings` is not read: these families' classes
        # standardize before they take the config's other keys.)
        _standardize(p, hf.max_position_embeddings)
    return params


def _standardize(p: dict, max_positions: int) -> None:
    """One rope dict's type (from the 4.x `type` key) and, for the scaled types, its
    pretraining length, as `standardize_rope_params` sets them."""
    p.setdefault("rope_type", p.get("type", "default"))
    if p["rope_type"] in LONG_ROPE_TYPES:
        p.setdefault("original_max_position_embeddings", max_positions)


def _gemma_rope(hf: SimpleNamespace, rope_scaling, rope_theta, local_theta) -> dict:
    """Gemma 3's: one dict per layer type; the global layers' takes `rope_scaling` and
    `rope_theta`, the sliding ones' `rope_local_base_freq`."""
    params = getattr(hf, "rope_parameters", None) or {
        SLIDING: {"rope_type": "default"},
        FULL: {"rope_type": "default"},
    }
    if rope_scaling is not None:
        params[FULL].update(rope_scaling)
    for layer_type, given in ((FULL, rope_theta), (SLIDING, local_theta)):
        if params.get(layer_type) is None:
            params[layer_type] = {"rope_type": "default"}
        params[layer_type].setdefault(
            "rope_theta", GEMMA_THETA[layer_type] if given is None else given
        )
    for key in [k for k in params if k in hf.layer_types]:
        _standardize(params[key], hf.max_position_embeddings)
    return params
