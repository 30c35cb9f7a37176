"""The weight matrix every model family's projections share: a kernel [in, out] in float32
(and a bias), with the slots `kubejax.models.lora` fills: a LoRA adapter
(`+ dropout(x) @ lora_a @ lora_b · lora_scale`) and, for QLoRA, the kernel stored quantized.
BERT's `Dense` and the decoders' `Linear` differ only in the product they call; one class
keeps LoRA, QLoRA and their export free of family cases."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from kubejax.models.kernels import product
from kubejax.models.quantize import dequantize_kernel


def _mix32(x: jax.Array) -> jax.Array:
    """C. Wellons' `lowbias32` integer hash: a bijection of uint32 in which every output bit
    depends on every input bit."""
    x = (x ^ (x >> 16)) * jnp.uint32(0x7FEB352D)
    x = (x ^ (x >> 15)) * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def dropout_bits(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """16 random bits (uint16) per element of `shape`, a deterministic function of `key`.

    A counter-based generator: one 32-bit seed drawn from `key`, then each counter hashed twice
    around it (`mix(mix(i) ^ seed)`), two elements per 32-bit hash (so up to 2³³ elements):
    about 17 integer operations per 32-bit word against threefry's 60-odd. Drawing every mask
    of a MiniLM train step through `jax.random.bits` was 3-6 % of the step (bench/NOTES.md,
    attempt 21). Dropout needs independent-looking bits, not a cryptographic stream.
    """
    n = math.prod(shape)
    seed = jax.random.bits(key, (), jnp.uint32)
    if jax.default_backend() != "cpu" and n < 2**32:
        # The same bits, each element hashing its own half-word: elementwise, so that on a GPU
        # XLA fuses the mask into the dropout that reads it instead of writing the bits out.
        i = jax.lax.iota(jnp.uint32, n).reshape(shape)
        words = _mix32(_mix32(i >> 1) ^ seed)
        return (words >> ((i & 1) << 4)).astype(jnp.uint16)
    words = _mix32(_mix32(jax.lax.iota(jnp.uint32, (n + 1) // 2)) ^ seed)
    return jax.lax.bitcast_convert_type(words, jnp.uint16).reshape(-1)[:n].reshape(shape)


def keep_mask(key: jax.Array, shape: tuple[int, ...], rate: float) -> tuple[jax.Array, float]:
    """Inverted dropout's mask for `key` (True: kept) and the scale of the kept elements; the
    drop probability is `rate` rounded to a multiple of 1/65536."""
    threshold = min(round(rate * 65536), 65535)
    return dropout_bits(key, shape) >= threshold, 65536 / (65536 - threshold)


def dropout(x: jax.Array, key: jax.Array, rate: float) -> jax.Array:
    """`x` with each element dropped with probability `rate` and the rest scaled up."""
    keep, scale = keep_mask(key, x.shape, rate)
    return jnp.where(keep, x * jnp.asarray(scale, x.dtype), jnp.zeros((), x.dtype))


class Projection(nnx.Module):
    """`kernel` [in, out] (float32, `init`) and an optional `bias` [out], computed in `dtype`
    by the subclass's `__call__`; `weight()` and `adapt()` give it LoRA and QLoRA."""

    def __init__(self, n_in: int, n_out: int, bias: bool, dtype, init, rngs: nnx.Rngs):
        self.kernel = nnx.Param(init(rngs.params(), (n_in, n_out), jnp.float32))
        self.bias = nnx.Param(jnp.zeros((n_out,), jnp.float32)) if bias else None
        self.dtype = dtype
        # Data, not static structure: `kubejax.models.lora` sets them later (the adapters; for
        # QLoRA the kernel's codes and scales in place of the kernel).
        self.lora_a, self.lora_b = nnx.data(None), nnx.data(None)
        self.lora_scale = 0.0
        self.lora_dropout = 0.0
        self.qkernel, self.qscale = nnx.data(None), nnx.data(None)
        self.qtype = ""

    @property
    def shape(self) -> tuple[int, int]:
        """The kernel's [in, out], stored quantized or not (a stacked layer's: one layer's)."""
        if self.qkernel is None:
            return tuple(self.kernel.shape[-2:])
        n_in, n_out = self.qkernel.shape[-2:]
        return (n_in if self.qtype == "int8" else 2 * n_in), n_out

    @property
    def stack(self) -> tuple[int, ...]:
        """The leading axes of stacked layers' kernels ([layers] in a decoder; () in BERT)."""
        return tuple((self.kernel if self.qkernel is None else self.qkernel).shape[:-2])

    def store_quantized(self, codes: jax.Array, scale: jax.Array, qtype: str) -> None:
        """Hold the kernel as `quantize_kernel`'s codes and scales (QLoRA's frozen base)."""
        self.kernel = None
        self.qkernel, self.qscale = nnx.Param(codes), nnx.Param(scale)
        self.qtype = qtype

    def weight(self) -> jax.Array:
        """The kernel [in, out], dequantized when stored quantized (QLoRA's frozen base)."""
        if self.qkernel is None:
            return self.kernel[...]
        return dequantize_kernel(self.qkernel[...], self.qscale[...], self.qtype)

    def effective_weight(self) -> jax.Array:
        """What the layer multiplies by, the adapter folded in (`weight() + A·B·scale`, no
        dropout): for a product that reads the weight itself (BERT's folded attention)."""
        w = self.weight()
        if self.lora_a is None:
            return w
        update = self.lora_a[...] @ self.lora_b[...] * self.lora_scale
        return (w.astype(jnp.float32) + update).astype(w.dtype)

    def adapt(self, x: jax.Array, y: jax.Array, key: jax.Array | None) -> jax.Array:
        """`y` (the base product of `x`, in the compute dtype) plus the adapter's
        `dropout(x) @ A @ B · scale`, summed in float32; `y` as it is without an adapter.
        `key`: the adapter's dropout mask (None: no dropout, as in evaluation)."""
        if self.lora_a is None:
            return y
        if key is not None and self.lora_dropout > 0.0:
            x = dropout(x, key, self.lora_dropout)
        low = product(x, self.lora_a[...].astype(self.dtype)).astype(self.dtype)
        update = product(low, self.lora_b[...].astype(self.dtype)).astype(jnp.float32)
        return (y + update * self.lora_scale).astype(self.dtype)
