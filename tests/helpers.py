"""Plain helpers the tests import (fixtures stay in conftest.py).

The numeric comparisons here hold on every CPU the suite may meet (Intel or AMD, with or
without AVX-512, one or two cores): XLA picks different kernels on each, so two mathematically
equal computations agree only up to float32 rounding, scaled by the size of what is compared.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

#: Parameters whose gradient is zero by symmetry: a key bias adds q·b to every score of a
#: query, and softmax is invariant to a per-query shift. What moves them is rounding noise
#: (amplified by Adam's normalisation), whose size depends on the CPU's kernels.
ZERO_GRADIENT_BY_SYMMETRY = ("attention.self.key.bias",)


@contextlib.contextmanager
def beside(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 600):
    """Run `cmd` in the background while the block runs, then wait for it and check that it
    succeeded (killed if the block fails). Two independent trainer runs of a test overlap this
    way: XLA compiles each program on one core, so on the suite's 2 cores the pair takes
    little more than the longer one."""
    proc = _start(cmd, env)
    try:
        yield proc
    except BaseException:
        proc.kill()
        proc.communicate()
        raise
    _finish(cmd, proc, timeout)


def side_by_side(cmds: list[list[str]], env: dict[str, str], timeout: float = 600) -> list[str]:
    """Run the commands at once and return each one's standard output, checking that each
    succeeded: independent programs to compile, each on a core of its own."""
    procs = [_start(cmd, env) for cmd in cmds]
    return [_finish(cmd, proc, timeout) for cmd, proc in zip(cmds, procs, strict=True)]


def _start(cmd: list[str], env: dict[str, str] | None) -> subprocess.Popen:
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(cmd: list[str], proc: subprocess.Popen, timeout: float) -> str:
    """Wait for `proc`, check that it succeeded, return its standard output."""
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"{cmd}: exit {proc.returncode}\n{out[-2000:]}\n{err[-3000:]}"
    return out


_COMPILED_CALLS: dict = {}


def compiled_call(module, *args, **kwargs):
    """`module(*args, **kwargs)` as one compiled program, the way the trainer runs a model.
    Called eagerly, a model runs op by op and each operation compiles on its own for each new
    shape (MiniLM's first call: 3.7 s against 1.3 s jitted, here). Keyword arguments that are
    Python scalars or None (`deterministic`, `cls_only`) are static; the rest are traced."""
    from flax import nnx

    static = {k: v for k, v in kwargs.items() if v is None or isinstance(v, bool | int | str)}
    arrays = {k: v for k, v in kwargs.items() if k not in static}
    key = tuple(sorted(static.items()))
    if key not in _COMPILED_CALLS:
        _COMPILED_CALLS[key] = nnx.jit(lambda m, a, kw: m(*a, **kw, **static))
    return _COMPILED_CALLS[key](module, args, arrays)


def env_with_no_jax_cache(cache_home: Path) -> dict[str, str]:
    """This environment without the suite's JAX cache (tests/conftest.py) or a kubejax cache
    folder, with XDG_CACHE_HOME at `cache_home`: a process started as a user would start it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMP", "JAX_PERS"))}
    env.pop("KUBEJAX_CACHE_DIR", None)
    return env | {"XDG_CACHE_HOME": str(cache_home)}


def trainer_cmd(*args: str) -> list[str]:
    """The command line of the trainer in this interpreter."""
    return [sys.executable, "-m", "kubejax.trainer", *args]


def tiny_args(model_dir: Path, data_dir: Path, out_dir: Path, **overrides) -> list[str]:
    """Trainer flags for a short run of the tiny model."""
    flags = {
        "model": str(model_dir),
        "data_dir": str(data_dir),
        "output_dir": str(out_dir),
        "global_batch_size": 8,
        "max_steps": 10,
        "learning_rate": 1e-3,
        "log_every": 1,
        "max_length": 64,
        # One padded length: each distinct program compiles once, not once a bucket (a cold
        # 2-worker run of the tiny model: 23-27 s with buckets of 32, 16-18 s with 64).
        "bucket_multiple": 64,
        "eval_batch_size": 32,
        "max_eval_examples": 64,
        "dropout": 0.0,
        "mlflow_tracking_uri": "",
    }
    flags.update(overrides)
    out = []
    for k, v in flags.items():
        name = k.replace("_", "-")
        out += (
            ([f"--{name}"] if v else [f"--no-{name}"])
            if isinstance(v, bool)
            else [f"--{name}", str(v)]
        )
    return out


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assert_close_to_scale(actual, expected, rel: float, what: str = "") -> None:
    """max |actual - expected| ≤ rel · max |expected|: a tolerance relative to the tensor's own
    magnitude, so it means the same for values of size 0.01 and of size 10."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    scale = float(np.abs(expected).max()) if expected.size else 0.0
    diff = float(np.abs(actual - expected).max()) if expected.size else 0.0
    assert diff <= rel * scale, f"{what}: max |diff| {diff:.3g} > {rel:g} × scale {scale:.3g}"


def assert_same_training(before: dict, a: dict, b: dict, rel: float) -> None:
    """Two training runs from the same `before` parameters made the same updates.

    Each tensor's update (after - before) is compared relative to that update's own size: the
    parameters themselves are large next to a few steps of updates, so a tolerance on them
    would hide a wrong update. Tensors with a zero gradient by symmetry are checked instead to
    have barely moved in either run (below 1 % of the typical update), whatever the noise.
    """
    assert a.keys() == b.keys() == before.keys()
    moved = [float(np.abs(a[k] - before[k]).max()) for k in a]
    typical = float(np.median(moved))
    assert typical > 0, "training did not change the parameters"
    for k in a:
        ua = np.asarray(a[k], np.float64) - before[k]
        ub = np.asarray(b[k], np.float64) - before[k]
        if k.endswith(ZERO_GRADIENT_BY_SYMMETRY):
            for u in (ua, ub):
                assert float(np.abs(u).max()) <= 0.01 * typical, k
            continue
        assert_close_to_scale(ub, ua, rel, what=k)


def assert_self_contained_report(text: str, figures: int) -> None:
    """An HTML report as the KFP UI's sandboxed viewer needs it: at least `figures` inline SVG
    figures, no script, and no reference to anything outside the file (the only URLs are
    XML namespace names, which are never fetched)."""
    import re

    assert text.count("<svg") >= figures, text.count("<svg")
    assert "<script" not in text.lower()
    outside = re.sub(r'xmlns(:\w+)?="[^"]*"', "", text)
    assert "http" not in outside and "src=" not in outside
