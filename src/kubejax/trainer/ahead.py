"""Programs compiled ahead, in threads, on an accelerator: the train step while the weights load
or are drawn, the evaluation while the steps run. A TPU's host cores are idle while the chip
computes, and a program compiles there in seconds (the 270M decoder's train step in 11.6 s, its
evaluation in 4.1 s: bench/NOTES.md, T8), which a run otherwise waits for. On a CPU those cores
run the setup and the steps, and everything compiles when it comes.

The train step ahead is compiled from the model's shapes, and the run takes that step where the
model it builds has the same structure: its first call then finds the program in memory. One
process only (a job's processes compile their programs together). The threads are not daemons:
a run that stops early (a setting refused, a checkpoint unreadable) exits once their compile is
done, since JAX tearing its backends down under a compile aborted the process (exit -6, not the
run's own status).
"""

from __future__ import annotations

import logging
import threading
from functools import partial

import jax
import numpy as np

from kubejax.models.kernels import matrices_in
from kubejax.trainer import distributed, precision, sharding
from kubejax.trainer.config import TrainConfig
from kubejax.trainer.inputs import TrainData, eval_batches, train_batches
from kubejax.trainer.model_setup import abstract_model, frozen_shardings, split_model
from kubejax.trainer.optimizer import make_optimizer, state_init
from kubejax.trainer.steps import make_train_step

log = logging.getLogger("kubejax.trainer")


def _accelerator() -> bool:
    return jax.devices()[0].platform != "cpu"


class StepAhead:
    """The train step's program for the run's first batch, compiled in a thread from the
    model's shapes (`model_setup.abstract_model`) while the main thread reads or draws the
    weights, places them and starts the tracking: on a TPU v5e the 270M decoder's epoch waited
    ~12 s for it after a setup of ~16 s. The run takes that step (`train_step`) where it was
    made for the same model, its program then in memory; a step made otherwise (another
    structure, a resumed run's first batch in another bucket) compiles its own, or reads it
    from the persistent cache. `on`: force or stop it (tests)."""

    def __init__(self, cfg: TrainConfig, data: TrainData, mesh, on=None):
        self.thread, self.made = None, None
        if not (_accelerator() if on is None else on) or jax.process_count() > 1:
            return
        args = (cfg, data, mesh)
        self.thread = threading.Thread(target=self._run, args=args, name="step-ahead")
        self.thread.start()

    def _run(self, cfg: TrainConfig, data: TrainData, mesh) -> None:
        try:
            step, args, kwargs, made_for = step_of_shapes(cfg, data, mesh)
            jitted = getattr(step, "func", step)
            jitted.lower(*args, **kwargs).compile()
            self.made = jitted, made_for
        except Exception as err:  # the run's own step compiles (and says any error) itself
            log.debug("train step compiled ahead: %s", err)

    def train_step(self, graphdef, tx, mesh, seed: int, sparse=None, shardings=None, frozen=None):
        """The run's train step (as `make_train_step` makes it): the one compiled ahead, once
        its thread is done, where it was made for the same model, placement and seed."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.made is not None and self.made[1] == _made_for(
            graphdef, mesh, seed, sparse, shardings, frozen
        ):
            jitted = self.made[0]
            return jitted if frozen is None else partial(jitted, frozen=frozen)
        return make_train_step(graphdef, tx, mesh, seed, sparse, shardings, frozen)


def _made_for(graphdef, mesh, seed, sparse, shardings, frozen) -> tuple:
    """What a train step is made for, as far as its program goes (`StepAhead.train_step`)."""
    placed = None if shardings is None else (jax.tree.structure(shardings),
                                             jax.tree.leaves(shardings))  # fmt: skip
    return graphdef, mesh, seed, sparse, placed, frozen is None


def step_of_shapes(cfg: TrainConfig, data: TrainData, mesh):
    """A train step as the run makes it, for the model's shapes placed as the run places them,
    its first call's arguments and what it was made for: (step, args, kwargs, made for)."""
    tx = make_optimizer(cfg)
    model = abstract_model(cfg, data.num_labels, data.total_steps)
    graphdef, params, frozen = split_model(cfg, model)
    params, opt_state, shardings = _state_of_shapes(params, tx, mesh)
    if frozen is not None:
        frozen = _placed(frozen, frozen_shardings(frozen, mesh))
    sparse = model.sparse_embedding if frozen is None else None
    step = make_train_step(graphdef, tx, mesh, cfg.seed, sparse, shardings, frozen)
    _, local = next(iter(train_batches(cfg, data, 0)))
    batch = distributed.global_batch(local, mesh, leading=1)
    # The run passes the step's number (an int) and its learning rate (a float32 from
    # `host_learning_rates`).
    args = (params, opt_state, batch, 0, np.float32(0.0))
    made_for = _made_for(graphdef, mesh, cfg.seed, sparse, shardings, frozen)
    return step, args, getattr(step, "keywords", {}), made_for


def _state_of_shapes(params, tx, mesh):
    """`train.place_state`'s parameters, optimizer state and shardings, as shapes."""
    opt_state = jax.eval_shape(state_init(tx), params)
    params_sh, opt_sh, shardings = sharding.state_layout(params, opt_state, tx, mesh)
    return _placed(params, params_sh), _placed(opt_state, opt_sh), shardings


def _placed(tree, shardings):
    """Shapes with their shardings (one for all, or a tree like `tree`)."""
    if not isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
        )
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings), tree)


class EvaluationAhead:
    """The evaluation step, its programs (one per batch shape of the validation split)
    compiled in a thread while the first train step compiles and the steps run, so that no
    evaluation stops the run to compile: on a TPU v5e the 270M decoder's took 4.5 s of its
    epoch's wall (bench/NOTES.md, T8). Only on an accelerator (`on`: force or stop it)."""

    def __init__(self, eval_step, params, data: TrainData, cfg: TrainConfig, mesh, on=None):
        self.step, self.thread = eval_step, None
        if not (_accelerator() if on is None else on) or not len(data.val):
            return
        dtype = precision.here(cfg).dtype
        shapes = jax.eval_shape(lambda p: matrices_in(p, dtype), params)
        abstract = _placed(shapes, jax.tree.map(lambda p: p.sharding, params))
        fn = getattr(eval_step, "func", eval_step)
        kwargs = getattr(eval_step, "keywords", {})

        def compile_each_shape():
            seen = set()
            for local in eval_batches(data.val, cfg, data.answers):
                shape = tuple(sorted((k, v.shape) for k, v in local.items()))
                if shape not in seen:
                    seen.add(shape)
                    batch = distributed.global_batch(local, mesh)
                    fn.lower(abstract, batch, **kwargs).compile()

        def run():
            try:
                compile_each_shape()
            except Exception as err:  # the evaluation compiles (and says any error) itself
                log.debug("evaluation compiled ahead: %s", err)

        self.thread = threading.Thread(target=run, name="evaluation-ahead")
        self.thread.start()

    def __call__(self, *args, **kwargs):
        """The step, once its programs are compiled (a call that came first would compile its
        own, the same, again)."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        return self.step(*args, **kwargs)
