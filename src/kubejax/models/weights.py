"""Hugging Face checkpoints in and out of the model families: the family from config.json's
`model_type` (`load_config`), BERT here, decoders in `kubejax.models.decoder_weights`.

A BERT checkpoint folder holds `config.json` and `model.safetensors` (or `pytorch_model.bin`), with
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

from kubejax.models.bert import BertClassifier, BertConfig

#: Every `model_type` kubejax trains.
MODEL_TYPES = ("bert", "llama", "mistral", "qwen2", "qwen3", "gemma3_text", "gemma3")
TASKS = ("classification", "causal-lm")

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
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "generation_config.json",
)


#: What a hub snapshot of a model brings besides its weights: config.json (and a sharded
#: checkpoint's index), the tokenizer's files, the chat template, the generation config.
HUB_FILES = ["*.json", "*.model", "*.txt", "*.jinja"]
#: The index of a sharded safetensors checkpoint (transformers' name).
SAFETENSORS_INDEX = "model.safetensors.index.json"


def resolve_model_dir(model: str, weights: bool = True) -> Path:
    """A local checkpoint folder for `model`: the folder itself, or a hub snapshot of the id,
    with its config and tokenizer files (`HUB_FILES`) and, with `weights`, the weight files
    transformers would read: the shards the index names, else model.safetensors, else
    pytorch_model.bin. A repository's other weight files are not fetched (Mistral's hold
    mistral-inference's `consolidated.safetensors` beside the shards, as large as the model)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise FileNotFoundError(f"model: {model!r} is not a folder")
    folder = _hub_snapshot(model, HUB_FILES)
    if weights:
        index = folder / SAFETENSORS_INDEX
        if index.is_file():
            shards = json.loads(index.read_text())["weight_map"].values()
            _hub_snapshot(model, sorted(set(shards)))
        elif not (_hub_snapshot(model, [SAFETENSORS]) / SAFETENSORS).is_file():
            _hub_snapshot(model, [PYTORCH_BIN])
    return folder


