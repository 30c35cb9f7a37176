"""The compiled steps: the loss, one optimizer step (with gradient accumulation inside), and one
evaluation step. Training, evaluation and the served model all use these."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from kubejax.trainer import distributed


def loss_fn(graphdef, params, batch, key, deterministic: bool):
    """Mean cross-entropy over the batch, with the accuracy and the logits."""
    model = nnx.merge(graphdef, params)
    rngs = None if deterministic else nnx.Rngs(dropout=key)
    logits = model(
        batch["input_ids"], batch["attention_mask"], deterministic=deterministic, rngs=rngs
    )
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
    correct = (jnp.argmax(logits, -1) == batch["labels"]).astype(jnp.float32)
    return ce.mean(), (correct.mean(), logits)


def make_train_step(graphdef, tx, mesh, seed: int):
    """One optimizer step over a global batch [accum, micro, length] at the given learning rate;
    state is donated."""
    rep = distributed.replicated(mesh)
    base_key = jax.random.key(seed)

    @partial(jax.jit, donate_argnums=(0, 1), out_shardings=(rep, rep, rep))
    def train_step(params, opt_state, batch, step, learning_rate):
        key = jax.random.fold_in(base_key, step)
        grad_fn = jax.value_and_grad(partial(loss_fn, graphdef, deterministic=False), has_aux=True)

        def micro(carry, xs):
            grads, loss, acc = carry
            mb, i = xs
            (mb_loss, (mb_acc, _)), g = grad_fn(params, mb, jax.random.fold_in(key, i))
            return (jax.tree.map(jnp.add, grads, g), loss + mb_loss, acc + mb_acc), None

        accum = batch["labels"].shape[0]
        zeros = jax.tree.map(jnp.zeros_like, params)
        init = (zeros, jnp.zeros(()), jnp.zeros(()))
        (grads, loss, acc), _ = jax.lax.scan(micro, init, (batch, jnp.arange(accum)))
        grads = jax.tree.map(lambda g: g / accum, grads)
        hyperparams = {**opt_state.hyperparams, "learning_rate": learning_rate}
        updates, opt_state = tx.update(grads, opt_state._replace(hyperparams=hyperparams), params)
        params = optax.apply_updates(params, updates)
        metrics = {
            "loss": loss / accum,
            "accuracy": acc / accum,
            "grad_norm": optax.tree.norm(grads),
            "tokens": batch["attention_mask"].sum(),
        }
        return params, opt_state, metrics

    return train_step


def make_eval_step(graphdef, mesh):
    """Weighted loss and accuracy sums over a global batch, and the logits."""
    rep = distributed.replicated(mesh)

    @partial(jax.jit, out_shardings=(rep, distributed.batch_sharding(mesh)))
    def eval_step(params, batch):
        model = nnx.merge(graphdef, params)
        logits = model(batch["input_ids"], batch["attention_mask"], deterministic=True)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
        correct = (jnp.argmax(logits, -1) == batch["labels"]).astype(jnp.float32)
        w = batch["weights"]
        sums = {"loss": (ce * w).sum(), "correct": (correct * w).sum(), "count": w.sum()}
        return sums, logits

    return eval_step
