"""The trainer's one typed config: every field documented, validated once at start."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kubejax.errors import KubejaxError
from kubejax.flags import OPTIMIZATION_ENV_PREFIX, add_flags, base_type
from kubejax.flags import setting as _f
from kubejax.tracking import resolve_uri
from kubejax.trainer import precision

SCHEDULES = ("linear", "cosine", "constant")
OPTIMIZERS = ("adamw", "adafactor", "lion", "sgd")
#: The optimizer settings and the optimizers they mean something for.
OPTIMIZER_SETTINGS = {
    "b1": ("adamw", "lion"),
    "b2": ("adamw", "lion"),
    "eps": ("adamw",),
    "mu_dtype": ("adamw", "lion"),
    "momentum": ("sgd",),
    "nesterov": ("sgd",),
    "decay_rate": ("adafactor",),
}
DTYPES = ("float32", "bfloat16")
#: `grad_accum_steps` and `remat` left to the memory plan (`kubejax.trainer.plan.fit_memory`).
AUTO = "auto"
#: The remat policies (`kubejax.models.decoder.REMAT_POLICIES`), and `auto`.
REMATS = ("none", "minimal", "full", AUTO)
#: The `attention` implementations (`kubejax.models.attention`).
ATTENTIONS = ("auto", "xla", "chunked", "splash", "cudnn")
PEFTS = ("none", "lora", "qlora")
QTYPES = ("nf4", "int8")
#: Training tasks: a classification head, or a decoder writing each label's answer.
TASKS = ("classification", "causal-lm")


class ConfigError(KubejaxError, ValueError):
    """A bad trainer setting; the message starts with the setting's name."""


