"""Run in a process of its own with 4 CPU devices (tests/trainer/test_plan.py): for each case,
the memory plan's bytes per device and XLA's (the compiled train step's arguments and
temporaries, per device); prints one JSON line."""

from __future__ import annotations

import json
import sys

import jax

jax.config.update("jax_num_cpu_devices", 4)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from kubejax.models.kernels import matrices_in  # noqa: E402
from kubejax.trainer import plan, precision, sharding, steps  # noqa: E402
from kubejax.trainer.config import TrainConfig  # noqa: E402
from kubejax.trainer.train import make_mesh, make_optimizer, place_state  # noqa: E402


def measure(settings: dict) -> tuple[int, int]:
    """(planned, compiled) bytes per device of one train step of `settings`."""
    cfg = TrainConfig(model="scratch", tokenizer="-", data_dir="-", output_dir="-", **settings)
    cfg = plan.as_asked(precision.here(cfg))  # one batch, no remat: what the plan checks
    model_cfg = plan.model_config(cfg)
    planned = plan.plan_memory(cfg, model_cfg, 5, jax.device_count()).total
    mesh, _ = make_mesh(cfg)
    abstract = plan.abstract_params(model_cfg, "classification", 5)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: _build(model_cfg)))
    params = matrices_in(jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), abstract),
                         cfg.param_dtype)  # fmt: skip
    tx = make_optimizer(cfg)
    params, opt_state, shardings = place_state(params, tx, mesh)
    step = steps.make_train_step(graphdef, tx, mesh, 0, None, shardings)
    accum, micro = cfg.grad_accum_steps, cfg.global_batch_size // cfg.grad_accum_steps
    spec = sharding.batch_spec(mesh, 1) if shardings else PartitionSpec(None, "data")
    batch = {
        name: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=NamedSharding(mesh, spec))
        for name, shape in (("input_ids", (accum, micro, cfg.max_length)),
                            ("attention_mask", (accum, micro, cfg.max_length)),
                            ("labels", (accum, micro)))
    }  # fmt: skip
    compiled = step.lower(params, opt_state, batch, 0, np.float32(1e-3)).compile()
    memory = compiled.memory_analysis()
    return planned, memory.argument_size_in_bytes + memory.temp_size_in_bytes


def _build(model_cfg):
    from kubejax.models import decoder_weights

    return decoder_weights.build(model_cfg, "classification", 5)


if __name__ == "__main__":
    cases = json.loads(sys.argv[1])
    print(json.dumps({name: measure(settings) for name, settings in cases.items()}))
