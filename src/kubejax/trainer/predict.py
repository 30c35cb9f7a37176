"""Inference with a trained classifier: what evaluation and the served MLflow model share."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from kubejax.data import dataset
from kubejax.trainer.model import matrices_in
from kubejax.trainer.steps import make_eval_step

#: Rows of a batch each CPU device takes at least when evaluation splits it over the cores.
CPU_DEVICE_ROWS = 32

#: Reviews of at most this many tokens are packed several to a row of this length. MiniLM's
#: evaluation of Yelp-like lengths (up to 512) against no packing: rows of 128 +8 %, 256
#: +17-19 %, 512 -20 % (a long row's attention costs more than the padding it saves;
#: bench/NOTES.md, attempt 53).
PACK_LENGTH = 256


def cpu_cores() -> int:
    """Cores this process may use: its CPU affinity, within a cgroup v2 CPU quota (a pod's
    CPU limit) where one is set."""
    cores = len(os.sched_getaffinity(0))
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            cores = min(cores, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return cores


def use_cpu_cores_as_devices(batch_size: int) -> int:
    """On CPU, run evaluation on one JAX device per core (each taking at least
    `CPU_DEVICE_ROWS` rows of a batch); returns the CPU device count asked for (1: unchanged).

    Each device runs its share of the batch on a thread of its own: MiniLM's evaluation on 2
    cores measured 81.0 against 73.2 examples/s for one device whose every operation is split
    over both cores (medians of 3 alternated runs, bench/NOTES.md, attempt 27). JAX fixes its
    devices at its first operation: call this before it. Kept as they are: a count the user
    set (JAX_NUM_CPU_DEVICES or XLA_FLAGS' host device count), and the devices of a JAX
    already started. Where JAX computes on an accelerator, the CPU device count changes
    nothing it uses.
    """
    wanted = max(1, min(cpu_cores(), batch_size // CPU_DEVICE_ROWS))
    user_set = jax.config.jax_num_cpu_devices != -1 or (
        "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")
    )
    if wanted == 1 or user_set:
        return 1
    try:
        jax.config.update("jax_num_cpu_devices", wanted)
    except RuntimeError:  # JAX has started: its devices stay
        return 1
    return wanted


def predict_logits(
    model, split: dataset.TokenizedSplit, batch_size: int, max_length: int, progress: bool = False
):
    """Logits for every row of `split`, in row order, data-parallel over local devices, reviews
    of at most `PACK_LENGTH` tokens packed several to a row (`dataset.packed_eval_batches`);
    with `progress`, a progress bar on a terminal (none in a pod's log)."""
    from jax.sharding import Mesh
    from tqdm.auto import tqdm

    devices = jax.local_devices()
    batch_size = max(len(devices), batch_size // len(devices) * len(devices))
    mesh = Mesh(np.array(devices), ("data",))
    graphdef, params = nnx.split(model)
    params = matrices_in(params, model.dtype)
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
    for batch in dataset.packed_eval_batches(
        split,
        batch_size=batch_size,
        local_devices=len(devices),
        bucket_multiple=dataset.DEFAULT_BUCKET_MULTIPLE,
        max_length=max_length,
        pack_length=PACK_LENGTH,
    ):
        rows, weights_ = batch.pop("rows"), batch["weights"]
        _, logits = eval_step(params, jax.device_put(batch, sharding))
        keep = weights_ > 0
        out[rows[keep]] = np.asarray(logits)[keep]
        bar.update(int(keep.sum()))
    bar.close()
    return out