@dataclass
class TrainConfig:
    """Settings of one training run (a JAXJob's workers all get the same)."""

    model: str = _f(
        "", "HF hub id or local HF folder to fine-tune, or 'scratch' (see scratch_config)"
    )
    scratch_config: str = _f(
        "",
        "JSON config fields for model='scratch': a BertConfig's, e.g. '{\"hidden_size\": 64}', "
        'or a decoder\'s with its model_type, e.g. \'{"model_type": "qwen2", ...}\'',
    )
    task: str = _f(
        "",
        "classification (a sequence-classification head: BERT's pooler and classifier, a "
        "decoder's `score` read at each review's last token) or causal-lm (a decoder writes "
        "the label's answer after the review's prompt; data prepared with task causal-lm); "
        "default: the data's task",
    )
    tokenizer: str = _f(
        "", "tokenizer folder or hub id; default: the model's (for 'scratch': required)"
    )
    data_dir: str = _f("", "prepared dataset folder (kubejax prepare)")
    output_dir: str = _f("", "checkpoints, metrics.json and the final model/ go here")
    num_labels: int = _f(0, "number of classes; 0 = from the dataset's metadata")
    epochs: float = _f(1.0, "passes over the training split (ignored when max_steps > 0)")
    max_steps: int = _f(0, "optimizer steps in all; 0 = from epochs")
    global_batch_size: int = _f(32, "examples per optimizer step, over all processes")
    grad_accum_steps: int | str = _f(
        AUTO,
        "micro-batches per optimizer step (the global batch split evenly; a count dividing each "
        "device's share of it), or auto: one batch where the memory plan says it fits the "
        "device, else the fewest micro-batches that fit (the trainer's first line says which "
        "and why); an explicit count is kept, and refused where it does not fit",
    )
    remat: str = _f(
        AUTO,
        "decoders' activation checkpointing: none, minimal (keep the projections' outputs, "
        "recompute attention and the rest), full (keep each layer's input only), or auto: none, "
        "or where no count of micro-batches fits the device without it, the cheapest policy "
        "that fits (minimal, then full)",
    )
    scan_layers: bool | None = _f(
        None,
        "decoders: true runs the layers as one scanned layer, so the program holds one layer "
        "(a 24-layer step compiles in ~15 s on a TPU v5e instead of ~80 s); false unrolls "
        "them, 6-9 % faster steps there (bench/tpu-results.md); unset (auto) unrolls them on "
        "a TPU when the run's training is long enough to repay the longer compile (the "
        "trainer's first line says which it took and why)",
    )
    attention: str = _f(
        "auto",
        "decoders' attention: auto (by platform and length: splash on a TPU, cudnn on an "
        "NVIDIA GPU where its masks serve, chunked on long sequences, else xla), xla (the "
        "reference: every layer's scores kept for the backward pass), chunked (a block of "
        "queries at a time, its scores recomputed in the backward pass), splash (Pallas splash "
        "attention, TPU) or cudnn (cuDNN flash attention, NVIDIA GPU)",
    )
    attention_block: int = _f(
        0,
        "tokens per block of splash and chunked attention (splash: a multiple of 128 dividing "
        "max_length); 0 = 512, or the whole sequence when shorter",
    )
    param_dtype: str = _f(
        "auto",
        "dtype of the weight matrices held and trained: float32, bfloat16 or auto (the compute "
        "dtype under LoRA/QLoRA, whose base is frozen; float32 for full fine-tuning) (optimizer "
        "moments and the update stay float32; vectors such as norms stay float32)",
    )
    mesh: str = _f(
        "",
        "device mesh, e.g. 'data=2,fsdp=-1' or 'fsdp=4,tensor=2' (axes data, fsdp, tensor; "
        "-1: every device left); fsdp shards parameters and optimizer state, tensor splits "
        "heads and MLP; empty: data-parallel over every device, parameters replicated",
    )
    max_micro_batch: int = _f(
        0,
        "largest micro-batch per device; 0 = no limit. When the global batch needs more, "
        "grad_accum_steps rises to the smallest count that fits",
    )
    device_memory: str = _f(
        "",
        "memory of one device, e.g. 80GiB or 24GB: a run whose memory plan (kubejax plan) "
        "needs more is refused before it starts, naming the smallest mesh / micro-batch that "
        "fits; empty: the GPU's own (its node's nvidia.com/gpu.product, or what JAX reports), "
        "no check on CPU",
    )
    peft: str = _f(
        "none",
        "none (full fine-tuning), lora (low-rank adapters on a frozen base: only they and a "
        "classifier's head train; exported as a PEFT adapter and a merged model) or qlora "
        "(LoRA on a base whose projections are stored quantized, weight_qtype)",
    )
    weight_qtype: str = _f(
        "nf4",
        "qlora: the frozen projections' storage: nf4 (QLoRA's 4-bit NormalFloat, absmax per "
        "block of 64 inputs) or int8 (the same blocks, 8-bit)",
    )
    lora_rank: int = _f(16, "LoRA: the adapters' rank")
    lora_alpha: float = _f(32.0, "LoRA: the adapters' scale is lora_alpha / lora_rank (PEFT's)")
    lora_targets: str = _f(
        "attention",
        "LoRA: the projections adapted: attention (decoders' q/k/v/o_proj, BERT's query, key, "
        "value, attn_out), mlp (gate/up/down_proj; BERT's intermediate, output), all, or "
        "names such as q_proj,v_proj",
    )
    lora_dropout: float = _f(
        0.0, "LoRA: dropout on the adapters' inputs in training (PEFT's lora_dropout), in [0, 1)"
    )
    katib_metrics: bool = _f(
        False,
        "worker 0 prints each evaluation as name=value lines (eval_accuracy=0.61 eval_loss=1.2) "
        "for Katib's StdOut metrics collector (set by tuner katib)",
    )
    optimizer: str = _f("adamw", "adamw, adafactor, lion or sgd (optax)")
    learning_rate: float = _f(5e-5, "peak learning rate")
    b1: float | None = _f(None, "first-moment decay of adamw/lion; default: optax's (0.9, 0.9)")
    b2: float | None = _f(None, "second-moment decay of adamw/lion; default: 0.999, 0.99")
    eps: float | None = _f(None, "adamw's epsilon; default: 1e-8")
    mu_dtype: str | None = _f(
        None,
        "dtype of adamw's and lion's first moment: float32 (default) or bfloat16, half its "
        "memory and traffic; adamw's second moment stays float32 (its 1 - b2 steps are below "
        "bfloat16's precision)",
    )
    momentum: float | None = _f(None, "sgd's momentum; default 0.9, 0 = plain SGD")
    nesterov: bool = _f(False, "sgd: Nesterov momentum")
    decay_rate: float | None = _f(None, "adafactor's second-moment decay exponent; default 0.8")
    warmup_ratio: float = _f(0.1, "share of steps with linear warmup from 0")
    weight_decay: float = _f(
        0.01, "weight decay, not on biases and LayerNorm (decoupled for adamw)"
    )
    schedule: str = _f("linear", "decay after warmup: linear, cosine or constant")
    max_grad_norm: float = _f(1.0, "clip gradients to this global norm; 0 = no clipping")
    dropout: float | None = _f(None, "hidden and attention dropout; default: the model config's")
    seed: int = _f(0, "seed of initialisation, data order and dropout")
    dtype: str = _f(
        "auto",
        "compute dtype: float32, bfloat16 or auto (bfloat16 where the device multiplies it "
        "natively: a TPU, an NVIDIA GPU from Ampere, a CPU with AMX or AVX512_BF16; float32 "
        "elsewhere; said in the trainer's first line; KUBEJAX_AUTO_DTYPE pins it)",
    )
    max_length: int = _f(512, "longest padded sequence fed to the model")
    bucket_multiple: int = _f(
        0,
        "padded lengths are multiples of this (bounds compiled shapes); 0 = auto: by platform, "
        "the multiple (32, 64, ... up to one shape) whose compiles and padding cost least for "
        "the training split's lengths (a compile costs seconds on CPU, ~20 s on TPU); the "
        "choice is said in the trainer's first line",
    )
    packing: bool = _f(
        False,
        "training rows of max_length tokens, each packed with several reviews (each with its "
        "own positions, attending to itself only; the loss is the mean over the step's "
        "reviews, as unpacked); global_batch_size then counts rows and an epoch's steps come "
        "from its packed rows; off: one review a row, padded to its length bucket",
    )
    eval_every: int = _f(0, "evaluate on validation every N steps; 0 = at the end only")
    eval_batch_size: int = _f(64, "examples per evaluation batch, over all processes")
    max_eval_examples: int = _f(0, "cap on validation examples per evaluation; 0 = all")
    checkpoint_every: int = _f(0, "save an Orbax checkpoint every N steps; 0 = at the end only")
    keep_checkpoints: int = _f(2, "checkpoints kept in output_dir/checkpoints")
    save_final: bool = _f(
        True,
        "save the last checkpoint and export output_dir/model at the end (sweep trials, never "
        "resumed and whose model is not used, turn it off)",
    )
    allow_fresh_start: bool = _f(
        False, "start from step 0 when output_dir holds checkpoints but none can be read"
    )
    log_every: int = _f(10, "log step metrics and print progress every N steps")
    coordinator_timeout: int = _f(
        300, "seconds to wait for every process of the job to join (slow pod start-up)"
    )
    mlflow_tracking_uri: str = _f(
        "", "MLflow tracking URI; default: $MLFLOW_TRACKING_URI; none: no tracking"
    )
    mlflow_experiment: str = _f("kubejax", "MLflow experiment name")
    mlflow_run_name: str = _f("", "MLflow run name")
    mlflow_run_id: str = _f("", "log into this existing MLflow run instead of creating one")
    mlflow_parent_run_id: str = _f("", "create the run nested under this one (sweep trials)")
    mlflow_tags: str = _f("", "JSON object of extra MLflow tags (KFP run id, task, job name)")

    def validate(self, check_paths: bool = True) -> TrainConfig:
        """Check every field once; raise ConfigError naming the first bad one. Without
        `check_paths` (a launcher checking settings before it submits a job whose pods see
        other files), folders are not looked at."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{f.name}: must be a finite number, got {value}")
        if not self.model:
            raise ConfigError("model: required (hub id, local folder or 'scratch')")
        if self.model == "scratch":
            if not self.tokenizer:
                raise ConfigError("tokenizer: required when model is 'scratch'")
            try:
                json.loads(self.scratch_config or "{}")
            except json.JSONDecodeError as err:
                raise ConfigError(f"scratch_config: not valid JSON ({err})") from err
        elif (
            check_paths
            and (self.model.startswith((".", "/", "~")) or self.model.count("/") > 1)
            and not Path(self.model).expanduser().is_dir()
        ):
            raise ConfigError(f"model: {self.model!r} is not a folder")
        if not self.data_dir:
            raise ConfigError("data_dir: required")
        if check_paths and not Path(self.data_dir).is_dir():
            raise ConfigError(f"data_dir: {self.data_dir!r} does not exist")
        if not self.output_dir:
            raise ConfigError("output_dir: required")
        if self.task and self.task not in TASKS:
            raise ConfigError(f"task: {self.task!r} is not one of {', '.join(TASKS)}")
        self._validate_memory()
        self._validate_optimizer()
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"schedule: {self.schedule!r} is not one of {', '.join(SCHEDULES)}")
        self._validate_accumulation()
        positive = (
            "global_batch_size",
            "eval_batch_size",
            "log_every",
            "coordinator_timeout",
        )
        for name in (*positive, "keep_checkpoints", "max_length"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be at least 1, got {getattr(self, name)}")
        for name in (
            "max_steps",
            "eval_every",
            "checkpoint_every",
            "num_labels",
            "max_micro_batch",
            "bucket_multiple",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}: must be 0 or more, got {getattr(self, name)}")
        if self.max_steps == 0 and self.epochs <= 0:
            raise ConfigError(f"epochs: must be positive when max_steps is 0, got {self.epochs}")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ConfigError(f"warmup_ratio: must be in [0, 1), got {self.warmup_ratio}")
        if self.learning_rate <= 0:
            raise ConfigError(f"learning_rate: must be positive, got {self.learning_rate}")
        if self.weight_decay < 0 or self.max_grad_norm < 0:
            raise ConfigError("weight_decay/max_grad_norm: must be 0 or more")
        if self.dropout is not None and not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout: must be in [0, 1), got {self.dropout}")
        if self.mlflow_tags:
            try:
                tags = json.loads(self.mlflow_tags)
            except json.JSONDecodeError as err:
                raise ConfigError(f"mlflow_tags: not valid JSON ({err})") from err
            if not isinstance(tags, dict):
                raise ConfigError("mlflow_tags: must be a JSON object")
        return self

    def _validate_accumulation(self) -> None:
        """`grad_accum_steps`: auto, or a count of at least 1 dividing the global batch (a
        number given as text, as a flag or a KFP parameter may carry it, becomes one)."""
        value = self.grad_accum_steps
        if isinstance(value, str) and value != AUTO:
            try:
                value = self.grad_accum_steps = int(value)
            except ValueError:
                raise ConfigError(
                    f"grad_accum_steps: {value!r} is neither a count of micro-batches nor auto"
                ) from None
        if value == AUTO:
            return
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"grad_accum_steps: must be at least 1 or auto, got {value!r}")
        if self.global_batch_size >= 1 and self.global_batch_size % value:
            raise ConfigError(
                f"grad_accum_steps: {value} does not divide global_batch_size "
                f"{self.global_batch_size} (a count of micro-batches dividing it, or auto)"
            )

    def _validate_memory(self) -> None:
        for name in ("dtype", "param_dtype"):
            try:
                precision.check(name, getattr(self, name))
            except precision.PrecisionError as err:
                raise ConfigError(str(err)) from None
        if self.attention not in ATTENTIONS:
            raise ConfigError(
                f"attention: {self.attention!r} is not one of {', '.join(ATTENTIONS)}"
            )
        if self.attention_block < 0:
            raise ConfigError(f"attention_block: must be 0 or more, got {self.attention_block}")
        if self.remat not in REMATS:
            raise ConfigError(f"remat: {self.remat!r} is not one of {', '.join(REMATS)}")
        if self.device_memory:
            from kubejax import tpu

            tpu.chip_memory(self.device_memory) or parse_bytes(self.device_memory)
        if self.peft not in PEFTS:
            raise ConfigError(f"peft: {self.peft!r} is not one of {', '.join(PEFTS)}")
        if self.weight_qtype not in QTYPES:
            raise ConfigError(
                f"weight_qtype: {self.weight_qtype!r} is not one of {', '.join(QTYPES)}"
            )
        if self.lora_rank < 1:
            raise ConfigError(f"lora_rank: must be at least 1, got {self.lora_rank}")
        if self.lora_alpha <= 0:
            raise ConfigError(f"lora_alpha: must be positive, got {self.lora_alpha}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ConfigError(f"lora_dropout: must be in [0, 1), got {self.lora_dropout}")

    def _validate_optimizer(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(
                f"optimizer: {self.optimizer!r} is not one of {', '.join(OPTIMIZERS)}"
            )
        for name, optimizers in OPTIMIZER_SETTINGS.items():
            value = getattr(self, name)
            if value not in (None, False) and self.optimizer not in optimizers:
                raise ConfigError(
                    f"{name}: applies to {' and '.join(optimizers)}, not to optimizer "
                    f"{self.optimizer!r}"
                )
        for name in ("b1", "b2", "momentum"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value < 1.0:
                raise ConfigError(f"{name}: must be in [0, 1), got {value}")
        if self.mu_dtype is not None and self.mu_dtype not in DTYPES:
            raise ConfigError(f"mu_dtype: {self.mu_dtype!r} is not one of {', '.join(DTYPES)}")
        if self.eps is not None and self.eps <= 0:
            raise ConfigError(f"eps: must be positive, got {self.eps}")
        if self.decay_rate is not None and not 0.0 < self.decay_rate <= 1.0:
            raise ConfigError(f"decay_rate: must be in (0, 1], got {self.decay_rate}")

    def fit_to_devices(self, devices: int) -> None:
        """Fit the batch to the job's devices: with `max_micro_batch`, raise an explicit
        grad_accum_steps until each device's share of a micro-batch fits (`auto`: the memory
        plan chooses among the counts that keep to it); then check that the global batch
        splits evenly over micro-batches and devices."""
        if self.max_micro_batch and self.grad_accum_steps != AUTO:
            self._fit_micro_batch(devices)
        self.check_process_count(devices)

    def _fit_micro_batch(self, devices: int) -> None:
        accum = self.grad_accum_steps
        while accum <= self.global_batch_size:
            micro = self.global_batch_size // accum
            fits = micro % devices == 0 and micro // devices <= self.max_micro_batch
            if self.global_batch_size % accum == 0 and fits:
                self.grad_accum_steps = accum
                return
            accum += 1
        raise ConfigError(
            f"max_micro_batch: no gradient accumulation splits global_batch_size "
            f"{self.global_batch_size} into micro-batches of at most {self.max_micro_batch} per "
            f"device on {devices} devices"
        )

    def check_process_count(self, devices: int) -> None:
        """The global batch must split evenly over the devices, and each device's share over
        an explicit grad_accum_steps' micro-batches."""
        if self.global_batch_size % devices:
            raise ConfigError(
                f"global_batch_size: {self.global_batch_size} is not divisible by the "
                f"{devices} devices of this job (processes × local devices)"
            )
        self.check_accumulation(devices)
        if self.eval_batch_size % devices:
            raise ConfigError(
                f"eval_batch_size: {self.eval_batch_size} is not divisible by the {devices} devices"
            )

    def check_accumulation(self, devices: int) -> None:
        """An explicit grad_accum_steps must divide each device's share of the global batch
        (on `devices` devices that split the batch), naming the counts that do."""
        if self.grad_accum_steps == AUTO:
            return
        share = self.global_batch_size // devices
        if share and share % self.grad_accum_steps:
            counts = [k for k in range(1, share + 1) if share % k == 0]
            raise ConfigError(
                f"grad_accum_steps: {self.grad_accum_steps} does not divide the per-device "
                f"batch of {share} (global_batch_size {self.global_batch_size} over {devices} "
                f"devices); use {', '.join(map(str, counts))} or auto"
            )

    @property
    def tracking_uri(self) -> str:
        """The MLflow tracking URI in effect ('' = no tracking)."""
        return resolve_uri(self.mlflow_tracking_uri)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip


