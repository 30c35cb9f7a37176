"""Decoder LLMs in Flax NNX: Llama (2, 3, 3.1, 3.2), Mistral, Qwen2 / 2.5, Qwen3 and Gemma 3
(text), with a sequence-classification head (`score`) or a language-model head.

One module with switches rather than one per family: the five families are the same pre-norm
decoder and differ in a handful of places (q/k/v biases, per-head q/k norms, Gemma's (1 + w)
norms, its norms around the MLP and its scaled embeddings, sliding-window layers and their own
RoPE base), each a field of `DecoderConfig` that the family's Hugging Face config sets. One
implementation keeps the loop, sharding and LoRA free of family cases; the parity tests pin each
switch against transformers' own class for that family (tests/models/test_decoder.py).

Computed as transformers computes them (`../shared/LLM.md`): RMSNorm in float32, RoPE in the
rotate-half layout with float32 frequencies (Llama 3's and linear scaling applied to them),
softmax in float32, grouped-query attention without copying K/V heads (the query heads of a
group are one axis of the product). The config is read as transformers' config class of the
family reads it (`hf_config`, checked against it), so a checkpoint's 4.x (`rope_scaling`,
`rope_theta`) and 5.x (`rope_parameters`) layouts and each family's defaults read alike.

For long sequences: the attention is one of `kubejax.models.attention`'s implementations (the
reference above, a query-blocked path, splash on TPUs, cuDNN on GPUs; `DecoderModel.attention`),
and the layers are stacked and scanned (`DecoderModel`), their kinds (a window, a RoPE base)
passed per layer, each under a remat policy (`REMAT_POLICIES`).
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from kubejax.models import attention, chunked_head, hf_config
from kubejax.models.kernels import linear, product
from kubejax.models.partitioning import constrain
from kubejax.models.projection import Projection

#: config.json `model_type`s this module runs, and the HF class names written on export.
FAMILIES = {
    "llama": ("LlamaForSequenceClassification", "LlamaForCausalLM"),
    "mistral": ("MistralForSequenceClassification", "MistralForCausalLM"),
    "qwen2": ("Qwen2ForSequenceClassification", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3ForSequenceClassification", "Qwen3ForCausalLM"),
    "gemma3_text": ("Gemma3TextForSequenceClassification", "Gemma3ForCausalLM"),
}
#: Multimodal Gemma 3 checkpoints (4B and up): their text model is trained, the vision tower
#: is left out.
MULTIMODAL = {"gemma3": "gemma3_text"}
#: The rope types the decoder computes, and the parameters each needs.
ROPE_TYPES = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
}
SLIDING, FULL = hf_config.SLIDING, hf_config.FULL
#: Activation checkpointing of each layer (the `remat` setting): what the backward pass keeps
#: of the forward's intermediates, the rest recomputed. `none` keeps the output of every
#: product (the projections, the attention's scores and context) and recomputes only the
#: elementwise work (norms, RoPE, softmax, activations), which XLA fuses into the backward's
#: products: in a scanned layer whatever is kept is written out, each layer's, so keeping the
#: elementwise intermediates too took 1.4-1.7 x the memory of this (bench/NOTES.md, attempt
#: S1). `minimal` keeps every projection's output (q, k, v, o, gate, up, down: `Linear` names
#: them) and the attention's (`attention.CONTEXT`: its output, and splash's softmax
#: statistics), recomputing the attention's scores; `full` keeps only the layer's input.
REMAT_POLICIES = {
    "none": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_saveable,
        jax.checkpoint_policies.save_only_these_names("projection", attention.CONTEXT),
    ),
    "minimal": jax.checkpoint_policies.save_only_these_names("projection", attention.CONTEXT),
    "full": jax.checkpoint_policies.nothing_saveable,
}


@dataclasses.dataclass
class Rope:
    """One layer type's rotary embedding: base, scaling type and its parameters."""

    theta: float
    type: str = "default"
    params: dict = dataclasses.field(default_factory=dict)

    def inv_freq(self, head_dim: int) -> np.ndarray:
        """The float32 inverse frequencies, scaled as transformers scales them."""
        exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim
        inv = (1.0 / (np.float32(self.theta) ** exponents)).astype(np.float32)
        if self.type == "linear":
            return (inv / np.float32(self.params["factor"])).astype(np.float32)
        if self.type == "llama3":
            return _llama3_scaling(inv, self.params)
        return inv


