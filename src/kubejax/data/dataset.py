"""The input pipeline over a prepared dataset (the format is described in `prepare.py`).

Batches are planned identically on every process from the seed, the epoch and the token lengths,
so all processes step in lockstep with the same padded shape; each process then gathers only its
share of every global batch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kubejax.errors import KubejaxError

METADATA_FILE = "metadata.json"
#: The bucket_multiple where none is chosen (serving, the prepare report's marks): padded
#: lengths are multiples of it. The trainer chooses its own by platform by default.
DEFAULT_BUCKET_MULTIPLE = 32

#: Evaluation packs reviews of at most this many tokens several to a row of this length.
#: MiniLM's evaluation of Yelp-like lengths (up to 512) against no packing: rows of 128 +8 %,
#: 256 +17-19 %, 512 -20 % (a long row's attention costs more than the padding it saves;
#: bench/NOTES.md, attempt 53).
DEFAULT_PACK_LENGTH = 256

#: Batches are formed from windows of this many batches sorted by length (length grouping).
_SORT_WINDOW = 64


class DatasetError(KubejaxError, ValueError):
    """A prepared dataset that cannot be used; the message names the setting."""


@dataclass
class TokenizedSplit:
    """One split in memory: ragged token ids as flat values + offsets, labels, lengths."""

    values: np.ndarray  # int32 [total tokens]
    offsets: np.ndarray  # int64 [rows + 1]
    labels: np.ndarray  # int32 [rows]
    texts: list[str] | None = None

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def __len__(self) -> int:
        return len(self.labels)


def read_metadata(data_dir: str | Path) -> dict:
    """The dataset's metadata.json."""
    path = Path(data_dir) / METADATA_FILE
    if not path.is_file():
        raise DatasetError(f"data_dir: {data_dir} is not a prepared dataset (no {METADATA_FILE})")
    return json.loads(path.read_text())


def load_split(data_dir: str | Path, split: str, *, with_text: bool = False) -> TokenizedSplit:
    """Load one split of a prepared dataset into NumPy arrays."""
    path = Path(data_dir) / split
    if not path.is_dir():
        have = sorted(
            d.name for d in Path(data_dir).iterdir() if (d / "dataset_info.json").exists()
        )
        raise DatasetError(
            f"split: {split!r} is not a split of {data_dir} (it has {', '.join(have) or 'none'})"
        )
    try:
        table = _read_saved_split(path)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise DatasetError(
            f"data_dir: the {split!r} split of {data_dir} is empty or unreadable "
            f"({type(err).__name__}: {err})"
        ) from err
    if table.num_rows == 0:
        return TokenizedSplit(np.zeros(0, np.int32), np.zeros(1, np.int64), np.zeros(0, np.int32))
    ids = table.column("input_ids").combine_chunks()
    offsets = ids.offsets.to_numpy().astype(np.int64)
    values = ids.values.to_numpy().astype(np.int32)
    offsets = offsets - offsets[0]
    labels = table.column("label").to_numpy().astype(np.int32)
    texts = None
    if with_text and "text" in table.column_names:
        texts = table.column("text").to_pylist()
    return TokenizedSplit(values, offsets, labels, texts)


def _read_saved_split(path: Path):
    """The Arrow table of a split written by `datasets.Dataset.save_to_disk`: the shards named in
    its state.json, memory-mapped. Read with pyarrow alone because importing `datasets` took
    0.8 s of every sweep trial's start (bench/NOTES.md)."""
    import pyarrow as pa

    state = json.loads((path / "state.json").read_text())
    files = [path / f["filename"] for f in state["_data_files"]]
    if not files:
        raise ValueError("no data files")  # save_to_disk of a split with no rows
    return pa.concat_tables(pa.ipc.open_stream(pa.memory_map(str(f))).read_all() for f in files)


