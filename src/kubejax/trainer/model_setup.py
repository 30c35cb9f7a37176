"""The model a run trains: the family's classifier or language model from its checkpoint (or
fresh), checked against the data and the mesh, with LoRA adapters where asked, and split into
what trains and what stays frozen."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from kubejax import tpu
from kubejax.data import dataset
from kubejax.models import lora, weights
from kubejax.models.bert import BertClassifier
from kubejax.models.kernels import matrices_in
from kubejax.models.shape import ModelShape
from kubejax.trainer import distributed, plan, precision, sharding
from kubejax.trainer.config import ConfigError, TrainConfig
from kubejax.trainer.inputs import TrainData


def build_model(
    cfg: TrainConfig, data: TrainData, mesh_sizes: dict | None = None, placement=None
) -> tuple[nnx.Module, Path | None, list]:
    """The classifier with pretrained weights (or fresh for 'scratch'), its tokenizer folder and
    the parts initialised fresh; refused before any weight is read when the data's rows are
    longer than its positions, or when the mesh's tensor axis does not divide its heads or MLP
    (`mesh_sizes`). `placement`: parameters load straight into these shardings
    (`sharding.placement`)."""
    check_positions(cfg, data, model_config(cfg)[0])
    return classifier_for(cfg, data.num_labels, mesh_sizes, placement, data.total_steps)


def check_positions(cfg: TrainConfig, data: TrainData, model_cfg) -> None:
    """The context the run feeds (its data's longest row, padded to its length bucket)
    against the model's positions: ConfigError naming max_length where it runs past them."""
    positions = model_cfg.max_position_embeddings
    longest = int(max(data.train.lengths.max(), data.val.lengths.max(initial=0)))
    multiple = cfg.bucket_multiple or dataset.DEFAULT_BUCKET_MULTIPLE  # 0: not yet chosen
    padded = dataset.bucket_length(longest, multiple, cfg.max_length)
    if padded > positions:
        raise ConfigError(
            f"max_length: rows of {cfg.data_dir} run to {longest} tokens (padded {padded}), more "
            f"than the {positions} positions of the model; set max_length to {positions} or "
            "less (longer rows are truncated) or prepare the data with that max_length"
        )


def fit_memory(
    cfg: TrainConfig, num_labels: int, mesh_sizes: dict
) -> tuple[TrainConfig, plan.Fitting]:
    """`cfg` with `grad_accum_steps` and `remat` `auto` settled for this process's devices
    (`plan.fit_memory`: the fewest micro-batches, then the cheapest remat policy, that the
    memory plan fits in the device's memory), and the choice, for the trainer's first line;
    from the model's config alone, before any weight is read. An explicit setting that does
    not fit, or a remat policy the model's family lacks, is refused."""
    model_cfg, _ = model_config(cfg)
    devices = math.prod(mesh_sizes.values())
    platform = jax.devices()[0].platform
    memory = plan.device_memory_of(cfg)
    fitted = plan.fit_memory(cfg, model_cfg, num_labels, devices, memory, platform)[1]
    return _settled(cfg, fitted), fitted


def _settled(cfg: TrainConfig, fitted: plan.Fitting) -> TrainConfig:
    return dataclasses.replace(cfg, grad_accum_steps=fitted.grad_accum_steps, remat=fitted.remat)


def classifier_for(
    cfg: TrainConfig,
    num_labels: int,
    mesh_sizes: dict | None = None,
    placement=None,
    steps: int = 0,
) -> tuple[nnx.Module, Path | None, list]:
    """The model of `cfg.model` for `cfg.task` (pretrained weights, or fresh for 'scratch') in
    `cfg.dtype` with `cfg.dropout`, its tokenizer folder and the parts initialised fresh
    (`steps`: the run's optimizer steps, for `scan_choice`)."""
    from safetensors import SafetensorError

    cfg = precision.here(cfg)  # dtypes `auto` where the trainer has not settled them
    dtype = _dtype(cfg)
    # The config first: the checks below run before any weight is fetched.
    model_cfg, model_dir = model_config(cfg)
    try:
        weights.check_task(model_cfg, cfg.task or "classification")
        if mesh_sizes:
            sharding.check_model(model_cfg, mesh_sizes)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    platform = jax.devices()[0].platform
    spec = plan.attention_of(cfg, model_cfg, platform)  # refused here if it cannot run here
    memory = plan.device_memory_of(cfg) if mesh_sizes else None
    if memory or plan.AUTO in (cfg.grad_accum_steps, cfg.remat):  # before any weight is read
        # Checked, and `auto` settled where the caller has not (`fit_memory`).
        devices = math.prod(mesh_sizes.values()) if mesh_sizes else 1
        fitted = plan.fit_memory(cfg, model_cfg, num_labels, devices, memory, platform)[1]
        cfg = _settled(cfg, fitted)
    plan.check_family(cfg, model_cfg)
    _apply_dropout(cfg, model_cfg)
    if cfg.scan_layers is False and not weights.is_decoder(model_cfg):
        raise ConfigError("scan_layers: false applies to decoder models; BERT's are unrolled")
    if model_dir is None:
        model, fresh = _fresh_model(cfg, model_cfg, num_labels, dtype), ["all"]
    else:
        try:  # the weights now (a hub id's; a folder is used as it is)
            model_dir = weights.resolve_model_dir(cfg.model)
        except (OSError, ValueError, KeyError) as err:  # the hub, or an unreadable index
            raise ConfigError(f"model: {cfg.model}: {err}") from err
        # Only the checkpoint's errors are named as such: a tensor missing, or of the wrong
        # shape or type. (An error of JAX's was once reported as a bad checkpoint.)
        try:
            task = cfg.task or "classification"
            # QLoRA: the projections quantized as they load; in bfloat16 runs the matrices
            # load in bfloat16. Never the float32 model on a device beside what the plan counts.
            qtype = cfg.weight_qtype if cfg.peft == "qlora" else ""
            matrices = jnp.bfloat16 if cfg.param_dtype == "bfloat16" else None
            model, fresh = weights.from_checkpoint(
                model_dir, model_cfg, task, num_labels, dtype, cfg.seed, placement, qtype,
                matrices,
            )  # fmt: skip
        except (KeyError, TypeError, ValueError, OSError, SafetensorError) as err:
            family = "BERT" if model_cfg.model_type == "bert" else model_cfg.model_type
            unusable = f"model: {cfg.model} is not a usable {family} checkpoint"
            raise ConfigError(f"{unusable} ({str(err).removeprefix('model: ')})") from err
    _settle(cfg, model, spec if weights.is_decoder(model_cfg) else None, steps)
    tokenizer_dir = Path(cfg.tokenizer) if cfg.tokenizer else model_dir
    if tokenizer_dir is not None and not tokenizer_dir.is_dir():
        tokenizer_dir = weights.resolve_model_dir(str(tokenizer_dir), weights=False)
    return model, tokenizer_dir, fresh


def model_config(cfg: TrainConfig):
    """The model's config (`weights.load_config`'s, or the scratch model's) and its folder (None
    for a scratch model), read without fetching any weight."""
    try:
        if cfg.model == "scratch":
            return weights.scratch_config(cfg.scratch_config), None
        model_dir = weights.resolve_model_dir(cfg.model, weights=False)
        return weights.load_config(model_dir), model_dir
    except (OSError, RuntimeError, ValueError, TypeError) as err:
        if cfg.model == "scratch":
            raise ConfigError(f"scratch_config: {err}") from err
        raise ConfigError(f"model: {cfg.model}: {err}") from err


def abstract_model(cfg: TrainConfig, num_labels: int, steps: int = 0) -> nnx.Module:
    """The model `classifier_for` makes, its weights as shapes: nothing read, drawn or placed
    (`nnx.eval_shape`). What a program can be compiled for while the weights load
    (`kubejax.trainer.ahead`). Its settings unchecked: `classifier_for` checks them."""
    cfg = precision.here(cfg)
    model_cfg, _ = model_config(cfg)
    _apply_dropout(cfg, model_cfg)
    dtype, decoder = _dtype(cfg), weights.is_decoder(model_cfg)
    spec = plan.attention_of(cfg, model_cfg, jax.devices()[0].platform) if decoder else None

    def make():
        if not decoder:
            model = BertClassifier(model_cfg, num_labels, dtype, rngs=nnx.Rngs(cfg.seed))
        else:
            from kubejax.models import decoder_weights

            task = cfg.task or "classification"
            model = decoder_weights.build(model_cfg, task, num_labels, dtype, cfg.seed)
        _settle(cfg, model, spec, steps)
        return model

    return nnx.eval_shape(make)


def _dtype(cfg: TrainConfig):
    return jnp.bfloat16 if cfg.dtype == "bfloat16" else jnp.float32


def _settle(cfg: TrainConfig, model, spec, steps: int = 0) -> None:
    """A decoder's attention (`spec`; None for BERT), scan (`scan_choice`) and remat as set,
    and the adapters where asked."""
    if spec is not None:
        model.model.remat = cfg.remat
        model.model.attention = spec
        model.model.scan = scan_choice(cfg, model.config, steps)[0]
    if cfg.peft != "none":
        _add_adapters(cfg, model)


#: `scan_layers` unset: how a TPU's unrolled layers pay, measured on a v5e at 2,048 tokens
#: (bench/NOTES.md T4, T13): steps 6-9 % faster than the scan's (Qwen2.5-0.5B shape full FT
#: 7.9 %, LoRA 6.0 %, Llama-3.2-1B shape LoRA 9.4 %), the first step 2.0-2.8 s a layer longer
#: to compile (the evaluation's too, compiled beside the steps); the scanned steps' MFU
#: 0.48-0.56 of the chip's peak. The least gain and the most compile, so that a run unrolls
#: only where it surely repays.
UNROLLED_GAIN = 0.06
UNROLLED_COMPILE_S_PER_LAYER = 3.0
SCANNED_MFU = 0.5


def scan_choice(cfg: TrainConfig, model_cfg, steps: int) -> tuple[bool, str]:
    """Whether a decoder's layers run in one scan, and why: as `scan_layers` says, or (unset)
    unrolled on a TPU whose run trains long enough that 6 % faster steps repay the unrolled
    program's compile, its training time estimated from its FLOPs (`ModelShape`) at half the
    chip's peak. Elsewhere scanned: on a CPU unrolling gained nothing (bench/NOTES.md C3), on
    a GPU it is unmeasured."""
    if cfg.scan_layers is not None:
        return cfg.scan_layers, "as set"
    device = jax.devices()[0]
    if device.platform != "tpu":
        return True, f"auto: unrolled only on a TPU, this is a {device.platform}"
    chip = tpu.generation(device.device_kind)
    if chip is None:  # its peak unknown: no estimate of the run's length
        return True, f"auto: {device.device_kind}'s peak is not known here"
    shape = ModelShape.of({k: getattr(model_cfg, k) for k in _SHAPE_KEYS})
    tokens = steps * cfg.global_batch_size * cfg.max_length
    flop_s = jax.device_count() * chip.peak_tflops * 1e12 * SCANNED_MFU
    training = tokens * shape.train_flops(cfg.max_length, cfg.peft) / flop_s
    repays = shape.layers * UNROLLED_COMPILE_S_PER_LAYER / UNROLLED_GAIN
    why = f"auto: ~{_minutes(training)} of training, unrolled from ~{_minutes(repays)}"
    return training < repays, why


_SHAPE_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "intermediate_size",
               "num_attention_heads", "head_dim", "num_key_value_heads")  # fmt: skip


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"