def _llama3_scaling(inv: np.ndarray, p: dict) -> np.ndarray:
    """Llama 3.1's frequency rescaling: long wavelengths divided by `factor`, short ones kept,
    the band between blended."""
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return np.where(medium, blended, scaled).astype(np.float32)


@dataclasses.dataclass
class DecoderConfig:
    """What the decoder reads from a Hugging Face config; `hf` keeps the whole config.json
    (written back on export)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    hidden_act: str
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # biases on q/k/v (Qwen2 always; Llama, Qwen3, Gemma 3: attention_bias)
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3)
    gemma: bool  # (1 + w) norms, norms around attention and MLP outputs, scaled embeddings
    attention_scale: float
    layer_types: list[str]
    sliding_window: int | None
    rope: dict[str, Rope]  # by layer type
    final_logit_softcapping: float | None
    pad_token_id: int | None
    bos_token_id: int | None
    eos_token_id: int | list[int] | None
    hf: dict[str, Any] = dataclasses.field(default_factory=dict, repr=False)

    @property
    def groups(self) -> int:
        """Query heads per key/value head."""
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_dict(cls, values: dict) -> DecoderConfig:
        """Read a config.json dict as transformers' config class of its family reads it (its
        defaults, both rope layouts: `hf_config`); ValueError names the field and what is
        allowed."""
        model_type = values.get("model_type")
        if model_type in MULTIMODAL:
            values = {"model_type": MULTIMODAL[model_type], **values.get("text_config", {})}
            model_type = values["model_type"]
        if model_type not in FAMILIES:
            raise ValueError(
                f"model_type: {model_type!r} is not a supported decoder ({', '.join(FAMILIES)})"
            )
        return cls._from_hf(model_type, hf_config.resolve(values), values)

    @classmethod
    def _from_hf(cls, model_type: str, hf, values: dict) -> DecoderConfig:
        heads = hf.num_attention_heads
        kv_heads = getattr(hf, "num_key_value_heads", None) or heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
        if heads % kv_heads:
            raise ValueError(
                f"num_attention_heads: {heads} is not a multiple of num_key_value_heads {kv_heads}"
            )
        gemma = model_type == "gemma3_text"
        if model_type in ("llama", "gemma3_text") and hf.hidden_size % heads:
            raise ValueError(
                f"hidden_size: {hf.hidden_size} is not a multiple of num_attention_heads {heads}"
            )
        # What these families' configs can switch on that this decoder does not compute: refused
        # rather than run as a different model.
        if getattr(hf, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention: only causal attention (false) runs")
        if getattr(hf, "attn_logit_softcapping", None) is not None:
            raise ValueError("attn_logit_softcapping: not supported (null)")
        bias = bool(getattr(hf, "attention_bias", False))
        act = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", None)
        if act not in ACTIVATIONS:
            raise ValueError(f"hidden_act: {act!r} is not supported ({', '.join(ACTIVATIONS)})")
        layer_types = list(getattr(hf, "layer_types", None) or [FULL] * hf.num_hidden_layers)
        window = getattr(hf, "sliding_window", None)
        if model_type == "mistral" and window:
            layer_types = [SLIDING] * hf.num_hidden_layers  # Mistral: every layer
        if len(layer_types) != hf.num_hidden_layers or not set(layer_types) <= {FULL, SLIDING}:
            raise ValueError(
                f"layer_types: {hf.num_hidden_layers} of {FULL!r} or {SLIDING!r} expected, got "
                f"{layer_types!r}"
            )
        if SLIDING in layer_types and not window:
            layer_types = [FULL] * hf.num_hidden_layers
        scale = (hf.query_pre_attn_scalar if gemma else head_dim) ** -0.5
        return cls(
            model_type=model_type,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_hidden_layers=hf.num_hidden_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.rms_norm_eps),
            hidden_act=act,
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=bias or model_type == "qwen2",
            o_bias=bias,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "gemma3_text"),
            gemma=gemma,
            attention_scale=float(scale),
            layer_types=layer_types,
            sliding_window=window if SLIDING in layer_types else None,
            rope=_ropes(hf, layer_types),
            final_logit_softcapping=getattr(hf, "final_logit_softcapping", None),
            pad_token_id=hf.pad_token_id,
            bos_token_id=hf.bos_token_id,
            eos_token_id=hf.eos_token_id,
            hf=dict(values),
        )


def _ropes(hf, layer_types: list[str]) -> dict[str, Rope]:
    """Each layer type's Rope from transformers' standardized `rope_parameters` (one dict, or
    one per layer type for Gemma 3)."""
    params = hf.rope_parameters
    per_type = params if set(params) <= {SLIDING, FULL} else dict.fromkeys(layer_types, params)
    ropes = {}
    for layer_type in set(layer_types):
        p = dict(per_type[layer_type])
        kind = p.pop("rope_type", p.pop("type", "default"))
        if kind not in ROPE_TYPES:
            raise ValueError(
                f"rope_scaling: type {kind!r} is not supported ({', '.join(ROPE_TYPES)})"
            )
        if p.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("partial_rotary_factor: only 1.0 (the whole head) is supported")
        for key in ("rope_theta", *ROPE_TYPES[kind]):
            value = p.get(key)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(
                    f"rope_scaling: {kind!r} needs {key} as a positive number, got {value!r}"
                )
        if kind == "llama3" and not p["high_freq_factor"] > p["low_freq_factor"]:
            raise ValueError("rope_scaling: high_freq_factor must exceed low_freq_factor")
        ropes[layer_type] = Rope(float(p.pop("rope_theta")), kind, p)
    return ropes


# ---------------------------------------------------------------------------------------------
# Layers


class Linear(Projection):
    """`x @ kernel (+ bias)`, kernel [in, out] in float32, computed in the compute dtype
    through `kernels.linear` (its weight gradient in the form XLA's CPU backend runs fast);
    with a LoRA adapter (`Projection.adapt`)."""

    def __init__(self, n_in: int, n_out: int, bias: bool, dtype, rngs: nnx.Rngs):
        super().__init__(n_in, n_out, bias, dtype, nnx.initializers.normal(0.02), rngs)

    def __call__(self, x: jax.Array, key: jax.Array | None = None) -> jax.Array:
        """`key`: the LoRA adapter's dropout mask (None: none)."""
        x = x.astype(self.dtype)
        y = self.adapt(x, linear(x, self.weight()), key)
        if self.bias is not None:
            y = (y + self.bias[...]).astype(self.dtype)
        return checkpoint_name(y, "projection")


#: Whether the attention's q, k and v projections run as one product off the CPU where one of
#: them is narrow (`NARROW`); the MLP's gate and up as one gained nothing on a TPU v5e
#: (bench/NOTES.md T14).
SIDE_BY_SIDE = True
#: Outputs under which a projection's product is bound by reading its input: an accelerator
#: does ~200-250 bf16 FLOPs per byte it reads (a v5e: 197 TFLOP/s over 819 GB/s), and a
#: product of x by n columns does n FLOPs per byte of x. Measured on the v5e (T14): Qwen2.5-
#: 0.5B's k and v (128 outputs) side by side with q +0.8-1.6 %; Llama-3.2-1B's (512) −0.6 %,
#: the split of the joint output into q, k and v costing more than x's reads saved.
NARROW = 256
#: Whether they do on a CPU too (for the tests: the same sums as one by one).
SIDE_BY_SIDE_ON_CPU = False


def side_by_side(
    projections: tuple[Linear, ...], x: jax.Array, keys: list[jax.Array | None]
) -> list[jax.Array]:
    """Each of `projections` applied to the same `x` (`keys`: their adapters' dropout).

    Off the CPU, where one of them is narrow (fewer than `NARROW` outputs: grouped-query
    attention's k and v on a small model), as one product of `x` by their kernels side by side,
    and their LoRA adapters as one: the A matrices side by side, the B matrices block-diagonal;
    apart, each narrow product reads the layer's input for little arithmetic, as each adapter's
    A does. One by one otherwise: on a CPU (a fused QKV was slower there, bench/NOTES.md attempt
    8), where every projection is wide, with the heads split over a tensor axis, or with
    different dtypes, biases or adapter scales, or adapters drawing dropout masks of their own.
    """
    if not shares_product(projections, keys):
        return [p(x, k) for p, k in zip(projections, keys, strict=True)]
    first = projections[0]
    dtype = first.dtype
    x = x.astype(dtype)
    kernel = jnp.concatenate([p.weight().astype(dtype) for p in projections], axis=-1)
    y = linear(x, kernel)
    if first.lora_a is not None:
        a = jnp.concatenate([p.lora_a[...].astype(dtype) for p in projections], axis=-1)
        b = jax.scipy.linalg.block_diag(*(p.lora_b[...].astype(dtype) for p in projections))
        low = product(x, a).astype(dtype)
        update = product(low, b).astype(jnp.float32)
        y = (y + update * first.lora_scale).astype(dtype)
    if first.bias is not None:
        bias = jnp.concatenate([p.bias[...] for p in projections])
        y = (y + bias).astype(dtype)
    y = checkpoint_name(y, "projection")
    ends = np.cumsum([p.shape[1] for p in projections])[:-1]
    return jnp.split(y, ends, axis=-1)


def shares_product(projections: tuple[Linear, ...], keys: list[jax.Array | None]) -> bool:
    """Whether `side_by_side` computes `projections` as one product (its docstring says when)."""
    adapters = [p.lora_a is not None for p in projections]
    mesh = jax.sharding.get_abstract_mesh()
    return (
        SIDE_BY_SIDE
        and (SIDE_BY_SIDE_ON_CPU or jax.default_backend() != "cpu")
        and min(p.shape[1] for p in projections) < NARROW
        and (mesh.empty or mesh.shape.get("tensor", 1) == 1)
        and len({p.dtype for p in projections}) == 1
        and len({p.bias is None for p in projections}) == 1
        and len(set(adapters)) == 1
        and (not adapters[0] or len({p.lora_scale for p in projections}) == 1)
        and (
            not adapters[0]
            or all(k is None for k in keys)
            or all(p.lora_dropout == 0.0 for p in projections)
        )
    )


class RMSNorm(nnx.Module):
    """RMSNorm in float32. Llama's: `scale · x̂` in the input's dtype; Gemma's (`one_plus`):
    `(1 + scale) · x̂` in float32, then cast (its weights start at zero)."""

    def __init__(self, size: int, eps: float, one_plus: bool):
        self.scale = nnx.Param(jnp.full((size,), 0.0 if one_plus else 1.0, jnp.float32))
        self.eps, self.one_plus = eps, one_plus

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.one_plus:
            return (normed * (1.0 + self.scale[...])).astype(x.dtype)
        return self.scale[...].astype(x.dtype) * normed.astype(x.dtype)


def rotate(x: jax.Array, positions: jax.Array, inv_freq) -> jax.Array:
    """RoPE in the rotate-half layout: x [batch, tokens, heads, head_dim], positions [batch,
    tokens]; cos and sin in float32, cast to x's dtype."""
    freqs = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq, jnp.float32)
    angles = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Tokens:
    """Where each token sits, for the attention masks and RoPE: `segments` [batch, length]
    (the sequence a token belongs to, 1, 2, ...; 0 for padding), `positions` [batch, length],
    and `branches` [batch, length] where several continuations share one prompt (0: the
    prompt, k: continuation k, which sees the prompt and itself only; None: no branches)."""

    segments: jax.Array
    positions: jax.Array
    branches: jax.Array | None = None

    def mask(self, queries: jax.Array | None, window: int | None) -> jax.Array:
        """[batch, 1, 1, q, length] True where a query may attend: its own sequence (and
        branch), causal, and within `window` positions (a query sees itself and the window - 1
        before it). `queries` [batch, q]: the query tokens' indices (None: every token)."""
        length = self.segments.shape[1]
        keys = jnp.arange(length)
        q = jnp.broadcast_to(keys, self.segments.shape) if queries is None else queries

        def at_queries(x):
            return jnp.take_along_axis(x, q, axis=1)[:, :, None]

        ok = (at_queries(self.segments) == self.segments[:, None, :]) & (
            self.segments[:, None, :] > 0
        )
        ok &= keys[None, None, :] <= q[:, :, None]
        if self.branches is not None:
            key_branch = self.branches[:, None, :]
            ok &= (key_branch == 0) | (key_branch == at_queries(self.branches))
        if window:
            ok &= self.positions[:, None, :] > at_queries(self.positions) - window
        return ok[:, None, None]


