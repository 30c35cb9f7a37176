"""Packing reviews several to a row for inference (`pack_rows`, `packed_eval_batches`)."""

from __future__ import annotations

import numpy as np
import pytest

from kubejax.data.dataset import TokenizedSplit, pack_rows, packed_eval_batches


def _split(lengths) -> TokenizedSplit:
    """Row i: [CLS]-like 101, then tokens 1000 * i + 1, 1000 * i + 2, ... (each row's own)."""
    rows = [np.array([101, *(1000 * i + np.arange(1, n))], np.int32) for i, n in enumerate(lengths)]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return TokenizedSplit(np.concatenate(rows), offsets, np.arange(len(lengths), dtype=np.int32))


def test_best_fit_decreasing_fills_the_fullest_bin_each_row_fits():
    # 6 opens a bin (4 left), 5 another (5 left); 4 fills the first exactly, 3 and 2 the second.
    assert pack_rows(np.array([6, 5, 4, 3, 2]), 10) == [[0, 2], [1, 3, 4]]


def test_packing_places_every_row_once_within_capacity_in_few_bins():
    lengths = np.random.default_rng(0).integers(2, 129, 2000)
    bins = pack_rows(lengths, 128)
    assert sorted(i for b in bins for i in b) == list(range(2000))
    assert max(lengths[b].sum() for b in bins) <= 128
    # Best-fit decreasing uses at most 11/9 of the optimum plus one bin.
    assert len(bins) <= np.ceil(lengths.sum() / 128 * 11 / 9) + 1


@pytest.mark.parametrize("devices, processes", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_packed_batches_hold_every_review_once_with_its_own_positions(devices, processes):
    rng = np.random.default_rng(1)
    # 3 over 64: alone; some as short as 3 tokens, up to 21 a row.
    lengths = np.concatenate([rng.integers(3, 60, 90), rng.integers(3, 6, 30), [100, 200, 256]])
    split = _split(lengths)
    shares = [
        list(packed_eval_batches(split, batch_size=8, local_devices=devices, bucket_multiple=16,
                                 max_length=256, pack_length=64, process_index=p,
                                 process_count=processes))
        for p in range(processes)
    ]  # fmt: skip
    # Every process has the same number of batches, each of the same shapes.
    assert len({len(s) for s in shares}) == 1
    for same in zip(*shares, strict=True):
        assert len({tuple((k, v.shape) for k, v in sorted(b.items())) for b in same}) == 1
    batches = [b for s in shares for b in s]
    seen = []
    for b in batches:
        size, length = b["input_ids"].shape
        assert size % devices == 0 and (size // devices) & (size // devices - 1) == 0
        assert length % 16 == 0 and b["starts"].shape == b["rows"].shape == b["weights"].shape
        for r, s in zip(*np.nonzero(b["rows"] >= 0), strict=True):
            i, at, n = b["rows"][r, s], b["starts"][r, s], lengths[b["rows"][r, s]]
            got = b["input_ids"][r, at : at + n]
            assert got.tolist() == split.values[split.offsets[i] : split.offsets[i + 1]].tolist()
            assert b["positions"][r, at : at + n].tolist() == list(range(n))
            assert (b["segments"][r, at : at + n] == s + 1).all()
            assert b["labels"][r, s] == i and b["weights"][r, s] == 1
            seen.append(int(i))
        tokens = (b["segments"] > 0).sum(1)
        assert (tokens == [lengths[row[row >= 0]].sum() for row in b["rows"]]).all()
        assert (b["weights"] == (b["rows"] >= 0)).all()
    assert sorted(seen) == list(range(len(lengths)))
    # One slot count a padded length, a power of two: one compiled program each.
    shapes = {(b["input_ids"].shape[1], b["starts"].shape[1]) for b in batches}
    assert len(shapes) == len({length for length, _ in shapes})
    assert all(slots & (slots - 1) == 0 for _, slots in shapes)
    long_rows = [b["rows"][r] for b in batches for r in range(len(b["rows"]))]
    for row in long_rows:
        if (lengths[row[row >= 0]] > 64).any():  # longer than pack_length: alone in its row
            assert (row >= 0).sum() == 1
    # Packing cuts the padded tokens: 120 reviews of at most 64 tokens in under 60 rows.
    assert sum(int((b["rows"] >= 0).any(1).sum()) for b in batches) < 60


def test_packed_batches_stop_at_the_limit():
    lengths = np.random.default_rng(2).integers(3, 60, 50)
    batches = packed_eval_batches(
        _split(lengths), batch_size=8, local_devices=1, bucket_multiple=16, max_length=64, limit=20
    )
    rows = np.concatenate([b["rows"][b["rows"] >= 0] for b in batches])
    assert sorted(rows.tolist()) == list(range(20))