def model_choices(cfg: TrainConfig, model, steps: int = 0) -> list[str]:
    """What the run's model computes with, for the trainer's first line: a decoder's attention
    (and why `auto` took it) and its scanned layers (and why, over `steps`); its remat policy
    is said with its micro-batches (`plan.Fitting.describe`)."""
    if not hasattr(getattr(model, "model", None), "attention"):  # BERT: the reference
        return []
    spec = model.model.attention
    why = "as set" if cfg.attention != "auto" else plan.attention_reason(cfg, model.config)
    block = f", blocks of {spec.block}" if spec.implementation in ("splash", "chunked") else ""
    return [
        f"attention {spec.implementation} ({why}{block})",
        f"{model.model.num_layers} layers {'in one scan' if model.model.scan else 'unrolled'} "
        f"({scan_choice(cfg, model.config, steps)[1]})",
    ]


def _add_adapters(cfg: TrainConfig, model) -> None:
    try:
        lora.apply(
            model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets, cfg.seed, cfg.lora_dropout
        )
        if cfg.peft == "qlora":
            lora.quantize(model, cfg.weight_qtype)
    except lora.LoraError as err:
        raise ConfigError(str(err)) from err


def split_trainable(cfg: TrainConfig, model, mesh):
    """(graphdef, the parameters that train, the frozen ones or None): everything trains in
    full fine-tuning, in `param_dtype`; under LoRA the adapters and a classifier's head train
    in float32 and the base stays frozen in `param_dtype`, placed on the mesh (in its shards on
    a named mesh, else replicated)."""
    graphdef, params, frozen = split_model(cfg, model)
    return graphdef, params, None if frozen is None else _place_frozen(frozen, mesh)