@dataclasses.dataclass(frozen=True)
class LayerKind:
    """What differs between a decoder's layers: the RoPE frequencies and the sliding window of
    one layer type (Gemma 3's local and global layers, Qwen's windowed ones)."""

    inv_freq: tuple[float, ...]
    window: int | None


class Attention(nnx.Module):
    """Grouped-query self-attention with RoPE, optional q/k norms and a sliding window, its
    core one of `attention`'s implementations (`attention_spec`)."""

    def __init__(self, cfg: DecoderConfig, dtype, rngs: nnx.Rngs):
        h, d = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            d,
        )
        self.q_proj = Linear(h, self.heads * d, cfg.qkv_bias, dtype, rngs)
        self.k_proj = Linear(h, self.kv_heads * d, cfg.qkv_bias, dtype, rngs)
        self.v_proj = Linear(h, self.kv_heads * d, cfg.qkv_bias, dtype, rngs)
        self.o_proj = Linear(self.heads * d, h, cfg.o_bias, dtype, rngs)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, cfg.gemma)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, cfg.gemma)
        else:
            self.q_norm = self.k_norm = None
        self.scale = cfg.attention_scale

    def __call__(
        self,
        x: jax.Array,
        tokens: Tokens,
        queries: jax.Array | None,
        key: jax.Array | None,
        kinds: tuple[LayerKind, ...],
        kind,
        spec: attention.Spec,
    ) -> jax.Array:
        """x [batch, length, hidden] → [batch, q, hidden] for the `queries` (None: all);
        `key`: the LoRA adapters' dropout (None: none); `kinds[kind]` this layer's RoPE and
        window (`kind` an int, or a traced index where layers of several kinds are scanned)."""
        b, n = x.shape[:2]
        kq, kk, kv, ko = keys(key, 4)
        q_in = x if queries is None else jnp.take_along_axis(x, queries[..., None], axis=1)
        q_pos = (
            tokens.positions
            if queries is None
            else jnp.take_along_axis(tokens.positions, queries, axis=1)
        )
        heads = ("batch", None, "heads", None)
        if queries is None:
            q, k, v = side_by_side((self.q_proj, self.k_proj, self.v_proj), x, [kq, kk, kv])
        else:
            q = self.q_proj(q_in, kq)
            k, v = side_by_side((self.k_proj, self.v_proj), x, [kk, kv])
        q = constrain(q.reshape(b, q_in.shape[1], self.heads, self.head_dim), *heads)
        k = constrain(k.reshape(b, n, self.kv_heads, self.head_dim), *heads)
        v = constrain(v.reshape(b, n, self.kv_heads, self.head_dim), *heads)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        scale = jnp.asarray(self.scale, q.dtype)

        def core(layer_kind: LayerKind, q, k, v):
            q = rotate(q, q_pos, layer_kind.inv_freq) * scale
            k = rotate(k, tokens.positions, layer_kind.inv_freq)
            return attention.attend(q, k, v, tokens, queries, layer_kind.window, spec)

        if isinstance(kind, int):
            ctx = core(kinds[kind], q, k, v)
        else:  # layers of several kinds in one scan: each kind's core, picked per layer
            ctx = jax.lax.switch(kind, [partial(core, lk) for lk in kinds], q, k, v)
        ctx = constrain(
            ctx.reshape(b, q.shape[1], self.heads * self.head_dim), "batch", None, "heads"
        )
        return self.o_proj(ctx, ko)


