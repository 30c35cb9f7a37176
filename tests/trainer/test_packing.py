"""Packed training rows (`packing`): the same loss and gradients as one review a row."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kubejax import monitoring
from kubejax.data import dataset
from kubejax.data.dataset import PackedPlan, TokenizedSplit
from kubejax.models import decoder_weights
from kubejax.models.bert import BertClassifier, BertConfig
from kubejax.models.decoder import DecoderConfig
from kubejax.trainer.config import TrainConfig
from kubejax.trainer.steps import _gradients
from kubejax.trainer.train import main as trainer_main
from tests.helpers import assert_close_to_scale, tiny_args
from tests.models.decoders import TINY

#: Each label's answer (causal-lm), of different lengths: the loss counts answer tokens.
ANSWERS = [[5], [6, 7], [8, 9, 10]]


def _split(n: int = 14, seed: int = 0) -> TokenizedSplit:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, 22, n)
    values = rng.integers(11, 250, int(lengths.sum())).astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return TokenizedSplit(values, offsets, rng.integers(0, 3, n).astype(np.int32))


def _model(family: str, task: str):
    if family == "bert":
        cfg = BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64, vocab_size=300, max_position_embeddings=128,
                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # fmt: skip
        return BertClassifier(cfg, 3, rngs=nnx.Rngs(0))
    cfg = DecoderConfig.from_dict({"model_type": family, **TINY[family]})
    return decoder_weights.build(cfg, task, 3, jnp.float32, seed=0)


def _unpacked(split: TokenizedSplit, answers) -> dict:
    """Every review in a row of its own: one micro-batch [1, reviews, length]."""
    rows = np.arange(len(split))[None]
    length = int(dataset.row_lengths(split, answers).max())
    batch = dataset.gather(split, rows, length)
    return batch if answers is None else dataset.with_answers(batch, split, rows, answers)


def _packed(split: TokenizedSplit, answers, capacity: int = 64) -> dict:
    """Every review packed in rows of `capacity` tokens: one step holding all of epoch 0."""
    lengths = dataset.row_lengths(split, answers)
    rows = PackedPlan(lengths, capacity, 1, seed=0).rows
    plan = PackedPlan(lengths, capacity, rows, seed=0)
    batches = dataset.packed_train_batches(
        split, plan, accum_steps=1, process_index=0, process_count=1, start_step=0, answers=answers
    )
    batch = next(batches)[1]
    assert rows < len(split) and int(batch["weights"].sum()) == len(split)
    return batch


@pytest.mark.parametrize(
    "family, task",
    [
        ("bert", "classification"),
        # Gemma 3: RoPE of two kinds, and sliding windows on its local layers.
        ("gemma3_text", "classification"),
        ("gemma3_text", "causal-lm"),
    ],
)
@pytest.mark.slow
def test_a_packed_step_gives_the_unpacked_steps_loss_and_gradients(family, task):
    split = _split()
    answers = ANSWERS if task == "causal-lm" else None
    graphdef, params = nnx.split(_model(family, task), nnx.Param)
    gradients = jax.jit(functools.partial(_gradients, graphdef), static_argnames="budget")
    key = jax.random.key(0)
    loss, acc, grads = gradients(params, _unpacked(split, answers), key, budget=0)
    packed = _packed(split, answers)
    # Whole, and in pieces of one packed row each: the pieces hold different numbers of
    # reviews, and still add up to the mean over all of them.
    for budget in (0, packed["input_ids"].shape[-1]):
        p_loss, p_acc, p_grads = gradients(params, packed, key, budget=budget)
        np.testing.assert_allclose(float(p_loss), float(loss), rtol=1e-5)
        np.testing.assert_allclose(float(p_acc), float(acc), rtol=1e-6)
        typical = max(float(np.abs(g).max()) for g in jax.tree.leaves(grads))
        got = jax.tree_util.tree_flatten_with_path(p_grads)[0]
        for (path, g), want in zip(got, jax.tree.leaves(grads), strict=True):
            name = f"{budget}: {jax.tree_util.keystr(path)}"
            if float(np.abs(want).max()) <= 1e-6 * typical:  # zero by symmetry (keys' bias)
                assert float(np.abs(g).max()) <= 1e-6 * typical, name
            else:
                assert_close_to_scale(g, want, 1e-5, name)


def test_packed_rows_hold_every_review_once_with_its_answer_and_own_positions():
    split = _split(40, seed=3)
    lengths = dataset.row_lengths(split, ANSWERS)
    plan = PackedPlan(lengths, 48, 4, seed=1)
    assert plan.slots & (plan.slots - 1) == 0
    steps = plan.steps_in(0)
    seen = []
    for process in (0, 1):
        batches = dataset.packed_train_batches(
            split,
            plan,
            accum_steps=2,
            process_index=process,
            process_count=2,
            start_step=0,
            answers=ANSWERS,
        )
        for _, b in (next(batches) for _ in range(steps)):
            assert b["input_ids"].shape == (2, 1, 48) and b["starts"].shape == (2, 1, plan.slots)
            assert b["targets"].shape == (2, 1, plan.slots, 3)
            ids, segs, pos = b["input_ids"][:, 0], b["attention_mask"][:, 0], b["positions"][:, 0]
            for a, s in zip(*np.nonzero(b["weights"][:, 0]), strict=True):
                at = b["starts"][a, 0, s]
                label = b["labels"][a, 0, s]
                n = int((segs[a] == s + 1).sum())
                prompt = ids[a, at : at + n - len(ANSWERS[label])].tolist()
                i = next(
                    i for i in range(len(split))
                    if split.values[split.offsets[i] : split.offsets[i + 1]].tolist() == prompt
                    and split.labels[i] == label and i not in seen
                )  # fmt: skip
                seen.append(i)
                assert ids[a, at + n - len(ANSWERS[label]) : at + n].tolist() == ANSWERS[label]
                assert pos[a, at : at + n].tolist() == list(range(n))
                # The answer's tokens, each predicted by the token before it.
                k = len(ANSWERS[label])
                assert b["target_at"][a, 0, s, :k].tolist() == list(
                    range(at + n - k - 1, at + n - 1)
                )
                assert b["target_weights"][a, 0, s].tolist() == [1.0] * k + [0.0] * (3 - k)
    # Every review at most once an epoch; the rows a whole step could not take are left out.
    assert len(seen) == len(set(seen)) and len(seen) >= len(split) - 4 * plan.slots


def test_the_packed_plan_is_the_same_for_a_seed_and_resumes_at_any_step():
    lengths = np.random.default_rng(0).integers(3, 40, 300)
    a, b = PackedPlan(lengths, 64, 8, seed=5), PackedPlan(lengths, 64, 8, seed=5)
    assert (a.epoch(1) == b.epoch(1)).all() and (a.epoch(0) == b.epoch(0)).all()
    assert not np.array_equal(a.epoch(1), a.epoch(0)[: len(a.epoch(1))])
    first = a.steps_in(0)
    assert a.locate(first + 2) == (1, 2) and a.total_steps(1.5) == first + -(-a.steps_in(1) // 2)
    # Every row within capacity, most rows nearly full.
    table = a.epoch(0).reshape(-1, a.slots)
    used = np.where(table >= 0, lengths[np.maximum(table, 0)], 0).sum(1)
    assert used.max() <= 64 and used.mean() > 0.9 * 64
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    split = TokenizedSplit(np.ones(int(lengths.sum()), np.int32), offsets, np.zeros(300, np.int32))
    resumed = dataset.packed_train_batches(
        split, a, accum_steps=1, process_index=0, process_count=1, start_step=first + 2
    )
    step, batch = next(resumed)
    rows = a.epoch(1)[2]
    assert step == first + 2 and (batch["weights"][0] == (rows >= 0)).all()


def test_the_first_fit_window_keeps_rows_open_and_closes_the_fullest():
    # Capacity 10, a window of 2: 6 and 5 open two rows; 7 fits neither: the fuller (6)
    # closes and 7 takes its place; 3 fits there (the first), 4 beside 5.
    rows = dataset.first_fit_rows(np.array([6, 5, 7, 3, 4]), np.arange(5), 10, 4, window=2)
    assert rows == [[0], [2, 3], [1, 4]]
    # A slot bound: no more than 2 reviews a row, whatever the room.
    rows = dataset.first_fit_rows(np.ones(5, np.int64), np.arange(5), 10, 2)
    assert rows == [[0, 1], [2, 3], [4]]


@pytest.mark.parametrize("task", ["classification", "causal-lm"])
@pytest.mark.slow
def test_training_with_packing_runs_end_to_end(
    task, tmp_path, capsys, tiny_model_dir, prepared, tiny_decoder_dir, prepared_prompts
):
    model, data = (
        (tiny_model_dir, prepared) if task == "classification" else
        (tiny_decoder_dir, prepared_prompts)
    )  # fmt: skip
    out = tmp_path / task
    flags = {"packing": True, "max_steps": 3, "global_batch_size": 4, "max_length": 128}
    assert trainer_main(tiny_args(model, data, out, **flags)) == 0
    first_line = capsys.readouterr().out.splitlines()[0]
    assert "packed:" in first_line and "reviews in" in first_line
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["status"] == "completed" and metrics["final"]["steps"] == 3
    assert all(np.isfinite(r["loss"]) for r in metrics["train"])
    # Examples are reviews: more than the 4 rows of each of the 3 steps.
    (summary,) = monitoring.read_worker_summaries(out)
    assert summary["examples"] > 3 * 4


def test_a_batch_larger_than_the_packed_rows_is_refused(tmp_path, capsys, tiny_model_dir, prepared):
    flags = {"packing": True, "global_batch_size": 1000, "max_length": 128}
    assert trainer_main(tiny_args(tiny_model_dir, prepared, tmp_path / "o", **flags)) == 2
    err = capsys.readouterr().err
    assert "global_batch_size: 1000 exceeds the" in err and "rows that packing fills" in err


def test_packing_is_off_by_default():
    assert TrainConfig().packing is False


_TWO_DEVICES = """
import json, numpy as np, jax
from flax import nnx
from jax.sharding import Mesh
from kubejax.data import dataset
from kubejax.data.dataset import PackedPlan, TokenizedSplit
from kubejax.models.bert import BertClassifier, BertConfig
from kubejax.trainer import distributed, optimizer
from kubejax.trainer.config import TrainConfig
from kubejax.trainer.steps import make_train_step
rng = np.random.default_rng(0)
lengths = rng.integers(3, 40, 60)
split = TokenizedSplit(rng.integers(1, 100, int(lengths.sum())).astype(np.int32),
                       np.concatenate([[0], np.cumsum(lengths)]), rng.integers(0, 5, 60))
