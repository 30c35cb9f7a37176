"""Hugging Face decoder checkpoints in and out of `DecoderClassifier` / `DecoderLM`.

In: `model.safetensors` or the shards of `model.safetensors.index.json`, stored in bfloat16,
float16 or float32, read tensor by tensor into an abstract model (shapes only), so the host
holds the model once plus one tensor, never the checkpoint and the model side by side. Keys may
sit under `model.` (a `*ForCausalLM` / `*ForSequenceClassification` checkpoint), nothing (a bare
`AutoModel`) or a multimodal Gemma 3's language-model prefix (its vision tower is left out).

Out: a folder transformers loads with `AutoModelForSequenceClassification` /
`AutoModelForCausalLM`: config.json in the 4.x layout (`rope_theta`, `rope_scaling`, which
transformers 4.x and 5.x both read) with `architectures` and a pad token id, float32 weights
with `{"format": "pt"}` metadata, in shards of at most `SHARD_BYTES` (one shard in host memory
at a time) with their index.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kubejax.models.decoder import (
    FAMILIES,
    FULL,
    SLIDING,
    DecoderClassifier,
    DecoderConfig,
    DecoderLM,
)
from kubejax.models.projection import Projection
from kubejax.models.quantize import block_size, quantize_kernel

log = logging.getLogger(__name__)

SAFETENSORS = "model.safetensors"
INDEX = "model.safetensors.index.json"
#: The largest export shard, as transformers' `save_pretrained` writes them.
SHARD_BYTES = 5 * 2**30
#: Keys a checkpoint may hold that the model does not use (rotary caches of old exports).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """Every tensor key of a checkpoint folder and the safetensors file holding it."""
    from safetensors import safe_open

    index = model_dir / INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {key: model_dir / name for key, name in weight_map.items()}
    single = model_dir / SAFETENSORS
    if not single.is_file():
        raise FileNotFoundError(
            f"model: {model_dir} has neither {SAFETENSORS} nor {INDEX} (decoders load from "
            "safetensors only)"
        )
    with safe_open(single, framework="numpy") as f:
        return dict.fromkeys(f.keys(), single)


def _language_prefix(keys) -> str:
    """The prefix before `embed_tokens.weight`: `model.`, '' or a multimodal one."""
    found = [
        k.removesuffix("embed_tokens.weight") for k in keys if k.endswith("embed_tokens.weight")
    ]
    if len(found) != 1:
        raise KeyError(f"model: the checkpoint has {len(found)} embed_tokens.weight tensors, not 1")
    return found[0]


def param_table(model: DecoderClassifier | DecoderLM) -> Iterator[tuple[nnx.Variable, Keys, bool]]:
    """(variable, HF key without the language prefix, transposed) for every parameter of the
    decoder itself; heads are the caller's. The layers' variables are stacked [layers, ...]
    (`DecoderModel`): theirs come with one key per layer, a list."""
    yield model.model.embed_tokens.embedding, "embed_tokens.weight", False
    layer, n = model.model.layers, model.model.num_layers

    def each(stem: str) -> list[str]:
        return [f"layers.{i}.{stem}" for i in range(n)]

    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        yield from _linear(getattr(layer.self_attn, name), each(f"self_attn.{name}"))
    for name in ("q_norm", "k_norm"):
        norm = getattr(layer.self_attn, name)
        if norm is not None:
            yield norm.scale, each(f"self_attn.{name}.weight"), False
    for name in ("gate_proj", "up_proj", "down_proj"):
        yield from _linear(getattr(layer.mlp, name), each(f"mlp.{name}"))
    norms = ["input_layernorm", "post_attention_layernorm"]
    if layer.gemma:
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    for name in norms:
        yield getattr(layer, name).scale, each(f"{name}.weight"), False
    yield model.model.norm.scale, "norm.weight", False


#: One tensor's key, or a stacked variable's keys (one a layer).
Keys = str | list[str]


def _linear(linear, keys: Keys):
    stems = [keys] if isinstance(keys, str) else keys
    weights = [f"{k}.weight" for k in stems]
    yield linear.kernel, weights if isinstance(keys, list) else weights[0], True
    if linear.bias is not None:
        biases = [f"{k}.bias" for k in stems]
        yield linear.bias, biases if isinstance(keys, list) else biases[0], False


def _prefixed(prefix: str, keys: Keys) -> Keys:
    return prefix + keys if isinstance(keys, str) else [prefix + k for k in keys]


def _all(keys: Keys) -> list[str]:
    return [keys] if isinstance(keys, str) else list(keys)


class _Reader:
    """Tensors by key from a checkpoint's files. Each read opens its file anew: a file stays
    memory-mapped while open, and the pages read through the map count as the process's
    resident memory until it is unmapped, so a handle kept open for the whole load held a
    second copy of the checkpoint beside the model (bench/NOTES.md, decoder attempt D4)."""

    def __init__(self, files: dict[str, Path]):
        import ml_dtypes  # noqa: F401  (numpy reads bfloat16 tensors through it)

        self.files = files

    def _open(self, key: str):
        from safetensors import safe_open

        return safe_open(self.files[key], framework="numpy")

    def shape(self, key: str, transpose: bool) -> tuple[int, ...]:
        with self._open(key) as f:
            shape = tuple(f.get_slice(key).get_shape())
        return shape[::-1] if transpose else shape

    def get(self, key: str, transpose: bool, index: tuple = (), dtype=np.float32) -> np.ndarray:
        """The tensor in `dtype` (our layout: [in, out] where the file holds [out, in]), or the
        part of it at `index` (slices over our layout), read alone from the file. `dtype`
        None: as the file stores it (a wider float than float32 narrowed to float32)."""
        index = tuple(index[::-1] if transpose else index) or (slice(None),)
        with self._open(key) as f:
            value = f.get_slice(key)[index]
        if dtype is None and value.dtype.itemsize > 4:
            dtype = np.float32
        value = value if dtype is None else value.astype(dtype)
        return value.T if transpose else value


def _set(
    var: nnx.Variable, reader: _Reader, keys: Keys, transpose: bool, sharding, dtype=None
) -> None:
    """Fill `var` from the checkpoint, in `dtype` (None: the variable's own): whole on the
    default device, or with `sharding` each device's part read straight from the file (no
    device holds the whole tensor). A stacked variable (`keys` a list) takes layer i's tensor
    at [i]."""
    current = var.get_value()  # a ShapeDtypeStruct in an abstract model
    _check_shapes(current, reader, keys, transpose)
    dtype = np.dtype(dtype or current.dtype)
    read = _stacked_reader(reader, keys, transpose, dtype)
    if sharding is None:
        var.set_value(jnp.asarray(read(tuple(slice(None) for _ in current.shape))))
        return
    var.set_value(jax.make_array_from_callback(current.shape, sharding, read))


def _stacked_reader(reader: _Reader, keys: Keys, transpose: bool, dtype):
    """`index → the part of the (stacked) tensor at index`, read from the file(s); a stacked
    part is filled layer by layer into one array (never the list and the stack side by
    side)."""
    if isinstance(keys, str):
        return lambda index: reader.get(keys, transpose, index, dtype)

    def read(index):
        layers = range(len(keys))[index[0] if index else slice(None)]
        parts = None
        for j, i in enumerate(layers):
            part = reader.get(keys[i], transpose, index[1:], dtype)
            if parts is None:
                parts = np.empty((len(layers), *part.shape), part.dtype)
            parts[j] = part
        return parts

    return read


def _check_shapes(current, reader: _Reader, keys: Keys, transpose: bool) -> None:
    expected = tuple(current.shape) if isinstance(keys, str) else tuple(current.shape[1:])
    for key in _all(keys):
        shape = reader.shape(key, transpose)
        if expected != shape:
            raise ValueError(f"model: tensor {key} has shape {shape[::-1] if transpose else shape}")


def _set_quantized(layer, reader: _Reader, keys: Keys, qtype: str, name: str, placement) -> None:
    """Fill a projection's kernel from the checkpoint stored quantized (QLoRA): the tensor read
    as the file stores it (bfloat16 mostly) into its shards on the devices (`placement`;
    `name`: the kernel's dotted path), each process reading only its own devices' parts, and
    quantized there into codes and scales in their shards. The kernel in float32 is never
    whole anywhere, and one projection (of every layer) at a time is on the devices in the
    file's form."""
    current = layer.kernel.get_value()
    _check_shapes(current, reader, keys, True)
    read = _stacked_reader(reader, keys, True, None)
    if placement is None:
        kernel, shardings = read(tuple(slice(None) for _ in current.shape)), None
    else:
        stem = name.rsplit(".", 1)[0]
        *lead, n_in, n_out = current.shape
        qshape = (*lead, n_in // 2 if qtype == "nf4" else n_in, n_out)
        sshape = (*lead, n_in // block_size(n_in), n_out)
        shardings = (placement(f"{stem}.qkernel", qshape), placement(f"{stem}.qscale", sshape))
        kernel = jax.make_array_from_callback(current.shape, placement(name, current.shape), read)
    codes, scale = quantize_kernel(kernel, qtype, shardings)
    del kernel  # the file's form goes before the next projection is read
    layer.store_quantized(codes, scale, qtype)


def load_pretrained(
    model, model_dir: Path, placement=None, qtype: str = "", matrices=None
) -> list[str]:
    """Fill an (abstract) decoder from a checkpoint folder, tensor by tensor; returns the parts
    left for fresh initialisation ("score" when the checkpoint has no head of this shape).
    Raises KeyError naming every missing and unexpected tensor. `placement(name, shape)`: the
    sharding of the parameter called `name` (its dotted path), to load it into its shards.
    `qtype` (QLoRA's `weight_qtype`): the projections' kernels stored quantized as they load.
    `matrices` (the run's `param_dtype`): the dtype the weight matrices and embedding tables
    load in (a classifier's `score` stays float32: LoRA trains it in float32)."""
    files = checkpoint_files(model_dir)
    prefix = _language_prefix(files)
    table = [(var, _prefixed(prefix, keys), t) for var, keys, t in param_table(model)]
    reader = _Reader(files)
    heads = _heads(model, reader, prefix)
    wanted = {key for _, keys, _ in table + heads for key in _all(keys)}
    missing = sorted(wanted - set(files))
    optional = {"lm_head.weight", "score.weight", prefix + "lm_head.weight"}
    # A multimodal checkpoint's other towers live outside the language prefix.
    unexpected = sorted(
        k
        for k in files
        if k not in wanted
        and k not in optional
        and (k.startswith(prefix) or not prefix)
        and not k.endswith(_IGNORED_SUFFIXES)
    )
    if missing or unexpected:
        raise KeyError(
            f"model: the checkpoint in {model_dir} does not match its config.json: "
            f"missing {_few(missing)}; unexpected {_few(unexpected)}"
        )
    # Parameters' dotted paths: what `placement` shards by.
    names = {id(v): ".".join(map(str, p)) for p, v in nnx.iter_graph(model)} if placement else {}
    # QLoRA: the decoder's own projections (its heads are not in `model.model`).
    graph = nnx.iter_graph(model.model) if qtype else ()
    quantized = {id(node.kernel): node for _, node in graph if isinstance(node, Projection)}
    for var, keys, transpose in table + heads:
        name = names.get(id(var), "")
        if id(var) in quantized:
            _set_quantized(quantized[id(var)], reader, keys, qtype, name, placement)
            continue
        shape = var.get_value().shape
        sharding = placement(name, shape) if placement else None
        # A stacked variable's per-layer dimensions: [layers, ...] less the first.
        per_layer = len(shape) - (not isinstance(keys, str))
        as_matrix = matrices is not None and per_layer >= 2 and keys != "score.weight"
        _set(var, reader, keys, transpose, sharding, matrices if as_matrix else None)
    if isinstance(model, DecoderClassifier) and not heads:
        return ["score"]
    return []


def _heads(model, reader: _Reader, prefix: str) -> list:
    """The head tensors to load: `score` of the right shape for a classifier, `lm_head` of an
    untied language model."""
    files = reader.files
    if isinstance(model, DecoderClassifier):
        if "score.weight" not in files:
            return []
        if reader.shape("score.weight", False) != (model.num_labels, model.config.hidden_size):
            return []
        return [(model.score.kernel, "score.weight", True)]
    if model.lm_head is None:
        return []
    key = "lm_head.weight" if "lm_head.weight" in files else prefix + "lm_head.weight"
    return [(model.lm_head.kernel, key, True)]


def _few(keys: list[str], most: int = 6) -> str:
    if not keys:
        return "none"
    more = f" and {len(keys) - most} more" if len(keys) > most else ""
    return ", ".join(keys[:most]) + more


def from_pretrained(
    cfg: DecoderConfig,
    model_dir: Path,
    task: str,
    num_labels: int,
    dtype,
    seed,
    placement=None,
    qtype: str = "",
    matrices=None,
):
    """The decoder of `task` ("classification" or "causal-lm") with the checkpoint's weights
    (in their shards with `placement`, the projections quantized with `qtype`, the matrices in
    `matrices`: `load_pretrained`); the score head freshly initialised from `seed` when the
    checkpoint has none. Returns the model and the fresh parts' names."""
    model = nnx.eval_shape(lambda: build(cfg, task, num_labels, dtype, seed))
    fresh = load_pretrained(model, model_dir, placement, qtype, matrices)
    if fresh:
        model.init_fresh(fresh, nnx.Rngs(seed))
    return model, fresh


def build(cfg: DecoderConfig, task: str, num_labels: int, dtype=jnp.float32, seed: int = 0):
    """A randomly initialised decoder of `task`."""
    if task == "causal-lm":
        return DecoderLM(cfg, dtype, rngs=nnx.Rngs(seed))
    return DecoderClassifier(cfg, num_labels, dtype, rngs=nnx.Rngs(seed))


# ---------------------------------------------------------------------------------------------
# Export


def export_tensors(model) -> Iterator[tuple[str, np.ndarray]]:
    """(HF key, float32 array) of every weight, in `*For…` names, one at a time (a stacked
    variable's layers one by one)."""
    for var, keys, transpose in param_table(model):
        value = np.asarray(jax.device_get(var[...]), np.float32)
        if isinstance(keys, str):
            value, keys = value[None], [keys]
        for key, part in zip(keys, value, strict=True):
            yield "model." + key, np.ascontiguousarray(part.T if transpose else part)
    head = model.score if isinstance(model, DecoderClassifier) else model.lm_head
    if head is not None:
        name = "score.weight" if isinstance(model, DecoderClassifier) else "lm_head.weight"
        yield name, np.ascontiguousarray(np.asarray(jax.device_get(head.kernel[...])).T)


def hf_config(model, label_names: list[str] | None) -> dict:
    """config.json of the exported model: the checkpoint's own, in the 4.x rope layout, with
    `architectures`, labels and a pad token id (the EOS token when the model has none: the
    classifier reads the last token that is not padding)."""
    cfg: DecoderConfig = model.config
    out = {k: v for k, v in cfg.hf.items() if k not in ("rope_parameters", "dtype")}
    out.pop("rope_scaling", None)
    out.update(_old_rope_keys(cfg))
    classify = isinstance(model, DecoderClassifier)
    out["architectures"] = [FAMILIES[cfg.model_type][0 if classify else 1]]
    out["torch_dtype"] = "float32"
    if cfg.pad_token_id is None:
        eos = cfg.eos_token_id[0] if isinstance(cfg.eos_token_id, list) else cfg.eos_token_id
        out["pad_token_id"] = eos if eos is not None else 0
        log.warning(
            "model: the config has no pad_token_id; the export sets %s", out["pad_token_id"]
        )
    if classify and label_names:
        out["id2label"] = {str(i): name for i, name in enumerate(label_names)}
        out["label2id"] = {name: i for i, name in enumerate(label_names)}
        out.pop("num_labels", None)
    return out


def _old_rope_keys(cfg: DecoderConfig) -> dict:
    """`rope_theta` and `rope_scaling` (and Gemma's `rope_local_base_freq`)."""
    full = cfg.rope.get(FULL) or next(iter(cfg.rope.values()))
    keys: dict = {"rope_theta": full.theta, "rope_scaling": None}
    if full.type != "default":
        keys["rope_scaling"] = {"rope_type": full.type, **full.params}
    if cfg.gemma:
        keys["rope_local_base_freq"] = cfg.rope.get(SLIDING, full).theta
    return keys


def save(model, out_dir: Path) -> None:
    """Weights as safetensors shards of at most SHARD_BYTES (one file when they fit), with
    transformers' index for several; one shard's arrays in host memory at a time."""
    from safetensors.numpy import save_file

    parts: list[list[str]] = []  # each written shard's keys
    shard: dict[str, np.ndarray] = {}
    size = total = 0

    def flush():
        save_file(shard, str(out_dir / f"part-{len(parts)}.tmp"), metadata={"format": "pt"})
        parts.append(list(shard))
        shard.clear()

    for key, value in export_tensors(model):
        if size and size + value.nbytes > SHARD_BYTES:
            flush()
            size = 0
        shard[key] = value
        size += value.nbytes
        total += value.nbytes
    flush()
    _name_shards(out_dir, parts, total)


def _name_shards(out_dir: Path, parts: list[list[str]], total: int) -> None:
    if len(parts) == 1:
        (out_dir / "part-0.tmp").replace(out_dir / SAFETENSORS)
        return
    weight_map = {}
    for i, keys in enumerate(parts):
        name = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
        (out_dir / f"part-{i}.tmp").replace(out_dir / name)
        weight_map.update(dict.fromkeys(keys, name))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / INDEX).write_text(json.dumps(index, indent=2) + "\n")