class MLP(nnx.Module):
    """`down(act(gate(x)) · up(x))`."""

    def __init__(self, cfg: DecoderConfig, dtype, rngs: nnx.Rngs):
        h, m, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = Linear(h, m, bias, dtype, rngs)
        self.up_proj = Linear(h, m, bias, dtype, rngs)
        self.down_proj = Linear(m, h, bias, dtype, rngs)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def __call__(self, x: jax.Array, key: jax.Array | None = None) -> jax.Array:
        mlp = ("batch", None, "mlp")
        kg, ku, kd = keys(key, 3)
        gate = self.gate_proj(x, kg)
        gate = self.act(constrain(gate, *mlp).astype(jnp.float32)).astype(x.dtype)
        return self.down_proj(gate * constrain(self.up_proj(x, ku), *mlp), kd)


class DecoderLayer(nnx.Module):
    """Pre-norm block; Gemma 3 adds norms after the attention and around the MLP."""

    def __init__(self, cfg: DecoderConfig, dtype, rngs: nnx.Rngs):
        eps, g = cfg.rms_norm_eps, cfg.gemma
        self.self_attn = Attention(cfg, dtype, rngs)
        self.mlp = MLP(cfg, dtype, rngs)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, g)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, g)
        if g:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, g)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, g)
        self.gemma = g

    def __call__(
        self,
        x: jax.Array,
        tokens: Tokens,
        queries: jax.Array | None,
        key: jax.Array | None,
        kinds: tuple[LayerKind, ...],
        kind,
        spec: attention.Spec,
    ) -> jax.Array:
        """`queries` [batch, q]: compute the outputs at those tokens only (None: all); `key`:
        the LoRA adapters' dropout (None: none); `kinds[kind]`: the layer's RoPE and window."""
        k_attn, k_mlp = keys(key, 2)
        residual = x if queries is None else jnp.take_along_axis(x, queries[..., None], axis=1)
        attn = self.self_attn(self.input_layernorm(x), tokens, queries, k_attn, kinds, kind, spec)
        if self.gemma:
            x = residual + self.post_attention_layernorm(attn)
            ff = self.mlp(self.pre_feedforward_layernorm(x), k_mlp)
            return x + self.post_feedforward_layernorm(ff)
        x = residual + attn
        return x + self.mlp(self.post_attention_layernorm(x), k_mlp)


