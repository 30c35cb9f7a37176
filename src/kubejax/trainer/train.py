"""Fine-tuning on a mesh of every worker's devices: the whole training story, top to bottom.

One process (no operator environment):

    python -m kubejax.trainer --model path/to/bert --data-dir data --output-dir out

Many processes (a JAXJob sets COORDINATOR_ADDRESS, COORDINATOR_PORT, NUM_PROCESSES and
PROCESS_ID on every worker; `kubejax jaxjob run --local --replicas 2 -- ...` does it here).

The batch is sharded over the mesh (one `data` axis, or `data`, `fsdp`, `tensor` with the
`mesh` setting), parameters are replicated or in their shards, and `jax.jit` with donated state
runs one optimizer step (with gradient accumulation inside). Only process 0 logs, writes metrics
and exports the model; every process checkpoints.

The rooms beside the loop: `model_setup` (the model and what trains), `optimizer`, `inputs`
(the splits and the batches), `steps` (the compiled steps), `progress` (metrics, MLflow, the
console), `checkpoint` and `export` (the model folder).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

import jax

from kubejax import monitoring
from kubejax.errors import KubejaxError
from kubejax.models.kernels import matrices_in
from kubejax.trainer import distributed, precision, sharding
from kubejax.trainer.ahead import EvaluationAhead, StepAhead
from kubejax.trainer.checkpoint import Checkpointer
from kubejax.trainer.compile_cache import lookups_said, use_user_dir
from kubejax.trainer.config import ConfigError, TrainConfig
from kubejax.trainer.export import export_model, state_sizes
from kubejax.trainer.inputs import TrainData, eval_batches, load_data, train_batches
from kubejax.trainer.model_setup import build_model, fit_memory, model_choices, split_trainable
from kubejax.trainer.optimizer import (
    host_learning_rates,
    make_optimizer,
    state_init,
    with_settings,
)
from kubejax.trainer.progress import Progress, start_tracker
from kubejax.trainer.steps import make_eval_step

log = logging.getLogger("kubejax.trainer")


# ---------------------------------------------------------------------------------------------
# The mesh, the state on it, and the state restored


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
    init = state_init(tx)
    params_sh, opt_sh, shardings = sharding.state_layout(
        params, jax.eval_shape(init, params), tx, mesh
    )
    if shardings is None:
        params = distributed.replicate(params, mesh)
    else:
        params = jax.device_put(params, params_sh)
    return params, jax.jit(init, out_shardings=opt_sh)(params), shardings


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


def _check_same_optimizer(cfg: TrainConfig, meta: dict, step: int) -> None:
    saved_optimizer = meta.get("config", {}).get("optimizer", "adamw")
    if saved_optimizer != cfg.optimizer:
        raise ConfigError(
            f"optimizer: {cfg.optimizer!r}, but the checkpoint at step {step} in "
            f"{cfg.output_dir} was made with {saved_optimizer!r}; resume with {saved_optimizer!r}"
            " or train into a fresh output_dir"
        )


def _writable_dir(path: Path) -> Path:
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise ConfigError(f"output_dir: {path} is not writable ({err.strerror})") from err
    return path


# ---------------------------------------------------------------------------------------------
# Evaluation during training


def evaluate_split(eval_step, params, split, cfg: TrainConfig, mesh, answers=None) -> dict:
    """Loss and accuracy over (up to max_eval_examples of) a split, as in prediction: short
    reviews packed several to a row (`dataset.packed_eval_batches`), or for a language model
    every label's answer scored (`dataset.scoring_batches`)."""
    params = matrices_in(params, precision.here(cfg).dtype)
    totals = {"loss": 0.0, "correct": 0.0, "count": 0.0}
    for local in eval_batches(split, cfg, answers):
        sums, _ = eval_step(params, distributed.global_batch(local, mesh))
        for k, v in jax.device_get(sums).items():
            totals[k] += float(v)
    n = max(totals["count"], 1.0)
    return {"eval_loss": totals["loss"] / n, "eval_accuracy": totals["correct"] / n}


