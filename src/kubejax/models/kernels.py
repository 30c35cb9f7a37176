"""The matrix products every model family computes with, tuned for XLA's CPU backend (and
plain elsewhere): float32 sums of bfloat16 operands, and weight gradients that YNNPACK, XLA's
CPU matrix library, takes (bench/NOTES.md holds the measurements behind each)."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp


def product(a: jax.Array, b: jax.Array) -> jax.Array:
    """`a @ b` summed in float32: on CPU returned in float32, elsewhere in the operands' dtype.

    For bfloat16 operands XLA's CPU backend runs a product with a float32 result in YNNPACK's
    bfloat16 kernels, about twice its float32 speed on a CPU with AVX512-BF16, and one with a
    bfloat16 result no faster than float32 (bench/NOTES.md, attempt 33); a float32 sum is also
    what mixed-precision training accumulates in. A GPU's matrix units sum bfloat16 in float32
    whatever the result's dtype, and there a float32 result only adds its memory traffic and a
    cast back: a bert-base step on an H200 took 4 % longer with it (attempt 35). For float32
    operands it is `a @ b`.
    """
    if jax.default_backend() != "cpu":
        return jnp.matmul(a, b)
    return jnp.matmul(a, b, preferred_element_type=jnp.float32)


def matrices_in(params, dtype):
    """`params` with every floating matrix (weights, embedding tables; a stacked decoder's of
    each layer) in `dtype` and the vectors (biases, norms' scales) as they are: for inference.
    The model casts each matrix to its compute dtype as it uses it, which in bfloat16 made
    every evaluation batch convert them all (bench/NOTES.md, attempt 41); cast once, the
    logits are the same."""
    from kubejax.models.partitioning import is_matrix, path_name

    dtype = jnp.dtype(dtype)

    def cast(path, p):
        matrix = is_matrix(path_name(path), p.ndim)
        if matrix and jnp.issubdtype(p.dtype, jnp.floating) and p.dtype != dtype:
            return p.astype(dtype)
        return p

    return jax.tree_util.tree_map_with_path(cast, params)


def _transposed_product(a: jax.Array, g: jax.Array) -> jax.Array:
    """`aᵀ·g` over the last two axes (a [..., m, k], g [..., m, n] → [..., k, n]), the weight
    gradient of a product.

    XLA derives it as a product contracting the second-to-last axis of both operands, which
    YNNPACK (XLA's CPU matrix library) does not take: XLA's own loops ran those at 75-110
    GFLOP/s against YNNPACK's 300-400, or XLA transposed the wider operand first (bench/NOTES.md,
    attempts 12 and 17). On CPU this transposes the narrower of the two into a copy instead;
    other backends' libraries take transposed operands.
    """
    t = partial(jnp.swapaxes, axis1=-1, axis2=-2)
    if jax.default_backend() != "cpu":
        return product(t(a), g)
    if a.shape[-1] <= g.shape[-1]:
        return product(_transposed_copy(a), g)
    return t(jax.lax.optimization_barrier(product(_transposed_copy(g), a)))


def _transposed_copy(x: jax.Array) -> jax.Array:
    """x with its last two axes swapped, written out in that order (`_in_memory`)."""
    return _in_memory(jnp.swapaxes(x, -1, -2))


def operand(x: jax.Array) -> jax.Array:
    """x as an attention product's operand: in float32 as it is, where YNNPACK reads a
    transposed view faster than XLA writes it out; otherwise written out (`_in_memory`), where
    XLA's CPU backend converted a bfloat16 product reading such a view to float32 (attempt
    37)."""
    return x if x.dtype == jnp.float32 else _in_memory(x)


def _in_memory(x: jax.Array) -> jax.Array:
    """x written out in its own axis order, for a product on CPU to read (elsewhere x itself).

    XLA folds a bare transpose back into the product that reads it, and a transpose behind an
    optimization barrier keeps the operand's own layout: XLA's CPU backend then ran a bfloat16
    product in float32, after converting both operands, at half YNNPACK's bfloat16 speed
    (bench/NOTES.md, attempt 37). Flattened behind the barrier, a transpose is a copy.
    """
    if jax.default_backend() != "cpu":
        return x
    return jax.lax.optimization_barrier(x.reshape(-1)).reshape(x.shape)


@jax.custom_vjp
def matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    """`a @ b` over the last two axes (batch axes equal), its `b` gradient through
    `_transposed_product`: the attention's products, whose key and value gradients XLA would
    otherwise compute in its own loops on CPU. Summed in float32 (`product`), returned in a's
    dtype."""
    return product(a, b).astype(a.dtype)


def _matmul_fwd(a, b):
    return matmul(a, b), (a, b)


def _matmul_bwd(residuals, g):
    a, b = residuals
    g = operand(g)
    grad_a = product(g, operand(jnp.swapaxes(b, -1, -2).astype(g.dtype)))
    return grad_a.astype(a.dtype), _transposed_product(a, g).astype(b.dtype)


matmul.defvjp(_matmul_fwd, _matmul_bwd)


@jax.custom_vjp
def dense(x: jax.Array, kernel: jax.Array, bias: jax.Array) -> jax.Array:
    """`x @ kernel + bias` over x's last axis, in x's dtype; the kernel's gradient through
    `_transposed_product` over every token."""
    return (product(x, kernel.astype(x.dtype)) + bias).astype(x.dtype)


def _dense_fwd(x, kernel, bias):
    return dense(x, kernel, bias), (x, kernel, bias)


def _dense_bwd(residuals, g):
    x, kernel, bias = residuals
    rows = g.reshape(-1, g.shape[-1])
    grad_kernel = _transposed_product(x.reshape(-1, x.shape[-1]), rows)
    grad_x = product(g, kernel.T.astype(g.dtype)).astype(g.dtype)
    return grad_x, grad_kernel.astype(kernel.dtype), rows.sum(0, dtype=bias.dtype)


dense.defvjp(_dense_fwd, _dense_bwd)


def linear(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """`x @ kernel` over x's last axis, in x's dtype (`dense` without a bias). On CPU its
    kernel gradient goes through `_transposed_product` over every token (`_cpu_linear`);
    elsewhere it is the plain product, which a remat policy sees as one (a custom rule's
    residuals are not a policy's to keep: every projection's forward product ran again in the
    backward pass, a third more work a step on a TPU; bench/NOTES.md, attempt T2)."""
    if jax.default_backend() == "cpu":
        return _cpu_linear(x, kernel)
    return jnp.matmul(x, kernel.astype(x.dtype))


@jax.custom_vjp
def _cpu_linear(x: jax.Array, kernel: jax.Array) -> jax.Array:
    return product(x, kernel.astype(x.dtype)).astype(x.dtype)


def _linear_fwd(x, kernel):
    return _cpu_linear(x, kernel), (x, kernel)


def _linear_bwd(residuals, g):
    x, kernel = residuals
    grad_kernel = _transposed_product(x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1]))
    grad_x = product(g, kernel.T.astype(g.dtype)).astype(g.dtype)
    return grad_x, grad_kernel.astype(kernel.dtype)


_cpu_linear.defvjp(_linear_fwd, _linear_bwd)