class Embedding(nnx.Module):
    """The token table [vocab, hidden], rows taken in float32 and cast (as `bert._rows`)."""

    def __init__(self, vocab: int, hidden: int, dtype, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.02)
        self.embedding = nnx.Param(init(rngs.params(), (vocab, hidden), jnp.float32))
        self.dtype = dtype

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.embedding[...], ids, axis=0).astype(self.dtype)


def layer_kinds(cfg: DecoderConfig) -> tuple[tuple[LayerKind, ...], tuple[int, ...]]:
    """The distinct layer kinds of `cfg` and each layer's index into them."""
    kinds: list[LayerKind] = []
    index = []
    for layer_type in cfg.layer_types:
        kind = LayerKind(
            tuple(float(f) for f in cfg.rope[layer_type].inv_freq(cfg.head_dim)),
            cfg.sliding_window if layer_type == SLIDING else None,
        )
        if kind not in kinds:
            kinds.append(kind)
        index.append(kinds.index(kind))
    return tuple(kinds), tuple(index)


class DecoderModel(nnx.Module):
    """Embeddings, the layers and the final norm (transformers' `model.` prefix).

    The layers are one `DecoderLayer` whose parameters are stacked [layers, ...] and run by
    `jax.lax.scan` under the remat policy: the compiled program holds one layer, not L (the
    24-layer Qwen shape's first step compiled ~80 s unrolled on a TPU, ../shared/TPU.md).
    Layers of different kinds (Gemma 3's local and global layers) pass their kind's index as
    a scanned input. `scan` False runs the same stacked layers one by one (the tests compare
    both)."""

    def __init__(self, cfg: DecoderConfig, dtype, rngs: nnx.Rngs):
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype, rngs)

        @nnx.split_rngs(splits=cfg.num_hidden_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, axis_size=cfg.num_hidden_layers)
        def stacked(rngs):
            return DecoderLayer(cfg, dtype, rngs)

        self.layers = stacked(rngs)
        self.num_layers = cfg.num_hidden_layers
        self.kinds, self.kind_of_layer = layer_kinds(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.gemma)
        # Gemma scales the embeddings by √hidden, rounded to the compute dtype first.
        self.embed_scale = cfg.hidden_size**0.5 if cfg.gemma else None
        self.dtype = dtype
        self.remat = "none"
        self.attention = attention.Spec()
        self.scan = True
        self.scan_unroll = 1

    def __call__(
        self,
        ids: jax.Array,
        tokens: Tokens,
        last_queries: jax.Array | None,
        key: jax.Array | None = None,
    ):
        """Final hidden states [batch, length, hidden]; with `last_queries` [batch, q], the last
        layer computes only those tokens' outputs ([batch, q, hidden]). `key`: the LoRA
        adapters' dropout (None: none)."""
        x = self.embed_tokens(ids)
        if self.embed_scale is not None:
            x = x * jnp.asarray(self.embed_scale, x.dtype)
        graphdef, state = nnx.split(self.layers)
        n = self.num_layers
        layer_keys = None if key is None else jax.random.split(key, n)
        policy = REMAT_POLICIES[self.remat]
        kinds, spec = self.kinds, self.attention

        def runner(kind):
            """Layer `kind`'s forward (kind: an int, or a traced index into `kinds`), under the
            remat policy."""

            def run(state, x, layer_key, queries):
                layer = nnx.merge(graphdef, state)
                x = constrain(x, "batch", None, None)
                return layer(x, tokens, queries, layer_key, kinds, kind, spec)

            return jax.checkpoint(run, policy=policy)

        at = partial(_layer, state)
        # The last layer apart when it computes a few queries only (a classifier's last tokens,
        # a language model's answer positions): the scan runs the first L - 1 layers' slice of
        # the stacked weights (a copy of them and of their gradients, ~2 % of a step on a TPU;
        # a `lax.cond` on the index inside the scan instead cost 9 %, bench/NOTES.md T5).
        scanned = n if last_queries is None else n - 1
        if not self.scan:
            for i in range(scanned):
                x = runner(self.kind_of_layer[i])(at(i), x, _key(layer_keys, i), None)
        elif scanned:
            kind_index = jnp.asarray(self.kind_of_layer[:scanned], jnp.int32)
            head = state if scanned == n else jax.tree.map(lambda a: a[:scanned], state)

            def body(x, xs):
                state_i, kind, layer_key = xs
                run = runner(0 if len(kinds) == 1 else kind)
                return run(state_i, x, layer_key, None), None

            keys_ = None if layer_keys is None else layer_keys[:scanned]
            x, _ = jax.lax.scan(body, x, (head, kind_index, keys_), unroll=self.scan_unroll)
        if scanned < n:
            run = runner(self.kind_of_layer[n - 1])
            x = run(at(n - 1), x, _key(layer_keys, n - 1), last_queries)
        return self.norm(constrain(x, "batch", None, None))


