"""LoRA: low-rank adapters on a model's projections, with PEFT's math, names and files.

`y = base(x) + (x @ A) @ B · alpha / rank`, A [in, rank] Kaiming-uniform (PEFT's
`kaiming_uniform_(a=√5)`: U(±1/√in)), B [rank, out] zero, so training starts from the base
model. The adapters are `nnx.LoRAParam`s on the decoder's own `Linear` layers (`lora_a`,
`lora_b`), not a wrapper module nor Qwix's interception of every product: the projection
stays one module whose kernel is the checkpoint's, the trainer splits what trains from what
stays frozen with one filter (`TRAINABLE`), and the export reads the adapters where the
checkpoint's names already are. Adapters are replicated on a sharded mesh (rank × (in + out)
values a projection: well under 1 % of its weight for the usual ranks).

Export: `save_adapter` writes PEFT's `adapter_config.json` and `adapter_model.safetensors`
(`base_model.model.<module>.lora_A.weight` [rank, in], `lora_B.weight` [out, rank], the trained
head under its own name, metadata `{"format": "pt"}`); `merge` folds each adapter into its
kernel in float32 for the merged Hugging Face folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kubejax.models.decoder import Linear
from kubejax.models.quantize import QTYPES, dequantize_kernel, quantize_kernel

#: `lora_targets` shorthands → the projections they name.
TARGET_GROUPS = {
    "attention": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}
TARGET_GROUPS["all"] = TARGET_GROUPS["attention"] + TARGET_GROUPS["mlp"]
#: Heads are trained whole (PEFT's `modules_to_save`), never adapted.
HEADS = ("score", "lm_head")


class LoraError(ValueError):
    """A LoRA setting that cannot apply to the model; names the setting."""


def target_names(text: str) -> tuple[str, ...]:
    """The projection names of a `lora_targets` setting ("attention", "mlp", "all" or a
    comma-separated list of names, groups allowed)."""
    names: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        for name in TARGET_GROUPS.get(part, (part,)):
            if name and name not in names:
                names.append(name)
    if not names:
        raise LoraError("lora_targets: empty; name projections, e.g. attention or q_proj,v_proj")
    return tuple(names)


def _projections(model) -> dict[str, Linear]:
    """Every adaptable projection by its dotted path (heads excluded)."""
    out = {}
    for path, node in nnx.iter_graph(model):
        if isinstance(node, Linear) and path and path[-1] not in HEADS:
            out[".".join(map(str, path))] = node
    return out


def apply(model, rank: int, alpha: float, targets: str, seed: int = 0) -> list[str]:
    """Add adapters of `rank` to the projections `targets` names; the adapted paths. A target
    that names no projection of the model is refused naming those that exist."""
    if rank < 1:
        raise LoraError(f"lora_rank: must be at least 1, got {rank}")
    names = target_names(targets)
    found = _projections(model)
    kinds = sorted({path.rsplit(".", 1)[-1] for path in found})
    missing = [n for n in names if n not in kinds]
    if missing:
        raise LoraError(
            f"lora_targets: {', '.join(missing)} matches no module of the model; its "
            f"projections are {', '.join(kinds)} (groups: {', '.join(TARGET_GROUPS)})"
        )
    key = jax.random.key(seed)
    adapted = []
    for i, (path, layer) in enumerate(sorted(found.items())):
        if path.rsplit(".", 1)[-1] not in names:
            continue
        n_in, n_out = layer.kernel.shape
        bound = 1.0 / np.sqrt(n_in)
        a = jax.random.uniform(jax.random.fold_in(key, i), (n_in, rank), jnp.float32, -bound, bound)
        layer.lora_a = nnx.LoRAParam(a)
        layer.lora_b = nnx.LoRAParam(jnp.zeros((rank, n_out), jnp.float32))
        layer.lora_scale = float(alpha) / rank
        adapted.append(path)
    return adapted


#: The filter of what trains under LoRA: the adapters, and a classifier's head (PEFT's
#: `modules_to_save` for SEQ_CLS).
TRAINABLE = nnx.Any(nnx.LoRAParam, nnx.PathContains("score"))


def adapters(model) -> dict[str, Linear]:
    """The adapted projections by path."""
    return {p: m for p, m in _projections(model).items() if m.lora_a is not None}


def merge(model) -> None:
    """Fold every adapter into its kernel (`W + A·B·scale`, in float32) and drop it: the model
    then computes what it computed with the adapters, as a plain checkpoint."""
    for layer in adapters(model).values():
        a = np.asarray(layer.lora_a[...], np.float32)
        b = np.asarray(layer.lora_b[...], np.float32)
        kernel = np.asarray(layer.kernel[...], np.float32) + (a @ b) * np.float32(layer.lora_scale)
        layer.kernel = nnx.Param(jnp.asarray(kernel))
        layer.lora_a = layer.lora_b = None
        layer.lora_scale = 0.0


def save_adapter(model, out_dir: Path, base_model: str) -> None:
    """The adapters (and a classifier's head) as a PEFT LoRA adapter folder."""
    from safetensors.numpy import save_file

    found = adapters(model)
    if not found:
        raise LoraError("peft: the model has no LoRA adapter to export")
    tensors = {}
    for path, layer in found.items():
        stem = f"base_model.model.{path}"
        tensors[f"{stem}.lora_A.weight"] = np.ascontiguousarray(np.asarray(layer.lora_a[...]).T)
        tensors[f"{stem}.lora_B.weight"] = np.ascontiguousarray(np.asarray(layer.lora_b[...]).T)
    classifier = getattr(model, "task", "") == "classification"
    if classifier:
        tensors["base_model.model.score.weight"] = np.ascontiguousarray(
            np.asarray(model.score.kernel[...]).T
        )
    any_layer = next(iter(found.values()))
    rank = int(any_layer.lora_a.shape[1])
    config = {
        "peft_type": "LORA",
        "task_type": "SEQ_CLS" if classifier else "CAUSAL_LM",
        "r": rank,
        "lora_alpha": any_layer.lora_scale * rank,
        "target_modules": sorted({p.rsplit(".", 1)[-1] for p in found}),
        "lora_dropout": 0.0,
        "bias": "none",
        "modules_to_save": ["score"] if classifier else None,
        "base_model_name_or_path": base_model,
        "use_rslora": False,
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, out_dir / "adapter_model.safetensors", metadata={"format": "pt"})


# ---------------------------------------------------------------------------------------------
# QLoRA: the frozen base's projections stored quantized


def quantize(model, qtype: str) -> int:
    """Store every projection's kernel of `model` quantized (the frozen base of QLoRA; heads
    and embeddings stay as they are); the number of kernels quantized."""
    if qtype not in QTYPES:
        raise LoraError(f"weight_qtype: {qtype!r} is not one of {', '.join(QTYPES)}")
    layers = _projections(model).values()
    for layer in layers:
        codes, scale = quantize_kernel(layer.kernel[...], qtype)
        layer.kernel = None
        layer.qkernel = nnx.Param(jnp.asarray(codes))
        layer.qscale = nnx.Param(jnp.asarray(scale))
        layer.qtype = qtype
    return len(layers)


def dequantize(model) -> None:
    """Undo `quantize`: float32 kernels from the codes (for the merged export)."""
    for layer in _projections(model).values():
        if layer.qkernel is not None:
            kernel = dequantize_kernel(layer.qkernel[...], layer.qscale[...], layer.qtype)
            layer.kernel = nnx.Param(kernel)
            layer.qkernel = layer.qscale = None
            layer.qtype = ""
