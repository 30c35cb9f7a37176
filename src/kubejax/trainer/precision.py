"""Precision chosen by the machine: `dtype` and `param_dtype` set to `auto`.

bfloat16 halves a step's memory traffic and, where the hardware multiplies bfloat16 natively,
runs its products several times faster than float32; where it does not, XLA emulates them and
the step runs slower than in float32 (an AVX2-only EPYC: 0.6 examples/s of a 270M decoder's
LoRA in bfloat16 against 2.0 in float32, bench/NOTES.md). So `auto` takes bfloat16 where the
device computes it natively and float32 elsewhere:

- a TPU (every generation computes bfloat16 in its matrix units);
- an NVIDIA GPU of compute capability 8.0 or later (Ampere, Ada, Hopper, Blackwell); one whose
  capability is not known here (the plan of a job for a cluster's GPUs) is taken for one;
- a CPU with AMX (`amx_bf16`) or AVX-512 BF16 (`avx512_bf16`) in its flags.

`param_dtype` `auto` holds the weights in the compute dtype under LoRA and QLoRA, whose base
is frozen (no update is lost to bfloat16's 8-bit mantissa), and in float32 for full
fine-tuning. `KUBEJAX_AUTO_DTYPE` (float32 or bfloat16) pins what `auto` takes, for
reproducible figures across machines; an explicit setting always wins.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path

AUTO = "auto"
DTYPES = ("float32", "bfloat16")
#: The environment variable that pins what `auto` resolves to.
PIN_ENV = "KUBEJAX_AUTO_DTYPE"
#: CPU flags (Linux's /proc/cpuinfo names) of native bfloat16 products, in the order named.
CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
#: NVIDIA's first compute capability with bfloat16 tensor cores (Ampere).
GPU_BF16_CAPABILITY = 8.0


class PrecisionError(ValueError):
    """A dtype setting that is neither float32, bfloat16 nor auto."""


@dataclasses.dataclass(frozen=True)
class Precision:
    """The run's dtypes and why: `native` whether the device multiplies bfloat16 natively."""

    dtype: str
    param_dtype: str
    native: bool
    why: str

    def describe(self) -> str:
        """One piece of the trainer's first line."""
        return f"dtype {self.dtype}, weights {self.param_dtype} ({self.why})"


@functools.cache
def cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """This machine's CPU flags (empty where /proc/cpuinfo is not readable)."""
    try:
        text = Path(path).read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def native_bfloat16(
    platform: str, device=None, flags: frozenset[str] | None = None
) -> tuple[bool, str]:
    """Whether `platform`'s device (`device`, a JAX device, when at hand) multiplies bfloat16
    natively, and the reason in a few words. `flags`: a CPU's flags (default: this machine's;
    empty for a CPU whose model is not known, whose answer is then float32)."""
    if platform == "tpu":
        return True, "a TPU multiplies bfloat16 natively"
    if platform == "gpu":
        capability = getattr(device, "compute_capability", None)
        if capability is None:
            return True, "an NVIDIA GPU, taken for Ampere or later"
        native = float(capability) >= GPU_BF16_CAPABILITY
        relation = "≥" if native else "<"
        return native, f"GPU compute capability {capability} {relation} {GPU_BF16_CAPABILITY}"
    found = [f for f in CPU_BF16_FLAGS if f in (cpu_flags() if flags is None else flags)]
    if found:
        return True, f"{found[0]} on this CPU"
    return False, "this CPU has no bfloat16 arithmetic (neither AMX nor AVX512_BF16)"


def check(setting: str, value: str) -> None:
    """Refuse a dtype setting that is not float32, bfloat16 or auto, naming it."""
    if value not in (*DTYPES, AUTO):
        raise PrecisionError(f"{setting}: {value!r} is not one of float32, bfloat16, auto")


def choose(
    dtype: str,
    param_dtype: str,
    peft: str,
    platform: str,
    device=None,
    flags: frozenset[str] | None = None,
) -> Precision:
    """The run's dtypes with `auto` resolved for `platform` (see the module's docstring)."""
    check("dtype", dtype)
    check("param_dtype", param_dtype)
    native, why = native_bfloat16(platform, device, flags)
    pinned = os.environ.get(PIN_ENV, "")
    if pinned:
        if pinned not in DTYPES:
            raise PrecisionError(f"{PIN_ENV}: {pinned!r} is not one of float32, bfloat16")
        chosen, why = pinned, f"{PIN_ENV}={pinned}"
    else:
        chosen = "bfloat16" if native else "float32"
    compute = chosen if dtype == AUTO else dtype
    # A frozen base loses nothing to bfloat16; trained weights would lose small updates.
    frozen = compute if peft != "none" else "float32"
    weights = frozen if param_dtype == AUTO else param_dtype
    why = "as set" if AUTO not in (dtype, param_dtype) else f"auto: {why}"
    return Precision(compute, weights, native, why)


def settle(cfg, platform: str, device=None, flags: frozenset[str] | None = None):
    """`cfg` (a TrainConfig) with `dtype` and `param_dtype` resolved (a copy where either was
    `auto`; `cfg` itself otherwise), and the Precision chosen."""
    chosen = choose(cfg.dtype, cfg.param_dtype, cfg.peft, platform, device, flags)
    if (cfg.dtype, cfg.param_dtype) == (chosen.dtype, chosen.param_dtype):
        return cfg, chosen
    return dataclasses.replace(cfg, dtype=chosen.dtype, param_dtype=chosen.param_dtype), chosen


def here(cfg):
    """`cfg` with `auto` dtypes resolved for this process's first device (`cfg` itself where
    nothing is `auto`): for the model-building functions a caller may reach without the
    trainer, which settles them once at its start."""
    if AUTO not in (cfg.dtype, cfg.param_dtype):
        return cfg
    import jax

    device = jax.devices()[0]
    return settle(cfg, device.platform, device)[0]


def slow_bfloat16_warning(platform: str, flags: frozenset[str] | None = None) -> str:
    """What bfloat16 costs on a device without bfloat16 arithmetic, measured now (one product
    of each dtype for half a second), for the warning given when a run sets it explicitly."""
    from kubejax.monitoring import matmul_gflops

    f32, bf16 = matmul_gflops("float32"), matmul_gflops("bfloat16")
    _, why = native_bfloat16(platform, flags=flags)
    return (
        f"dtype bfloat16 on a {platform} without native bfloat16 ({why}): a bfloat16 matmul "
        f"runs at {bf16:.0f} GFLOP/s here against float32's {f32:.0f} (measured now, "
        f"{f32 / max(bf16, 1e-9):.1f}× slower); dtype auto would take float32"
    )
