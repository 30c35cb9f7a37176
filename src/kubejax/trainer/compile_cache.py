"""JAX's persistent compilation cache: where kubejax keeps it, and what it keeps.

A pipeline's trainer pods share one in its workspace (`launchers.common`); local runs, and the
trainer, the evaluation and the served model wherever they start without one, use the user's
cache folder (`user_dir`). JAX is imported where it is used, so that `user_dir` costs a local
run's parent process no JAX start.
"""

from __future__ import annotations

import os
from pathlib import Path


def user_dir() -> Path:
    """The user's compilation cache: $KUBEJAX_CACHE_DIR/jax, else $XDG_CACHE_HOME/kubejax/jax,
    else ~/.cache/kubejax/jax (beside pip's and Hugging Face's caches)."""
    root = os.environ.get("KUBEJAX_CACHE_DIR") or (
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kubejax"
    )
    return Path(root) / "jax"


def use_user_dir() -> Path | None:
    """Keep this process's compiled programs, every one (`cache_every_program`), in the cache
    JAX was given (JAX_COMPILATION_CACHE_DIR), else in `user_dir` where it can be written;
    returns the folder (None: no cache). JAX reads the folder at its first compile: call this
    before.

    Without it, every process that set no cache compiled afresh: each trial of `kubejax tune`
    or job of `kubejax launch`, each `kubejax evaluate`, and each process serving the MLflow
    model, where a request shape is a program (MiniLM, 2 cores: 0.93-1.40 s a first request,
    0.26-0.47 s from this cache; bench/NOTES.md, attempts 59 and 60).
    """
    import jax

    folder = jax.config.jax_compilation_cache_dir
    if not folder:
        try:
            path = user_dir()
            path.mkdir(parents=True, exist_ok=True)
        except (OSError, RuntimeError):  # RuntimeError: no home folder to be found
            return None
        if not os.access(path, os.W_OK | os.X_OK):  # a read-only home: JAX would warn a program
            return None
        jax.config.update("jax_compilation_cache_dir", str(path))
        folder = str(path)
    cache_every_program()
    count_lookups()
    return Path(folder)


def cache_every_program() -> None:
    """Keep every compiled program in JAX's persistent cache (when one is set), not only those
    that took over 1 s: the dozen small ones (optimizer init, key folding) cost each sweep
    trial 1 s, and an evaluation step compiles in 0.6 s per length bucket. A
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS the user set is kept. Every CPU process of a
    job writes its own programs (`_every_cpu_process_writes_the_cache`)."""
    import jax

    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    _every_cpu_process_writes_the_cache()


def _every_cpu_process_writes_the_cache() -> None:
    """Let processes other than 0 write their CPU programs to the persistent cache too.

    JAX writes entries from process 0 alone, so that processes do not write one key at once.
    On CPU the keys are each process's own (its device ids are in them), so process 1 never
    found an entry: on a warm cache it still compiled every program while process 0 waited
    for it at the first all-reduce. A 2-worker MiniLM job of 2 steps on 2 cores, warm cache:
    30-34 s -> 11.4-11.8 s (bench/NOTES.md, attempt 31). No other process of the job writes
    these keys. (JAX's private `_cache_write`, whose arguments changed between JAX 0.10 and
    0.11: they are read by name, and JAX's own is kept where they are not the ones known;
    test_two_processes_equal_one_process checks that a second job finds every program in the
    cache on both workers.)
    """
    import inspect
    import warnings

    import jax
    from jax._src import compilation_cache, compiler
    from jax._src import distributed as jax_distributed

    write = compiler._cache_write
    signature = inspect.signature(write)
    known = _CACHE_WRITE_ARGS.issubset(signature.parameters)
    if getattr(write, "every_cpu_process", False) or not known:
        return

    def cache_write(*args, **kwargs):
        a = signature.bind(*args, **kwargs).arguments
        process = jax_distributed.global_state.process_id
        if process == 0 or a["backend"].platform != "cpu":
            return write(*args, **kwargs)
        # What JAX does on process 0 (JAX 0.10 also skips programs with host callbacks).
        seconds = a["compile_time_secs"]
        if a.get("callbacks") or seconds < jax.config.jax_persistent_cache_min_compile_time_secs:
            return None
        try:
            compilation_cache.put_executable_and_time(
                a["cache_key"], a["module_name"], a["executable"], a["backend"], int(seconds)
            )
        except Exception as ex:  # as JAX's own write: a cache that fails is only slower
            warnings.warn(
                f"Error writing persistent compilation cache entry for {a['module_name']!r}: "
                f"{type(ex).__name__}: {ex}",
                stacklevel=2,
            )
        return None

    cache_write.every_cpu_process = True
    compiler._cache_write = cache_write


#: The arguments of JAX's `_cache_write` that `_every_cpu_process_writes_the_cache` reads.
_CACHE_WRITE_ARGS = {"cache_key", "compile_time_secs", "module_name", "backend", "executable"}


#: Programs this process found in the persistent cache, and those it compiled (JAX's
#: monitoring events, counted from `count_lookups` on).
LOOKUPS = {"hits": 0, "misses": 0}
_EVENTS = {
    "/jax/compilation_cache/cache_hits": "hits",
    "/jax/compilation_cache/cache_misses": "misses",
}


def count_lookups() -> None:
    """Count this process's persistent-cache hits and misses in `LOOKUPS` (once): a sweep
    trial whose programs are another trial's says so after its first step."""
    import jax

    if getattr(count_lookups, "listening", False):
        return

    def listen(event: str, **_) -> None:
        if event in _EVENTS:
            LOOKUPS[_EVENTS[event]] += 1

    jax.monitoring.register_event_listener(listen)
    count_lookups.listening = True


def lookups_said() -> str:
    """The counts so far, as the trainer says them: "compilation cache: 3 hits, 1 miss"."""
    if not getattr(count_lookups, "listening", False):
        return "no compilation cache"
    hits, misses = LOOKUPS["hits"], LOOKUPS["misses"]
    if not hits + misses:
        return "compilation cache: no lookup"
    return f"compilation cache: {hits} hit{'s' * (hits != 1)}, {misses} miss{'es' * (misses != 1)}"
