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
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from kubejax import monitoring, tracking
from kubejax.data import dataset
from kubejax.errors import KubejaxError
from kubejax.trainer import distributed, weights
from kubejax.trainer.checkpoint import Checkpointer
from kubejax.trainer.config import ConfigError, TrainConfig
from kubejax.trainer.model import BertClassifier
from kubejax.trainer.outputs import METRICS_FILE, MODEL_DIR
from kubejax.trainer.steps import make_eval_step, make_train_step

log = logging.getLogger("kubejax.trainer")


# ---------------------------------------------------------------------------------------------
# Model and optimizer


def build_model(cfg: TrainConfig, num_labels: int) -> tuple[BertClassifier, Path | None, list]:
    """The classifier with pretrained weights (or fresh for 'scratch'), its tokenizer folder."""
    from transformers import BertConfig

    dtype = jnp.bfloat16 if cfg.dtype == "bfloat16" else jnp.float32
    if cfg.model == "scratch":
        model_cfg = BertConfig(**json.loads(cfg.scratch_config or "{}"))
        model_dir, tensors = None, None
    else:
        try:
            model_dir = weights.resolve_model_dir(cfg.model)
            model_cfg = weights.load_config(model_dir)
            tensors = weights.read_tensors(model_dir)
        except (FileNotFoundError, RuntimeError, ValueError) as err:
            raise ConfigError(str(err)) from err
    if cfg.dropout is not None:
        model_cfg.hidden_dropout_prob = cfg.dropout
        model_cfg.attention_probs_dropout_prob = cfg.dropout
        model_cfg.classifier_dropout = cfg.dropout
    if tensors is None:
        model, fresh = (
            BertClassifier(model_cfg, num_labels, dtype, rngs=nnx.Rngs(cfg.seed)),
            ["all"],
        )
    else:
        model, fresh = weights.from_pretrained(model_cfg, num_labels, tensors, dtype, cfg.seed)
    tokenizer_dir = Path(cfg.tokenizer) if cfg.tokenizer else model_dir
    if tokenizer_dir is not None and not tokenizer_dir.is_dir():
        tokenizer_dir = weights.resolve_model_dir(str(tokenizer_dir))
    return model, tokenizer_dir, fresh


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


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """Gradient clipping, then AdamW with the decay mask.

    The learning rate, weight decay and clipping norm live in the optimizer state
    (`optax.inject_hyperparams`) instead of being constants of the compiled step: the step gets
    this step's learning rate as an input, so sweep trials that differ only in these settings
    run one compiled program, shared through the persistent compilation cache.
    """

    def chain(learning_rate, weight_decay, max_grad_norm):
        return optax.chain(
            optax.clip_by_global_norm(max_grad_norm),
            optax.adamw(
                learning_rate,
                b1=0.9,
                b2=0.999,
                eps=1e-8,
                weight_decay=weight_decay,
                mask=decay_mask,
            ),
        )

    return optax.inject_hyperparams(chain)(
        learning_rate=0.0,
        weight_decay=cfg.weight_decay,
        max_grad_norm=cfg.max_grad_norm if cfg.max_grad_norm > 0 else math.inf,
    )


# ---------------------------------------------------------------------------------------------
# Evaluation during training