def start_message(
    cfg: TrainConfig, data: TrainData, start_step: int, fresh: list, choices: list[str]
) -> str:
    """The run's first line: processes, devices, rows, steps, resume, fresh parts, packing,
    task, then the `choices` the run made for itself (each a short piece, e.g. its length
    buckets), so that one line says what this run compiles and why."""
    packed = data.packed
    return "; ".join(
        [
            f"kubejax trainer: {jax.process_count()} process(es), {jax.device_count()} "
            f"{jax.devices()[0].platform} device(s)",
            f"{len(data.train)} train rows, {data.total_steps} steps",
            *([f"resumed at step {start_step}"] if start_step else []),
            *([f"freshly initialised: {', '.join(fresh)}"] if fresh else []),
            *(
                [
                    f"packed: {len(data.train)} reviews in {packed.rows} rows of "
                    f"{cfg.max_length} tokens ({packed.slots} slots a row), "
                    f"{packed.real_token_share:.0%} real tokens"
                ]
                if packed is not None
                else []
            ),
            *(
                [
                    f"task causal-lm: answers of up to {max(map(len, data.answers))} tokens, "
                    "evaluation scores every answer of a prompt in one row (no packing)"
                ]
                if data.answers is not None
                else []
            ),
            *choices,
        ]
    )


# ---------------------------------------------------------------------------------------------
# The loop


def train_and_evaluate(cfg: TrainConfig) -> dict:
    """Train per `cfg`, resuming from the latest checkpoint in output_dir; return final metrics."""
    walls = Walls()
    cfg.validate()
    penv = distributed.initialize(timeout_s=cfg.coordinator_timeout)
    cfg, chosen = settle_precision(cfg)
    mesh, sizes = make_mesh(cfg)
    out = _writable_dir(Path(cfg.output_dir))
    sampler = monitoring.ResourceSampler().start()
    data = load_data(cfg)
    # Micro-batches and remat `auto` settled by the memory plan, before the step is compiled
    # ahead or any weight is read.
    cfg, fitted = fit_memory(cfg, data.num_labels, sizes)
    total = data.total_steps

    # Model and optimizer on the mesh (replicated or in shards), resumed from the last checkpoint.
    ahead = StepAhead(cfg, data, mesh)  # the step's program compiled meanwhile
    model, tokenizer_dir, fresh = build_model(cfg, data, sizes, sharding.placement(mesh))
    graphdef, params, frozen = split_trainable(cfg, model, mesh)
    host_lr = host_learning_rates(cfg, total)
    tx = make_optimizer(cfg)
    params, opt_state, shardings = place_state(params, tx, mesh)
    ckpt = Checkpointer(out, cfg.keep_checkpoints)
    params, opt_state, start_step, history = restore_latest(ckpt, cfg, params, opt_state)

    tracker = start_tracker(cfg, data, resumed=start_step > 0)
    system_monitor = tracker.start_system_metrics("worker-0")  # None on processes 1+
    progress = Progress(cfg, out, tracker, total, host_lr, history, sampler)
    choices = [chosen.describe(), fitted.describe(), *run_choices(cfg, data, model)]
    progress.say(start_message(cfg, data, start_step, fresh, choices))
    sparse = model.sparse_embedding if frozen is None else None  # LoRA: the table is frozen
    train_step = ahead.train_step(graphdef, tx, mesh, cfg.seed, sparse, shardings, frozen)
    eval_step = EvaluationAhead(make_eval_step(graphdef, mesh, frozen), params, data, cfg, mesh)

    def save(step: int) -> None:
        meta = {"step": step, "seed": cfg.seed, "history": history, "config": cfg.to_dict()}
        ckpt.save(step, {"params": params, "opt_state": opt_state}, meta)

    def evaluate() -> dict:
        return evaluate_split(eval_step, params, data.val, cfg, mesh, data.answers)

    batches = train_batches(cfg, data, start_step)
    t_start, status, step = time.monotonic(), "FAILED", start_step
    walls.lap("setup")
    try:
        for step, local in batches:
            if step >= total:
                break
            batch = distributed.global_batch(local, mesh, leading=1)
            params, opt_state, metrics = train_step(params, opt_state, batch, step, host_lr[step])
            progress.dispatched(step, metrics)
            if step == start_step:  # compiled by now (a jitted call compiles before it runs)
                _first_said(progress, train_step, params, opt_state, batch, step, host_lr[step])
            done = step + 1
            eval_due, save_due = _due(cfg, done, total)
            if eval_due or save_due:
                progress.flush()
            if eval_due:
                progress.evaluated(done, evaluate())
            if save_due:
                save(done)
        progress.flush()
        walls.lap("training")

        # The end: a last evaluation, checkpoint and model (unless made already or not wanted).
        final_step = max(start_step, min(step + 1, total)) if total else 0
        final_eval = progress.last_eval(final_step) or progress.evaluated(final_step, evaluate())
        walls.lap("evaluation")
        if cfg.save_final and ckpt.latest_step() != final_step:
            save(final_step)
        ckpt.wait()
        final = progress.final(final_step, final_eval, time.monotonic() - t_start)
        final.update(state_sizes(params, opt_state, frozen))
        if cfg.save_final:
            export_model(cfg, graphdef, (params, frozen), data, tokenizer_dir, tracker)
        walls.lap("saving")
        final["phases_s"] = walls.said(progress)
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


