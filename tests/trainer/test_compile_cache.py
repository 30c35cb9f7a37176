"""JAX's persistent compilation cache: the user's folder where none is set, and the hook that
lets every CPU process write to it across JAX's `_cache_write` signatures."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from types import SimpleNamespace

import jax
import pytest
from jax._src import compilation_cache, compiler
from jax._src import distributed as jax_distributed

from kubejax.trainer import compile_cache
from tests.helpers import env_with_no_jax_cache, tiny_args, trainer_cmd


def _jax_0_10(cache_key, compile_time_secs, module_name, backend, executable, callbacks):
    return ("jax", cache_key)


def _jax_0_11(cache_key: str, compile_time_secs: float, module_name: str, backend, executable):
    return ("jax", cache_key)


def _unknown(key, seconds, backend):
    return ("jax", key)


@pytest.fixture
def hooked(monkeypatch):
    """Install the hook over a stand-in `_cache_write`; record what it puts in the cache."""
    threshold = "jax_persistent_cache_min_compile_time_secs"
    before = getattr(jax.config, threshold)
    jax.config.update(threshold, 1.0)
    puts = []
    monkeypatch.setattr(
        compilation_cache, "put_executable_and_time", lambda *a: puts.append(a), raising=True
    )

    def install(original, process_id):
        monkeypatch.setattr(compiler, "_cache_write", original)
        monkeypatch.setattr(jax_distributed.global_state, "process_id", process_id)
        compile_cache._every_cpu_process_writes_the_cache()
        return compiler._cache_write, puts

    yield install
    jax.config.update(threshold, before)


@pytest.mark.parametrize("original", [_jax_0_10, _jax_0_11], ids=["jax-0.10", "jax-0.11"])
def test_a_second_cpu_process_writes_its_programs_under_either_jax_signature(hooked, original):
    write, puts = hooked(original, process_id=1)
    cpu, gpu = SimpleNamespace(platform="cpu"), SimpleNamespace(platform="gpu")
    extra = {"callbacks": []} if original is _jax_0_10 else {}
    assert write("k1", 2.5, "jit_step", cpu, "exe", **extra) is None
    assert puts == [("k1", "jit_step", "exe", cpu, 2)]
    # Under the persistent cache's threshold (1 s here), nothing is written.
    assert write("k0", 0.5, "jit_small", cpu, "exe", **extra) is None
    assert len(puts) == 1
    # Other backends keep JAX's own write, whatever the process.
    assert write("k2", 2.5, "jit_step", gpu, "exe", **extra) == ("jax", "k2")
    assert len(puts) == 1


def test_process_0_keeps_jax_s_own_write(hooked):
    write, puts = hooked(_jax_0_11, process_id=0)
    assert write("k", 1.0, "m", SimpleNamespace(platform="cpu"), "exe") == ("jax", "k")
    assert puts == []


def test_a_jax_whose_cache_write_takes_other_arguments_is_left_alone(hooked):
    write, _ = hooked(_unknown, process_id=1)
    assert write is _unknown


def test_compilation_cache_lives_in_the_user_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("KUBEJAX_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.user_dir() == tmp_path / "xdg" / "kubejax" / "jax"
    monkeypatch.setenv("KUBEJAX_CACHE_DIR", str(tmp_path / "mine"))
    assert compile_cache.user_dir() == tmp_path / "mine" / "jax"


@pytest.mark.slow
def test_a_trainer_started_without_a_cache_keeps_its_programs_in_the_user_cache(
    tiny_model_dir, prepared, tmp_path
):
    # `kubejax tune` and `kubejax launch` start trainers with no cache of their own: each trial
    # compiled every program afresh.
    env = env_with_no_jax_cache(tmp_path / "xdg")
    args = tiny_args(tiny_model_dir, prepared, tmp_path / "out", max_steps=1)
    run = subprocess.run(trainer_cmd(*args), env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    entries = list((tmp_path / "xdg" / "kubejax" / "jax").iterdir())
    assert len(entries) >= 3  # the train and evaluation steps, the optimizer's set-up
    assert re.search(r"first step .*compilation cache: \d+ hits?, [1-9]\d* miss", run.stdout)
    # A sweep's next trial (another learning rate: the same programs) finds them all.
    args = tiny_args(tiny_model_dir, prepared, tmp_path / "out2", max_steps=1, learning_rate=1e-3)
    run = subprocess.run(trainer_cmd(*args), env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert re.search(r"first step .*compilation cache: [1-9]\d* hits?, 0 misses\)", run.stdout)


def test_a_cache_the_user_set_is_kept_and_one_that_cannot_be_made_is_skipped(tmp_path, monkeypatch):
    given = jax.config.jax_compilation_cache_dir  # the suite's (tests/conftest.py)
    assert given and compile_cache.use_user_dir() == Path(given)
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("KUBEJAX_CACHE_DIR", str(tmp_path / "a-file"))
    try:
        jax.config.update("jax_compilation_cache_dir", None)
        assert compile_cache.use_user_dir() is None
        assert jax.config.jax_compilation_cache_dir is None
    finally:
        jax.config.update("jax_compilation_cache_dir", given)