plan = PackedPlan(lengths, 64, 4, seed=0)
local = next(dataset.packed_train_batches(split, plan, accum_steps=ACCUM, process_index=0,
                                          process_count=1, start_step=0))[1]
cfg = BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                 vocab_size=100, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
out = {}
for n in (1, 2):
    mesh = Mesh(np.array(jax.devices()[:n]), ("data",))
    tx = optimizer.make_optimizer(TrainConfig())
    graphdef, params = nnx.split(BertClassifier(cfg, 5, rngs=nnx.Rngs(0)))
    params = distributed.replicate(params, mesh)
    step = make_train_step(graphdef, tx, mesh, 0, BertClassifier.sparse_embedding)
    batch = distributed.global_batch(local, mesh, leading=1)
    params, _, metrics = step(params, tx.init(params), batch, 0, np.float32(1e-3))
    out[n] = {"loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"]),
              "examples": float(metrics["examples"]),
              "params": [float(x.sum()) for x in jax.tree.leaves(params)]}
print(json.dumps(out))
"""


@pytest.mark.slow
def test_a_packed_step_on_two_devices_is_the_one_device_step():
    # Each device's rows hold a different number of reviews: the step's mean is still over
    # all of them (each device's sums divided by the step's totals), micro-batches included.
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    script = _TWO_DEVICES.replace("ACCUM", "2")
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.splitlines()[-1])
    one, two = got["1"], got["2"]
    assert one["examples"] == two["examples"] > 4
    np.testing.assert_allclose(two["loss"], one["loss"], rtol=1e-5)
    np.testing.assert_allclose(two["grad_norm"], one["grad_norm"], rtol=1e-4)
    np.testing.assert_allclose(two["params"], one["params"], rtol=1e-5, atol=1e-5)
