"""Orbax checkpoints in `<output_dir>/checkpoints`.

Restore order: the latest complete checkpoint of this output folder, else a fresh start.
Orbax writes each step to a temporary folder and renames it when complete, so a worker killed
mid-save, or a full disk, leaves no checkpoint that looks valid: the previous one stays the
latest, and the next run removes the partial folder. A failed write stops the run with
`CheckpointWriteError`, naming the step, the folder and the cause.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from kubejax.errors import KubejaxError

_OS_CAUSE = re.compile(
    r"No space left on device|File too large|Disk quota exceeded|Read-only file system"
    r"|Permission denied|Input/output error"
)


class CheckpointWriteError(KubejaxError, OSError):
    """A checkpoint could not be written (disk full, quota, permissions)."""


class Checkpointer:
    """Save and restore (params, optimizer state) plus JSON metadata, on every process."""

    def __init__(self, output_dir: str | Path, keep: int):
        self.directory = Path(output_dir).resolve() / "checkpoints"
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, create=True, cleanup_tmp_directories=True
            ),
        )
        self.saving: int | None = None  # the step whose asynchronous write may still fail

    def latest_step(self) -> int | None:
        """The step of the newest complete checkpoint, if any."""
        return self.manager.latest_step()

    def set_aside(self, steps: list[int]) -> Path:
        """Move unreadable checkpoints out of the way (kept for a look, never deleted), so the
        run can save those steps again; every process calls it, process 0 moves."""
        aside = self.directory.parent / "checkpoints-unreadable"
        if jax.process_index() == 0:
            aside.mkdir(exist_ok=True)
            for step in steps:
                target = aside / f"{step}-{int(time.time())}"
                (self.directory / str(step)).rename(target)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("kubejax-checkpoints-set-aside")
        self.manager.reload()
        return aside

    def all_steps(self) -> list[int]:
        """Every checkpoint step present, oldest first."""
        return sorted(self.manager.all_steps())

    def save(self, step: int, state: dict, meta: dict) -> None:
        """Start saving `state` at `step` (asynchronously; `wait` before exit). A failure of
        the save before it surfaces here or in `wait`."""
        with self._reporting():
            self.manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
                ),
                force=True,
            )
        self.saving = step

    @contextlib.contextmanager
    def _reporting(self) -> Iterator[None]:
        """Turn orbax's write failure (an error from its background thread) into one line."""
        try:
            yield
        except Exception as err:
            cause = _OS_CAUSE.search(str(err))
            step, kept = self.saving, self.manager.latest_step()
            raise CheckpointWriteError(
                f"checkpoint: writing step {step} in {self.directory} failed "
                f"({cause[0] if cause else type(err).__name__}); "
                + (
                    f"the checkpoint of step {kept} is intact and a rerun resumes from it"
                    if kept is not None
                    else "no earlier checkpoint exists"
                )
            ) from err

    def restore(self, step: int, like: dict) -> tuple[dict, dict]:
        """Restore (state, meta) at `step` into the structure and shardings of `like`."""
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        out = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
            ),
        )
        return out["state"], out["meta"]

    def metadata(self, step: int) -> dict:
        """The JSON metadata saved with `step` (the config, the history), without the state."""
        out = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return out["meta"]

    def wait(self) -> None:
        """Block until pending saves are complete."""
        with self._reporting():
            self.manager.wait_until_finished()
        self.saving = None

    def close(self) -> None:
        """Release orbax's threads; a write failure was reported by `save` or `wait`."""
        with contextlib.suppress(Exception):
            self.manager.close()
