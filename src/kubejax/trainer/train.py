"""Data-parallel fine-tuning of a BERT classifier: the whole training story, top to bottom.

One process (no operator environment):

    python -m kubejax.trainer --model path/to/bert --data-dir data --output-dir out

Many processes (a JAXJob sets COORDINATOR_ADDRESS, COORDINATOR_PORT, NUM_PROCESSES and
PROCESS_ID on every worker; `kubejax jaxjob run --local --replicas 2 -- ...` does it here).

The batch is sharded over a one-axis `data` mesh of all devices, parameters are replicated,
and `jax.jit` with donated state runs one optimizer step (with gradient accumulation inside).
Only process 0 logs, writes metrics and exports the model; every process checkpoints.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from kubejax import monitoring, report, tracking
from kubejax.data import dataset
from kubejax.errors import KubejaxError
from kubejax.models import lora, weights
from kubejax.models.bert import BertClassifier
from kubejax.models.kernels import matrices_in
from kubejax.outputs import ADAPTER_DIR, METRICS_FILE, MODEL_DIR, UNDELIVERED_FILE
from kubejax.trainer import distributed, plan, sharding
from kubejax.trainer.checkpoint import Checkpointer
from kubejax.trainer.compile_cache import use_user_dir
from kubejax.trainer.config import ConfigError, TrainConfig
from kubejax.trainer.steps import make_eval_step, make_train_step
from kubejax.trainer.trainer_status import StatusReporter

log = logging.getLogger("kubejax.trainer")


class DivergedError(KubejaxError, RuntimeError):
    """The loss became NaN or infinite; the message names the step."""


# ---------------------------------------------------------------------------------------------
# Model and optimizer


def build_model(
    cfg: TrainConfig, data: TrainData, mesh_sizes: dict | None = None, placement=None
) -> tuple[nnx.Module, Path | None, list]:
    """The classifier with pretrained weights (or fresh for 'scratch'), its tokenizer folder and
    the parts initialised fresh; refused when the data's rows are longer than its positions,
    or when the mesh's tensor axis does not divide its heads or MLP (`mesh_sizes`).
    `placement`: parameters load straight into these shardings (`sharding.placement`)."""
    model, tokenizer_dir, fresh = classifier_for(cfg, data.num_labels, mesh_sizes, placement)
    positions = model.config.max_position_embeddings
    longest = int(max(data.train.lengths.max(), data.val.lengths.max(initial=0)))
    padded = dataset.bucket_length(longest, cfg.bucket_multiple, cfg.max_length)
    if padded > positions:
        raise ConfigError(
            f"max_length: rows of {cfg.data_dir} run to {longest} tokens (padded {padded}), more "
            f"than the {positions} positions of the model; set max_length to {positions} or "
            "less (longer rows are truncated) or prepare the data with that max_length"
        )
    return model, tokenizer_dir, fresh


def classifier_for(
    cfg: TrainConfig, num_labels: int, mesh_sizes: dict | None = None, placement=None
) -> tuple[nnx.Module, Path | None, list]:
    """The model of `cfg.model` for `cfg.task` (pretrained weights, or fresh for 'scratch') in
    `cfg.dtype` with `cfg.dropout`, its tokenizer folder and the parts initialised fresh."""
    from safetensors import SafetensorError

    dtype = jnp.bfloat16 if cfg.dtype == "bfloat16" else jnp.float32
    model_dir = None
    try:
        if cfg.model == "scratch":
            model_cfg = weights.scratch_config(cfg.scratch_config)
        else:
            # The config first: the checks below run before any weight is fetched.
            model_dir = weights.resolve_model_dir(cfg.model, weights=False)
            model_cfg = weights.load_config(model_dir)
    except (OSError, RuntimeError, ValueError, TypeError) as err:
        if cfg.model == "scratch":
            raise ConfigError(f"scratch_config: {err}") from err
        raise ConfigError(f"model: {cfg.model}: {err}") from err
    try:
        weights.check_task(model_cfg, cfg.task or "classification")
        if mesh_sizes:
            sharding.check_model(model_cfg, mesh_sizes)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    memory = plan.device_memory_of(cfg) if mesh_sizes else None
    if memory:  # before any weight is read
        plan.check_fits(cfg, model_cfg, num_labels, math.prod(mesh_sizes.values()), memory)
    _apply_dropout(cfg, model_cfg)
    if cfg.remat != "none" and not weights.is_decoder(model_cfg):
        raise ConfigError(f"remat: {cfg.remat!r} applies to decoder models; BERT trains without")
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
    if weights.is_decoder(model_cfg):
        model.model.remat = cfg.remat
    if cfg.peft != "none":
        _add_adapters(cfg, model)
    tokenizer_dir = Path(cfg.tokenizer) if cfg.tokenizer else model_dir
    if tokenizer_dir is not None and not tokenizer_dir.is_dir():
        tokenizer_dir = weights.resolve_model_dir(str(tokenizer_dir), weights=False)
    return model, tokenizer_dir, fresh


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
    if cfg.peft == "none":
        graphdef, params = nnx.split(model)
        return graphdef, matrices_in(params, cfg.param_dtype), None
    graphdef, params, frozen = nnx.split(model, lora.TRAINABLE, ...)
    return graphdef, params, _place_frozen(matrices_in(frozen, cfg.param_dtype), mesh)


def _place_frozen(frozen, mesh):
    if sharding.is_sharded(mesh):
        return jax.device_put(frozen, sharding.param_shardings(frozen, mesh))
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
    if weights.is_decoder(model_cfg):
        from kubejax.models import decoder_weights

        task = cfg.task or "classification"
        return decoder_weights.build(model_cfg, task, num_labels, dtype, cfg.seed)
    return BertClassifier(model_cfg, num_labels, dtype, rngs=nnx.Rngs(cfg.seed))


def make_schedule(cfg: TrainConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0, then linear, cosine or no decay."""
    warmup = int(cfg.warmup_ratio * total_steps)
    decay = max(total_steps - warmup, 1)
    lr = cfg.learning_rate
    if cfg.schedule == "cosine":
        after = optax.cosine_decay_schedule(lr, decay)
    elif cfg.schedule == "linear":
        after = optax.linear_schedule(lr, 0.0, decay)
    else:
        after = optax.constant_schedule(lr)
    return optax.join_schedules([optax.linear_schedule(0.0, lr, max(warmup, 1)), after], [warmup])


