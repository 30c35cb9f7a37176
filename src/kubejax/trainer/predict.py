"""Inference with a trained classifier: what evaluation and the served MLflow model share."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from kubejax.data import dataset
from kubejax.models.kernels import matrices_in
from kubejax.trainer import distributed
from kubejax.trainer.steps import make_eval_step

#: Rows of a batch each CPU device takes at least when evaluation splits it over the cores.
CPU_DEVICE_ROWS = 32


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


class Predictor:
    """A classifier placed on this process's devices with its evaluation step, for many calls:
    each batch shape is traced and compiled once, not again in every call (a served model's
    requests)."""

    def __init__(self, model, answers: list[list[int]] | None = None):
        """`answers`: for a language model (task causal-lm), each label's answer tokens; its
        logits are then the labels' log-likelihoods (`DecoderLM.label_scores`)."""
        from jax.sharding import Mesh

        devices = jax.local_devices()
        self.answers = answers
        self.devices = len(devices)
        self.num_labels = len(answers) if answers is not None else model.num_labels
        mesh = Mesh(np.array(devices), (distributed.DATA_AXIS,))
        graphdef, params = nnx.split(model)
        params = matrices_in(params, model.dtype)
        self.params = jax.device_put(params, distributed.replicated(mesh))
        self.eval_step = make_eval_step(graphdef, mesh)
        self.sharding = distributed.batch_sharding(mesh)

    def logits(
        self, split: dataset.TokenizedSplit, batch_size: int, max_length: int, progress=False
    ) -> np.ndarray:
        """Logits for every row of `split`, in row order, data-parallel over the devices, short
        reviews packed several to a row (`dataset.packed_eval_batches`); with `progress`, a
        progress bar on a terminal (none in a pod's log)."""
        from tqdm.auto import tqdm

        batch_size = max(self.devices, batch_size // self.devices * self.devices)
        out = np.zeros((len(split), self.num_labels), dtype=np.float32)
        bar = tqdm(
            total=len(split),
            desc="predict",
            unit="review",
            disable=not (progress and sys.stderr.isatty()),
        )
        for batch in dataset.eval_batches(
            split,
            self.answers,
            batch_size=batch_size,
            local_devices=self.devices,
            bucket_multiple=dataset.DEFAULT_BUCKET_MULTIPLE,
            max_length=max_length,
        ):
            rows, weights_ = batch.pop("rows"), batch["weights"]
            _, logits = self.eval_step(self.params, jax.device_put(batch, self.sharding))
            keep = weights_ > 0
            out[rows[keep]] = np.asarray(logits)[keep]
            bar.update(int(keep.sum()))
        bar.close()
        return out


def predict_logits(
    model,
    split: dataset.TokenizedSplit,
    batch_size: int,
    max_length: int,
    progress: bool = False,
    answers: list[list[int]] | None = None,
) -> np.ndarray:
    """`Predictor.logits` of `model` for one call."""
    return Predictor(model, answers).logits(split, batch_size, max_length, progress)
