"""The causal-LM loss through the vocabulary head a chunk at a time (`models.chunked_head`): the
same loss, accuracy, gradients and answer scores as the whole float32 logits give, on every
family's tied or untied head (Gemma's soft cap included), LoRA and full fine-tuning, padding,
lengths and vocabularies no chunk divides; and a compiled step's temporaries far under the
whole logits' size where the vocabulary dominates."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from kubejax.data import dataset
from kubejax.models import chunked_head, decoder_weights, lora
from kubejax.models.decoder import DecoderConfig
from kubejax.trainer import steps
from tests.helpers import assert_close_to_scale
from tests.models.decoders import TINY

ANSWERS = [[5], [6, 7], [8, 9, 10]]


def _model(family: str, peft: str = "none", **overrides):
    cfg = DecoderConfig.from_dict({"model_type": family, **TINY[family], **overrides})
    model = decoder_weights.build(cfg, "causal-lm", 3, jnp.float32, seed=0)
    # Logits of a fresh model's 0.02-scaled weights are nearly equal: scale the head so that
    # the softmax (and the soft cap) has something to be exact about.
    table = model.model.embed_tokens.embedding
    table.set_value(table[...] * 40.0)
    if model.lm_head is not None:
        model.lm_head.kernel.set_value(model.lm_head.kernel[...] * 40.0)
    if peft == "lora":
        lora.apply(model, 4, 8.0, "all", seed=1)
        # A trained-looking B (a fresh one is zero, which would hide A's gradient).
        for layer in lora.adapters(model).values():
            b = layer.lora_b[...]
            layer.lora_b = nnx.LoRAParam(jax.random.normal(jax.random.key(2), b.shape) * 0.1)
    return model


def _split(lengths, seed: int = 0) -> dataset.TokenizedSplit:
    rng = np.random.default_rng(seed)
    values = rng.integers(11, 290, int(np.sum(lengths))).astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return dataset.TokenizedSplit(
        values, offsets, rng.integers(0, 3, len(lengths)).astype(np.int32)
    )


def _answer_batch(length: int = 23) -> dict:
    """Prompts of several lengths (rows padded) with each row's answer after its prompt."""
    split = _split([7, 12, 4, 15])
    rows = np.arange(4)
    return dataset.with_answers(dataset.gather(split, rows, length), split, rows, ANSWERS)


def _every_token_batch(length: int = 29) -> dict:
    """Every token's next one the target (the peers' causal-LM work), rows padded at the
    end: `target_at` every position but the last, weights 0 on the padding."""
    rng = np.random.default_rng(1)
    ids = rng.integers(1, 300, (3, length)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, 17:], mask[2, 5:] = 0, 0
    ids[mask == 0] = 0
    at = np.broadcast_to(np.arange(length - 1), (3, length - 1))
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "targets": ids[:, 1:, None].copy(),
        "target_at": at[..., None].astype(np.int32).copy(),
        "target_weights": mask[:, 1:, None].astype(np.float32),
    }


def _whole_loss_fn(graphdef, params, batch, frozen=None):
    """The loss and accuracy as the whole logits gave them (the path before the chunks)."""
    model = nnx.merge(graphdef, params, *(() if frozen is None else (frozen,)))
    at = batch["target_at"]
    logits = model(
        batch["input_ids"], batch["attention_mask"], at=at.reshape(at.shape[0], -1)
    ).reshape(*at.shape, -1)
    w = batch["target_weights"]
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    wrong = (jnp.argmax(logits, -1) != batch["targets"]) & (w > 0)
    correct = 1.0 - wrong.any(-1).astype(jnp.float32)
    loss_total, reviews = steps.step_totals(batch)
    return (ce * w).sum() / loss_total, correct.sum() / reviews


def _split_model(model, peft: str):
    if peft == "none":
        graphdef, params = nnx.split(model)
        return graphdef, params, None
    return nnx.split(model, lora.TRAINABLE, ...)


def _chunked(graphdef, params, batch, frozen):
    loss, (acc, _) = steps.loss_fn(graphdef, params, batch, None, True, frozen)
    return loss, acc


