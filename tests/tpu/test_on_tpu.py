"""Checks that need a TPU (run through the device tool: `bench/tpu.sh` runs them first); they
skip, saying so, where JAX sees none. Splash attention compiled for the chip (not Pallas's
interpret mode) against the XLA reference at a real length, and a scanned decoder's training
step with splash against the same step with the reference."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kubejax.models import attention
from kubejax.models.decoder import Tokens
from tests.helpers import assert_close_to_scale

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "tpu", reason="needs a TPU (run by bench/tpu.sh on the device)"
)


@pytest.mark.parametrize("window", [None, 512])
def test_splash_on_the_chip_equals_the_reference(window):
    """Grouped heads (14 over 2, head_dim 64: Qwen2.5-0.5B's), 2,048 tokens, two packed
    sequences in one row and right padding in the other; bfloat16 as training runs it."""
    b, n, heads, kv, d = 2, 2048, 14, 2, 64
    seg = np.ones((b, n), np.int32)
    pos = np.broadcast_to(np.arange(n), (b, n)).copy()
    seg[0, 1200:], pos[0, 1200:] = 2, np.arange(n - 1200)
    seg[1, 1900:] = 0
    tokens = Tokens(jnp.asarray(seg), jnp.asarray(pos))
    keys = jax.random.split(jax.random.key(0), 3)
    q = (jax.random.normal(keys[0], (b, n, heads, d)) * d**-0.5).astype(jnp.bfloat16)
    k = jax.random.normal(keys[1], (b, n, kv, d)).astype(jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, n, kv, d)).astype(jnp.bfloat16)
    real = (tokens.segments > 0)[:, :, None, None]

    def loss(spec):
        def f(q, k, v):
            out = attention.attend(q, k, v, tokens, None, window, spec).astype(jnp.float32)
            return jnp.sum(jnp.where(real, out, 0.0) * jnp.cos(jnp.arange(d))), out

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(q, k, v)

    (_, out), grads = loss(attention.Spec("splash", 512))
    (_, ref), ref_grads = loss(attention.Spec("xla"))
    mask = np.asarray(tokens.segments > 0)
    assert_close_to_scale(np.asarray(out)[mask], np.asarray(ref)[mask], 2e-2, "splash output")
    for g, r, name in zip(grads, ref_grads, "qkv", strict=True):
        g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
        assert_close_to_scale(g, r, 2e-2, f"splash d{name}")


def test_a_training_step_with_splash_equals_the_reference():
    """A 4-layer Qwen-shaped decoder, scanned, one step's loss and gradients in float32."""
    from flax import nnx

    from kubejax.models import decoder_weights, weights

    cfg = weights.scratch_config(json.dumps({
        "model_type": "qwen2", "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 1000,
    }))  # fmt: skip
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 1000, (2, 1024)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, 700:] = 0
    labels = jnp.array([1, 3])

    def step(spec):
        model = decoder_weights.build(cfg, "classification", 5)
        model.model.attention = spec
        graphdef, params = nnx.split(model)

        def loss(params):
            logits = nnx.merge(graphdef, params)(ids, mask)
            return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(2), labels])

        with jax.default_matmul_precision("highest"):
            return jax.jit(jax.value_and_grad(loss))(params)

    got, ref = step(attention.Spec("splash", 512)), step(attention.Spec("xla"))
    assert_close_to_scale(got[0], ref[0], 1e-3, "loss")
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(ref[1]), strict=True):
        assert_close_to_scale(a, b, 1e-2, "gradient")


def test_this_chip_is_known_and_a_long_run_unrolls_its_layers():
    """`scan_layers` unset reads the chip's kind from JAX (`kubejax.tpu`'s table): a 12-step
    run keeps the scan, 20,000 steps of the Qwen2.5-0.5B shape at 4 × 2,048 unroll."""
    from kubejax import tpu
    from kubejax.models.weights import scratch_config
    from kubejax.trainer import model_setup
    from kubejax.trainer.config import TrainConfig

    assert tpu.generation(jax.devices()[0].device_kind) is not None, jax.devices()[0]
    qwen = scratch_config(json.dumps({
        "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896,
        "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
        "num_key_value_heads": 2,
    }))  # fmt: skip
    cfg = TrainConfig(model="scratch", global_batch_size=4 * jax.device_count(), max_length=2048)
    short, long = (model_setup.scan_choice(cfg, qwen, steps) for steps in (12, 20_000))
    print(short, long)
    assert short[0] and not long[0], (short, long)