def decay_mask(params):
    """Weight decay on weight matrices and embeddings only, not on biases or LayerNorm."""

    def keep(path, _):
        name = jax.tree_util.keystr(path)
        return not ("bias" in name or "scale" in name)

    return jax.tree_util.tree_map_with_path(keep, params)


def base_optimizer(cfg: TrainConfig, learning_rate, weight_decay) -> optax.GradientTransformation:
    """The optimizer itself, by name, with the weight-decay mask; settings left unset take
    optax's defaults."""
    given = {k: getattr(cfg, k) for k in ("b1", "b2", "eps") if getattr(cfg, k) is not None}
    if cfg.optimizer == "adamw":
        return optax.adamw(learning_rate, weight_decay=weight_decay, mask=decay_mask, **given)
    if cfg.optimizer == "lion":
        return optax.lion(learning_rate, weight_decay=weight_decay, mask=decay_mask, **given)
    if cfg.optimizer == "adafactor":
        # An absolute learning rate (the schedule's), not Adafactor's parameter-relative one.
        return optax.adafactor(
            learning_rate,
            decay_rate=0.8 if cfg.decay_rate is None else cfg.decay_rate,
            multiply_by_parameter_scale=False,
            weight_decay_rate=weight_decay,
            weight_decay_mask=decay_mask,
        )
    momentum = 0.9 if cfg.momentum is None else cfg.momentum
    return optax.chain(
        optax.add_decayed_weights(weight_decay, mask=decay_mask),
        optax.sgd(learning_rate, momentum=momentum or None, nesterov=cfg.nesterov),
    )


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """Gradient clipping, then the configured optimizer (adamw, adafactor, lion or sgd).

    The learning rate, weight decay and clipping norm live in the optimizer state
    (`optax.inject_hyperparams`) instead of being constants of the compiled step: the step gets
    this step's learning rate as an input, so sweep trials that differ only in these settings
    run one compiled program, shared through the persistent compilation cache.
    """

    def chain(learning_rate, weight_decay, max_grad_norm):
        return optax.chain(
            optax.clip_by_global_norm(max_grad_norm),
            base_optimizer(cfg, learning_rate, weight_decay),
        )

    return optax.inject_hyperparams(chain)(
        learning_rate=0.0,
        weight_decay=cfg.weight_decay,
        max_grad_norm=cfg.max_grad_norm if cfg.max_grad_norm > 0 else math.inf,
    )