def _whole(graphdef, params, batch, frozen):
    return _whole_loss_fn(graphdef, params, batch, frozen)


@pytest.mark.parametrize(
    ("family", "peft", "overrides", "chunk", "batch_of"),
    [
        # chunk None: one chunk of all 300 words; 64: five, the last padded; 37: odd widths.
        ("llama", "none", {}, 37, _every_token_batch),
        ("llama", "none", {}, None, _answer_batch),
        ("qwen2", "lora", {}, 64, _every_token_batch),
        ("qwen3", "none", {}, 37, _answer_batch),  # an untied head (`lm_head`)
        # Gemma's scaled embeddings, its (1 + w) norms and a final soft cap over the logits.
        ("gemma3_text", "none", {"final_logit_softcapping": 3.0}, 64, _every_token_batch),
        ("gemma3_text", "lora", {}, 37, _answer_batch),
    ],
)
def test_the_loss_in_chunks_equals_the_whole_logits(family, peft, overrides, chunk, batch_of):
    model = _model(family, peft, **overrides)
    model.vocab_chunk = chunk
    graphdef, params, frozen = _split_model(model, peft)
    batch = batch_of()
    found = {}
    for name, fn in (("chunked", _chunked), ("whole", _whole)):
        grad_fn = jax.value_and_grad(fn, argnums=1, has_aux=True)
        found[name] = jax.jit(grad_fn)(graphdef, params, batch, frozen)
    (loss, acc), grads = found["chunked"]
    (loss_w, acc_w), grads_w = found["whole"]
    assert_close_to_scale(loss, loss_w, 1e-6, "loss")
    assert float(acc) == float(acc_w)
    names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(grads)[0]]
    leaves, leaves_w = jax.tree.leaves(grads), jax.tree.leaves(grads_w)
    assert len(leaves) == len(leaves_w) > 0
    for name, g, g_w in zip(names, leaves, leaves_w, strict=True):
        assert float(jnp.abs(g_w).max()) > 0, name
        assert_close_to_scale(g, g_w, 2e-5, name)


def test_the_accuracy_counts_an_answer_right_only_when_each_token_is_the_most_likely():
    """Targets set to the model's own most likely words: every review right; one token moved
    to another word: that review wrong, in both paths."""
    model = _model("llama")
    model.vocab_chunk = 64
    graphdef, params = nnx.split(model)
    batch = _answer_batch()
    at = batch["target_at"]
    logits = model(batch["input_ids"], batch["attention_mask"], at=at.reshape(at.shape[0], -1))
    best = np.asarray(jnp.argmax(logits, -1)).reshape(at.shape)
    right = {**batch, "targets": best.astype(np.int32)}
    wrong = {**right, "targets": right["targets"].copy()}
    wrong["targets"][1, 0] = (wrong["targets"][1, 0] + 1) % 300
    for b, expected in ((right, 1.0), (wrong, 0.75)):
        assert float(_chunked(graphdef, params, b, None)[1]) == expected
        assert float(_whole(graphdef, params, b, None)[1]) == expected


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_text"])
def test_answer_scores_in_chunks_equal_the_whole_logits(family):
    """The evaluation's label scores (every label's answer after each prompt): the summed
    log-probabilities of each answer's tokens, in chunks as from the whole logits."""
    model = _model(family, **({"final_logit_softcapping": 3.0} if family == "gemma3_text" else {}))
    model.vocab_chunk = 37
    (batch,) = dataset.scoring_batches(
        _split([5, 9, 3, 14, 6]), ANSWERS, batch_size=8, local_devices=1, bucket_multiple=8,
        max_length=64,
    )  # fmt: skip
    inputs = {k: v for k, v in batch.items() if k not in ("rows", "labels", "weights")}
    ours = jax.jit(lambda kw: model.label_scores(**kw))(inputs)

    def whole(kw):
        b, _, k, a = kw["score_at"].shape
        logits = model(
            kw["input_ids"], kw["segments"], positions=kw["positions"],
            branches=kw["branches"], at=kw["score_at"].reshape(b, -1),
        )  # fmt: skip
        logp = jax.nn.log_softmax(logits, -1).reshape(b, 1, k, a, -1)
        picked = jnp.take_along_axis(logp, kw["score_tokens"][..., None], -1)[..., 0]
        return (picked * kw["score_weights"]).sum(-1)

    expected = jax.jit(whole)(inputs)
    assert ours.shape == expected.shape == (8, 1, 3)
    assert_close_to_scale(ours, expected, 1e-6, f"{family} answer scores")