def evaluate_split(eval_step, params, split, cfg: TrainConfig, mesh) -> dict:
    """Loss and accuracy over (up to max_eval_examples of) a split."""
    totals = {"loss": 0.0, "correct": 0.0, "count": 0.0}
    for local in dataset.eval_batches(
        split,
        batch_size=cfg.eval_batch_size,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
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
# Outputs


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def _host_params(params):
    """Replicated global arrays → host NumPy (works on any process)."""
    return jax.tree.map(lambda a: np.asarray(a.addressable_data(0)), params)


def _check_output_dir(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise ConfigError(f"output_dir: {path} is not writable ({err.strerror})") from err


def _eta(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return (
        f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
        if seconds >= 3600
        else (f"{seconds // 60}m{seconds % 60:02d}s")
    )


# ---------------------------------------------------------------------------------------------
# The loop


def train_and_evaluate(cfg: TrainConfig) -> dict:
    """Train per `cfg`, resuming from the latest checkpoint in output_dir; return final metrics."""
    cfg.validate()
    penv = distributed.initialize(timeout_s=cfg.coordinator_timeout)
    is_main = jax.process_index() == 0
    mesh = distributed.data_mesh()
    cfg.check_process_count(jax.device_count())
    out = Path(cfg.output_dir)
    _check_output_dir(out)
    sampler = monitoring.ResourceSampler().start()

    # Data: every process reads the lengths of all rows to plan identical batches.
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
    total_steps = cfg.max_steps or math.ceil(cfg.epochs * steps_per_epoch)
    label_names = list(meta.get("label_names") or [str(i) for i in range(num_labels)])
    label_names += [str(i) for i in range(len(label_names), num_labels)]

    # Model, optimizer, state on the mesh.
    model, tokenizer_dir, fresh = build_model(cfg, num_labels)
    graphdef, params = nnx.split(model)
    # The schedule, computed once on the host: each step gets its learning rate as an input
    # (see make_optimizer), and evaluating it during the loop would stall the host.
    host_lr = np.asarray(
        jax.vmap(make_schedule(cfg, total_steps))(jnp.arange(total_steps + 1)), np.float32
    )
    tx = make_optimizer(cfg)
    params = distributed.replicate(params, mesh)
    opt_state = jax.jit(tx.init, out_shardings=distributed.replicated(mesh))(params)

    ckpt = Checkpointer(out, cfg.keep_checkpoints)
    start_step, history = 0, {"train": [], "evals": []}
    latest = ckpt.latest_step()
    if latest is not None:
        state, saved = ckpt.restore(latest, {"params": params, "opt_state": opt_state})
        params, opt_state = state["params"], state["opt_state"]
        start_step, history = saved["step"], saved.get("history", history)

    tracker = tracking.Tracker()
    system_monitor = None
    if is_main:
        tracker = tracking.create_tracker(
            cfg.tracking_uri,
            cfg.mlflow_experiment,
            run_name=cfg.mlflow_run_name or None,
            run_id=cfg.mlflow_run_id or None,
            parent_run_id=cfg.mlflow_parent_run_id or None,
            tags=tracking.kfp_tags(tracking.parse_tags(cfg.mlflow_tags)),
        )
        if latest is None:
            tracker.log_params(
                {
                    **cfg.to_dict(),
                    "num_labels": num_labels,
                    "total_steps": total_steps,
                    "num_processes": jax.process_count(),
                    "num_devices": jax.device_count(),
                    "train_rows": len(train),
                }
            )
        system_monitor = tracker.start_system_metrics("worker-0")
        print(
            f"kubejax trainer: {jax.process_count()} process(es), {jax.device_count()} "
            f"{jax.devices()[0].platform} device(s); {len(train)} train rows, {total_steps} steps"
            + (f"; resumed at step {start_step}" if latest is not None else "")
            + (f"; freshly initialised: {', '.join(fresh)}" if fresh else ""),
            flush=True,
        )

    train_step = make_train_step(graphdef, tx, mesh, cfg.seed)
    eval_step = make_eval_step(graphdef, mesh)

    def write_metrics(status: str, step: int, final: dict | None = None) -> None:
        if is_main:
            data = {
                "status": status,
                "step": step,
                "total_steps": total_steps,
                "mlflow_run_id": tracker.run_id or "",
                **history,
            }
            if final is not None:
                data["final"] = final
            _write_json(out / METRICS_FILE, data)

    def run_eval(step: int) -> dict:
        result = {"step": step, **evaluate_split(eval_step, params, val, cfg, mesh)}
        history["evals"].append(result)
        tracker.log_metrics({k: v for k, v in result.items() if k != "step"}, step=step)
        write_metrics("running", step)
        if is_main:
            print(
                f"eval step {step}: loss {result['eval_loss']:.4f} "
                f"accuracy {result['eval_accuracy']:.4f}",
                flush=True,
            )
        return result

    def save(step: int) -> None:
        ckpt.save(
            step,
            {"params": params, "opt_state": opt_state},
            {"step": step, "seed": cfg.seed, "history": history, "config": cfg.to_dict()},
        )

    batches = dataset.train_batches(
        train,
        global_batch=cfg.global_batch_size,
        accum_steps=cfg.grad_accum_steps,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        seed=cfg.seed,
        start_step=start_step,
        bucket_multiple=cfg.bucket_multiple,
        max_length=cfg.max_length,
    )
    t_start = time.monotonic()
    window = {"t": time.monotonic(), "examples": 0, "tokens": 0.0, "steps": 0}
    pending = None  # the previous step's metrics, read after the next step is dispatched

    def report_step(step: int, metrics) -> None:
        m = {k: float(v) for k, v in jax.device_get(metrics).items()}
        window["examples"] += cfg.global_batch_size
        window["tokens"] += m.pop("tokens")
        window["steps"] += 1
        done = step + 1
        if done % cfg.log_every and done != total_steps:
            return
        dt = max(time.monotonic() - window["t"], 1e-9)
        row = {
            "step": done,
            **m,
            "learning_rate": float(host_lr[step]),
            "examples_per_s": window["examples"] / dt,
            "tokens_per_s": window["tokens"] / dt,
        }
        history["train"].append(row)
        tracker.log_metrics({k: v for k, v in row.items() if k != "step"}, step=done)
        if is_main:
            eta = (total_steps - done) * dt / window["steps"]
            print(
                f"step {done}/{total_steps} | loss {m['loss']:.4f} | lr {row['learning_rate']:.2e}"
                f" | {row['examples_per_s']:.1f} ex/s | {row['tokens_per_s']:.0f} tok/s"
                f" | ETA {_eta(eta)}",
                flush=True,
            )
        window.update(t=time.monotonic(), examples=0, tokens=0.0, steps=0)

    status = "FAILED"
    try:
        step = start_step
        for step, local in batches:
            if step >= total_steps:
                break
            batch = distributed.global_batch(local, mesh, leading=1)
            params, opt_state, metrics = train_step(params, opt_state, batch, step, host_lr[step])
            if pending is not None:
                report_step(*pending)
            pending = (step, metrics)
            done = step + 1
            if (cfg.eval_every and done % cfg.eval_every == 0) or (
                cfg.checkpoint_every and done % cfg.checkpoint_every == 0
            ):
                report_step(*pending)
                pending = None
                if cfg.eval_every and done % cfg.eval_every == 0 and done != total_steps:
                    run_eval(done)
                if cfg.checkpoint_every and done % cfg.checkpoint_every == 0:
                    save(done)
        if pending is not None:
            report_step(*pending)
        final_step = max(start_step, min(step + 1, total_steps)) if total_steps else 0
        final_eval = (
            history["evals"][-1]
            if history["evals"] and history["evals"][-1]["step"] == final_step
            else run_eval(final_step)
        )
        if ckpt.latest_step() != final_step:
            save(final_step)
        ckpt.wait()
        train_rows = history["train"]
        final = {
            "train_loss": train_rows[-1]["loss"] if train_rows else float("nan"),
            "train_accuracy": train_rows[-1]["accuracy"] if train_rows else float("nan"),
            "eval_loss": final_eval["eval_loss"],
            "eval_accuracy": final_eval["eval_accuracy"],
            "examples_per_s": float(
                np.mean(
                    [r["examples_per_s"] for r in train_rows[1:]]
                    or [r["examples_per_s"] for r in train_rows]
                    or [0]
                )
            ),
            "tokens_per_s": float(
                np.mean(
                    [r["tokens_per_s"] for r in train_rows[1:]]
                    or [r["tokens_per_s"] for r in train_rows]
                    or [0]
                )
            ),
            "steps": final_step,
            "wall_s": time.monotonic() - t_start,
            "num_processes": jax.process_count(),
        }
        if is_main:
            final_model = _host_params(params)
            host_model = nnx.merge(graphdef, final_model)
            weights.save_model_dir(
                host_model,
                out / MODEL_DIR,
                label_names,
                tokenizer_dir,
                max_length=min(cfg.max_length, int(meta.get("max_length", cfg.max_length))),
            )
            tracker.log_summary({f"final_{k}": v for k, v in final.items()})
        write_metrics("completed", final_step, final)
        status = "FINISHED"
        return final
    finally:
        summary = sampler.stop()
        monitoring.write_worker_summary(out, penv.process_id, summary)
        if system_monitor is not None:
            system_monitor.finish()
        tracker.finish(status)
        ckpt.close()


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; exit status 2 for a bad setting, 1 for any other failure."""
    from kubejax.trainer.config import from_args

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg = from_args(argv)
        train_and_evaluate(cfg)
    except KubejaxError as err:  # a bad setting, data or tracking server: one line, status 2
        print(f"kubejax trainer: error: {err}", file=sys.stderr, flush=True)
        return 2
    return 0