# ---------------------------------------------------------------------------------------------
# Evaluation during training


def evaluate_split(eval_step, params, split, cfg: TrainConfig, mesh, answers=None) -> dict:
    """Loss and accuracy over (up to max_eval_examples of) a split, as in prediction: short
    reviews packed several to a row (`dataset.packed_eval_batches`), or for a language model
    every label's answer scored (`dataset.scoring_batches`)."""
    params = matrices_in(params, cfg.dtype)
    totals = {"loss": 0.0, "correct": 0.0, "count": 0.0}
    for local in dataset.eval_batches(
        split,
        answers,
        batch_size=cfg.eval_batch_size,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        local_devices=jax.local_device_count(),
        bucket_multiple=cfg.bucket_multiple,
        max_length=cfg.max_length,
        limit=cfg.max_eval_examples,
    ):
        local.pop("rows")
        sums, _ = eval_step(params, distributed.global_batch(local, mesh))
        for k, v in jax.device_get(sums).items():
            totals[k] += float(v)
    n = max(totals["count"], 1.0)
    return {"eval_loss": totals["loss"] / n, "eval_accuracy": totals["correct"] / n}


# ---------------------------------------------------------------------------------------------
# Data


@dataclass
class TrainData:
    """The splits the loop reads and what follows from them."""

    train: dataset.TokenizedSplit
    val: dataset.TokenizedSplit
    meta: dict
    num_labels: int
    total_steps: int
    label_names: list[str]
    #: causal-lm: each label's answer tokens (the data's prompts are answered with them)
    answers: list[list[int]] | None = None


def load_data(cfg: TrainConfig) -> TrainData:
    """Read the prepared splits (every process reads the lengths of all rows, to plan identical
    batches) and check them against the settings."""
    try:
        meta = dataset.read_metadata(cfg.data_dir)
        train = dataset.load_split(cfg.data_dir, "train")
        val = dataset.load_split(cfg.data_dir, "validation")
    except dataset.DatasetError as err:
        raise ConfigError(str(err)) from err
    num_labels = cfg.num_labels or int(meta["num_labels"])
    if len(train) == 0:
        raise ConfigError(f"data_dir: the train split of {cfg.data_dir} is empty")
    top = int(max(train.labels.max(), val.labels.max(initial=0)))
    if top >= num_labels:
        raise ConfigError(f"num_labels: {num_labels}, but the data has label {top}")
    steps_per_epoch = len(train) // cfg.global_batch_size
    if steps_per_epoch == 0:
        raise ConfigError(
            f"global_batch_size: {cfg.global_batch_size} exceeds the {len(train)} training rows"
        )
    label_names = list(meta.get("label_names") or [str(i) for i in range(num_labels)])
    label_names += [str(i) for i in range(len(label_names), num_labels)]
    answers = _check_task(cfg, meta, num_labels)
    return TrainData(
        answers=answers,
        train=train,
        val=val,
        meta=meta,
        num_labels=num_labels,
        total_steps=cfg.max_steps or math.ceil(cfg.epochs * steps_per_epoch),
        label_names=label_names,
    )


