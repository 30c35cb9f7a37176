"""LoRA: low-rank adapters on a model's projections, with PEFT's math, names and files.

`y = base(x) + (dropout(x) @ A) @ B · alpha / rank`, A [in, rank] Kaiming-uniform (PEFT's
`kaiming_uniform_(a=√5)`: U(±1/√in)), B [rank, out] zero, so training starts from the base
model. The adapters are `nnx.LoRAParam`s on the models' own projections (`Projection`:
the decoders' `Linear`, BERT's `Dense`; `lora_a`, `lora_b`), not a wrapper module nor Qwix's
interception of every product: the projection stays one module whose kernel is the
checkpoint's, the trainer splits what trains from what stays frozen with one filter
(`TRAINABLE`), and the export reads the adapters where the checkpoint's names are. Adapters
are replicated on a sharded mesh (rank × (in + out) values a projection: well under 1 % of its
weight for the usual ranks). A classifier's head trains whole (PEFT's `modules_to_save`): the
decoders' `score`; BERT's `classifier` and its `pooler`, which feeds only the head and is
freshly initialised for checkpoints without one, so the adapter carries it.

Export: `save_adapter` writes PEFT's `adapter_config.json` and `adapter_model.safetensors`
(`base_model.model.<module>.lora_A.weight` [rank, in], `lora_B.weight` [out, rank] under the
Hugging Face module names, the trained head under its own, metadata `{"format": "pt"}`);
`merge` folds each adapter into its kernel in float32 for the merged Hugging Face folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kubejax.models.projection import Projection
from kubejax.models.quantize import QTYPES, dequantize_kernel, quantize_kernel


def _groups(attention: tuple[str, ...], mlp: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    return {"attention": attention, "mlp": mlp, "all": attention + mlp}


#: `lora_targets` shorthands → the projections they name, for the decoder families (their
#: Hugging Face module names) and for BERT (its modules here: `attn_out` is Hugging Face's
#: `attention.output.dense`, `intermediate` and `output` the MLP's `intermediate.dense` and
#: `output.dense`).
TARGET_GROUPS = _groups(
    ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj")
)
BERT_TARGET_GROUPS = _groups(("query", "key", "value", "attn_out"), ("intermediate", "output"))
#: Heads are never adapted; a classifier's (`TRAINED_HEADS`) train whole (PEFT's
#: `modules_to_save`), a language model's stays frozen.
TRAINED_HEADS = ("score", "classifier", "pooler")
HEADS = (*TRAINED_HEADS, "lm_head")


class LoraError(ValueError):
    """A LoRA setting that cannot apply to the model; names the setting."""


def target_groups(model_type: str) -> dict[str, tuple[str, ...]]:
    """The `lora_targets` groups of a config.json `model_type`."""
    return BERT_TARGET_GROUPS if model_type == "bert" else TARGET_GROUPS


def target_names(text: str, groups: dict[str, tuple[str, ...]] = TARGET_GROUPS) -> tuple[str, ...]:
    """The projection names of a `lora_targets` setting ("attention", "mlp", "all" or a
    comma-separated list of names, groups allowed) under a family's `groups`."""
    names: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        for name in groups.get(part, (part,)):
            if name and name not in names:
                names.append(name)
    if not names:
        raise LoraError("lora_targets: empty; name projections, e.g. attention or q_proj,v_proj")
    return tuple(names)


def projections(model) -> dict[str, Projection]:
    """Every adaptable projection by its dotted path (heads excluded)."""
    out = {}
    for path, node in nnx.iter_graph(model):
        if isinstance(node, Projection) and path and path[-1] not in HEADS:
            out[".".join(map(str, path))] = node
    return out


def apply(
    model, rank: int, alpha: float, targets: str, seed: int = 0, dropout: float = 0.0
) -> list[str]:
    """Add adapters of `rank` (their inputs dropped out at rate `dropout` in training) to the
    projections `targets` names; the adapted paths. A target that names no projection of the
    model is refused naming those that exist."""
    if rank < 1:
        raise LoraError(f"lora_rank: must be at least 1, got {rank}")
    if not 0.0 <= dropout < 1.0:
        raise LoraError(f"lora_dropout: must be in [0, 1), got {dropout}")
    groups = BERT_TARGET_GROUPS if _is_bert(model) else TARGET_GROUPS
    names = target_names(targets, groups)
    found = projections(model)
    kinds = sorted({path.rsplit(".", 1)[-1] for path in found})
    missing = [n for n in names if n not in kinds]
    if missing:
        raise LoraError(
            f"lora_targets: {', '.join(missing)} matches no module of the model; its "
            f"projections are {', '.join(kinds)} (groups: {', '.join(groups)})"
        )
    key = jax.random.key(seed)
    adapted = []
    for i, (path, layer) in enumerate(sorted(found.items())):
        if path.rsplit(".", 1)[-1] not in names:
            continue
        n_in, n_out = layer.shape
        bound = 1.0 / np.sqrt(n_in)
        shape = (*layer.stack, n_in, rank)  # a stacked decoder's: one adapter a layer
        a = jax.random.uniform(jax.random.fold_in(key, i), shape, jnp.float32, -bound, bound)
        layer.lora_a = nnx.LoRAParam(a)
        layer.lora_b = nnx.LoRAParam(jnp.zeros((*layer.stack, rank, n_out), jnp.float32))
        layer.lora_scale = float(alpha) / rank
        layer.lora_dropout = float(dropout)
        adapted.append(path)
    return adapted


def _is_bert(model) -> bool:
    return getattr(getattr(model, "config", None), "model_type", "") == "bert"


