"""The decoders' attention: one function, several implementations (the `attention` setting).

- `xla`: the reference. Scores [batch, kv heads, group, queries, keys] in float32, masked,
  softmax, the weighted values; the query heads of a key/value head are one axis of the product
  (no repeated K/V). The backward pass keeps the scores and probabilities of every layer: at
  2,048 tokens that is most of a long run's memory (../shared/TPU.md: 38 GB for Llama-3.2-1B at
  batch 4).
- `chunked`: the same arithmetic a block of queries at a time, each block under
  `jax.checkpoint`, so the backward pass recomputes one block's scores instead of keeping every
  layer's: any platform, any mask (the evaluation's shared-prompt branches too).
- `splash`: Pallas splash attention on TPU (`jax.experimental.pallas.ops.tpu.splash_attention`):
  causal, grouped-query heads natively, padding and packed sequences as segment ids, sliding
  windows as a local mask; blocks of `block` tokens, never the whole score matrix.
- `cudnn`: `jax.nn.dot_product_attention(implementation="cudnn")` (cuDNN's flash attention) on
  NVIDIA GPUs: causal, right padding as sequence lengths, sliding windows; packed rows are not
  among its masks.

`choose` resolves `auto` by platform and shape. Calls the fast kernels cannot take fall back:
a subset of queries (the classifier's last layer reads only each sequence's last token; the
language model's answer positions) is a few rows of scores, computed by `xla`; the shared
prompt branches of the evaluation's answer scoring go to `chunked`.

Queries arrive scaled (the model multiplies by its attention scale first: Gemma's
`query_pre_attn_scalar`), so no implementation scales again.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

IMPLEMENTATIONS = ("auto", "xla", "chunked", "splash", "cudnn")
#: The name of what the remat policy `minimal` keeps of the attention
#: (`jax.ad_checkpoint.checkpoint_name`): its output (and splash's softmax statistics).
CONTEXT = "context"
#: The TPU kernel's tiles are multiples of its 128 lanes.
LANES = 128
#: The default block of `splash` and `chunked` (queries and keys a tile).
DEFAULT_BLOCK = 512
#: From this length on, `auto` on a CPU takes `chunked`: below it the scores of a layer are a
#: few MB and keeping them costs less than recomputing them (bench/NOTES.md, attempt A2).
CPU_CHUNKED_FROM = 1024
#: From this length on, `auto` on a TPU takes `splash` (bench/NOTES.md, attempt A3).
TPU_SPLASH_FROM = 256


class AttentionError(ValueError):
    """An attention setting that cannot run here; the message names the setting."""


@dataclasses.dataclass(frozen=True)
class Spec:
    """A resolved attention choice, static in the model: the implementation (never `auto`),
    the block of `splash` and `chunked`, and Pallas's interpret mode (splash on a CPU, for
    tests)."""

    implementation: str = "xla"
    block: int = DEFAULT_BLOCK
    interpret: bool = False


def choose(
    setting: str,
    platform: str,
    length: int,
    *,
    packing: bool = False,
    dtype: str = "float32",
    head_dim: int = 64,
    block: int = 0,
) -> tuple[Spec, str]:
    """The implementation for `setting` on `platform` ("cpu", "tpu", "gpu") at sequences of
    `length` tokens, and why, in a few words (the trainer's first line says it). An explicit
    setting the platform cannot run is refused naming what would; `block` (0: the default)
    must suit it."""
    if setting not in IMPLEMENTATIONS:
        raise AttentionError(f"attention: {setting!r} is not one of {', '.join(IMPLEMENTATIONS)}")
    if setting == "splash" and platform != "tpu":
        raise AttentionError(
            f"attention: splash runs on TPUs only, and this is a {platform}; use auto, xla or "
            "chunked"
        )
    if setting == "cudnn" and platform != "gpu":
        raise AttentionError(
            f"attention: cudnn runs on NVIDIA GPUs only, and this is a {platform}; use auto, "
            "xla or chunked"
        )
    if setting == "cudnn" and packing:
        raise AttentionError(
            "attention: cudnn has no mask for packed rows (packing is on); use auto or xla, or "
            "turn packing off"
        )
    if setting == "cudnn" and (dtype != "bfloat16" or head_dim > 128 or head_dim % 8):
        raise AttentionError(
            f"attention: cudnn takes bfloat16 heads of at most 128 in multiples of 8 (here "
            f"dtype {dtype}, head_dim {head_dim}); use auto or xla"
        )
    size = check_block(block, length, setting if setting != "auto" else "")
    if setting != "auto":
        return Spec(setting, size), "as set"
    if platform == "tpu" and length >= TPU_SPLASH_FROM:
        return Spec("splash", size), f"TPU, {length} tokens"
    cudnn_heads = head_dim <= 128 and head_dim % 8 == 0
    if platform == "gpu" and not packing and dtype == "bfloat16" and cudnn_heads:
        return Spec("cudnn", size), "NVIDIA GPU, bfloat16"
    if length >= CPU_CHUNKED_FROM:
        return Spec("chunked", size), f"{length} tokens: scores a block at a time"
    return Spec("xla", size), f"{platform}, {length} tokens"


def check_block(block: int, length: int, implementation: str) -> int:
    """The block for sequences of `length` tokens: `block` when it suits (splash: a multiple
    of 128 lanes; both block paths: dividing `length`), else AttentionError naming what would;
    0 gives the default (512, or the whole length when shorter)."""
    if block == 0:
        return min(DEFAULT_BLOCK, max(LANES, length))
    if block < 1:
        raise AttentionError(f"attention_block: must be positive or 0 (auto), got {block}")
    if implementation == "splash" and block % LANES:
        raise AttentionError(
            f"attention_block: {block} is not a multiple of the TPU kernel's {LANES} lanes; "
            f"use {max(LANES, block // LANES * LANES)} or 0 (auto)"
        )
    if implementation in ("splash", "chunked") and length % block:
        fits = [b for b in range(LANES, min(length, 4096) + 1, LANES) if length % b == 0]
        raise AttentionError(
            f"attention_block: {block} does not divide max_length {length}; use one of "
            f"{', '.join(map(str, fits)) or 'a divisor of max_length'} or 0 (auto)"
        )
    return block


# ---------------------------------------------------------------------------------------------
# The function


def attend(q, k, v, tokens, queries, window: int | None, spec: Spec) -> jax.Array:
    """Attention of q [batch, q, heads, head_dim] (scaled; the tokens at `queries` [batch, q],
    or every token when None) over k, v [batch, keys, kv_heads, head_dim], masked by `tokens`
    (`decoder.Tokens`: each token's sequence, position and prompt branch: causal, within its
    own sequence, and within `window` positions when set). Returns [batch, q, heads,
    head_dim]."""
    impl = spec.implementation
    if queries is not None:
        impl = "xla"
    elif tokens.branches is not None and impl in ("splash", "cudnn"):
        impl = "chunked"
    if impl == "splash":  # its output and softmax statistics are named inside the kernel
        return _splash(q, k, v, tokens.segments, window, spec)
    if impl == "cudnn":
        out = _cudnn(q, k, v, tokens.segments, window)
    elif impl == "chunked":
        out = _chunked(q, k, v, tokens, window, spec.block)
    else:
        out = _xla(q, k, v, tokens.mask(queries, window))
    return checkpoint_name(out, CONTEXT)


def _xla(q, k, v, mask) -> jax.Array:
    """The reference: float32 scores of every query and key, masked (`mask` [batch, 1, 1, q,
    keys]), softmax, values; the query heads of each key/value head grouped."""
    b, n, heads, d = q.shape
    kv_heads = k.shape[2]
    q = q.reshape(b, n, kv_heads, heads // kv_heads, d)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k, preferred_element_type=jnp.float32)
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    ctx = jnp.einsum("bkgqs,bskd->bqkgd", probs, v, preferred_element_type=jnp.float32)
    return ctx.reshape(b, n, heads, d)


def _chunked(q, k, v, tokens, window, block: int) -> jax.Array:
    """`_xla` over blocks of queries, each block's scores recomputed in the backward pass
    (`jax.checkpoint`): one block's [block, keys] scores live at a time, not a layer's."""
    n = q.shape[1]
    size = max(d for d in range(1, min(n, block) + 1) if n % d == 0)
    if size == n:
        return jax.checkpoint(lambda q, k, v: _xla(q, k, v, tokens.mask(None, window)))(q, k, v)
    idx = jnp.arange(n).reshape(n // size, size)

    @jax.checkpoint
    def one(q_blk, rows):
        queries = jnp.broadcast_to(rows, (q.shape[0], size))
        return _xla(q_blk, k, v, tokens.mask(queries, window))

    blocks = q.reshape(q.shape[0], n // size, size, *q.shape[2:]).swapaxes(0, 1)
    out = jax.lax.map(lambda xs: one(*xs), (blocks, idx))
    return out.swapaxes(0, 1).reshape(q.shape[0], n, *out.shape[3:])


# ---------------------------------------------------------------------------------------------
# cuDNN (NVIDIA GPUs)


def _cudnn(q, k, v, segments, window, implementation: str = "cudnn") -> jax.Array:
    """cuDNN's flash attention through `jax.nn.dot_product_attention`: causal, each row's
    padding as its length (rows are right-padded: `dataset.gather`), the window as its left
    side. `implementation` "xla" runs the same call through XLA (how the tests check it on a
    CPU)."""
    lengths = (segments > 0).sum(axis=1).astype(jnp.int32)
    out = jax.nn.dot_product_attention(
        q,
        k,
        v,
        scale=1.0,
        is_causal=True,
        query_seq_lengths=lengths,
        key_value_seq_lengths=lengths,
        local_window_size=None if not window else (window - 1, 0),
        implementation=implementation,
    )
    return out


# ---------------------------------------------------------------------------------------------
# Splash (TPU)


@functools.cache
def _splash_kernel(length: int, heads: int, window: int | None, block: int, interpret: bool):
    """The splash kernel for `heads` query heads over sequences of `length` tokens: causal, or
    a query seeing itself and the `window` - 1 tokens before it (transformers' sliding
    window); the segment ids given at each call keep sequences apart."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as kernel,
    )
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_mask as masks,
    )

    shape = (length, length)
    if window:
        mask = masks.LocalMask(shape, window_size=(window - 1, 0), offset=0)
    else:
        mask = masks.CausalMask(shape)
    size = min(block, length)
    # The fused backward kernel computes dq with dk and dv, from one recomputation of the
    # scores instead of two: 5-11 % faster steps on a TPU v5e at 2,048 tokens (head size 64,
    # where the softmax's elementwise work bounds the kernels; bench/NOTES.md, T7).
    sizes = kernel.BlockSizes(
        block_q=size,
        block_kv=size,
        block_kv_compute=size,
        block_q_dkv=size,
        block_kv_dkv=size,
        block_kv_dkv_compute=size,
        use_fused_bwd_kernel=True,
    )
    # The kernel's mask tables as concrete arrays, made outside any trace: the kernel is
    # cached and reused by every trace that asks for it.
    with jax.ensure_compile_time_eval():
        return kernel.make_splash_mha(
            masks.MultiHeadMask([mask] * heads),
            block_sizes=sizes,
            head_shards=1,
            q_seq_shards=1,
            residual_checkpoint_name=CONTEXT,
            interpret=interpret,
        )