def settle_precision(cfg: TrainConfig) -> tuple[TrainConfig, precision.Precision]:
    """`cfg` with `dtype` and `param_dtype` `auto` resolved for this process's devices, and
    the choice; bfloat16 set explicitly where the device has no bfloat16 arithmetic is kept,
    with a warning that says what it costs here (process 0 alone measures and says it)."""
    device = jax.devices()[0]
    explicit = cfg.dtype == "bfloat16"
    cfg, chosen = precision.settle(cfg, device.platform, device)
    if explicit and not chosen.native and jax.process_index() == 0:
        warning = precision.slow_bfloat16_warning(device.platform)
        print(f"kubejax trainer: warning: {warning}", file=sys.stderr, flush=True)
    return cfg, chosen


def run_choices(cfg: TrainConfig, data: TrainData, model) -> list[str]:
    """What the run chose for itself, for its first line: its length buckets, the model's
    attention, scanned layers and remat."""
    choices = [data.buckets.describe(packing=data.packed is not None)] if data.buckets else []
    return choices + model_choices(cfg, model, data.total_steps)


class Walls:
    """Each phase's wall time, from the run's start, said at its end."""

    def __init__(self):
        self.t = time.monotonic()
        self.phases: dict[str, float] = {}

    def lap(self, phase: str) -> None:
        now = time.monotonic()
        self.phases[phase], self.t = now - self.t, now

    def said(self, progress: Progress) -> dict[str, float]:
        rounded = {k: round(v, 1) for k, v in self.phases.items()}
        progress.say(
            "wall: "
            + ", ".join(f"{k} {v:.1f} s" for k, v in rounded.items())
            + " (training includes the first step's compile)"
        )
        return rounded


def _due(cfg: TrainConfig, done: int, total: int) -> tuple[bool, bool]:
    """Whether an evaluation (not the last step's: the end evaluates) and a checkpoint are due
    after `done` steps."""
    eval_due = bool(cfg.eval_every) and done % cfg.eval_every == 0 and done != total
    return eval_due, bool(cfg.checkpoint_every) and done % cfg.checkpoint_every == 0


def _first_said(progress: Progress, train_step, *args) -> None:
    """After the first step: the compilation cache's lookups and, on an accelerator, what the
    compiled step needs (`step_program`)."""
    progress.cache = lookups_said()
    if jax.devices()[0].platform != "cpu":
        progress.program(step_program(train_step, *args))


def step_program(train_step, *args) -> dict:
    """What the compiled train step needs on each device, by XLA's memory analysis: its
    arguments, outputs (less those that reuse a donated argument's memory) and temporaries.
    The device's own `peak_bytes_in_use` counts the arrays alone, not a running program's
    temporaries (on a TPU, the activations of a step: bench/NOTES.md, attempt T1). The step
    is compiled again from its lowering, which the compilation cache answers."""
    fn, kwargs = getattr(train_step, "func", train_step), getattr(train_step, "keywords", {})
    memory = fn.lower(*args, **kwargs).compile().memory_analysis()
    figures = {
        "arguments": memory.argument_size_in_bytes,
        "outputs": memory.output_size_in_bytes - memory.alias_size_in_bytes,
        "temporaries": memory.temp_size_in_bytes,
    }
    return {**figures, "total": sum(figures.values())}


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
