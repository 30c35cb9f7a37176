"""Inference with a trained classifier: what evaluation and the served MLflow model share."""

from __future__ import annotations

import sys

import jax
import numpy as np
from flax import nnx

from kubejax.data import dataset
from kubejax.trainer.steps import make_eval_step


def predict_logits(
    model, split: dataset.TokenizedSplit, batch_size: int, max_length: int, progress: bool = False
):
    """Logits for every row of `split`, in row order, data-parallel over local devices; with
    `progress`, a progress bar on a terminal (none in a pod's log)."""
    from jax.sharding import Mesh
    from tqdm.auto import tqdm

    devices = jax.local_devices()
    batch_size = max(len(devices), batch_size // len(devices) * len(devices))
    mesh = Mesh(np.array(devices), ("data",))
    graphdef, params = nnx.split(model)
    params = jax.device_put(params, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    eval_step = make_eval_step(graphdef, mesh)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    out = np.zeros((len(split), model.num_labels), dtype=np.float32)
    bar = tqdm(
        total=len(split),
        desc="predict",
        unit="review",
        disable=not (progress and sys.stderr.isatty()),
    )
    for batch in dataset.eval_batches(
        split,
        batch_size=batch_size,
        process_index=0,
        process_count=1,
        local_devices=len(devices),
        bucket_multiple=dataset.DEFAULT_BUCKET_MULTIPLE,
        max_length=max_length,
    ):
        rows, weights_ = batch.pop("rows"), batch["weights"]
        _, logits = eval_step(params, jax.device_put(batch, sharding))
        keep = weights_ > 0
        out[rows[keep]] = np.asarray(logits)[keep]
        bar.update(int(keep.sum()))
    bar.close()
    return out