def _check_task(cfg: TrainConfig, meta: dict, num_labels: int) -> list[list[int]] | None:
    """Settle `cfg.task` from the data (prompts or not) and check that they agree; the
    answers of a causal-lm dataset."""
    prepared = meta.get("task", "classification")
    cfg.task = cfg.task or prepared
    if cfg.task != prepared:
        raise ConfigError(
            f"task: {cfg.task!r}, but {cfg.data_dir} was prepared for {prepared!r}; prepare it "
            f"with task {cfg.task!r} or leave task unset"
        )
    if cfg.task != "causal-lm":
        return None
    prepared_length = int(meta["max_length"])
    if cfg.max_length < prepared_length:
        raise ConfigError(
            f"max_length: {cfg.max_length}, but the prompts of {cfg.data_dir} were cut to fit "
            f"{prepared_length} tokens with their answers; set max_length to {prepared_length}"
        )
    answers = meta["answers"]
    if len(answers) != num_labels:
        raise ConfigError(
            f"num_labels: {num_labels}, but {cfg.data_dir} has answers for {len(answers)} labels"
        )
    return answers


def host_learning_rates(cfg: TrainConfig, total_steps: int) -> np.ndarray:
    """The schedule, computed once on the host: each step gets its learning rate as an input
    (see make_optimizer), and evaluating it during the loop would stall the host."""
    schedule = jax.vmap(make_schedule(cfg, total_steps))
    return np.asarray(schedule(jnp.arange(total_steps + 1)), np.float32)


def restore_latest(ckpt: Checkpointer, cfg: TrainConfig, params, opt_state):
    """The state of the newest readable checkpoint, if any: params, optimizer state, the step
    to go on from and the metric history so far. An unreadable checkpoint (truncated, corrupt)
    is passed over for the one before, saying so; when checkpoints exist but none can be read,
    the run fails naming the folder unless `allow_fresh_start`. A checkpoint made with another
    optimizer is refused (its state could not be read into this one's)."""
    steps, unreadable, problems = ckpt.all_steps(), [], []
    restored = None
    for step in sorted(steps, reverse=True):
        try:
            meta = ckpt.metadata(step)
            _check_same_optimizer(cfg, meta, step)
            restored = ckpt.restore(step, {"params": params, "opt_state": opt_state})
            break
        except ConfigError:
            raise
        except Exception as err:  # Orbax reports damaged files in many error types
            unreadable.append(step)
            problems.append(f"step {step}: {type(err).__name__}: {str(err)[:200]}")
            print(f"kubejax trainer: checkpoint {step} is unreadable ({type(err).__name__})")
    if unreadable and (restored is not None or cfg.allow_fresh_start):
        aside = ckpt.set_aside(unreadable)
        print(f"kubejax trainer: unreadable checkpoints {unreadable} moved to {aside}")
    if restored is not None:
        state, saved = restored
        history = saved.get("history", {"train": [], "evals": []})
        return state["params"], with_settings(state["opt_state"], cfg), saved["step"], history
    if unreadable and not cfg.allow_fresh_start:
        raise ConfigError(
            f"output_dir: no readable checkpoint in {ckpt.directory} ({'; '.join(problems)}); "
            "move it away or set allow_fresh_start to train from step 0"
        )
    if unreadable:
        print(f"kubejax trainer: no readable checkpoint in {ckpt.directory}; starting fresh")
    return params, opt_state, 0, {"train": [], "evals": []}


def with_settings(opt_state, cfg: TrainConfig):
    """A restored optimizer state with this run's weight decay and clipping norm: on resume the
    moments are kept and the settings are the run's own (the learning rate comes from its
    schedule at the resumed step anyway), as Population Based Training's restarted trials
    need."""
    hyperparams = getattr(opt_state, "hyperparams", None)
    if not hyperparams:
        return opt_state
    settings = {
        "weight_decay": cfg.weight_decay,
        "max_grad_norm": cfg.max_grad_norm if cfg.max_grad_norm > 0 else math.inf,
    }
    new = dict(hyperparams)
    for name, value in settings.items():
        old = hyperparams.get(name)
        if old is not None:
            new[name] = jax.device_put(jnp.asarray(value, old.dtype), old.sharding)
    return opt_state._replace(hyperparams=new)