def split_model(cfg: TrainConfig, model):
    """`split_trainable`'s (graphdef, trains, frozen or None), nothing placed; of an abstract
    model (`abstract_model`), shapes."""
    cfg = precision.here(cfg)
    if cfg.peft == "none":
        graphdef, params = nnx.split(model)
        return graphdef, _matrices_in(params, cfg.param_dtype), None
    graphdef, params, frozen = nnx.split(model, lora.TRAINABLE, ...)
    return graphdef, params, _matrices_in(frozen, cfg.param_dtype)


def _matrices_in(params, dtype):
    if all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params)):
        return jax.eval_shape(lambda p: matrices_in(p, dtype), params)
    return matrices_in(params, dtype)


def frozen_shardings(frozen, mesh):
    """Where `split_trainable` places the frozen parameters: in their shards on a named mesh,
    else replicated."""
    if sharding.is_sharded(mesh):
        return sharding.param_shardings(frozen, mesh)
    return jax.tree.map(lambda _: distributed.replicated(mesh), frozen)


def _place_frozen(frozen, mesh):
    if sharding.is_sharded(mesh):
        return jax.device_put(frozen, frozen_shardings(frozen, mesh))
    return distributed.replicate(frozen, mesh)


def _apply_dropout(cfg: TrainConfig, model_cfg) -> None:
    if cfg.dropout is None:
        return
    if weights.is_decoder(model_cfg):
        if cfg.dropout:
            raise ConfigError(
                f"dropout: {cfg.dropout}, but decoder models train without dropout (as their "
                "released configs do); leave it unset or 0"
            )
        return
    model_cfg.hidden_dropout_prob = cfg.dropout
    model_cfg.attention_probs_dropout_prob = cfg.dropout
    model_cfg.classifier_dropout = cfg.dropout