#: The filter of what trains under LoRA: the adapters, and a classifier's head (PEFT's
#: `modules_to_save` for SEQ_CLS: the decoders' `score`, BERT's `classifier` and `pooler`).
TRAINABLE = nnx.Any(nnx.LoRAParam, *(nnx.PathContains(h) for h in TRAINED_HEADS))


def adapters(model) -> dict[str, Projection]:
    """The adapted projections by path."""
    return {p: m for p, m in projections(model).items() if m.lora_a is not None}


def merge(model) -> None:
    """Fold every adapter into its kernel (`W + A·B·scale`, in float32) and drop it: the model
    then computes what it computed with the adapters, as a plain checkpoint."""
    for layer in adapters(model).values():
        a = np.asarray(layer.lora_a[...], np.float32)
        b = np.asarray(layer.lora_b[...], np.float32)
        # Stacked layers' adapters multiply layer by layer (matmul over the leading axis).
        kernel = np.asarray(layer.kernel[...], np.float32) + (a @ b) * np.float32(layer.lora_scale)
        layer.kernel = nnx.Param(jnp.asarray(kernel))
        layer.lora_a = layer.lora_b = None
        layer.lora_scale = layer.lora_dropout = 0.0


def _head_tensors(model) -> tuple[dict[str, np.ndarray], list[str]]:
    """A classifier's trained head under PEFT's names, and its `modules_to_save`."""
    if getattr(model, "task", "") != "classification":
        return {}, []

    def t(var):
        return np.ascontiguousarray(np.asarray(var[...]).T)

    if not _is_bert(model):
        return {"base_model.model.score.weight": t(model.score.kernel)}, ["score"]
    return {
        "base_model.model.classifier.weight": t(model.classifier.kernel),
        "base_model.model.classifier.bias": np.asarray(model.classifier.bias[...]),
        "base_model.model.bert.pooler.dense.weight": t(model.pooler.kernel),
        "base_model.model.bert.pooler.dense.bias": np.asarray(model.pooler.bias[...]),
    }, ["classifier", "pooler"]


def save_adapter(model, out_dir: Path, base_model: str) -> None:
    """The adapters (and a classifier's head) as a PEFT LoRA adapter folder, under the Hugging
    Face module names of `base_model`'s checkpoint."""
    from safetensors.numpy import save_file

    from kubejax.models.weights import hf_module_names

    hf_names = hf_module_names(model)

    found = adapters(model)
    if not found:
        raise LoraError("peft: the model has no LoRA adapter to export")
    tensors, modules_to_save = _head_tensors(model)
    modules = []
    for path, layer in found.items():
        a, b = np.asarray(layer.lora_a[...]), np.asarray(layer.lora_b[...])
        for module, a_i, b_i in _per_layer(hf_names.get(path, path), layer.stack, a, b):
            modules.append(module)
            stem = f"base_model.model.{module}"
            tensors[f"{stem}.lora_A.weight"] = np.ascontiguousarray(a_i.T)
            tensors[f"{stem}.lora_B.weight"] = np.ascontiguousarray(b_i.T)
    any_layer = next(iter(found.values()))
    rank = int(any_layer.lora_a.shape[-1])
    # The decoders' projection names are unique suffixes; BERT's `output.dense` is also the
    # end of `attention.output.dense`, so its modules are listed by their full names.
    targets = sorted(set(modules) if hf_names else {m.rsplit(".", 1)[-1] for m in modules})
    config = {
        "peft_type": "LORA",
        "task_type": "SEQ_CLS" if modules_to_save else "CAUSAL_LM",
        "r": rank,
        "lora_alpha": any_layer.lora_scale * rank,
        "target_modules": targets,
        "lora_dropout": any_layer.lora_dropout,
        "bias": "none",
        "modules_to_save": modules_to_save or None,
        "base_model_name_or_path": base_model,
        "use_rslora": False,
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, out_dir / "adapter_model.safetensors", metadata={"format": "pt"})


def _per_layer(module: str, stack: tuple[int, ...], a: np.ndarray, b: np.ndarray):
    """(Hugging Face module name, A, B) of each layer of a projection: a stacked decoder's
    `model.layers.self_attn.q_proj` is transformers' `model.layers.{i}.self_attn.q_proj`."""
    if not stack:
        yield module, a, b
        return
    for i in range(stack[0]):
        yield module.replace("layers.", f"layers.{i}.", 1), a[i], b[i]


# ---------------------------------------------------------------------------------------------
# QLoRA: the frozen base's projections stored quantized


def quantize(model, qtype: str) -> int:
    """Store every projection's kernel of `model` quantized (the frozen base of QLoRA; heads
    and embeddings stay as they are; kernels the checkpoint's loader quantized already,
    `decoder_weights.load_pretrained`, are left); the number of kernels quantized."""
    if qtype not in QTYPES:
        raise LoraError(f"weight_qtype: {qtype!r} is not one of {', '.join(QTYPES)}")
    layers = [layer for layer in projections(model).values() if layer.qkernel is None]
    for layer in layers:
        codes, scale = quantize_kernel(layer.kernel[...], qtype)
        layer.store_quantized(codes, scale, qtype)
    return len(layers)


def dequantize(model) -> None:
    """Undo `quantize`: float32 kernels from the codes (for the merged export)."""
    for layer in projections(model).values():
        if layer.qkernel is not None:
            kernel = dequantize_kernel(layer.qkernel[...], layer.qscale[...], layer.qtype)
            layer.kernel = nnx.Param(kernel)
            layer.qkernel = layer.qscale = None
            layer.qtype = ""
