"""Hugging Face checkpoints in and out of `BertClassifier`.

A checkpoint folder holds `config.json` and `model.safetensors` (or `pytorch_model.bin`), with
or without the `bert.` prefix, the pooler optional. The model folder the trainer writes is such
a checkpoint too (BertForSequenceClassification names), plus tokenizer files and `labels.json`,
so transformers can load it as well.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from kubejax.trainer.model import BertClassifier, BertConfig

SAFETENSORS = "model.safetensors"
PYTORCH_BIN = "pytorch_model.bin"
LABELS_FILE = "labels.json"
#: How texts were tokenized for this model (max_length), read by the pyfunc model.
SETTINGS_FILE = "kubejax.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "special_tokens_map.json",
)


def resolve_model_dir(model: str) -> Path:
    """A local checkpoint folder for `model`: the folder itself, or a hub snapshot of the id."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise FileNotFoundError(f"model: {model!r} is not a folder")
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(
                model,
                allow_patterns=["*.json", "*.safetensors", "vocab.txt", "*.model", "*.txt"],
            )
        )
    except Exception as err:  # the hub client raises many kinds; all mean "not available"
        raise FileNotFoundError(
            f"model: {model!r} is neither a local folder nor a reachable Hugging Face hub id "
            f"({type(err).__name__}: {err}). Offline, pass a local checkpoint folder."
        ) from err


def load_config(model_dir: Path) -> BertConfig:
    """The BertConfig of a checkpoint folder."""
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"model: {model_dir} has no config.json")
    cfg = BertConfig.from_file(config_file)
    if cfg.model_type != "bert":
        raise ValueError(f"model: model_type {cfg.model_type!r} is not supported (bert)")
    return cfg


def read_tensors(model_dir: Path) -> dict[str, np.ndarray]:
    """All tensors of a checkpoint folder as float32 NumPy arrays."""
    if (model_dir / SAFETENSORS).is_file():
        from safetensors.numpy import load_file

        return {k: v.astype(np.float32) for k, v in load_file(model_dir / SAFETENSORS).items()}
    if (model_dir / PYTORCH_BIN).is_file():
        try:
            import torch
        except ImportError as err:
            raise RuntimeError(
                f"model: {model_dir} has only {PYTORCH_BIN}, which needs torch to read; "
                "install torch or convert the checkpoint to model.safetensors"
            ) from err
        state = torch.load(model_dir / PYTORCH_BIN, map_location="cpu", weights_only=True)
        return {k: v.float().numpy() for k, v in state.items()}
    raise FileNotFoundError(f"model: {model_dir} has neither {SAFETENSORS} nor {PYTORCH_BIN}")


def _param_table(model: BertClassifier) -> Iterator[tuple[nnx.Module, str, str]]:
    """(module, HF name without `bert.`, kind) for every weight-bearing module."""
    emb = model.bert.embeddings
    yield emb.word, "embeddings.word_embeddings", "embed"
    yield emb.position, "embeddings.position_embeddings", "embed"
    yield emb.token_type, "embeddings.token_type_embeddings", "embed"
    yield emb.norm, "embeddings.LayerNorm", "norm"
    for i, layer in enumerate(model.bert.layers):
        p = f"encoder.layer.{i}."
        yield layer.query, p + "attention.self.query", "dense"
        yield layer.key, p + "attention.self.key", "dense"
        yield layer.value, p + "attention.self.value", "dense"
        yield layer.attn_out, p + "attention.output.dense", "dense"
        yield layer.attn_norm, p + "attention.output.LayerNorm", "norm"
        yield layer.intermediate, p + "intermediate.dense", "dense"
        yield layer.output, p + "output.dense", "dense"
        yield layer.out_norm, p + "output.LayerNorm", "norm"
    yield model.pooler, "pooler.dense", "dense"


def _norm_names(tensors: dict, name: str) -> tuple[str, str]:
    if f"{name}.weight" in tensors:
        return f"{name}.weight", f"{name}.bias"
    return f"{name}.gamma", f"{name}.beta"  # old TF-converted checkpoints


def _set(var: nnx.Variable, value: np.ndarray, name: str) -> None:
    current = var.get_value()  # an array, or a ShapeDtypeStruct in an abstract model
    if tuple(current.shape) != tuple(value.shape):
        raise ValueError(
            f"model: weight {name} has shape {value.shape}, expected {tuple(current.shape)}"
        )
    var.set_value(jnp.asarray(value, dtype=current.dtype))


