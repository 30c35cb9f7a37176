"""Weights stored quantized: QLoRA's frozen base. Per block of (up to) 64 inputs and each
output an absmax scale; the codes int8, or NF4 (QLoRA's 4-bit NormalFloat), two a byte.
JAX both ways: to quantize (once, at load, where the kernel is: in its shards on the devices)
and to dequantize (in each product's use), no dependency beyond it: Qwix does the same behind
interception of every product, which the decoder's own projections do not need."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

#: QLoRA's NormalFloat4 levels (Dettmers et al. 2023; bitsandbytes' table): quantiles of a
#: normal distribution, so normally distributed weights use the 16 codes evenly.
NF4 = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
], np.float32)  # fmt: skip
#: The thresholds between neighbouring NF4 levels.
NF4_MIDPOINTS = (NF4[1:] + NF4[:-1]) / 2
QTYPES = ("nf4", "int8")
#: Weights per absmax scale, along the input axis (QLoRA's block; smaller where the input
#: width is not a multiple).
BLOCK = 64


def block_size(n_in: int) -> int:
    """Inputs per scale for a kernel of `n_in` inputs: BLOCK, or the largest divisor of it
    that divides `n_in`."""
    return math.gcd(n_in, BLOCK)


def quantize_kernel(kernel: jax.Array, qtype: str, shardings=None) -> tuple[jax.Array, jax.Array]:
    """(codes, scales) of a kernel [..., in, out] (leading axes: stacked layers'; any float
    type, on the devices or the host's array), computed where the kernel is, in one compiled
    program: per block of
    `block_size(in)` inputs and each output, the absmax scale [in / block, out] (float32) and
    the codes: int8 [in, out] (round(w / absmax · 127)), or nf4, two 4-bit codes a byte along
    the input [in / 2, out] (the nearest NF4 level of w / absmax, a tie to the lower one, as
    bitsandbytes' thresholds at the levels' midpoints decide it). `shardings`: the codes' and
    the scales' (a pair), where they are to be placed; a sharded kernel is quantized in its
    shards."""
    if qtype not in QTYPES:
        raise ValueError(f"weight_qtype: {qtype!r} is not one of {', '.join(QTYPES)}")
    return _quantizer(qtype, shardings)(kernel)


@functools.cache
def _quantizer(qtype: str, shardings):
    body = functools.partial(_quantize, qtype=qtype)
    return jax.jit(body) if shardings is None else jax.jit(body, out_shardings=shardings)


def _quantize(kernel: jax.Array, qtype: str) -> tuple[jax.Array, jax.Array]:
    *lead, n_in, n_out = kernel.shape
    block = block_size(n_in)
    blocks = kernel.astype(jnp.float32).reshape(*lead, n_in // block, block, n_out)
    scale = jnp.max(jnp.abs(blocks), axis=-2)
    scale = jnp.where(scale == 0, jnp.float32(1), scale)
    normed = (blocks / scale[..., None, :]).reshape(*lead, n_in, n_out)
    if qtype == "int8":
        return jnp.round(normed * 127).astype(jnp.int8), scale
    # A level's code is the number of midpoints below the value: 15 comparisons XLA fuses into
    # one pass (an argmin over [in, out, 16] values took 27 s for Qwen2.5-0.5B's projections
    # in NumPy, bench/NOTES.md).
    codes = sum((normed > m).astype(jnp.uint8) for m in NF4_MIDPOINTS.tolist())
    return codes[..., 0::2, :] | (codes[..., 1::2, :] << 4), scale


def dequantize_kernel(codes: jax.Array, scale: jax.Array, qtype: str) -> jax.Array:
    """The float32 kernel [..., in, out] of `quantize_kernel`'s codes and scales (leading axes:
    a stacked layer's)."""
    if qtype == "int8":
        values = codes.astype(jnp.float32) / 127.0
    else:
        low, high = codes & 0x0F, codes >> 4
        idx = jnp.stack([low, high], axis=-2).reshape(*codes.shape[:-2], -1, codes.shape[-1])
        values = jnp.asarray(NF4)[idx.astype(jnp.int32)]
    *lead, n_in, n_out = values.shape
    blocks = values.reshape(*lead, scale.shape[-2], n_in // scale.shape[-2], n_out)
    return (blocks * scale[..., None, :]).reshape(*lead, n_in, n_out)
