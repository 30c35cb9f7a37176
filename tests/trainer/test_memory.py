"""Memory settings: activation checkpointing (`remat`) keeps the gradients and lowers the
step's temporaries; bfloat16 weights (`param_dtype`) train with float32 moments."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kubejax.models.partitioning import is_matrix, path_name
from kubejax.trainer import distributed, steps
from kubejax.trainer.config import TrainConfig
from kubejax.trainer.model_setup import classifier_for
from kubejax.trainer.optimizer import make_optimizer
from kubejax.trainer.train import place_state
from tests.helpers import assert_close_to_scale


def _batch(rows: int = 8, length: int = 96):
    rng = np.random.default_rng(0)
    return {
        "input_ids": rng.integers(1, 300, (rows, length)).astype(np.int32),
        "attention_mask": np.ones((rows, length), np.int32),
        "labels": rng.integers(0, 5, rows).astype(np.int32),
    }


#: A decoder deep and long enough for its activations to outweigh the rest of a step's
#: temporaries (the tiny checkpoint's two layers are not).
DEEP = json.dumps(
    {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 8,
     "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300}
)  # fmt: skip


def _model(model_dir, deep: bool = False, **settings):
    if deep:  # model_dir's tokenizer, a deeper random model
        settings = {"scratch_config": DEEP, "tokenizer": str(model_dir), **settings}
        model_dir = "scratch"
    cfg = TrainConfig(model=str(model_dir), data_dir="-", output_dir="-", **settings)
    return classifier_for(cfg, 5)[0], cfg


@pytest.mark.slow
def test_remat_keeps_the_gradients_and_recomputes_what_its_policy_drops(tiny_decoder_dir):
    """The backward pass recomputes what `remat` does not keep: the attention's scores with
    `minimal` (the projections' outputs and the attention's are kept), every product with
    `full`; `none` recomputes no product; the gradients stay those of `none`. The program
    holds the scanned layer once, and the last layer apart (a classifier's, at its last tokens
    only): two copies of each product. (XLA's CPU compiler folds the recomputation back into
    the forward's values, as it does for `jax.checkpoint` itself, so on CPU the compiled step's
    memory does not change; the policy is visible in the program JAX hands to XLA.)"""
    grads, products = {}, {}
    batch = _batch(8, 64)
    for remat in ("none", "minimal", "full"):
        model, _ = _model(tiny_decoder_dir, deep=True, remat=remat)
        graphdef, params = nnx.split(model)

        def loss(p, graphdef=graphdef):
            return steps.loss_fn(graphdef, p, batch, None, True)[0]

        lowered = jax.jit(jax.grad(loss)).lower(params)
        products[remat] = lowered.as_text().count("stablehlo.dot_general")
        grads[remat] = jax.tree.leaves(lowered.compile()(params))
    for remat in ("minimal", "full"):
        for ours, expected in zip(grads[remat], grads["none"], strict=True):
            assert_close_to_scale(np.asarray(ours), np.asarray(expected), 1e-5, remat)
    copies = 2  # the scanned layer and the last one
    # minimal: the attention's scores again; full: every product whose output the backward
    # pass reads (all but the MLP's down projection, eight of nine).
    assert products["minimal"] - products["none"] == 1 * copies, products
    assert products["full"] - products["none"] == 8 * copies, products


@pytest.mark.slow
def test_bfloat16_weights_train_with_float32_moments(tiny_decoder_dir):
    losses = {}
    for param_dtype in ("float32", "bfloat16"):
        model, cfg = _model(tiny_decoder_dir, param_dtype=param_dtype)
        graphdef, params = nnx.split(model)
        from kubejax.models.kernels import matrices_in

        params = matrices_in(params, param_dtype)
        tx = make_optimizer(cfg)
        mesh = distributed.data_mesh()
        params, opt_state, shardings = place_state(params, tx, mesh)
        step = steps.make_train_step(graphdef, tx, mesh, 0, model.sparse_embedding, shardings)
        batch = distributed.global_batch({k: v[None] for k, v in _batch().items()}, mesh, 1)
        out = []
        for i in range(3):
            params, opt_state, metrics = step(params, opt_state, batch, i, np.float32(1e-3))
            out.append(float(metrics["loss"]))
        losses[param_dtype] = out
        # The matrices (a stacked decoder's [layers, in, out]) in param_dtype; the vectors
        # (norms' scales, [layers, hidden] when stacked) stay float32.
        flat = jax.tree_util.tree_flatten_with_path(params)[0]
        kernels = [p for path, p in flat if is_matrix(path_name(path), p.ndim)]
        vectors = [p for path, p in flat if not is_matrix(path_name(path), p.ndim)]
        assert {p.dtype for p in kernels} == {jnp.dtype(param_dtype)}
        assert vectors and {p.dtype for p in vectors} == {jnp.dtype(jnp.float32)}
        moments = [m for m in jax.tree.leaves(opt_state) if getattr(m, "ndim", 0) >= 2]
        assert moments and {m.dtype for m in moments} == {jnp.dtype(jnp.float32)}
    np.testing.assert_allclose(losses["bfloat16"], losses["float32"], rtol=2e-2)
    assert losses["bfloat16"][-1] < losses["bfloat16"][0]


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({"remat": "some"}, "remat: 'some' is not one of none, minimal, full"),
        (
            {"param_dtype": "float16"},
            "param_dtype: 'float16' is not one of float32, bfloat16, auto",
        ),
    ],
)
def test_bad_memory_settings_are_named(settings, expected):
    from kubejax.trainer.config import ConfigError

    with pytest.raises(ConfigError, match=expected):
        TrainConfig(model="m", data_dir="d", output_dir="o", **settings).validate(check_paths=False)
