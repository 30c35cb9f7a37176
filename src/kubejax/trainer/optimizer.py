"""The optimizer: the learning-rate schedule, the optimizer by name with its weight-decay mask,
and the settings a resumed run takes from its own config."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

from kubejax.models.kernels import matrices_in
from kubejax.trainer.config import TrainConfig


def make_schedule(cfg: TrainConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0, then linear, cosine or no decay."""
    warmup = int(cfg.warmup_ratio * total_steps)
    decay = max(total_steps - warmup, 1)
    lr = cfg.learning_rate
    if cfg.schedule == "cosine":
        after = optax.cosine_decay_schedule(lr, decay)
    elif cfg.schedule == "linear":
        after = optax.linear_schedule(lr, 0.0, decay)
    else:
        after = optax.constant_schedule(lr)
    return optax.join_schedules([optax.linear_schedule(0.0, lr, max(warmup, 1)), after], [warmup])


def decay_mask(params):
    """Weight decay on weight matrices and embeddings only, not on biases or LayerNorm."""

    def keep(path, _):
        name = jax.tree_util.keystr(path)
        return not ("bias" in name or "scale" in name)

    return jax.tree_util.tree_map_with_path(keep, params)


def base_optimizer(cfg: TrainConfig, learning_rate, weight_decay) -> optax.GradientTransformation:
    """The optimizer itself, by name, with the weight-decay mask; settings left unset take
    optax's defaults."""
    given = {k: getattr(cfg, k) for k in ("b1", "b2", "eps") if getattr(cfg, k) is not None}
    if cfg.mu_dtype is not None:
        given["mu_dtype"] = jnp.dtype(cfg.mu_dtype)
    if cfg.optimizer == "adamw":
        return optax.adamw(learning_rate, weight_decay=weight_decay, mask=decay_mask, **given)
    if cfg.optimizer == "lion":
        return optax.lion(learning_rate, weight_decay=weight_decay, mask=decay_mask, **given)
    if cfg.optimizer == "adafactor":
        # An absolute learning rate (the schedule's), not Adafactor's parameter-relative one.
        return optax.adafactor(
            learning_rate,
            decay_rate=0.8 if cfg.decay_rate is None else cfg.decay_rate,
            multiply_by_parameter_scale=False,
            weight_decay_rate=weight_decay,
            weight_decay_mask=decay_mask,
        )
    momentum = 0.9 if cfg.momentum is None else cfg.momentum
    return optax.chain(
        optax.add_decayed_weights(weight_decay, mask=decay_mask),
        optax.sgd(learning_rate, momentum=momentum or None, nesterov=cfg.nesterov),
    )


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """Gradient clipping, then the configured optimizer (adamw, adafactor, lion or sgd).

    The learning rate, weight decay and clipping norm live in the optimizer state
    (`optax.inject_hyperparams`) instead of being constants of the compiled step: the step gets
    this step's learning rate as an input, so sweep trials that differ only in these settings
    run one compiled program, shared through the persistent compilation cache.
    """

    def chain(learning_rate, weight_decay, max_grad_norm):
        return optax.chain(
            optax.clip_by_global_norm(max_grad_norm),
            base_optimizer(cfg, learning_rate, weight_decay),
        )

    return optax.inject_hyperparams(chain)(
        learning_rate=0.0,
        weight_decay=cfg.weight_decay,
        max_grad_norm=cfg.max_grad_norm if cfg.max_grad_norm > 0 else math.inf,
    )


def host_learning_rates(cfg: TrainConfig, total_steps: int) -> np.ndarray:
    """The schedule, computed once on the host: each step gets its learning rate as an input
    (see make_optimizer), and evaluating it during the loop would stall the host. One compiled
    program: evaluated op by op, each of its ten operations compiled apart on the device."""
    schedule = jax.jit(jax.vmap(make_schedule(cfg, total_steps)))
    return np.asarray(schedule(jnp.arange(total_steps + 1)), np.float32)


def with_settings(opt_state, cfg: TrainConfig):
    """A restored optimizer state with this run's weight decay and clipping norm: on resume the
    moments are kept and the settings are the run's own (the learning rate comes from its
    schedule at the resumed step anyway), as Population Based Training's restarted trials
    need."""
    hyperparams = getattr(opt_state, "hyperparams", None)
    if not hyperparams:
        return opt_state
    settings = {
        "weight_decay": cfg.weight_decay,
        "max_grad_norm": cfg.max_grad_norm if cfg.max_grad_norm > 0 else math.inf,
    }
    new = dict(hyperparams)
    for name, value in settings.items():
        old = hyperparams.get(name)
        if old is not None:
            new[name] = jax.device_put(jnp.asarray(value, old.dtype), old.sharding)
    return opt_state._replace(hyperparams=new)


def state_init(tx):
    """`params → tx`'s fresh state, in float32 whatever the weights' dtype (`param_dtype`)."""

    def init(params):
        return tx.init(matrices_in(params, jnp.float32))

    return init