def _splash_local(q, k, v, segments, window, spec: Spec) -> jax.Array:
    """Splash on this device's rows and heads: q [batch, length, heads, d], k and v [batch,
    length, kv_heads, d], the length padded to a multiple of the block where it is not one
    (the pad is a sequence of its own: segment 0, as padding already is)."""
    from jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_kernel import (
        SegmentIds,
    )

    n = q.shape[1]
    size = min(spec.block, max(LANES, n))
    padded = -(-n // size) * size
    if padded != n:
        pad = [(0, 0), (0, padded - n), (0, 0), (0, 0)]
        q, k, v = (jnp.pad(x, pad) for x in (q, k, v))
        segments = jnp.pad(segments, [(0, 0), (0, padded - n)])
    kernel = _splash_kernel(padded, q.shape[2], window, size, spec.interpret)
    heads_first = functools.partial(jnp.swapaxes, axis1=1, axis2=2)

    def one(q, k, v, seg):
        return kernel(q, k, v, segment_ids=SegmentIds(q=seg, kv=seg))

    out = jax.vmap(one)(heads_first(q), heads_first(k), heads_first(v), segments.astype(jnp.int32))
    return heads_first(out)[:, :n]


def _splash(q, k, v, segments, window, spec: Spec) -> jax.Array:
    """Splash on the mesh of the trace: a Pallas kernel is not partitioned automatically, so
    under a mesh whose axes split the batch (`data`, `fsdp`) or the heads (`tensor`) it runs in
    `shard_map` on each device's rows and heads; inside a `shard_map` already (the
    data-parallel step), or on one device, it runs as it is."""
    mesh = jax.sharding.get_abstract_mesh()
    manual = getattr(jax.sharding.AxisType, "Manual", None)
    live = [
        a
        for a, t in zip(mesh.axis_names, getattr(mesh, "axis_types", ()), strict=False)
        if mesh.shape[a] > 1 and t != manual
    ]
    if mesh.empty or not live:
        return _splash_local(q, k, v, segments, window, spec)
    from jax.sharding import PartitionSpec as P

    b, heads, kv_heads = q.shape[0], q.shape[2], k.shape[2]
    batch = tuple(a for a in ("data", "fsdp") if a in live)
    rows = math.prod(mesh.shape[a] for a in batch)
    batch_axes = batch if batch and b % rows == 0 else None
    tensor = "tensor" if "tensor" in live else None
    if tensor and (heads % mesh.shape[tensor] or kv_heads % mesh.shape[tensor]):
        tensor = None
    qkv = P(batch_axes, None, tensor, None)
    fn = jax.shard_map(
        functools.partial(_splash_local, window=window, spec=spec),
        mesh=mesh,
        in_specs=(qkv, qkv, qkv, P(batch_axes, None)),
        out_specs=qkv,
        check_vma=False,
    )
    return fn(q, k, v, segments)
