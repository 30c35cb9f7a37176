"""The run's data: the length buckets chosen by platform, said in the first line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kubejax.trainer.config import ConfigError, TrainConfig
from kubejax.trainer.inputs import BucketChoice, choose_buckets
from kubejax.trainer.train import main as trainer_main
from tests.helpers import tiny_args


def _yelp_like(n: int, seed: int = 0) -> np.ndarray:
    """Token lengths shaped like Yelp reviews' (MiniLM's tokenizer): a long right tail."""
    return np.clip(np.random.default_rng(seed).lognormal(4.8, 0.7, n).astype(int), 5, 2000)


@pytest.mark.parametrize(
    "name, lengths, batch, max_length, steps, platform, multiple, shapes",
    [
        # TPU.md's case: a 270M decoder's epoch over 2,000 reviews of at most 128 tokens,
        # batch 16: compiles (~20 s each) cost more than all the padding: one shape.
        ("tpu short reviews", np.random.default_rng(0).integers(10, 129, 2000), 16, 128, 125,
         "tpu", 128, 1),
        # The same on the CPU: a compile costs seconds, padding there costs more: buckets.
        ("cpu short reviews", np.random.default_rng(0).integers(10, 129, 2000), 16, 128, 125,
         "cpu", 64, 2),
        # Yelp's lengths at 512 over an epoch of 100,000 reviews: buckets of 32 on the CPU
        # (bench: 3.1x over one padded shape) ...
        ("cpu yelp epoch", _yelp_like(100_000), 32, 512, 3125, "cpu", 32, 16),
        # ... fewer, wider ones on the TPU, where each shape's compile costs 20 s.
        ("tpu yelp epoch", _yelp_like(100_000), 32, 512, 3125, "tpu", 128, 4),
        # A short trial's 12 steps: one shape on the TPU, its longest batch's (rounded to 32).
        ("tpu trial", _yelp_like(5_000), 32, 512, 12, "tpu", 288, 1),
    ],
)  # fmt: skip
def test_the_buckets_weigh_compiles_against_padding_by_platform(
    name, lengths, batch, max_length, steps, platform, multiple, shapes
):
    got = choose_buckets(lengths, global_batch=batch, max_length=max_length, steps=steps, seed=0,
                         platform=platform)  # fmt: skip
    assert (got.multiple, len(got.lengths), got.auto) == (multiple, shapes, True), name
    assert max(got.lengths) <= max_length and all(n % 32 == 0 for n in got.lengths)


def test_a_given_bucket_multiple_wins_and_an_unknown_platform_counts_as_a_gpu():
    lengths = np.random.default_rng(0).integers(10, 129, 2000)
    given = choose_buckets(lengths, global_batch=16, max_length=128, steps=125, seed=0,
                           platform="tpu", multiple=32)  # fmt: skip
    assert given == BucketChoice(32, (32, 64, 96, 128))
    assert given.describe() == "buckets: 4 shapes of 32-token multiples (bucket_multiple 32)"
    gpu = choose_buckets(lengths, global_batch=16, max_length=128, steps=125, seed=0,
                         platform="gpu")  # fmt: skip
    other = choose_buckets(lengths, global_batch=16, max_length=128, steps=125, seed=0,
                           platform="rocm")  # fmt: skip
    assert (gpu.multiple, gpu.lengths) == (other.multiple, other.lengths)


def test_the_choice_reads_as_the_first_lines_words():
    assert (
        BucketChoice(32, (32, 64, 96, 128), auto=True, platform="cpu").describe()
        == "buckets: 4 shapes of 32-token multiples (auto, cpu)"
    )
    assert (
        BucketChoice(128, (128,), auto=True, platform="tpu").describe()
        == "buckets: one shape of 128 tokens (auto, tpu)"
    )
    assert BucketChoice(128, (128,), auto=True, platform="tpu").describe(packing=True) == (
        "evaluation buckets: one shape of 128 tokens (auto, tpu)"
    )


def test_a_negative_bucket_multiple_is_refused_and_zero_means_auto():
    assert TrainConfig().bucket_multiple == 0
    cfg = TrainConfig(model="m", data_dir="d", output_dir="o", bucket_multiple=-1)
    with pytest.raises(ConfigError, match="bucket_multiple: must be 0 or more, got -1"):
        cfg.validate(check_paths=False)


@pytest.mark.slow
def test_the_first_line_says_the_buckets_chosen(tmp_path, capsys, tiny_model_dir, prepared):
    out = tmp_path / "auto"
    flags = {"bucket_multiple": 0, "max_steps": 2, "checkpoint_every": 2, "save_final": False}
    assert trainer_main(tiny_args(tiny_model_dir, prepared, out, **flags)) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("kubejax trainer: 1 process(es), 1 cpu device(s)")
    # Two steps: one compile is worth more than the padding of two batches.
    assert first.endswith("; buckets: one shape of 64 tokens (auto, cpu)"), first
    # dtype auto, pinned by the suite (conftest): the choice and why, in the same line.
    assert "; dtype float32, weights float32 (auto: KUBEJAX_AUTO_DTYPE=float32); " in first
    # The multiple the run used is the one logged and kept with its checkpoints, and so are
    # the dtypes `auto` resolved to.
    meta = json.loads(next((out / "checkpoints").glob("*/meta/metadata")).read_text())
    assert meta["config"]["bucket_multiple"] == 64
    assert (meta["config"]["dtype"], meta["config"]["param_dtype"]) == ("float32", "float32")
