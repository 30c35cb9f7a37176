"""The attention implementations against the XLA reference: splash in Pallas's interpret mode
(the TPU kernel, run on the CPU), the query-blocked `chunked` path and cuDNN's call run through
XLA, on tiny shapes with every mask the decoders use (causal, padding left and right, packed
sequences, a sliding window, grouped-query heads); forward and gradients. And `choose`."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kubejax.models import attention
from kubejax.models.decoder import Tokens
from tests.helpers import assert_close_to_scale

B, T, HEADS, KV, D = 2, 128, 4, 2, 64


def _tokens(layout: str) -> Tokens:
    """Segments and positions of two rows: `right` / `left` padding, or `packed` sequences."""
    seg = np.ones((B, T), np.int32)
    pos = np.broadcast_to(np.arange(T), (B, T)).copy()
    if layout == "right":
        seg[1, 90:] = 0
    elif layout == "left":
        seg[1, :40] = 0
    elif layout == "packed":
        seg[0, :50], seg[0, 50:100], seg[0, 100:] = 1, 2, 0
        pos[0, 50:100] = np.arange(50)
        seg[1, :70], seg[1, 70:] = 1, 2
        pos[1, 70:] = np.arange(T - 70)
    return Tokens(jnp.asarray(seg), jnp.asarray(pos))


def _qkv(seed: int = 0):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(k1, (B, T, HEADS, D)) * D**-0.5
    return q, jax.random.normal(k2, (B, T, KV, D)), jax.random.normal(k3, (B, T, KV, D))


def _loss(impl: str, tokens: Tokens, window, block: int = 128):
    spec = attention.Spec(impl, block, interpret=True)
    real = (tokens.segments > 0)[:, :, None, None]

    def f(q, k, v):
        out = attention.attend(q, k, v, tokens, None, window, spec)
        # Padding queries' outputs are never read: left out of the comparison.
        return jnp.sum(jnp.where(real, out, 0.0) * jnp.cos(jnp.arange(D))), out

    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))


CASES = [
    ("causal", "none", None),
    ("right padding", "right", None),
    ("left padding", "left", None),
    ("packed", "packed", None),
    ("sliding window", "right", 17),
    ("packed and windowed", "packed", 9),
]


@pytest.mark.parametrize("impl", ["splash", "chunked"])
@pytest.mark.parametrize(("name", "layout", "window"), CASES, ids=[c[0] for c in CASES])
@pytest.mark.slow
def test_an_implementation_equals_the_reference(impl, name, layout, window):
    tokens = _tokens(layout)
    q, k, v = _qkv()
    # chunked: blocks of 32 queries, so the blocks and their masks are exercised.
    (_, out), grads = _loss(impl, tokens, window, 128 if impl == "splash" else 32)(q, k, v)
    (_, ref), ref_grads = _loss("xla", tokens, window)(q, k, v)
    real = np.asarray(tokens.segments > 0)
    assert_close_to_scale(np.asarray(out)[real], np.asarray(ref)[real], 1e-4, f"{impl} {name}")
    for g, r, which in zip(grads, ref_grads, "qkv", strict=True):
        assert_close_to_scale(g, r, 1e-4, f"{impl} {name}: d{which}")


@pytest.mark.slow
def test_splash_pads_a_length_that_is_not_a_multiple_of_its_block():
    tokens = dataclasses.replace(_tokens("right"))
    q, k, v = (x[:, :100] for x in _qkv())
    short = Tokens(tokens.segments[:, :100], tokens.positions[:, :100])
    spec = attention.Spec("splash", 128, interpret=True)
    out = attention.attend(q, k, v, short, None, None, spec)
    ref = attention.attend(q, k, v, short, None, None, attention.Spec("xla"))
    real = np.asarray(short.segments > 0)
    assert_close_to_scale(np.asarray(out)[real], np.asarray(ref)[real], 1e-4, "padded to 128")


@pytest.mark.parametrize("window", [None, 17])
@pytest.mark.slow
def test_the_cudnn_call_means_the_reference_mask(window):
    """cuDNN's arguments (causal, each row's length, the window's left side) run through XLA
    here: the same mask as the reference's on right-padded rows (a GPU runs them in cuDNN)."""
    tokens = _tokens("right")
    q, k, v = (x.astype(jnp.bfloat16) for x in _qkv())
    out = attention._cudnn(q, k, v, tokens.segments, window, implementation="xla")
    ref = attention.attend(q, k, v, tokens, None, window, attention.Spec("xla"))
    real = np.asarray(tokens.segments > 0)
    out, ref = np.asarray(out, np.float32)[real], np.asarray(ref, np.float32)[real]
    assert_close_to_scale(out, ref, 1e-2, "cudnn's mask")


