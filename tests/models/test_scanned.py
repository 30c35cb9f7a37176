"""The decoder's stacked layers: run by a scan (the trainer's way) or one by one, the same
logits and the same training step on every family, LoRA and QLoRA included; the attention
implementations inside the model; and the stacked layout in and out of Hugging Face folders."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kubejax.models import attention, lora, weights
from tests.helpers import assert_close_to_scale
from tests.models.decoders import TINY, save_tiny

FAMILIES = list(TINY)


def _model(folder, head: str, peft: str = "none"):
    cfg = weights.load_config(folder)
    model, _ = weights.from_checkpoint(folder, cfg, head, 3, jnp.float32)
    if peft != "none":
        lora.apply(model, 4, 8.0, "all", seed=1)
        # A trained-looking B (a fresh one is zero, which would hide A's gradient).
        for layer in lora.adapters(model).values():
            b = layer.lora_b[...]
            layer.lora_b = nnx.LoRAParam(jax.random.normal(jax.random.key(2), b.shape) * 0.1)
        if peft == "qlora":
            lora.quantize(model, "nf4")
    return model


def _batch(length: int = 24):
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 300, size=(3, length))
    mask = np.ones_like(ids)
    mask[1, 15:], mask[2, 9:] = 0, 0
    ids[mask == 0] = 0
    return ids, mask


def _loss_and_grads(model, scan: bool, head: str, peft: str, spec=None):
    """The loss of a batch and its gradients of what trains, the layers scanned or not."""
    model.model.scan = scan
    if spec is not None:
        model.model.attention = spec
    ids, mask = _batch(128 if spec is not None else 24)
    if peft == "none":
        graphdef, params = nnx.split(model)
        frozen = ()
    else:
        graphdef, params, frozen = nnx.split(model, lora.TRAINABLE, ...)
        frozen = (frozen,)

    def loss(params):
        m = nnx.merge(graphdef, params, *frozen)
        if head == "classification":
            return jnp.sum(m(ids, mask) ** 2)
        logits = m(ids, mask)
        return jnp.sum(jax.nn.log_softmax(logits)[..., 0] * mask)

    return jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.parametrize(
    ("family", "head", "peft"),
    [(f, "classification", "none") for f in FAMILIES]
    + [("llama", "causal-lm", "none"), ("gemma3_text", "causal-lm", "lora"),
       ("qwen2", "classification", "lora"), ("qwen3", "causal-lm", "qlora"),
       ("mistral", "classification", "qlora")],
)  # fmt: skip
@pytest.mark.slow
def test_scanned_layers_equal_layers_one_by_one(tmp_path, family, head, peft):
    save_tiny(family, tmp_path, head=head)
    scanned = _loss_and_grads(_model(tmp_path, head, peft), True, head, peft)
    unrolled = _loss_and_grads(_model(tmp_path, head, peft), False, head, peft)
    assert_close_to_scale(scanned[0], unrolled[0], 1e-5, f"{family} loss")
    flat_s, flat_u = jax.tree.leaves(scanned[1]), jax.tree.leaves(unrolled[1])
    assert len(flat_s) == len(flat_u) > 0
    for a, b in zip(flat_s, flat_u, strict=True):
        assert_close_to_scale(a, b, 1e-4, f"{family} {head} {peft} gradient")


@pytest.mark.parametrize("family", ["gemma3_text", "qwen2"])
@pytest.mark.slow
def test_splash_in_the_model_equals_the_reference(tmp_path, family):
    """Gemma 3's local and global layers (two kinds in one scan: a switch between two splash
    kernels) and Qwen's grouped heads with biases, splash in Pallas's interpret mode against
    the reference attention: loss and gradients."""
    save_tiny(family, tmp_path, head="classification")
    splash = attention.Spec("splash", 128, interpret=True)
    got = _loss_and_grads(_model(tmp_path, "classification"), True, "classification", "none",
                          splash)  # fmt: skip
    ref = _loss_and_grads(_model(tmp_path, "classification"), True, "classification", "none",
                          attention.Spec("xla"))  # fmt: skip
    assert_close_to_scale(got[0], ref[0], 1e-4, f"{family} loss")
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(ref[1]), strict=True):
        assert_close_to_scale(a, b, 1e-4, f"{family} gradient")


def test_the_stacked_layout_loads_and_exports_every_layer(tmp_path):
    """Hugging Face's per-layer tensors load into [layers, ...] variables, each layer at its
    index, and export back under their own keys, bit for bit."""
    from safetensors.numpy import load_file

    save_tiny("gemma3_text", tmp_path / "in", head="causal-lm")
    model = _model(tmp_path / "in", "causal-lm")
    stacked = model.model.layers.self_attn.q_proj.kernel[...]
    original = load_file(tmp_path / "in" / "model.safetensors")
    assert stacked.shape[0] == 3
    for i in range(3):
        np.testing.assert_array_equal(
            stacked[i], original[f"model.layers.{i}.self_attn.q_proj.weight"].T
        )
    weights.save_model_dir(model, tmp_path / "out", None, None, max_length=32)
    exported = load_file(tmp_path / "out" / "model.safetensors")
    assert set(exported) == set(original)
    for key, value in original.items():
        np.testing.assert_array_equal(exported[key], value, err_msg=key)


@pytest.mark.parametrize(
    ("family", "head", "peft"),
    [("qwen2", "classification", "none"), ("qwen2", "classification", "lora"),
     ("llama", "causal-lm", "qlora"), ("gemma3_text", "causal-lm", "lora")],
)  # fmt: skip
@pytest.mark.slow
def test_q_k_and_v_side_by_side_equal_them_one_by_one(tmp_path, monkeypatch, family, head, peft):
    """q, k and v as one product, their adapters as one (what a TPU runs): the loss and every
    gradient of what trains as each projection apart (a CPU's way); the classifier's last
    layer shares k and v only."""
    from kubejax.models import decoder

    save_tiny(family, tmp_path, head=head)
    apart = _loss_and_grads(_model(tmp_path, head, peft), True, head, peft)
    monkeypatch.setattr(decoder, "SIDE_BY_SIDE_ON_CPU", True)
    calls = []
    real = decoder.side_by_side
    monkeypatch.setattr(
        decoder, "side_by_side", lambda p, x, k: calls.append(len(p)) or real(p, x, k)
    )
    together = _loss_and_grads(_model(tmp_path, head, peft), True, head, peft)
    assert 3 in calls and (head != "classification" or 2 in calls)
    assert_close_to_scale(together[0], apart[0], 1e-5, f"{family} loss")
    flat_t, flat_a = jax.tree.leaves(together[1]), jax.tree.leaves(apart[1])
    assert len(flat_t) == len(flat_a) > 0
    for a, b in zip(flat_t, flat_a, strict=True):
        assert_close_to_scale(a, b, 1e-4, f"{family} gradient")


@pytest.mark.slow
def test_only_narrow_projections_share_a_product_and_only_off_the_cpu(monkeypatch):
    """The rule `side_by_side` follows: off the CPU, one of them narrow (Qwen2.5-0.5B's k and
    v: 128 outputs), no adapter dropout drawn; wide ones (Llama-3.2-1B's 512) stay apart."""
    from kubejax.models import decoder

    rngs = nnx.Rngs(0)

    def linears(outs):
        return tuple(decoder.Linear(64, n, True, jnp.float32, rngs) for n in outs)

    qwen, llama = linears((896, 128, 128)), linears((2048, 512, 512))
    keys = [None] * 3
    assert not decoder.shares_product(qwen, keys)  # this is a CPU
    monkeypatch.setattr(decoder, "SIDE_BY_SIDE_ON_CPU", True)
    assert decoder.shares_product(qwen, keys)
    assert not decoder.shares_product(llama, keys)
    mixed = (*linears((896,)), *linears((128, 128)))
    mixed[0].bias = None  # biases on some only
    assert not decoder.shares_product(mixed, keys)
    for layer in qwen:
        layer.lora_a = nnx.LoRAParam(jnp.zeros((64, 4)))
        layer.lora_b = nnx.LoRAParam(jnp.zeros((4, layer.shape[1])))
        layer.lora_scale, layer.lora_dropout = 2.0, 0.1
    assert decoder.shares_product(qwen, keys)  # evaluation: no dropout drawn
    drawn = list(jax.random.split(jax.random.key(0), 3))
    assert not decoder.shares_product(qwen, drawn)  # each adapter its own mask
