"""Run in a process of its own with 4 CPU devices (tests/trainer/test_sharding.py): a few
train steps of a tiny decoder on each mesh, or (`qlora:MESH`) QLoRA's load on the mesh; prints
one JSON line of losses, parameter sums and the share of each parameter the first device
holds."""

from __future__ import annotations

import json
import sys

import jax

jax.config.update("jax_num_cpu_devices", 4)

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from kubejax.models import decoder_weights, lora, weights  # noqa: E402
from kubejax.trainer import distributed, sharding  # noqa: E402
from kubejax.trainer.config import TrainConfig  # noqa: E402
from kubejax.trainer.optimizer import make_optimizer  # noqa: E402
from kubejax.trainer.steps import make_train_step  # noqa: E402
from kubejax.trainer.train import make_mesh, place_state  # noqa: E402


def run(model_dir: str, mesh_text: str, steps: int = 3) -> dict:
    cfg = TrainConfig(model=model_dir, data_dir="-", output_dir="-", mesh=mesh_text,
                      global_batch_size=8, learning_rate=1e-3)  # fmt: skip
    mesh, sizes = make_mesh(cfg)
    placement = sharding.placement(mesh) if sharding.is_sharded(mesh) else None
    model_cfg = weights.load_config(weights.resolve_model_dir(model_dir))
    sharding.check_model(model_cfg, sizes)
    model, _ = weights.from_checkpoint(
        weights.resolve_model_dir(model_dir), model_cfg, "classification", 5, np.float32, 0,
        placement,
    )  # fmt: skip
    loaded = {
        ".".join(map(str, p)): sharding.shard_fraction(v.get_value())
        for p, v in nnx.iter_graph(model)
        if isinstance(v, nnx.Param)
    }
    graphdef, params = nnx.split(model)
    tx = make_optimizer(cfg)
    params, opt_state, shardings = place_state(params, tx, mesh)
    step = make_train_step(graphdef, tx, mesh, 0, model.sparse_embedding, shardings)
    rng = np.random.default_rng(0)
    losses = []
    for i in range(steps):
        local = {
            "input_ids": rng.integers(1, 300, (1, 8, 16)).astype(np.int32),
            "attention_mask": (np.arange(16) < rng.integers(4, 17, (1, 8, 1))).astype(np.int32),
            "labels": rng.integers(0, 5, (1, 8)).astype(np.int32),
        }
        batch = distributed.global_batch(local, mesh, leading=1)
        params, opt_state, metrics = step(params, opt_state, batch, i, np.float32(1e-3))
        losses.append(float(metrics["loss"]))
    flat = {
        jax.tree_util.keystr(p): np.asarray(jax.device_get(x))
        for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
    }
    moments = [x for x in jax.tree.leaves(opt_state) if getattr(x, "ndim", 0) == 2]
    return {
        "losses": losses,
        "params": {k: v.tolist() for k, v in flat.items()},
        "loaded_fraction": loaded,
        "state_fraction": {
            k: sharding.shard_fraction(x)
            for k, x in zip(flat, jax.tree.leaves(params), strict=True)
        },
        "moment_fraction": min(sharding.shard_fraction(m) for m in moments),
        "devices": jax.device_count(),
    }


def qlora_load(model_dir: str, mesh_text: str, qtype: str = "nf4") -> dict:
    """QLoRA's load into the mesh's shards against quantizing the whole model after a plain
    load: whether the codes and scales are equal, the largest share of a projection's kernel
    any one read of the checkpoint took, and the share of the codes the first device holds."""
    cfg = TrainConfig(model=model_dir, data_dir="-", output_dir="-", mesh=mesh_text)
    mesh, _ = make_mesh(cfg)
    model_dir = weights.resolve_model_dir(model_dir)
    model_cfg = weights.load_config(model_dir)
    reads: list[float] = []
    get = decoder_weights._Reader.get

    def counted(self, key, transpose, index=(), dtype=np.float32):
        value = get(self, key, transpose, index, dtype)
        if key.endswith("_proj.weight"):
            reads.append(value.size / np.prod(self.shape(key, transpose)))
        return value

    decoder_weights._Reader.get = counted
    args = (model_dir, model_cfg, "causal-lm", 2, np.float32, 0)
    sharded, _ = weights.from_checkpoint(*args, sharding.placement(mesh), qtype)
    decoder_weights._Reader.get = get
    whole, _ = weights.from_checkpoint(*args)
    lora.quantize(whole, qtype)
    ours, theirs = lora.projections(sharded), lora.projections(whole)
    equal = all(
        np.array_equal(np.asarray(ours[k].qkernel[...]), np.asarray(theirs[k].qkernel[...]))
        and np.array_equal(np.asarray(ours[k].qscale[...]), np.asarray(theirs[k].qscale[...]))
        for k in theirs
    )
    codes = [sharding.shard_fraction(layer.qkernel[...]) for layer in ours.values()]
    return {"equal": equal, "largest_read": max(reads), "reads": len(reads),
            "codes_fraction": max(codes)}  # fmt: skip


if __name__ == "__main__":
    model_dir, *meshes = sys.argv[1:]
    print(json.dumps({
        m: qlora_load(model_dir, m.removeprefix("qlora:")) if m.startswith("qlora:")
        else run(model_dir, m)
        for m in meshes
    }))  # fmt: skip
