"""The data a run reads: the prepared splits checked against the settings, and this process's
share of every step's batch."""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import numpy as np

from kubejax.data import dataset
from kubejax.trainer.config import ConfigError, TrainConfig

#: What one compiled shape costs against the padding it saves, by platform, for the automatic
#: length buckets (bucket_multiple 0): seconds to compile a train step's program, and the
#: tokens (padding included) a second the steps then run.
#: - cpu: MiniLM's first step 5.3 s cold, compile included (bench/results.md,
#:   `compile_s_cold`); its step runs 3,400-3,900 tokens/s on 2 cores from 128 to 512 tokens
#:   (`bucketing_step_s_by_length`, batch 16). Compiles are cheap next to slow steps:
#:   buckets won 3.1x there (`bucketing_speedup`).
#: - tpu: one v5e chip, ~20-30 s a compile for a 270M decoder's bucket shape and ~50,000
#:   tokens/s for the Qwen2.5-0.5B shape at sequence 256 (../shared/TPU.md): one padded shape
#:   ran a one-epoch LoRA in 46 s against 283 s with buckets of 32.
#: - gpu: between the two. bert-base ran 629,000 tokens/s on an H200 at sequence 128
#:   (bench/gpu-results.md; a 0.5B decoder some 5x fewer); no compile was timed on a GPU here,
#:   so it is taken between the CPU's and the TPU's.
COMPILE_S = {"cpu": 5.0, "gpu": 12.0, "tpu": 20.0}
TOKENS_PER_S = {"cpu": 3_500.0, "gpu": 120_000.0, "tpu": 50_000.0}
#: The smallest multiple the automatic choice tries; then each double, up to one shape.
_FIRST_MULTIPLE = 32


@dataclass(frozen=True)
class BucketChoice:
    """The length buckets of a run: the multiple padded lengths round up to, and the padded
    lengths its training steps use."""

    multiple: int
    lengths: tuple[int, ...]
    #: chosen automatically (bucket_multiple 0) for `platform`
    auto: bool = False
    platform: str = ""

    def describe(self, packing: bool = False) -> str:
        """For the trainer's first line, e.g. `buckets: 4 shapes of 32-token multiples (auto,
        cpu)` or `buckets: one shape of 128 tokens (auto, tpu)`."""
        how = f"auto, {self.platform}" if self.auto else f"bucket_multiple {self.multiple}"
        name = "evaluation buckets" if packing else "buckets"
        if len(self.lengths) == 1:
            return f"{name}: one shape of {self.lengths[0]} tokens ({how})"
        return f"{name}: {len(self.lengths)} shapes of {self.multiple}-token multiples ({how})"