@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("columns", [None, 128, 50, 7])
def test_log_probs_and_gradients_equal_the_whole_softmax(softcap, columns):
    """The function itself: 3 × 11 tokens over 300 words in chunks of every width (7: 43
    chunks, the last padded), the table trained or frozen."""
    k = jax.random.split(jax.random.key(0), 4)
    hidden = jax.random.normal(k[0], (3, 11, 16))
    table = jax.random.normal(k[1], (300, 16))
    targets = jax.random.randint(k[2], (3, 11), 0, 300)
    weights = jax.random.uniform(k[3], (3, 11))
    # Ties broken as argmax does: two words with the same logits, the target the second.
    table = table.at[42].set(table[41])
    hidden = hidden.at[0, 0].set(table[41] * 5.0)
    targets = targets.at[0, 0].set(42)

    def loss(f, h, t):
        return (f(h, t)[0] * weights).sum()

    def chunked(h, t):
        return chunked_head.log_probs(h, t, targets, softcap, columns)

    def whole(h, t):
        return chunked_head.whole_log_probs(h, t, targets, softcap)

    for a, b in zip(chunked(hidden, table), whole(hidden, table), strict=True):
        assert a.shape == b.shape == (3, 11)
        if a.dtype == jnp.bool_:
            np.testing.assert_array_equal(a, b)
            assert not bool(a[0, 0])  # word 41 is the most likely, not 42
        else:
            assert_close_to_scale(a, b, 1e-6, "log-probabilities")
    ours = jax.jit(jax.grad(_of(loss, chunked), argnums=(0, 1)))(hidden, table)
    expected = jax.jit(jax.grad(_of(loss, whole), argnums=(0, 1)))(hidden, table)
    for a, b, name in zip(ours, expected, ("hidden", "table"), strict=True):
        assert_close_to_scale(a, b, 1e-6, name)
    frozen = jax.jit(jax.grad(lambda h: loss(chunked, h, jax.lax.stop_gradient(table))))(hidden)
    assert_close_to_scale(frozen, expected[0], 1e-6, "hidden, frozen table")


def _of(loss, f):
    return lambda h, t: loss(f, h, t)