def _layer(state, i: int):
    """Layer `i`'s parameters of the stacked layers' state."""
    return jax.tree.map(lambda a: a[i], state)


def _key(layer_keys, i: int):
    return None if layer_keys is None else layer_keys[i]


def keys(key: jax.Array | None, n: int) -> list[jax.Array | None]:
    """`n` independent keys of `key` (n Nones for None: no dropout)."""
    return [None] * n if key is None else list(jax.random.split(key, n))


def dropout_key(deterministic: bool, rngs) -> jax.Array | None:
    """The key of a forward pass's LoRA dropout: None when deterministic or without rngs."""
    return None if deterministic or rngs is None else rngs.dropout()


def tokens_of(attention_mask: jax.Array, positions: jax.Array | None, branches=None) -> Tokens:
    """Tokens of a batch: one sequence a row (mask 0/1; positions 0, 1, ... from the row's
    start, as transformers numbers them, whatever the padding: RoPE sees only differences) or
    packed rows (segment ids 1, 2, ... and each token's position in its own sequence)."""
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(attention_mask.shape[1]), attention_mask.shape)
    return Tokens(attention_mask.astype(jnp.int32), positions, branches)


def last_tokens(segments: jax.Array, slots: int | None) -> jax.Array:
    """Index of each sequence's last token [batch, slots] (slots None: one sequence a row,
    [batch, 1]); an empty slot gives 0. Works with left and right padding."""
    idx = jnp.arange(segments.shape[1])
    if slots is None:
        return jnp.argmax(idx * (segments > 0), axis=-1)[:, None]
    ids = jnp.arange(1, slots + 1)[None, :, None]
    return jnp.argmax(idx * (segments[:, None, :] == ids), axis=-1)


