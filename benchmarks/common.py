"""Shared bits of the benchmarks: the machine, a float32 matmul peak measured in the run, and
running the trainer (or one side of a comparison) as a process of its own."""

from __future__ import annotations

import atexit
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def scratch_dir(prefix: str) -> Path:
    """A fresh temporary folder removed when the benchmark exits, errors included: a `make bench`
    writes several GB of datasets, checkpoints and caches that nothing reads afterwards."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


#: CPU features that set the products' speed: AVX-512, its bfloat16 dot products, AMX's tiles.
MATRIX_FLAGS = ("avx512f", "avx512_bf16", "amx_bf16")


def describe_cpu(cpuinfo: str) -> str:
    """The first CPU of /proc/cpuinfo's text: its model name, family and model numbers and the
    MATRIX_FLAGS it has. One name ("Intel(R) Xeon(R) Processor") covered CPUs whose float32
    matmul peaks differed 2.3× (bench/NOTES.md, run T), so the name alone does not say which
    CPU a figure came from."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        key = key.strip()
        if sep and key in ("model name", "cpu family", "model", "flags"):
            fields.setdefault(key, value.strip())
    name = fields.get("model name") or platform.processor() or platform.machine()
    details = []
    if "cpu family" in fields and "model" in fields:
        details.append(f"family {fields['cpu family']} model {fields['model']}")
    flags = set(fields.get("flags", "").split())
    details += [flag for flag in MATRIX_FLAGS if flag in flags]
    return f"{name} ({', '.join(details)})" if details else name


def machine() -> str:
    """One line describing this machine: the CPU (`describe_cpu`), cores, JAX and its backend."""
    try:
        cpu = describe_cpu(Path("/proc/cpuinfo").read_text())
    except OSError:
        cpu = describe_cpu("")
    import jax

    return f"{cpu}, {os.cpu_count()} cores, JAX {jax.__version__} on {jax.devices()[0].platform}"


def matmul_peak_gflops(n: int = 2048, repeats: int = 10, dtype: str = "float32") -> float:
    """n×n matmul throughput through XLA with `dtype` operands summed in float32 (as the
    model's products are, `kubejax.models.kernels.product`), best of `repeats`."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    f = jax.jit(lambda x: jnp.matmul(x, x, preferred_element_type=jnp.float32))
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


def torch_matmul_gflops(n: int = 2048, repeats: int = 10, dtype: str = "float32") -> float:
    """n×n matmul throughput through torch on CPU (oneDNN) in `dtype`, best of `repeats`."""
    import torch

    torch.set_num_threads(os.cpu_count())
    a = torch.randn(n, n, dtype=getattr(torch, dtype))
    torch.mm(a, a)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        torch.mm(a, a)
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


def cpu_peak_gflops(dtype: str = "float32", n: int = 2048, repeats: int = 20) -> float:
    """The machine's matmul peak in `dtype`: the faster of XLA's (`matmul_peak_gflops`) and
    torch's n×n product. XLA's bfloat16 product, measured before each bfloat16 round of a run,
    gave a median of 263 GFLOP/s there, below what the trainer's step ran at (MFU 1.2;
    bench/NOTES.md, attempt 39); alone it read 375-387 on the Zen 4 CPU, torch's 421-434."""
    return max(matmul_peak_gflops(n, repeats, dtype), torch_matmul_gflops(n, repeats, dtype))


def model_flops_per_token(hidden: int, layers: int, intermediate: int, seq: int) -> float:
    """Training FLOPs per token by the standard count, the same for every side: 6·N (N the
    non-embedding weights) + 12·L·H·T for attention."""
    n_params = layers * (4 * hidden * hidden + 2 * hidden * intermediate)
    return 6 * n_params + 12 * layers * hidden * seq


#: The trainer as jobs run it.
TRAINER = [sys.executable, "-m", "kubejax.trainer"]


def job_env(**extra: str) -> dict[str, str]:
    """What kubejax adds to the environment of its trainer processes (`worker_env` without a
    workspace or tracking server: glibc's malloc tunable), and `extra`."""
    from kubejax.launchers.common import worker_env

    return {**worker_env("", ""), **extra}


def trainer_env(**extra: str) -> dict[str, str]:
    """This process's environment as a job gives it to a trainer process (`job_env`)."""
    return {**os.environ, **job_env(**extra)}


def flags(**settings) -> list[str]:
    """Trainer command-line flags from settings."""
    return [a for k, v in settings.items() for a in ("--" + k.replace("_", "-"), str(v))]


def median_step_rate(metrics: dict) -> float:
    """Examples/s of the trainer's median step after the first (from its per-step log): a step
    that the machine's neighbours slowed down moves a mean over a dozen steps by several
    percent (bench/NOTES.md, attempt 15)."""
    return statistics.median(row["examples_per_s"] for row in metrics["train"][1:])


def dp_figures(pairs: list[tuple[dict, dict]]) -> dict:
    """The data-parallel figures from alternated rounds of (1 process × 1 core, 2 processes)
    trainer metrics: each side's median-step rate over the rounds, and the efficiency as the
    median of the rounds' own (one round's figure moved 0.74-0.85 between runs of the same
    code on one machine: bench/NOTES.md, attempt 51)."""
    a = [median_step_rate(one) for one, _ in pairs]
    b = [median_step_rate(two) for _, two in pairs]
    means = [
        two["final"]["examples_per_s"] / (2 * one["final"]["examples_per_s"]) for one, two in pairs
    ]
    rounds = [y / (2 * x) for x, y in zip(a, b, strict=True)]
    return {
        "dp_one_process_one_core_examples_per_s": round(statistics.median(a), 2),
        "dp_two_processes_examples_per_s": round(statistics.median(b), 2),
        "dp_scaling_efficiency": round(statistics.median(rounds), 3),
        "dp_scaling_efficiency_rounds": [round(r, 3) for r in rounds],
        "dp_scaling_efficiency_mean_of_steps": round(statistics.median(means), 3),
    }


def run_trainer(args: list[str], env: dict, prefix: list[str] = ()) -> tuple[dict, list[tuple]]:
    """Run the trainer; its metrics.json and its stdout lines with their arrival times."""
    proc = subprocess.Popen(
        [*prefix, *TRAINER, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    lines = [(time.monotonic(), line) for line in proc.stdout]
    if proc.wait() != 0:
        raise RuntimeError("".join(line for _, line in lines[-30:]))
    out = Path(args[args.index("--output-dir") + 1])
    return json.loads((out / "metrics.json").read_text()), lines


def run_json(args: list[str], env: dict | None = None) -> dict:
    """Run `python ARGS` (one side of a comparison, in a process of its own) and return the
    JSON object on its last line of output."""
    proc = subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


#: A tokenizer's own files (no config.json).
TOKENIZER_FILES = (
    "tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json"
)  # fmt: skip


def tokenizer_alone(tokenizer: str | Path, work: Path) -> Path:
    """A copy of a tokenizer folder's tokenizer files without its model's config.json, in
    `work`: the benchmarks' scratch decoders read its ids at lengths its own model's positions
    do not reach (MiniLM's 512), which `kubejax prepare` checks a folder's config against."""
    folder = work / "tokenizer"
    if not folder.is_dir():
        folder.mkdir(parents=True)
        for name in TOKENIZER_FILES:
            if (Path(tokenizer) / name).is_file():
                shutil.copy(Path(tokenizer) / name, folder / name)
    return folder