def parse_bytes(text: str) -> int:
    """`80GiB`, `24GB`, `512MiB` or a plain number of bytes (the `device_memory` setting; a TPU
    type there is read by `kubejax.tpu.chip_memory` first)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", text.upper())
    if not m:
        from kubejax import tpu

        raise ConfigError(
            f"device_memory: {text!r} is neither a size such as 80GiB, 24GB or 512MiB nor a "
            f"TPU type ({tpu.known_types()})"
        )
    return int(float(m[1]) * _UNITS[m[2] or ""])


def parser(prog: str = "python -m kubejax.trainer") -> argparse.ArgumentParser:
    """An argparse parser with one --flag per TrainConfig field."""
    p = argparse.ArgumentParser(prog=prog, description="Fine-tune a BERT classifier with JAX.")
    add_flags(p, TrainConfig)
    return p


def assigned_flags(env: Mapping[str, str]) -> list[str]:
    """Flags for the settings an OptimizationJob trial assigns in `env` (each
    KUBEFLOW_TRAINER_OPT_<SETTING>), to go after the command line's so that they win;
    ConfigError naming a variable that is no trainer setting."""
    names = {f.name.upper(): f for f in dataclasses.fields(TrainConfig)}
    hints = typing.get_type_hints(TrainConfig)
    flags = []
    for key, value in sorted(env.items()):
        if not key.startswith(OPTIMIZATION_ENV_PREFIX):
            continue
        field = names.get(key.removeprefix(OPTIMIZATION_ENV_PREFIX).replace("-", "_"))
        if field is None:
            raise ConfigError(
                f"{key}: the OptimizationJob assigns a parameter that is not a trainer setting "
                "(its parameters must be named as the settings: `python -m kubejax.trainer "
                "--help`)"
            )
        flag = "--" + field.name.replace("_", "-")
        if base_type(hints[field.name]) is bool:
            if value.strip().lower() not in ("true", "false"):
                raise ConfigError(f"{key}: {field.name} must be true or false, got {value!r}")
            flags.append(flag if value.strip().lower() == "true" else "--no-" + flag[2:])
        else:
            flags += [flag, value]
    return flags


def from_args(argv: list[str] | None = None, env: Mapping[str, str] | None = None) -> TrainConfig:
    """Parse command-line flags into a TrainConfig (not yet validated); an OptimizationJob
    trial's assignments in the environment (`assigned_flags`) override them."""
    argv = sys.argv[1:] if argv is None else list(argv)
    extra = assigned_flags(os.environ if env is None else env)
    return TrainConfig(**vars(parser().parse_args([*argv, *extra])))
