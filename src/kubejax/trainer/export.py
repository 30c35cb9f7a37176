"""The trained model out: the Hugging Face folder (merged under LoRA, with the PEFT adapter),
gathered from every process, and the sizes of the trained state."""

from __future__ import annotations

import shutil
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from kubejax.models import lora, weights
from kubejax.outputs import ADAPTER_DIR, MODEL_DIR
from kubejax.trainer.config import TrainConfig
from kubejax.trainer.inputs import TrainData


def _host_params(params):
    """Global arrays → host NumPy: a replicated array's local copy; a sharded one gathered
    from every process (a collective: every process calls it then)."""
    from jax.experimental import multihost_utils

    def host(a):
        if a.is_fully_replicated:
            return np.asarray(a.addressable_data(0))
        if a.is_fully_addressable:
            return np.asarray(jax.device_get(a))
        return np.asarray(multihost_utils.process_allgather(a, tiled=True))

    return jax.tree.map(host, params)


def state_sizes(params, opt_state, frozen) -> dict:
    """What trains (LoRA: the adapters and a head), the bytes of its optimizer state, and the
    bytes of the frozen base (QLoRA's quantized)."""
    return {
        "trainable_params": sum(x.size for x in jax.tree.leaves(params)),
        "optimizer_state_bytes": sum(x.nbytes for x in jax.tree.leaves(opt_state)),
        "frozen_params_bytes": sum(x.nbytes for x in jax.tree.leaves(frozen)),
    }


def export_model(
    cfg: TrainConfig, graphdef, states, data: TrainData, tokenizer_dir, tracker=None
) -> None:
    """The final model folder (HF layout, tokenizer and labels), written by process 0; every
    process calls it (parameters sharded across processes are gathered together). `states`:
    the trained parameters and the frozen ones (None without). Under LoRA the folder holds the
    merged model (adapters folded into the base in float32) and the PEFT adapter in
    `adapter/`, also logged to the MLflow run (`tracker`) as the artifact `adapter`."""
    states = [s for s in states if s is not None]
    spread = any(not a.is_fully_addressable for a in jax.tree.leaves(states))
    if jax.process_index() != 0 and not spread:
        return
    host_model = nnx.merge(graphdef, *map(_host_params, states))
    if jax.process_index() != 0:
        return
    # An earlier run's adapter in this output_dir (a job run again, or resumed after its
    # export) gives way to this run's, or to none for full fine-tuning.
    shutil.rmtree(Path(cfg.output_dir) / MODEL_DIR / ADAPTER_DIR, ignore_errors=True)
    adapter = None
    if cfg.peft != "none":
        adapter = Path(cfg.output_dir) / f"{MODEL_DIR}.adapter"
        lora.save_adapter(host_model, adapter, cfg.model)
        lora.dequantize(host_model)  # QLoRA: the merged model's base is the dequantized one
        lora.merge(host_model)
    weights.save_model_dir(
        host_model,
        Path(cfg.output_dir) / MODEL_DIR,
        data.label_names,
        tokenizer_dir,
        max_length=min(cfg.max_length, int(data.meta.get("max_length", cfg.max_length))),
        prompts=None
        if data.answers is None
        else {"prompt_template": data.meta["prompt_template"], "answers": data.answers},
    )
    if adapter is not None:  # inside the model folder, which the launcher copies whole
        adapter = adapter.replace(Path(cfg.output_dir) / MODEL_DIR / ADAPTER_DIR)
        if tracker is not None:
            tracker.log_artifact(adapter, "adapter")
