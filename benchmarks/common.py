"""Shared bits of the benchmarks: the machine, a float32 matmul peak measured in the run."""

from __future__ import annotations

import os
import platform
import time


def machine() -> str:
    """One line describing this machine."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    import jax

    return f"{cpu}, {os.cpu_count()} cores, JAX {jax.__version__} on {jax.devices()[0].platform}"


def matmul_peak_gflops(n: int = 2048, repeats: int = 10) -> float:
    """float32 n×n matmul throughput through XLA, best of `repeats`."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9