class DecoderClassifier(nnx.Module):
    """`*ForSequenceClassification`: the decoder and a bias-free `score` head read at each
    sequence's last token."""

    task = "classification"
    sparse_embedding = "['model']['embed_tokens']['embedding']"

    def __init__(self, cfg: DecoderConfig, num_labels: int, dtype=jnp.float32, *, rngs):
        self.config, self.num_labels, self.dtype = cfg, num_labels, dtype
        self.model = DecoderModel(cfg, dtype, rngs)
        self.score = Linear(cfg.hidden_size, num_labels, False, dtype, rngs)

    def init_fresh(self, names: list[str], rngs: nnx.Rngs) -> None:
        """Initialise the parts a checkpoint did not provide ("score")."""
        if "score" in names:
            self.score = Linear(self.config.hidden_size, self.num_labels, False, self.dtype, rngs)

    def __call__(
        self,
        input_ids,
        attention_mask,
        *,
        positions=None,
        starts=None,
        deterministic=True,
        rngs=None,
    ):
        """Logits [batch, num_labels] in float32; for packed rows (segment ids in
        `attention_mask`, `positions`, `starts` [batch, n] of the sequences) [batch, n,
        num_labels]. The only dropout is LoRA's (`lora_dropout`), drawn from `rngs` when not
        `deterministic`: the families' released configs set no other."""
        tokens = tokens_of(attention_mask, positions)
        last = last_tokens(tokens.segments, None if starts is None else starts.shape[1])
        hidden = self.model(input_ids, tokens, last, dropout_key(deterministic, rngs))
        logits = self.score(hidden).astype(jnp.float32)
        return logits[:, 0] if starts is None else logits