def _check_same_optimizer(cfg: TrainConfig, meta: dict, step: int) -> None:
    saved_optimizer = meta.get("config", {}).get("optimizer", "adamw")
    if saved_optimizer != cfg.optimizer:
        raise ConfigError(
            f"optimizer: {cfg.optimizer!r}, but the checkpoint at step {step} in "
            f"{cfg.output_dir} was made with {saved_optimizer!r}; resume with {saved_optimizer!r}"
            " or train into a fresh output_dir"
        )


def train_batches(cfg: TrainConfig, data: TrainData, start_step: int):
    """This process's share of every step's batch, from `start_step` on."""
    return dataset.train_batches(
        data.train,
        global_batch=cfg.global_batch_size,
        accum_steps=cfg.grad_accum_steps,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        seed=cfg.seed,
        start_step=start_step,
        bucket_multiple=cfg.bucket_multiple,
        max_length=cfg.max_length,
        answers=data.answers,
    )


# ---------------------------------------------------------------------------------------------
# Outputs


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


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


def _writable_dir(path: Path) -> Path:
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise ConfigError(f"output_dir: {path} is not writable ({err.strerror})") from err
    return path


def _eta(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return (
        f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
        if seconds >= 3600
        else (f"{seconds // 60}m{seconds % 60:02d}s")
    )


def _mean_after_first(rows: list[dict], key: str) -> float:
    """Mean of a throughput column, leaving out the first window (it holds the compilation)."""
    values = [r[key] for r in rows[1:]] or [r[key] for r in rows] or [0.0]
    return float(np.mean(values))


def start_tracker(cfg: TrainConfig, data: TrainData, resumed: bool) -> tracking.Tracker:
    """Process 0's MLflow run (a no-op tracker on the other processes); parameters are logged
    once, by the attempt that starts the run."""
    if jax.process_index() != 0:
        return tracking.Tracker()
    tracker = tracking.create_tracker(
        cfg.tracking_uri,
        cfg.mlflow_experiment,
        run_name=cfg.mlflow_run_name or None,
        run_id=cfg.mlflow_run_id or None,
        parent_run_id=cfg.mlflow_parent_run_id or None,
        tags=tracking.kfp_tags(tracking.parse_tags(cfg.mlflow_tags)),
    )
    if not resumed:
        tracker.log_params(
            {
                **cfg.to_dict(),
                "num_labels": data.num_labels,
                "total_steps": data.total_steps,
                "num_processes": jax.process_count(),
                "num_devices": jax.device_count(),
                "train_rows": len(data.train),
            }
        )
    return tracker


class Progress:
    """Where the loop's figures go: the history (kept in checkpoints), MLflow, metrics.json
    (which the launcher and the sweep read) and the console, with a throughput window.

    A step's metrics are read one step late (`dispatched`), so that reading them never waits
    for the device while the next step could already be running.
    """

    def __init__(self, cfg, out: Path, tracker, total_steps: int, host_lr, history: dict, sampler):
        self.cfg, self.out, self.tracker, self.sampler = cfg, out, tracker, sampler
        self.total_steps, self.host_lr, self.history = total_steps, host_lr, history
        self.is_main = jax.process_index() == 0
        # A TrainJob's progress in its status, where Trainer asks for it (worker 0 only).
        self.status = StatusReporter.from_env() if self.is_main else None
        self.pending = None
        self.window = {"t": time.monotonic(), "examples": 0, "tokens": 0.0, "steps": 0}

    def say(self, text: str) -> None:
        if self.is_main:
            print(text, flush=True)

    def dispatched(self, step: int, metrics) -> None:
        """Record the previous step's metrics, keep this step's for later."""
        self.flush()
        self.pending = (step, metrics)

    def flush(self) -> None:
        """Record the step whose metrics are still pending."""
        if self.pending is not None:
            self._record(*self.pending)
            self.pending = None

    def _record(self, step: int, metrics) -> None:
        m = {k: float(v) for k, v in jax.device_get(metrics).items()}
        if not math.isfinite(m["loss"]):
            self.diverged(step + 1, m["loss"])
        self.sampler.count(self.cfg.global_batch_size // jax.process_count())
        w = self.window
        w["examples"] += self.cfg.global_batch_size
        w["tokens"] += m.pop("tokens")
        w["steps"] += 1
        done = step + 1
        if done % self.cfg.log_every and done != self.total_steps:
            return
        dt = max(time.monotonic() - w["t"], 1e-9)
        row = {
            "step": done,
            **m,
            "learning_rate": float(self.host_lr[step]),
            "examples_per_s": w["examples"] / dt,
            "tokens_per_s": w["tokens"] / dt,
        }
        self.history["train"].append(row)
        self.tracker.log_metrics({k: v for k, v in row.items() if k != "step"}, step=done)
        eta = (self.total_steps - done) * dt / w["steps"]
        if self.status is not None:
            shown = ("loss", "accuracy", "learning_rate", "examples_per_s")
            self.status.update(done, self.total_steps, eta, {k: row[k] for k in shown})
        self.say(
            f"step {done}/{self.total_steps} | loss {m['loss']:.4f} | lr {row['learning_rate']:.2e}"
            f" | {row['examples_per_s']:.1f} ex/s | {row['tokens_per_s']:.0f} tok/s"
            f" | ETA {_eta(eta)}"
        )
        w.update(t=time.monotonic(), examples=0, tokens=0.0, steps=0)

    def diverged(self, step: int, loss: float) -> None:
        """Stop on a non-finite loss: it is logged (visible in MLflow and metrics.json), and
        the run fails naming the step instead of training on to a NaN model."""
        self.tracker.log_metrics({"loss": loss}, step=step)
        self.history["train"].append({"step": step, "loss": loss})
        self.write("failed", step)
        raise DivergedError(
            f"loss: {loss} at step {step}; training stopped (lower learning_rate, raise "
            "warmup_ratio or max_grad_norm clipping, or check the data)"
        )

    def evaluated(self, step: int, result: dict) -> dict:
        """Record an evaluation of the validation split."""
        result = {"step": step, **result}
        self.history["evals"].append(result)
        self.tracker.log_metrics({k: v for k, v in result.items() if k != "step"}, step=step)
        self.write("running", step)
        if self.status is not None:
            figures = {k: v for k, v in result.items() if k.startswith("eval_")}
            self.status.update(step, self.total_steps, None, figures)
        self.say(
            f"eval step {step}: loss {result['eval_loss']:.4f} "
            f"accuracy {result['eval_accuracy']:.4f}"
        )
        if self.cfg.katib_metrics:  # Katib's StdOut collector: name=value, one line an eval
            self.say(" ".join(f"{k}={v:.6g}" for k, v in result.items() if k.startswith("eval_")))
        return result

    def last_eval(self, step: int) -> dict | None:
        evals = self.history["evals"]
        return evals[-1] if evals and evals[-1]["step"] == step else None

    def final(self, step: int, final_eval: dict, wall_s: float) -> dict:
        """The run's final figures (metrics.json's `final`)."""
        rows = self.history["train"]
        return {
            "train_loss": rows[-1]["loss"] if rows else float("nan"),
            "train_accuracy": rows[-1]["accuracy"] if rows else float("nan"),
            "eval_loss": final_eval["eval_loss"],
            "eval_accuracy": final_eval["eval_accuracy"],
            "examples_per_s": _mean_after_first(rows, "examples_per_s"),
            "tokens_per_s": _mean_after_first(rows, "tokens_per_s"),
            "steps": step,
            "wall_s": wall_s,
            "num_processes": jax.process_count(),
            "num_devices": jax.device_count(),
        }

    def log_final(self, final: dict) -> None:
        """The final figures, and the run's curves (loss, accuracy, learning rate,
        throughput) as MLflow figures."""
        self.tracker.log_summary({f"final_{k}": v for k, v in final.items()})
        if self.tracker.run_id is None:
            return
        figures = monitoring.training_figures(self.history, [])
        for name, fig in figures.items():
            self.tracker.log_figure(fig, f"training/{name}")
        report.close(figures.values())

    def completed(self, step: int, final: dict, final_eval: dict) -> None:
        """metrics.json's last state, and the TrainJob's last progress (100 %)."""
        self.write("completed", step, final)
        if self.status is not None:
            evals = {k: v for k, v in final_eval.items() if k.startswith("eval_")}
            self.status.finish(step, {"loss": final["train_loss"], **evals})

    def write(self, status: str, step: int, final: dict | None = None) -> None:
        """metrics.json, replaced atomically (process 0 only)."""
        if not self.is_main:
            return
        data = {
            "status": status,
            "step": step,
            "total_steps": self.total_steps,
            "mlflow_run_id": self.tracker.run_id or "",
            **self.history,
        }
        if final is not None:
            data["final"] = final
        _write_json(self.out / METRICS_FILE, data)

    def undelivered(self, lost: list[tuple]) -> None:
        """Metric values MLflow never took (a long outage): kept in a file beside
        metrics.json, counted there and reported, never silently dropped."""
        if not (self.is_main and lost):
            return
        path = self.out / UNDELIVERED_FILE
        rows = [dict(zip(("key", "value", "timestamp_ms", "step"), m, strict=True)) for m in lost]
        _write_json(path, {"run_id": self.tracker.run_id, "metrics": rows})
        metrics_path = self.out / METRICS_FILE
        if metrics_path.exists():
            data = json.loads(metrics_path.read_text())
            _write_json(metrics_path, {**data, "mlflow_undelivered": len(lost)})
        print(
            f"kubejax trainer: warning: {len(lost)} metric values could not be delivered to "
            f"MLflow run {self.tracker.run_id}; they are kept in {path}",
            file=sys.stderr,
            flush=True,
        )


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


def make_mesh(cfg: TrainConfig):
    """The job's mesh from the `mesh` setting, and its axis sizes: one `data` axis when nothing
    is sharded (the data-parallel step), else the named mesh; the batch fitted to the devices
    it is split over."""
    try:
        sizes = sharding.parse_mesh(cfg.mesh, jax.device_count())
    except sharding.MeshError as err:
        raise ConfigError(str(err)) from err
    cfg.fit_to_devices(sizes["data"] * sizes["fsdp"])
    if sizes["fsdp"] == sizes["tensor"] == 1:
        return distributed.data_mesh(), sizes
    return sharding.make_mesh(sizes), sizes


def place_state(params, tx, mesh):
    """Parameters and a fresh optimizer state on the mesh: replicated, or each in its shards
    (the moments like their parameters); with the shardings for a sharded train step."""

    # The optimizer's state is float32 whatever the weights' dtype (`param_dtype`).
    def init(params):
        return tx.init(matrices_in(params, jnp.float32))

    if not sharding.is_sharded(mesh):
        params = distributed.replicate(params, mesh)
        opt_state = jax.jit(init, out_shardings=distributed.replicated(mesh))(params)
        return params, opt_state, None
    params_sh = sharding.param_shardings(params, mesh)
    params = jax.device_put(params, params_sh)
    opt_sh = sharding.state_shardings(tx, jax.eval_shape(init, params), params_sh, mesh)
    opt_state = jax.jit(init, out_shardings=opt_sh)(params)
    return params, opt_state, (params_sh, opt_sh)


def start_message(cfg: TrainConfig, data: TrainData, start_step: int, fresh: list) -> str:
    """The run's first line: processes, devices, rows, steps, resume, fresh parts, task."""
    return (
        f"kubejax trainer: {jax.process_count()} process(es), {jax.device_count()} "
        f"{jax.devices()[0].platform} device(s); {len(data.train)} train rows, "
        f"{data.total_steps} steps"
        + (f"; resumed at step {start_step}" if start_step else "")
        + (f"; freshly initialised: {', '.join(fresh)}" if fresh else "")
        + (
            f"; task causal-lm: answers of up to {max(map(len, data.answers))} tokens, "
            "evaluation scores every answer of a prompt in one row (no packing)"
            if data.answers is not None
            else ""
        )
    )


# ---------------------------------------------------------------------------------------------
# The loop


def train_and_evaluate(cfg: TrainConfig) -> dict:
    """Train per `cfg`, resuming from the latest checkpoint in output_dir; return final metrics."""
    cfg.validate()
    penv = distributed.initialize(timeout_s=cfg.coordinator_timeout)
    mesh, sizes = make_mesh(cfg)
    out = _writable_dir(Path(cfg.output_dir))
    sampler = monitoring.ResourceSampler().start()
    data = load_data(cfg)
    total = data.total_steps

    # Model and optimizer on the mesh (replicated, or in their shards); resumed from the
    # latest checkpoint.
    sharded = sharding.is_sharded(mesh)
    placement = sharding.placement(mesh) if sharded else None
    model, tokenizer_dir, fresh = build_model(cfg, data, sizes, placement)
    graphdef, params, frozen = split_trainable(cfg, model, mesh)
    host_lr = host_learning_rates(cfg, total)
    tx = make_optimizer(cfg)
    params, opt_state, shardings = place_state(params, tx, mesh)
    ckpt = Checkpointer(out, cfg.keep_checkpoints)
    params, opt_state, start_step, history = restore_latest(ckpt, cfg, params, opt_state)

    tracker = start_tracker(cfg, data, resumed=start_step > 0)
    system_monitor = tracker.start_system_metrics("worker-0")  # None on processes 1+
    progress = Progress(cfg, out, tracker, total, host_lr, history, sampler)
    progress.say(start_message(cfg, data, start_step, fresh))
    sparse = model.sparse_embedding if frozen is None else None  # LoRA: the table is frozen
    train_step = make_train_step(graphdef, tx, mesh, cfg.seed, sparse, shardings, frozen)
    eval_step = make_eval_step(graphdef, mesh, frozen)

    def save(step: int) -> None:
        ckpt.save(
            step,
            {"params": params, "opt_state": opt_state},
            {"step": step, "seed": cfg.seed, "history": history, "config": cfg.to_dict()},
        )

    batches = train_batches(cfg, data, start_step)
    t_start, status, step = time.monotonic(), "FAILED", start_step
    try:
        for step, local in batches:
            if step >= total:
                break
            batch = distributed.global_batch(local, mesh, leading=1)
            params, opt_state, metrics = train_step(params, opt_state, batch, step, host_lr[step])
            progress.dispatched(step, metrics)
            done = step + 1
            eval_due = cfg.eval_every and done % cfg.eval_every == 0 and done != total
            save_due = cfg.checkpoint_every and done % cfg.checkpoint_every == 0
            if eval_due or save_due:
                progress.flush()
            if eval_due:
                progress.evaluated(
                    done, evaluate_split(eval_step, params, data.val, cfg, mesh, data.answers)
                )
            if save_due:
                save(done)
        progress.flush()

        # The end: a last evaluation, checkpoint and model (unless made already or not wanted).
        final_step = max(start_step, min(step + 1, total)) if total else 0
        final_eval = progress.last_eval(final_step) or progress.evaluated(
            final_step, evaluate_split(eval_step, params, data.val, cfg, mesh, data.answers)
        )
        if cfg.save_final and ckpt.latest_step() != final_step:
            save(final_step)
        ckpt.wait()
        final = progress.final(final_step, final_eval, time.monotonic() - t_start)
        final.update(state_sizes(params, opt_state, frozen))
        if cfg.save_final:
            export_model(cfg, graphdef, (params, frozen), data, tokenizer_dir, tracker)
        if jax.process_index() == 0:
            progress.log_final(final)
        progress.completed(final_step, final, final_eval)
        status = "FINISHED"
        return final
    finally:
        monitoring.write_worker_summary(out, penv.process_id, sampler.stop())
        if system_monitor is not None:
            system_monitor.finish()
        progress.undelivered(tracker.finish(status))
        ckpt.close()


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; exit status 2 for a bad setting, 1 for any other failure."""
    from kubejax.trainer.config import from_args

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    use_user_dir()
    try:
        cfg = from_args(argv)
        train_and_evaluate(cfg)
    except KubejaxError as err:  # a bad setting, data or tracking server: one line, status 2
        print(f"kubejax trainer: error: {err}", file=sys.stderr, flush=True)
        return 2
    return 0