def load_pretrained(model: BertClassifier, tensors: dict[str, np.ndarray]) -> list[str]:
    """Copy HF weights into `model` in place; returns the names left at their fresh init."""
    t = {k.removeprefix("bert."): v for k, v in tensors.items()}
    fresh = []
    for module, name, kind in _param_table(model):
        if kind == "embed":
            _set(module.embedding, t[f"{name}.weight"], name)
        elif kind == "norm":
            w, b = _norm_names(t, name)
            _set(module.scale, t[w], w)
            _set(module.bias, t[b], b)
        elif f"{name}.weight" in t:
            _set(module.kernel, t[f"{name}.weight"].T, name)
            _set(module.bias, t[f"{name}.bias"], name)
        elif name == "pooler.dense":
            fresh.append(name)  # sentence-embedding checkpoints may lack the pooler
        else:
            raise KeyError(f"model: checkpoint lacks {name}.weight")
    head = t.get("classifier.weight")
    if head is not None and head.shape == (model.num_labels, model.config.hidden_size):
        _set(model.classifier.kernel, head.T, "classifier.weight")
        _set(model.classifier.bias, t["classifier.bias"], "classifier.bias")
    else:
        fresh.append("classifier")
    return fresh


def export_tensors(model: BertClassifier) -> dict[str, np.ndarray]:
    """The model's weights under BertForSequenceClassification names."""
    out: dict[str, np.ndarray] = {}
    for module, name, kind in _param_table(model):
        key = f"bert.{name}"
        if kind == "embed":
            out[f"{key}.weight"] = np.asarray(module.embedding[...])
        elif kind == "norm":
            out[f"{key}.weight"] = np.asarray(module.scale[...])
            out[f"{key}.bias"] = np.asarray(module.bias[...])
        else:
            out[f"{key}.weight"] = np.ascontiguousarray(np.asarray(module.kernel[...]).T)
            out[f"{key}.bias"] = np.asarray(module.bias[...])
    out["classifier.weight"] = np.ascontiguousarray(np.asarray(model.classifier.kernel[...]).T)
    out["classifier.bias"] = np.asarray(model.classifier.bias[...])
    return {k: v.astype(np.float32) for k, v in out.items()}


def save_model_dir(
    model: BertClassifier,
    out_dir: Path,
    label_names: list[str],
    tokenizer_dir: Path | None,
    max_length: int = 512,
) -> None:
    """Write a self-contained model folder: config, weights, tokenizer files, label names."""
    from safetensors.numpy import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    config = {
        **model.config.to_dict(),
        "architectures": ["BertForSequenceClassification"],
        "id2label": {str(i): name for i, name in enumerate(label_names)},
        "label2id": {name: i for i, name in enumerate(label_names)},
    }
    config.pop("num_labels", None)  # id2label says it
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(export_tensors(model), str(out_dir / SAFETENSORS), metadata={"format": "pt"})
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            src = tokenizer_dir / name
            if src.is_file():
                (out_dir / name).write_bytes(src.read_bytes())
    (out_dir / LABELS_FILE).write_text(json.dumps(label_names, indent=1))
    (out_dir / SETTINGS_FILE).write_text(json.dumps({"max_length": max_length}))


def from_pretrained(
    cfg, num_labels: int, tensors: dict[str, np.ndarray], dtype=jnp.float32, seed: int = 0
) -> tuple[BertClassifier, list[str]]:
    """The classifier with `tensors` loaded; the parts they lack (the head, sometimes the
    pooler) freshly initialised from `seed`. Returns the model and the fresh parts' names.

    The model is built abstract (shapes only) and filled from the checkpoint: randomly
    initialising weights that the checkpoint then replaces took 2.7 s for MiniLM on CPU, paid
    by every worker and sweep trial.
    """
    model = nnx.eval_shape(lambda: BertClassifier(cfg, num_labels, dtype, rngs=nnx.Rngs(seed)))
    fresh = load_pretrained(model, tensors)
    model.init_fresh(fresh, nnx.Rngs(seed))
    return model, fresh


def load_model_dir(model_dir: Path, dtype=jnp.float32) -> tuple[BertClassifier, list[str]]:
    """Load a model folder written by `save_model_dir` (or any BERT classification checkpoint)."""
    cfg = load_config(model_dir)
    labels_file = model_dir / LABELS_FILE
    labels = json.loads(labels_file.read_text()) if labels_file.is_file() else cfg.label_names()
    model, fresh = from_pretrained(cfg, len(labels), read_tensors(model_dir), dtype)
    if fresh:
        raise ValueError(f"model: {model_dir} is not a trained classifier (missing {fresh})")
    return model, labels