def bucket_length(max_len: int, multiple: int, cap: int) -> int:
    """The padded length for a batch whose longest row has `max_len` tokens."""
    return int(min(cap, max(multiple, -(-max_len // multiple) * multiple)))


def plan_epoch(
    lengths: np.ndarray, global_batch: int, seed: int, epoch: int, *, group_by_length: bool = True
) -> np.ndarray:
    """Row indices of every full global batch of one epoch, [batches, global_batch].

    Seeded shuffle per epoch; rows are grouped by length within windows of batches so padding
    stays small; the last partial batch is dropped so every process runs the same steps.
    """
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(lengths))
    n_batches = len(order) // global_batch
    order = order[: n_batches * global_batch]
    if group_by_length:
        window = _SORT_WINDOW * global_batch
        for start in range(0, len(order), window):
            chunk = order[start : start + window]
            order[start : start + window] = chunk[np.argsort(lengths[chunk], kind="stable")]
    batches = order.reshape(n_batches, global_batch)
    return batches[rng.permutation(n_batches)]


def gather(
    split: TokenizedSplit, rows: np.ndarray, length: int, pad_id: int = 0
) -> dict[str, np.ndarray]:
    """Padded `input_ids`, `attention_mask` and `labels` for `rows` (any leading shape)."""
    flat = rows.reshape(-1)
    starts = split.offsets[flat]
    lens = np.minimum(split.offsets[flat + 1] - starts, length)
    pos = np.arange(length)
    mask = pos[None, :] < lens[:, None]
    idx = np.where(mask, starts[:, None] + pos[None, :], 0)
    ids = np.where(mask, split.values[idx], pad_id).astype(np.int32)
    shape = (*rows.shape, length)
    return {
        "input_ids": ids.reshape(shape),
        "attention_mask": mask.astype(np.int32).reshape(shape),
        "labels": split.labels[flat].reshape(rows.shape),
    }


def train_batches(
    split: TokenizedSplit,
    *,
    global_batch: int,
    accum_steps: int,
    process_index: int,
    process_count: int,
    seed: int,
    start_step: int,
    bucket_multiple: int,
    max_length: int,
    answers: list[list[int]] | None = None,
) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
    """Endless (step, local batch) from `start_step` on; batch arrays are
    [accum_steps, micro_batch / process_count, length]. With `answers` (prompts, causal-lm)
    each row's answer follows its prompt (`with_answers`)."""
    lengths = row_lengths(split, answers)
    per_epoch = len(lengths) // global_batch
    micro = global_batch // accum_steps
    local = micro // process_count
    step = start_step
    while True:
        epoch, index = divmod(step, per_epoch)
        plan = plan_epoch(lengths, global_batch, seed, epoch)
        for rows in plan[index:]:
            length = bucket_length(int(lengths[rows].max()), bucket_multiple, max_length)
            mine = rows.reshape(accum_steps, micro)[
                :, process_index * local : (process_index + 1) * local
            ]
            batch = gather(split, mine, length)
            yield step, batch if answers is None else with_answers(batch, split, mine, answers)
            step += 1


def row_lengths(split: TokenizedSplit, answers: list[list[int]] | None = None) -> np.ndarray:
    """The tokens each row trains on: its own, and with `answers` (prompts, causal-lm) its
    label's answer after them."""
    if answers is None:
        return split.lengths
    return split.lengths + np.array([len(a) for a in answers])[split.labels]


def _padded_rows(rows: int, batch_size: int, devices: int) -> int:
    """Rows of an evaluation batch holding `rows`: a power of two per device, at most
    `batch_size`, so a short last batch keeps equal shapes without a whole batch of padding."""
    per_device = 1 << (math.ceil(rows / devices) - 1).bit_length()
    return min(batch_size, per_device * devices)


def pack_rows(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Row indices grouped into bins of at most `capacity` tokens, best-fit decreasing: rows from
    the longest, each into the fullest bin it fits (a new bin if none). Every length must be at
    most `capacity`."""
    bins: list[list[int]] = []
    free = np.zeros(capacity + 1, np.int64)  # free[c]: how many bins have c tokens left
    by_free: list[list[int]] = [[] for _ in range(capacity + 1)]
    for i in np.argsort(-lengths, kind="stable"):
        n = int(lengths[i])
        fits = np.flatnonzero(free[n:])
        if fits.size:
            room = n + int(fits[0])
            b = by_free[room].pop()
            free[room] -= 1
            bins[b].append(int(i))
        else:
            room, b = capacity, len(bins)
            bins.append([int(i)])
        free[room - n] += 1
        by_free[room - n].append(b)
    return bins


def packed_eval_batches(
    split: TokenizedSplit,
    *,
    batch_size: int,
    local_devices: int,
    bucket_multiple: int,
    max_length: int,
    pack_length: int = DEFAULT_PACK_LENGTH,
    process_index: int = 0,
    process_count: int = 1,
    limit: int = 0,
) -> Iterator[dict[str, np.ndarray]]:
    """Every row (the first `limit`, if over 0) once, with rows of at most `pack_length`
    tokens packed several to a row (`pack_rows`) and longer ones alone, as global batches of
    at most `batch_size` rows over `process_count` × `local_devices` devices; this process's
    share of each.

    A batch holds `input_ids`, `segments` (1, 2, ... for the reviews of a row, 0 for padding)
    and `positions` (each review's own, from 0) [rows, length], and per review slot
    [rows, slots]: `starts` (where its [CLS] is), `rows` (its index in `split`, -1 for an
    empty slot), `labels` and `weights` (0 for an empty slot). Batches go in length order; the
    last is padded with empty rows to a power of two per device (`_padded_rows`), so every
    device keeps equal shapes without computing a whole batch of padding for a few reviews.
    """
    n = len(split) if limit <= 0 else min(limit, len(split))
    lengths = np.minimum(split.lengths[:n], max_length)
    cap = min(pack_length, max_length)
    short = np.flatnonzero(lengths <= cap)
    units = [short[b] for b in pack_rows(lengths[short], cap)]
    units += [np.array([i]) for i in np.flatnonzero(lengths > cap)]
    totals = np.array([lengths[u].sum() for u in units])
    order = np.argsort(totals, kind="stable")
    plan = [order[start : start + batch_size] for start in range(0, len(units), batch_size)]
    padded = [bucket_length(int(totals[c].max()), bucket_multiple, max_length) for c in plan]
    # One slot count a padded length, the most any of its rows holds rounded up to a power of
    # two: one compiled program a length rather than one for each slot count (each costs a
    # trace and a cache load), and few across calls with other reviews (a served model's
    # requests). An empty slot costs one token's last layer.
    slots: dict[int, int] = {}
    for chosen, length in zip(plan, padded, strict=True):
        most = max(slots.get(length, 1), *(len(units[k]) for k in chosen))
        slots[length] = 1 << (most - 1).bit_length()
    devices = process_count * local_devices
    for chosen, length in zip(plan, padded, strict=True):
        local = _padded_rows(len(chosen), batch_size, devices) // process_count
        mine = [units[k] for k in chosen[process_index * local : (process_index + 1) * local]]
        yield _packed_batch(split, lengths, mine, local, length, slots[length])


def _packed_batch(split, lengths, units, size: int, length: int, slots: int) -> dict:
    ids = np.zeros((size, length), np.int32)
    segments, positions = np.zeros_like(ids), np.zeros_like(ids)
    starts = np.zeros((size, slots), np.int32)
    rows = np.full((size, slots), -1, np.int64)
    for r, unit in enumerate(units):
        at = 0
        for s, i in enumerate(unit):
            n, first = int(lengths[i]), int(split.offsets[i])
            ids[r, at : at + n] = split.values[first : first + n]
            segments[r, at : at + n] = s + 1
            positions[r, at : at + n] = np.arange(n)
            starts[r, s], rows[r, s] = at, i
            at += n
    return {
        "input_ids": ids,
        "segments": segments,
        "positions": positions,
        "starts": starts,
        "rows": rows,
        "labels": split.labels[np.maximum(rows, 0)],
        "weights": (rows >= 0).astype(np.float32),
    }


# ---------------------------------------------------------------------------------------------
# Prompts and answers (task=causal-lm: a split's rows are prompts, `answers` each label's
# answer tokens, `kubejax.data.prompts`)


def answer_table(answers: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Answers as a padded table [labels, longest] and their lengths [labels]."""
    lengths = np.array([len(a) for a in answers], np.int64)
    table = np.zeros((len(answers), int(lengths.max())), np.int32)
    for i, a in enumerate(answers):
        table[i, : len(a)] = a
    return table, lengths


def with_answers(batch: dict, split: TokenizedSplit, rows: np.ndarray, answers) -> dict:
    """A gathered batch of prompts (`gather`) with each row's own answer after its prompt, and
    what the loss reads: `targets` [..., longest answer] (the answer's tokens), `target_at`
    (where the token that predicts each one sits) and `target_weights` (1 for a real token)."""
    table, lengths = answer_table(answers)
    flat = rows.reshape(-1)
    ids = batch["input_ids"].reshape(len(flat), -1)
    mask = batch["attention_mask"].reshape(len(flat), -1)
    labels = split.labels[flat]
    prompt = mask.sum(-1)
    at = prompt[:, None] + np.arange(table.shape[1])[None]
    real = np.arange(table.shape[1])[None] < lengths[labels][:, None]
    r = np.repeat(np.arange(len(flat)), table.shape[1]).reshape(at.shape)
    ids[r[real], at[real]] = table[labels][real]
    mask[r[real], at[real]] = 1
    shape = (*rows.shape, table.shape[1])
    return {
        **batch,
        "targets": table[labels].reshape(shape),
        "target_at": np.maximum(at - 1, 0).astype(np.int32).reshape(shape),
        "target_weights": real.astype(np.float32).reshape(shape),
    }


def scoring_batches(
    split: TokenizedSplit,
    answers: list[list[int]],
    *,
    batch_size: int,
    local_devices: int,
    bucket_multiple: int,
    max_length: int,
    process_index: int = 0,
    process_count: int = 1,
    limit: int = 0,
) -> Iterator[dict[str, np.ndarray]]:
    """`packed_eval_batches` for prompts: every row (the first `limit`) once, each as its
    prompt followed by every label's answer, each answer attending to the prompt and to its own
    earlier tokens only (`branches`: 0 for the prompt, k + 1 for answer k; `positions` go on
    from the prompt's end in every answer), so one pass scores every label.

    Per row [rows, 1, labels, longest answer]: `score_at` (the token that predicts each answer
    token), `score_tokens`, `score_weights`; and as in packed batches `rows`, `labels`,
    `weights` [rows, 1]. Batches go in length order, the last padded to a power of two per
    device."""
    table, answer_lengths = answer_table(answers)
    n = len(split) if limit <= 0 else min(limit, len(split))
    prompts = np.minimum(split.lengths[:n], max_length)
    totals = prompts + int(answer_lengths.sum())
    order = np.argsort(totals, kind="stable")
    devices = process_count * local_devices
    for start in range(0, n, batch_size):
        chosen = order[start : start + batch_size]
        length = bucket_length(int(totals[chosen].max()), bucket_multiple, 1 << 30)
        local = _padded_rows(len(chosen), batch_size, devices) // process_count
        mine = chosen[process_index * local : (process_index + 1) * local]
        yield _scoring_batch(split, prompts, mine, local, length, table, answer_lengths)


def _scoring_batch(split, prompts, rows, size, length, table, answer_lengths) -> dict:
    k, longest = table.shape
    ids = np.zeros((size, length), np.int32)
    segments, positions, branches = np.zeros_like(ids), np.zeros_like(ids), np.zeros_like(ids)
    at = np.zeros((size, 1, k, longest), np.int32)
    weights = (np.arange(longest)[None] < answer_lengths[:, None]).astype(np.float32)
    for r, i in enumerate(rows):
        n, first = int(prompts[i]), int(split.offsets[i])
        ids[r, :n] = split.values[first : first + n]
        positions[r, :n] = np.arange(n)
        cursor = n
        for label in range(k):
            a = int(answer_lengths[label])
            span = slice(cursor, cursor + a)
            ids[r, span] = table[label, :a]
            positions[r, span] = n + np.arange(a)
            branches[r, span] = label + 1
            # Answer token 0 is predicted by the prompt's last token, token j by token j - 1.
            at[r, 0, label, :a] = [n - 1, *range(cursor, cursor + a - 1)]
            cursor += a
        segments[r, :cursor] = 1
    slots = np.full((size, 1), -1, np.int64)
    slots[: len(rows), 0] = rows
    return {
        "input_ids": ids,
        "segments": segments,
        "positions": positions,
        "branches": branches,
        "score_at": at,
        "score_tokens": np.broadcast_to(table[None, None], at.shape).copy(),
        "score_weights": np.broadcast_to(weights[None, None], at.shape).copy(),
        "rows": slots,
        "labels": split.labels[np.maximum(slots, 0)],
        "weights": (slots >= 0).astype(np.float32),
    }


def eval_batches(split: TokenizedSplit, answers: list[list[int]] | None, **kwargs):
    """The evaluation batches of a split: packed reviews for a classifier, scored answers
    (`scoring_batches`) for a language model."""
    if answers is None:
        return packed_eval_batches(split, **kwargs)
    return scoring_batches(split, answers, **kwargs)


# ---------------------------------------------------------------------------------------------
# Packed training rows (the `packing` setting): several reviews a row of max_length tokens


#: Packing for training puts each review into the first of at most this many open rows with
#: room for it (first-fit over a window of the shuffled reviews): a wider window fills rows
#: fuller, and keeps a review further from its shuffled place.
PACK_WINDOW = 64


def first_fit_rows(
    lengths: np.ndarray, order: np.ndarray, capacity: int, slots: int, window: int = PACK_WINDOW
) -> list[list[int]]:
    """Row indices taken in `order` into rows of at most `capacity` tokens and `slots` reviews:
    each into the first open row with room for it, else a new row; with `window` rows open, the
    fullest is closed first. Rows come out as they close, then those still open. Every length
    must be at most `capacity`."""
    lengths = lengths.tolist()
    # Tokens an open row can still take (-1: no row there, or its slots are full): one
    # vectorised look for the first that fits, the rest in plain lists (faster at this size).
    room = np.full(window, -1, np.int64)
    left, held = [0] * window, [0] * window
    members: list[list[int]] = [[] for _ in range(window)]
    is_open = [False] * window
    rows: list[list[int]] = []
    for i in order.tolist():
        n = lengths[i]
        k = int(np.argmax(room >= n))
        if room[k] < n:
            if not all(is_open):
                k = is_open.index(False)
            else:  # close the fullest open row: the least likely to take another review
                k = min(range(window), key=left.__getitem__)
                rows.append(members[k])
            is_open[k], left[k], held[k], members[k] = True, capacity, 0, []
        left[k] -= n
        held[k] += 1
        members[k].append(i)
        room[k] = left[k] if held[k] < slots else -1
    rows += [members[k] for k in range(window) if is_open[k]]
    return rows


def real_token_share(
    lengths: np.ndarray, max_length: int, *, packed: bool, bucket_multiple: int = 0, seed: int = 0
) -> float:
    """The share of real tokens in the padded rows that hold reviews of `lengths` (truncated to
    `max_length`): one review a row padded to max_length (`bucket_multiple` 0) or to its own
    multiple of `bucket_multiple` (a bound of what length buckets reach), or rows of
    max_length packed as training packs them (`packed`)."""
    lengths = np.minimum(lengths, max_length)
    if packed:
        order = np.random.default_rng([seed, 0]).permutation(len(lengths))
        rows = len(first_fit_rows(lengths, order, max_length, max_length))
        return float(lengths.sum() / (rows * max_length))
    if bucket_multiple:
        padded = np.minimum(-(-lengths // bucket_multiple) * bucket_multiple, max_length)
        return float(lengths.sum() / padded.sum())
    return float(lengths.sum() / (len(lengths) * max_length))


class PackedPlan:
    """Every epoch's packed rows for training, planned identically on every process from the
    seed, the epoch and the lengths: each epoch's reviews shuffled, then packed first-fit
    (`first_fit_rows`) into rows of `capacity` tokens and `slots` reviews; its rows shuffled and
    cut into steps of `global_batch` rows (the last partial step dropped). Epochs differ in
    their number of steps by the few rows their packings differ by."""

    def __init__(
        self, lengths: np.ndarray, capacity: int, global_batch: int, seed: int,
        window: int = PACK_WINDOW,
    ):  # fmt: skip
        self.lengths = np.minimum(lengths, capacity)
        self.capacity, self.global_batch, self.seed, self.window = (
            capacity, global_batch, seed, window,
        )  # fmt: skip
        # The slots: the most reviews a row of epoch 0 holds, rounded up to a power of two (one
        # compiled shape); later epochs pack to at most that many. Epoch 0 packed with that
        # bound is the same packing (it never binds there), so it is kept.
        rows, rng = self._pack(0, capacity)
        self.slots = 1 << (max(map(len, rows)) - 1).bit_length()
        #: epoch 0's rows, and the share of their tokens that are real (not padding)
        self.rows = len(rows)
        self.real_token_share = float(self.lengths.sum() / (len(rows) * capacity))
        self._epochs = {0: self._steps_of(rows, rng)}
        self._steps = {0: len(self._epochs[0])}

    def _pack(self, epoch: int, slots: int) -> tuple[list[list[int]], np.random.Generator]:
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(len(self.lengths))
        return first_fit_rows(self.lengths, order, self.capacity, slots, self.window), rng

    def _steps_of(self, rows: list[list[int]], rng: np.random.Generator) -> np.ndarray:
        table = np.full((len(rows), self.slots), -1, np.int64)
        for r, members in enumerate(rows):
            table[r, : len(members)] = members
        table = table[rng.permutation(len(rows))]
        steps = len(rows) // self.global_batch
        return table[: steps * self.global_batch].reshape(steps, self.global_batch, self.slots)

    def epoch(self, epoch: int) -> np.ndarray:
        """Review indices of one epoch's steps [steps, global_batch, slots], -1 an empty slot."""
        if epoch not in self._epochs:
            # Only the latest epoch is kept: the loop moves forward.
            self._epochs = {epoch: self._steps_of(*self._pack(epoch, self.slots))}
        return self._epochs[epoch]

    def steps_in(self, epoch: int) -> int:
        """The steps of one epoch."""
        if epoch not in self._steps:
            self._steps[epoch] = len(self.epoch(epoch))
        return self._steps[epoch]

    def locate(self, step: int) -> tuple[int, int]:
        """(epoch, index in it) of a step counted from the run's start."""
        epoch = 0
        while step >= (n := self.steps_in(epoch)):
            if n == 0:
                raise ValueError("an epoch packs into fewer rows than one step's")
            step -= n
            epoch += 1
        return epoch, step

    def total_steps(self, epochs: float) -> int:
        """The steps of `epochs` epochs (a fraction: of the last one's steps, rounded up)."""
        whole = int(epochs)
        steps = sum(self.steps_in(e) for e in range(whole))
        if epochs > whole:
            steps += math.ceil((epochs - whole) * self.steps_in(whole))
        return steps


def packed_train_batches(
    split: TokenizedSplit,
    plan: PackedPlan,
    *,
    accum_steps: int,
    process_index: int,
    process_count: int,
    start_step: int,
    answers: list[list[int]] | None = None,
) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
    """`train_batches` with packed rows (`plan`): endless (step, local batch) from `start_step`
    on, every array [accum_steps, micro_rows / process_count, ...]: `input_ids`,
    `attention_mask` (segment ids 1, 2, ... of a row's reviews, 0 for padding) and `positions`
    (each review's own, from 0) [..., capacity]; per review slot `starts` (its first token),
    `labels` and `weights` (1 for a review, 0 for an empty slot) [..., slots]. With `answers`
    (prompts, causal-lm) each review's answer follows its prompt, and `targets`, `target_at`,
    `target_weights` [..., slots, longest answer] are `with_answers`'s for each slot."""
    table = lengths = None
    if answers is not None:
        table, lengths = answer_table(answers)
    micro = plan.global_batch // accum_steps
    local = micro // process_count
    epoch, index = plan.locate(start_step)
    step = start_step
    while True:
        for rows in plan.epoch(epoch)[index:]:
            mine = rows.reshape(accum_steps, micro, -1)[
                :, process_index * local : (process_index + 1) * local
            ]
            units = mine.reshape(-1, plan.slots)
            batch = _packed_rows(split, plan.lengths, units, plan.capacity, table, lengths)
            yield step, {k: v.reshape(*mine.shape[:2], *v.shape[1:]) for k, v in batch.items()}
            step += 1
        epoch, index = epoch + 1, 0


def _packed_rows(split, lengths, units, capacity: int, table, answer_lengths) -> dict:
    """The packed rows of `units` [rows, slots] (review indices, -1 empty): prompts followed by
    their answers when `table` (answer tokens by label) is given."""
    size, slots = units.shape
    ids = np.zeros((size, capacity), np.int32)
    segments, positions = np.zeros_like(ids), np.zeros_like(ids)
    starts = np.zeros((size, slots), np.int32)
    labels = split.labels[np.maximum(units, 0)]
    longest = 0 if table is None else table.shape[1]
    target_at = np.zeros((size, slots, longest), np.int32)
    target_weights = np.zeros((size, slots, longest), np.float32)
    for r in range(size):
        at = 0
        for s in range(slots):
            i = int(units[r, s])
            if i < 0:  # a row's reviews fill its first slots
                break
            n, first = int(lengths[i]), int(split.offsets[i])
            if table is None:
                ids[r, at : at + n] = split.values[first : first + n]
            else:  # `lengths` count prompt and answer
                a = int(answer_lengths[labels[r, s]])
                ids[r, at : at + n - a] = split.values[first : first + n - a]
                ids[r, at + n - a : at + n] = table[labels[r, s], :a]
                # Answer token 0 is predicted by the prompt's last token, token j by token j - 1.
                target_at[r, s, :a] = at + n - a - 1 + np.arange(a)
                target_weights[r, s, :a] = 1.0
            segments[r, at : at + n] = s + 1
            positions[r, at : at + n] = np.arange(n)
            starts[r, s] = at
            at += n
    batch = {
        "input_ids": ids,
        "attention_mask": segments,
        "positions": positions,
        "starts": starts,
        "labels": labels,
        "weights": (units >= 0).astype(np.float32),
    }
    if table is not None:
        batch["targets"] = table[labels]
        batch["target_at"] = target_at
        batch["target_weights"] = target_weights
    return batch