@pytest.mark.slow
def test_a_subset_of_queries_and_shared_prompt_branches_fall_back():
    """The last layer's few queries go to the reference (a few rows of scores); prompt
    branches, which splash's segment ids cannot say, to the blocked path."""
    tokens = _tokens("right")
    q, k, v = _qkv()
    queries = jnp.array([[127], [89]])
    sub = jnp.take_along_axis(q, queries[:, :, None, None], axis=1)
    spec = attention.Spec("splash", 128, interpret=True)
    out = attention.attend(sub, k, v, tokens, queries, None, spec)
    full = attention.attend(q, k, v, tokens, None, None, attention.Spec("xla"))
    expected = jnp.take_along_axis(full, queries[:, :, None, None], axis=1)
    assert_close_to_scale(out, expected, 1e-5, "last queries")
    branches = jnp.asarray(np.repeat([[0] * 64 + [1] * 32 + [2] * 32], B, axis=0))
    branched = Tokens(tokens.segments, tokens.positions, branches)
    out = attention.attend(q, k, v, branched, None, None, spec)
    ref = attention.attend(q, k, v, branched, None, None, attention.Spec("xla"))
    real = np.asarray(tokens.segments > 0)
    assert_close_to_scale(np.asarray(out)[real], np.asarray(ref)[real], 1e-5, "branches")


@dataclasses.dataclass
class Choice:
    name: str
    setting: str
    platform: str
    length: int
    expected: str | None = None  # the implementation, or None for an error
    error: str = ""
    packing: bool = False
    dtype: str = "bfloat16"
    block: int = 0


CHOICES = [
    Choice("tpu long", "auto", "tpu", 2048, "splash"),
    Choice("tpu short", "auto", "tpu", 128, "xla"),
    Choice("gpu bf16", "auto", "gpu", 2048, "cudnn"),
    Choice("gpu packed", "auto", "gpu", 2048, "chunked", packing=True),
    Choice("gpu fp32", "auto", "gpu", 512, "xla", dtype="float32"),
    Choice("cpu short", "auto", "cpu", 256, "xla"),
    Choice("cpu long", "auto", "cpu", 8192, "chunked"),
    Choice("explicit", "chunked", "cpu", 256, "chunked"),
    Choice("splash off tpu", "splash", "cpu", 256, error="attention: splash runs on TPUs only"),
    Choice("cudnn off gpu", "cudnn", "tpu", 256, error="attention: cudnn runs on NVIDIA GPUs"),
    Choice("cudnn packed", "cudnn", "gpu", 256, error="no mask for packed rows", packing=True),
    Choice("unknown", "flash", "tpu", 256, error="attention: 'flash' is not one of auto, xla"),
    Choice("block lanes", "splash", "tpu", 1024, error="not a multiple of the TPU kernel's 128",
           block=200),
    Choice("block divides", "splash", "tpu", 1280, error="128, 256, 640, 1280 or 0", block=512),
]  # fmt: skip


@pytest.mark.parametrize("case", CHOICES, ids=[c.name for c in CHOICES])
def test_choose(case: Choice):
    def run():
        return attention.choose(
            case.setting, case.platform, case.length, packing=case.packing, dtype=case.dtype,
            head_dim=64, block=case.block,
        )  # fmt: skip

    if case.expected is None:
        with pytest.raises(attention.AttentionError, match=case.error):
            run()
        return
    spec, why = run()
    assert spec.implementation == case.expected, why
    assert why