def _fresh_model(cfg: TrainConfig, model_cfg, num_labels: int, dtype) -> nnx.Module:
    """A freshly initialised model: a decoder's weights made in one compiled program on the
    device, its matrices in `param_dtype` there (a classifier's head in float32, as LoRA
    trains it), never the float32 model beside them nor a copy on the host."""
    if not weights.is_decoder(model_cfg):
        return BertClassifier(model_cfg, num_labels, dtype, rngs=nnx.Rngs(cfg.seed))
    from kubejax.models import decoder_weights

    task = cfg.task or "classification"

    def build():
        return decoder_weights.build(model_cfg, task, num_labels, dtype, cfg.seed)

    graphdef = nnx.graphdef(nnx.eval_shape(build))

    def weights_in_dtype():
        state = drawn_at_once(nnx.state(build()), cfg.seed)
        head = {k: v for k, v in state.items() if k == "score"}
        body = matrices_in(nnx.State({k: v for k, v in state.items() if k != "score"}),
                           cfg.param_dtype)  # fmt: skip
        return nnx.State({**body, **head})

    return nnx.merge(graphdef, jax.jit(weights_in_dtype)())


#: The standard deviation of a fresh decoder's matrices (transformers' `initializer_range`).
INIT_STD = 0.02


def drawn_at_once(state, seed: int):
    """`state` with every matrix (kernels, embedding tables: what the decoder draws from
    N(0, 0.02²)) cut from a few normal draws by XLA's own generator (`rbg`), one per width of
    matrix (their rows stacked, so that each is a slice of rows, as the TPU lays them out):
    the module's own draws, one threefry program per matrix, are then dead code. Compiled
    for a TPU v5e on this project's CPU, the 270M decoder's weights program took 14.5 s that
    way and 3.9 s this way (38.6 and 5.9 s on the TPU machine's own host: bench/NOTES.md,
    T8)."""
    from kubejax.models.partitioning import is_matrix, path_name

    leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    values = [x for _, x in leaves]
    by_width: dict[int, list[int]] = {}
    for i, (path, x) in enumerate(leaves):
        if is_matrix(path_name(path), x.ndim):
            by_width.setdefault(x.shape[-1], []).append(i)
    key = jax.random.key(seed, impl="rbg")
    for n, (width, group) in enumerate(sorted(by_width.items())):
        rows = [values[i].size // width for i in group]
        drawn = jax.random.normal(jax.random.fold_in(key, n), (sum(rows), width), jnp.float32)
        start = 0
        for i, r in zip(group, rows, strict=True):
            x = values[i]
            values[i] = (drawn[start : start + r].reshape(x.shape) * INIT_STD).astype(x.dtype)
            start += r
    return jax.tree_util.tree_unflatten(treedef, values)