@pytest.mark.parametrize(
    ("rows", "tokens", "vocab", "expected"),
    [
        (4, 2048, 151936, 8064),  # Qwen2.5-0.5B's batch of the peers' work: 19 chunks
        (1, 32768, 128256, 2048),  # Llama-3.2-1B's 32k row: 63 chunks (the last narrower)
        (4, 3, 151936, 151936),  # the answers' few tokens: one chunk, no padding
        (3, 28, 300, 300),
    ],
)
def test_chunk_width_keeps_a_chunk_s_logits_within_the_budget(rows, tokens, vocab, expected):
    columns = chunked_head.chunk_columns(rows, tokens, vocab)
    assert columns == expected
    chunks = -(-vocab // columns)
    assert rows * tokens * columns * 4 <= max(chunked_head.CHUNK_BYTES, rows * tokens * 4 * 128)
    assert chunks == 1 or columns % chunked_head.LANES == 0


def test_a_step_s_temporaries_stay_far_under_the_whole_logits(monkeypatch):
    """Where the vocabulary dominates (32,768 words, hidden 32, 2 × 256 tokens: the whole
    float32 logits 64 MiB), the compiled gradient of the loss over every token holds a small
    part of that in temporaries (XLA's memory analysis, CPU); the whole logits' path holds
    more than the logits themselves (which is what makes the comparison mean something)."""
    monkeypatch.setattr(chunked_head, "CHUNK_BYTES", 2**20)  # 1 MiB chunks: 16 of 2,048 words
    family, vocab, rows, length = "llama", 32768, 2, 256
    model = _model(
        family, vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
    )  # fmt: skip
    graphdef, params = nnx.split(model)
    rng = np.random.default_rng(0)
    ids = rng.integers(1, vocab, (rows, length)).astype(np.int32)
    at = np.broadcast_to(np.arange(length - 1), (rows, length - 1))[..., None]
    batch = {
        "input_ids": ids,
        "attention_mask": np.ones_like(ids),
        "targets": ids[:, 1:, None].copy(),
        "target_at": at.astype(np.int32).copy(),
        "target_weights": np.ones((rows, length - 1, 1), np.float32),
    }
    logits_bytes = rows * length * vocab * 4
    temps = {}
    for name, fn in (("chunked", _chunked), ("whole", _whole)):
        grad_fn = jax.value_and_grad(fn, argnums=1, has_aux=True)
        compiled = jax.jit(grad_fn).lower(graphdef, params, batch, None).compile()
        temps[name] = compiled.memory_analysis().temp_size_in_bytes
    assert temps["whole"] > logits_bytes, temps
    assert temps["chunked"] < logits_bytes / 4, temps


SHARDED = """
import json, re
import jax
jax.config.update("jax_num_cpu_devices", 4)
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from kubejax.models import chunked_head

mesh = jax.make_mesh((1, 2, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)
k = jax.random.split(jax.random.key(0), 3)
hidden = jax.random.normal(k[0], (4, 64, 32))
table = jax.random.normal(k[1], (1000, 32))
targets = jax.random.randint(k[2], (4, 64), 0, 1000)

def grads(h, t):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        loss = lambda h, t: chunked_head.log_probs(h, t, targets, None, 256)[0].sum()
        return jax.value_and_grad(loss, (0, 1))(h, t)

# The trainer's shardings: the batch over data x fsdp, the table's rows over tensor (vocab),
# its columns over fsdp (embed).
h = jax.device_put(hidden, NamedSharding(mesh, P(("data", "fsdp"), None, None)))
t = jax.device_put(table, NamedSharding(mesh, P("tensor", "fsdp")))
compiled = jax.jit(grads).lower(h, t).compile()
text = compiled.as_text()
computations = dict(re.findall(r"^%?([\\w.\\-]+) .*?\\{\\n(.*?)\\n\\}", text, re.S | re.M))
bodies = [computations[b] for b in set(re.findall(r"body=%?([\\w.\\-]+)", text))]
value, (g_h, g_t) = compiled(h, t)
whole = lambda h, t: chunked_head.whole_log_probs(h, t, targets)[0].sum()
value_w, (g_h_w, g_t_w) = jax.jit(jax.value_and_grad(whole, (0, 1)))(hidden, table)
print(json.dumps({
    "loops": len(bodies),
    "gathers_in_loops": sum(b.count("all-gather") + b.count("all-to-all") for b in bodies),
    "value": [float(value), float(value_w)],
    "hidden": float(jnp.abs(g_h - g_h_w).max() / jnp.abs(g_h_w).max()),
    "table": float(jnp.abs(g_t - g_t_w).max() / jnp.abs(g_t_w).max()),
}))
"""


def test_on_a_sharded_mesh_the_chunks_gather_nothing_in_their_loops():
    """On 4 CPU devices (fsdp 2 × tensor 2, a process of its own), the table sharded as the
    trainer shards it: the forward and backward loops over the chunks hold no gather (the
    table's columns are gathered once, before them), and the sums equal one device's."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).parents[2]
    env = {**os.environ, "PYTHONPATH": f"{root / 'src'}:{root}"}
    out = subprocess.run(
        [sys.executable, "-c", SHARDED], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["loops"] == 2, found  # the forward's and the backward's
    assert found["gathers_in_loops"] == 0, found
    assert abs(found["value"][0] - found["value"][1]) <= 1e-6 * abs(found["value"][1])
    assert found["hidden"] < 1e-5 and found["table"] < 1e-5, found