def _hub_snapshot(model: str, patterns: list[str]) -> Path:
    """The local snapshot of hub id `model` with the files matching `patterns` fetched."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(model, allow_patterns=patterns))
    except Exception as err:  # the hub client raises many kinds; all mean "not available"
        raise FileNotFoundError(
            f"model: {model!r} is neither a local folder nor a reachable Hugging Face hub id "
            f"({type(err).__name__}: {err}). Offline, pass a local checkpoint folder."
        ) from err


def load_config(model_dir: Path):
    """The config of a checkpoint folder: a BertConfig, or a DecoderConfig for the decoder
    families. An unsupported `model_type`, or one that needs the checkpoint's own code
    (`auto_map`), is refused naming the supported ones."""
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"model: {model_dir} has no config.json")
    return config_from_file(config_file)


def config_from_file(config_file: Path):
    """`load_config`'s config from the file itself (a config.json of any name)."""
    try:
        values = json.loads(config_file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{config_file}: not valid JSON ({err})") from err
    if not isinstance(values, dict):
        raise ValueError(f"{config_file}: not a JSON object")
    # BERT checkpoints from before `model_type` was written carry none.
    model_type = values.get("model_type", "bert")
    if model_type not in MODEL_TYPES:
        code = " and needs the checkpoint's own code" if "auto_map" in values else ""
        raise ValueError(
            f"model: model_type {model_type!r}{code} is not supported ({', '.join(MODEL_TYPES)}); "
            "remote code is never run"
        )
    if model_type == "bert":
        return BertConfig.from_file(config_file)
    from kubejax.models.decoder import DecoderConfig

    try:
        return DecoderConfig.from_dict(values)
    except ValueError as err:
        raise ValueError(f"{config_file}: {err}") from err


def scratch_config(text: str):
    """The config of model='scratch' from its JSON fields: a BertConfig's, or a decoder's when
    they name its model_type."""
    values = json.loads(text or "{}")
    if values.get("model_type", "bert") == "bert":
        return BertConfig.from_dict(values, strict=True)
    from kubejax.models.decoder import DecoderConfig

    return DecoderConfig.from_dict(values)


def is_decoder(cfg) -> bool:
    """Whether a config (from `load_config`) is one of the decoder families'."""
    return not isinstance(cfg, BertConfig)


def check_task(cfg, task: str) -> None:
    """A task the model can do: an encoder classifies only; decoders do both."""
    if task not in TASKS:
        raise ValueError(f"task: {task!r} is not one of {', '.join(TASKS)}")
    if task != "classification" and not is_decoder(cfg):
        raise ValueError(
            f"task: {task!r} needs a decoder model (llama, mistral, qwen2, qwen3, gemma3_text); "
            f"{cfg.model_type} models do classification"
        )


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


def hf_module_names(model) -> dict[str, str]:
    """Our dotted module path → the Hugging Face module name, where they differ: BERT's
    (`bert.layers.0.query` is `bert.encoder.layer.0.attention.self.query`); the decoders'
    paths are transformers' own, so empty for them."""
    if not isinstance(model, BertClassifier):
        return {}
    hf = {id(module): f"bert.{name}" for module, name, _ in _param_table(model)}
    return {
        ".".join(map(str, path)): hf[id(node)]
        for path, node in nnx.iter_graph(model)
        if id(node) in hf and path
    }


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
    model,
    out_dir: Path,
    label_names: list[str],
    tokenizer_dir: Path | None,
    max_length: int = 512,
    prompts: dict | None = None,
) -> None:
    """Write a self-contained model folder: config, weights, tokenizer files, label names,
    which transformers loads as well (`AutoModelForSequenceClassification`, or
    `AutoModelForCausalLM` for a decoder trained as a language model, with `prompts`: its
    `prompt_template` and the labels' `answers`, kept in the settings file)."""
    from safetensors.numpy import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    if is_decoder(model.config):
        from kubejax.models import decoder_weights

        config = decoder_weights.hf_config(model, label_names)
        decoder_weights.save(model, out_dir)
    else:
        config = {
            **model.config.to_dict(),
            "architectures": ["BertForSequenceClassification"],
            "id2label": {str(i): name for i, name in enumerate(label_names)},
            "label2id": {name: i for i, name in enumerate(label_names)},
        }
        config.pop("num_labels", None)  # id2label says it
        save_file(export_tensors(model), str(out_dir / SAFETENSORS), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            src = tokenizer_dir / name
            if src.is_file():
                (out_dir / name).write_bytes(src.read_bytes())
    (out_dir / LABELS_FILE).write_text(json.dumps(label_names, indent=1))
    settings = {"max_length": max_length, "task": getattr(model, "task", "classification")}
    (out_dir / SETTINGS_FILE).write_text(json.dumps({**settings, **(prompts or {})}))


def read_settings(model_dir: Path) -> dict:
    """The model folder's settings (`SETTINGS_FILE`): max_length, task and, for a language
    model, prompt_template and answers; a folder without the file is a classifier."""
    path = Path(model_dir) / SETTINGS_FILE
    settings = json.loads(path.read_text()) if path.is_file() else {}
    return {"max_length": 512, "task": "classification", **settings}


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


def from_checkpoint(
    model_dir: Path,
    cfg,
    task: str,
    num_labels: int,
    dtype,
    seed: int = 0,
    placement=None,
    qtype: str = "",
    matrices=None,
):
    """The model of `cfg`'s family for `task` with a checkpoint folder's weights; the parts it
    lacks freshly initialised from `seed`. Returns the model and the fresh parts' names.
    `placement(name, shape)`: a decoder's parameters load straight into those shardings;
    `qtype` (QLoRA): a decoder's projections are stored quantized as they load; `matrices`: a
    decoder's weight matrices load in that dtype (`param_dtype`). A BERT checkpoint, small,
    loads whole in float32 (`lora.quantize` and the trainer's cast follow)."""
    if is_decoder(cfg):
        from kubejax.models import decoder_weights

        return decoder_weights.from_pretrained(
            cfg, model_dir, task, num_labels, dtype, seed, placement, qtype, matrices
        )
    return from_pretrained(cfg, num_labels, read_tensors(model_dir), dtype, seed)


def load_model_dir(model_dir: Path, dtype=jnp.float32) -> tuple[object, list[str]]:
    """Load a model folder written by `save_model_dir` (or any classification checkpoint of a
    supported family): the model (a language model where its settings say causal-lm) and its
    label names."""
    cfg = load_config(model_dir)
    labels_file = model_dir / LABELS_FILE
    if labels_file.is_file():
        labels = json.loads(labels_file.read_text())
    elif is_decoder(cfg):
        id2label = cfg.hf.get("id2label") or {"0": "LABEL_0", "1": "LABEL_1"}
        labels = [id2label[k] for k in sorted(id2label, key=int)]
    else:
        labels = cfg.label_names()
    task = read_settings(model_dir)["task"]
    model, fresh = from_checkpoint(model_dir, cfg, task, len(labels), dtype)
    if fresh:
        raise ValueError(f"model: {model_dir} is not a trained classifier (missing {fresh})")
    return model, labels