class DecoderLM(nnx.Module):
    """`*ForCausalLM`: the decoder and its language-model head (the embeddings when tied)."""

    task = "causal-lm"

    @property
    def sparse_embedding(self) -> str | None:
        """The embedding table's path when only looked up; tied, the head reads all of it."""
        return None if self.lm_head is None else "['model']['embed_tokens']['embedding']"

    def __init__(self, cfg: DecoderConfig, dtype=jnp.float32, *, rngs):
        self.config, self.dtype = cfg, dtype
        self.model = DecoderModel(cfg, dtype, rngs)
        tied = cfg.tie_word_embeddings
        self.lm_head = None if tied else Linear(cfg.hidden_size, cfg.vocab_size, False, dtype, rngs)
        # Words a chunk of `target_log_probs` (None: `chunked_head.chunk_columns`'s).
        self.vocab_chunk: int | None = None

    def head(self, hidden: jax.Array) -> jax.Array:
        """Vocabulary logits in float32 of hidden states [..., hidden] (whole: for a few
        tokens; a loss over many reads `target_log_probs`)."""
        if self.lm_head is None:
            table = self.model.embed_tokens.embedding[...].astype(hidden.dtype)
            logits = product(hidden, table.T).astype(jnp.float32)
        else:
            logits = self.lm_head(hidden).astype(jnp.float32)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else jnp.tanh(logits / cap) * cap

    def __call__(
        self,
        input_ids,
        attention_mask,
        *,
        positions=None,
        branches=None,
        at=None,
        deterministic=True,
        rngs=None,
    ):
        """Vocabulary logits [batch, length, vocab] (float32); with `at` [batch, q], only at
        those tokens ([batch, q, vocab]), the last layer computing those tokens alone. LoRA's
        dropout is drawn from `rngs` when not `deterministic`."""
        return self.head(
            self.hidden(
                input_ids, attention_mask, positions=positions, branches=branches, at=at,
                deterministic=deterministic, rngs=rngs,
            )
        )  # fmt: skip

    def hidden(
        self,
        input_ids,
        attention_mask,
        *,
        positions=None,
        branches=None,
        at=None,
        deterministic=True,
        rngs=None,
    ) -> jax.Array:
        """The final hidden states that `__call__` reads its logits from ([batch, length,
        hidden], or [batch, q, hidden] at `at`)."""
        tokens = tokens_of(attention_mask, positions, branches)
        return self.model(input_ids, tokens, at, dropout_key(deterministic, rngs))

    def target_log_probs(self, hidden: jax.Array, targets: jax.Array):
        """Each target's log-probability [batch, q] (float32) given hidden states [batch, q,
        hidden], and whether it is the most likely word: through the head a vocabulary chunk
        at a time (`chunked_head.log_probs`), so that a loss over every token never holds their
        whole float32 logits, forward or backward."""
        if self.lm_head is None:
            table = self.model.embed_tokens.embedding[...]
        else:
            table = self.lm_head.weight().T
        cap = self.config.final_logit_softcapping
        return chunked_head.log_probs(hidden, table, targets, cap, self.vocab_chunk)

    def label_scores(
        self, input_ids, segments, positions, branches, score_at, score_tokens, score_weights
    ) -> jax.Array:
        """Each label's log-likelihood as the answer to each prompt [batch, 1, labels]: the sum
        over the answer's tokens of their log-probabilities, every answer read in one pass
        (`dataset.scoring_batches`). A softmax over them is the model's distribution over the
        labels, so they serve as a classifier's logits."""
        b, _, k, a = score_at.shape
        hidden = self.hidden(
            input_ids, segments, positions=positions, branches=branches, at=score_at.reshape(b, -1)
        )
        picked, _ = self.target_log_probs(hidden, score_tokens.reshape(b, -1))
        return (picked.reshape(b, 1, k, a) * score_weights).sum(-1)