def choose_buckets(
    lengths: np.ndarray,
    *,
    global_batch: int,
    max_length: int,
    steps: int,
    seed: int,
    platform: str,
    multiple: int = 0,
) -> BucketChoice:
    """The length buckets of a run over rows of `lengths`: `multiple` when given, else the
    multiple (32, 64, 128, ... up to one shape for every batch) whose estimated time is least:
    a compile per padded length the run's steps use (`COMPILE_S`) plus the tokens they run,
    padding included (`TOKENS_PER_S`), by `platform` (cpu, gpu or tpu; another counts as a
    gpu). The batches are those of the input pipeline's epoch 0 (`dataset.plan_epoch`), the
    first `steps` of them, or all repeated for a longer run."""
    lengths = np.minimum(lengths, max_length)
    plan = dataset.plan_epoch(lengths, global_batch, seed, 0)
    longest = lengths[plan].max(axis=1)  # each batch's; at least one (load_data checks)
    used = longest[:steps] if 0 < steps < len(longest) else longest
    repeats = max(steps, 1) / len(used)

    def padded(m: int) -> np.ndarray:
        return np.minimum(max_length, np.maximum(m, -(-used // m) * m))

    if multiple:
        return BucketChoice(multiple, tuple(np.unique(padded(multiple)).tolist()))
    kind = platform if platform in COMPILE_S else "gpu"
    one_shape = -(-int(used.max()) // _FIRST_MULTIPLE) * _FIRST_MULTIPLE
    candidates = [one_shape]
    m = _FIRST_MULTIPLE
    while m < one_shape:
        candidates.append(m)
        m *= 2
    best = None
    for m in candidates:  # one shape first: a tie goes to fewer compiles
        shapes = np.unique(padded(m))
        tokens = float(padded(m).sum()) * global_batch * repeats
        wall = len(shapes) * COMPILE_S[kind] + tokens / TOKENS_PER_S[kind]
        if best is None or wall < best[0]:
            best = (wall, m, tuple(shapes.tolist()))
    return BucketChoice(best[1], best[2], auto=True, platform=platform)


@dataclass
class TrainData:
    """The splits the loop reads and what follows from them."""

    train: dataset.TokenizedSplit
    val: dataset.TokenizedSplit
    meta: dict
    num_labels: int
    total_steps: int
    label_names: list[str]
    #: causal-lm: each label's answer tokens (the data's prompts are answered with them)
    answers: list[list[int]] | None = None
    #: packing: every epoch's packed rows
    packed: dataset.PackedPlan | None = None
    #: the length buckets (with packing, the evaluation's)
    buckets: BucketChoice | None = None


def load_data(cfg: TrainConfig) -> TrainData:
    """Read the prepared splits (every process reads the lengths of all rows, to plan identical
    batches) and check them against the settings."""
    try:
        meta = dataset.read_metadata(cfg.data_dir)
        train = dataset.load_split(cfg.data_dir, "train")
        val = dataset.load_split(cfg.data_dir, "validation")
    except dataset.DatasetError as err:
        raise ConfigError(str(err)) from err
    num_labels = cfg.num_labels or int(meta["num_labels"])
    if len(train) == 0:
        raise ConfigError(f"data_dir: the train split of {cfg.data_dir} is empty")
    top = int(max(train.labels.max(), val.labels.max(initial=0)))
    if top >= num_labels:
        raise ConfigError(f"num_labels: {num_labels}, but the data has label {top}")
    steps_per_epoch = len(train) // cfg.global_batch_size
    if steps_per_epoch == 0:
        raise ConfigError(
            f"global_batch_size: {cfg.global_batch_size} exceeds the {len(train)} training rows"
        )
    label_names = list(meta.get("label_names") or [str(i) for i in range(num_labels)])
    label_names += [str(i) for i in range(len(label_names), num_labels)]
    answers = _check_task(cfg, meta, num_labels)
    packed = _packed_plan(cfg, train, answers) if cfg.packing else None
    if packed is None:
        total_steps = cfg.max_steps or math.ceil(cfg.epochs * steps_per_epoch)
    else:
        total_steps = cfg.max_steps or packed.total_steps(cfg.epochs)
    buckets = choose_buckets(
        dataset.row_lengths(train, answers),
        global_batch=cfg.global_batch_size,
        max_length=cfg.max_length,
        steps=total_steps,
        seed=cfg.seed,
        platform=jax.devices()[0].platform,
        multiple=cfg.bucket_multiple,
    )
    # The run's multiple from here on (its evaluation, its logged parameters, its checkpoints'
    # config): an automatic choice is made again, the same, by a resumed run.
    cfg.bucket_multiple = buckets.multiple
    return TrainData(
        answers=answers,
        train=train,
        val=val,
        meta=meta,
        num_labels=num_labels,
        total_steps=total_steps,
        label_names=label_names,
        packed=packed,
        buckets=buckets,
    )


def _packed_plan(cfg: TrainConfig, train: dataset.TokenizedSplit, answers) -> dataset.PackedPlan:
    """The packed rows of every epoch; refused when an epoch's rows fill no whole step."""
    packed = dataset.PackedPlan(
        dataset.row_lengths(train, answers), cfg.max_length, cfg.global_batch_size, cfg.seed
    )
    if packed.steps_in(0) == 0:
        raise ConfigError(
            f"global_batch_size: {cfg.global_batch_size} exceeds the {packed.rows} rows that "
            f"packing fills with the {len(train)} training reviews at max_length "
            f"{cfg.max_length}; "
            "lower global_batch_size or max_length, or train without packing"
        )
    return packed


def _check_task(cfg: TrainConfig, meta: dict, num_labels: int) -> list[list[int]] | None:
    """Settle `cfg.task` from the data (prompts or not) and check that they agree; the
    answers of a causal-lm dataset."""
    prepared = meta.get("task", "classification")
    cfg.task = cfg.task or prepared
    if cfg.task != prepared:
        raise ConfigError(
            f"task: {cfg.task!r}, but {cfg.data_dir} was prepared for {prepared!r}; prepare it "
            f"with task {cfg.task!r} or leave task unset"
        )
    if cfg.task != "causal-lm":
        return None
    prepared_length = int(meta["max_length"])
    if cfg.max_length < prepared_length:
        raise ConfigError(
            f"max_length: {cfg.max_length}, but the prompts of {cfg.data_dir} were cut to fit "
            f"{prepared_length} tokens with their answers; set max_length to {prepared_length}"
        )
    answers = meta["answers"]
    if len(answers) != num_labels:
        raise ConfigError(
            f"num_labels: {num_labels}, but {cfg.data_dir} has answers for {len(answers)} labels"
        )
    return answers


def train_batches(cfg: TrainConfig, data: TrainData, start_step: int):
    """This process's share of every step's batch, from `start_step` on: rows of one review
    padded to their length bucket, or packed rows (`packing`)."""
    if data.packed is not None:
        return dataset.packed_train_batches(
            data.train,
            data.packed,
            accum_steps=cfg.grad_accum_steps,
            process_index=jax.process_index(),
            process_count=jax.process_count(),
            start_step=start_step,
            answers=data.answers,
        )
    return dataset.train_batches(
        data.train,
        global_batch=cfg.global_batch_size,
        accum_steps=cfg.grad_accum_steps,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        seed=cfg.seed,
        start_step=start_step,
        bucket_multiple=cfg.bucket_multiple,
        max_length=cfg.max_length,
        answers=data.answers,
    )


def eval_batches(split, cfg: TrainConfig, answers):
    """This process's share of each evaluation batch of `split` (`dataset.eval_batches`), for
    the evaluation step."""
    for local in dataset.eval_batches(
        split,
        answers,
        batch_size=cfg.eval_batch_size,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        local_devices=jax.local_device_count(),
        bucket_multiple=cfg.bucket_multiple or dataset.DEFAULT_BUCKET_MULTIPLE,
        max_length=cfg.max_length,
        limit=cfg.max_eval_examples,
    ):
        local.pop("rows")
        yield local
