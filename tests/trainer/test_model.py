"""The Flax model against transformers' PyTorch BERT, and HF checkpoints in and out."""

from __future__ import annotations

import functools
import json
import math
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from flax import nnx
from transformers import BertConfig, BertForSequenceClassification, BertModel

from kubejax.models import weights
from kubejax.models.bert import BertClassifier
from tests.helpers import ZERO_GRADIENT_BY_SYMMETRY, assert_close_to_scale, compiled_call

torch.manual_seed(0)


def _inputs(vocab: int, batch: int = 3, length: int = 40):
    rng = np.random.default_rng(0)
    ids = rng.integers(1000 if vocab > 1000 else 1, vocab, size=(batch, length))
    mask = np.ones_like(ids)
    mask[1, 23:] = 0  # padding
    mask[2, 6:] = 0
    ids[mask == 0] = 0
    return ids, mask


def _ynn_fusions(hlo: str) -> dict[str, str]:
    """The body of every computation a compiled program hands to YNNPACK, by name."""
    bodies = {}
    for name in re.findall(r"fusion\([^\n]*calls=%([\w.-]+)[^\n]*__ynn_fusion", hlo):
        start = hlo.index(f"\n%{name} ")
        bodies[name] = hlo[start : hlo.index("\n}", start)]
    return bodies


def _ours(model_dir, num_labels=5):
    cfg = weights.load_config(model_dir)
    model = BertClassifier(cfg, num_labels, rngs=nnx.Rngs(0))
    fresh = weights.load_pretrained(model, weights.read_tensors(model_dir))
    return model, fresh


@pytest.mark.slow
def test_minilm_last_hidden_state_matches_transformers(minilm_dir):
    model, fresh = _ours(minilm_dir)
    assert fresh == ["classifier"]  # the checkpoint has a pooler, no head
    ids, mask = _inputs(30522)
    ref = BertModel.from_pretrained(str(minilm_dir)).eval()
    with torch.no_grad():
        expected = ref(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask))
    ours = np.asarray(compiled_call(model.bert, ids, mask))
    # Two frameworks, two sets of kernels: rounding only, relative to the states' own size.
    assert_close_to_scale(ours, expected.last_hidden_state.numpy(), 2e-5, "last hidden state")


def _small_config(**overrides) -> BertConfig:
    """A random-size transformers BERT config small enough to run in a second."""
    sizes = dict(
        hidden_size=48, num_hidden_layers=3, num_attention_heads=4, intermediate_size=96,
        vocab_size=500, max_position_embeddings=64,
    )  # fmt: skip
    return BertConfig(**{**sizes, **overrides})


@pytest.mark.slow
def test_random_small_config_matches_transformers(tmp_path):
    cfg = _small_config()
    ref = BertForSequenceClassification(cfg).eval()  # random init, num_labels 2
    ref.save_pretrained(str(tmp_path))
    model, fresh = _ours(tmp_path, num_labels=2)
    assert fresh == []
    ids, mask = _inputs(500, length=30)
    with torch.no_grad():
        out = ref(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            output_hidden_states=True,
        )
    hidden = np.asarray(compiled_call(model.bert, ids, mask))
    assert_close_to_scale(hidden, out.hidden_states[-1].numpy(), 1e-4, "hidden states")
    logits = np.asarray(compiled_call(model, ids, mask))
    assert_close_to_scale(logits, out.logits.numpy(), 1e-4, "logits")


@pytest.mark.slow
def test_gradients_match_transformers_backward(tmp_path):
    # Every parameter's gradient of the classification loss, ours (with the dense layers' own
    # backward, model.dense) against torch autograd through transformers' model.
    import jax

    from kubejax.trainer.steps import loss_fn

    cfg = _small_config(
        num_hidden_layers=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
    )
    ref = BertForSequenceClassification(cfg)
    ref.save_pretrained(str(tmp_path))
    model, _ = _ours(tmp_path, num_labels=2)
    ids, mask = _inputs(500, length=30)
    labels = np.array([0, 1, 1], np.int32)
    out = ref(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask))
    torch.nn.functional.cross_entropy(out.logits, torch.tensor(labels).long()).backward()
    expected = {name: p.grad.numpy() for name, p in ref.named_parameters()}

    graphdef, params = nnx.split(model, nnx.Param)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    grads = jax.jit(jax.grad(lambda p: loss_fn(graphdef, p, batch, None, deterministic=True)[0]))(
        params
    )
    ours = weights.export_tensors(nnx.merge(graphdef, grads))
    assert ours.keys() <= expected.keys() and len(ours) > 30
    for name, grad in ours.items():
        if name.endswith(ZERO_GRADIENT_BY_SYMMETRY):  # rounding noise on both sides
            assert np.abs(grad).max() < 1e-9 and np.abs(expected[name]).max() < 1e-9, name
            continue
        assert_close_to_scale(grad, expected[name], 1e-4, name)


@pytest.mark.slow
def test_cls_only_last_layer_equals_full_computation(minilm_dir):
    model, _ = _ours(minilm_dir)
    ids, mask = _inputs(30522)
    full = np.asarray(compiled_call(model.bert, ids, mask))
    cls = np.asarray(compiled_call(model.bert, ids, mask, cls_only=True))
    assert cls.shape == (3, 1, 384)
    # Other matmul shapes, other kernels: equal up to rounding.
    assert_close_to_scale(cls[:, 0], full[:, 0], 1e-5, "[CLS] state")


@pytest.mark.slow
def test_packed_rows_give_each_sequence_the_logits_it_has_alone(minilm_dir):
    # Several reviews a row: each attends to itself alone, from position 0, and is classified
    # from its own [CLS]; an empty slot or a row of padding stays finite.
    model, _ = _ours(minilm_dir)
    rng = np.random.default_rng(2)
    packs = [[20, 30, 11], [50], [7, 9], []]
    seqs = [[np.array([101, *rng.integers(1000, 30000, n - 2), 102]) for n in p] for p in packs]
    ids, segments, positions = (np.zeros((4, 64), np.int32) for _ in range(3))
    starts = np.zeros((4, 3), np.int32)
    for r, row in enumerate(seqs):
        at = 0
        for s, seq in enumerate(row):
            ids[r, at : at + len(seq)], segments[r, at : at + len(seq)] = seq, s + 1
            positions[r, at : at + len(seq)], starts[r, s] = np.arange(len(seq)), at
            at += len(seq)
    packed = np.asarray(compiled_call(model, ids, segments, positions=positions, starts=starts))
    assert packed.shape == (4, 3, 5) and np.isfinite(packed).all()
    # Each review alone: a row of its own, padded (one call, so one shape to run).
    flat = [seq for row in seqs for seq in row]
    rows, masks = (np.zeros((len(flat), 64), np.int32) for _ in range(2))
    for i, seq in enumerate(flat):
        rows[i, : len(seq)], masks[i, : len(seq)] = seq, 1
    alone = iter(np.asarray(compiled_call(model, rows, masks)))
    for r, row in enumerate(seqs):
        for s, _ in enumerate(row):
            assert_close_to_scale(packed[r, s], next(alone), 1e-5, f"row {r} review {s}")
    # One review a row: the key mask alone, the same logits as unpacked.
    ids, mask = _inputs(30522)
    one = compiled_call(
        model, ids, mask, positions=np.tile(np.arange(40), (3, 1)), starts=np.zeros((3, 1), int)
    )
    assert_close_to_scale(
        np.asarray(one)[:, 0], np.asarray(compiled_call(model, ids, mask)), 1e-5, "logits"
    )


@pytest.mark.slow
def test_folded_cls_attention_equals_keys_and_values_under_dropout(minilm_dir):
    # The last layer's [CLS] attention folds its query into the key and value weights; with
    # the same dropout mask it equals attention through every position's keys and values.
    import jax.numpy as jnp

    model, _ = _ours(minilm_dir)
    layer = model.bert.layers[-1]
    _, mask = _inputs(30522)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((3, 40, 384)), jnp.float32)
    bias = jnp.asarray((1.0 - mask[:, None, None, :]) * np.finfo(np.float32).min)
    q = layer.query(x[:, :1]) / np.sqrt(32.0)

    def attend(method, deterministic):
        return np.asarray(method(x, q, bias, deterministic=deterministic, rngs=nnx.Rngs(7)))

    full = attend(layer._attention, deterministic=False)
    assert not np.allclose(full, attend(layer._attention, deterministic=True))  # masks drawn
    folded = attend(layer._folded_attention, deterministic=False)
    assert folded.shape == (3, 1, 384)
    assert_close_to_scale(folded, full, 2e-5, "[CLS] attention")


@pytest.mark.slow
def test_pytorch_bin_with_bert_prefix_loads(tmp_path, minilm_dir):
    ref = BertModel.from_pretrained(str(minilm_dir))
    state = {f"bert.{k}": v for k, v in ref.state_dict().items()}
    torch.save(state, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text((minilm_dir / "config.json").read_text())
    model, fresh = _ours(tmp_path)
    assert fresh == ["classifier"]
    ours_safetensors, _ = _ours(minilm_dir)
    ids, mask = _inputs(30522)
    # The same weights through the same program.
    assert_close_to_scale(
        compiled_call(model.bert, ids, mask),
        compiled_call(ours_safetensors.bert, ids, mask),
        1e-6,
        "hidden states",
    )


@pytest.mark.slow
def test_saved_model_folder_loads_in_transformers_and_back(tmp_path, minilm_dir):
    model, _ = _ours(minilm_dir, num_labels=3)
    weights.save_model_dir(model, tmp_path / "m", ["neg", "mid", "pos"], minilm_dir, max_length=64)
    reloaded, labels = weights.load_model_dir(tmp_path / "m")
    assert labels == ["neg", "mid", "pos"]
    ids, mask = _inputs(30522)
    logits = compiled_call(model, ids, mask)
    assert_close_to_scale(compiled_call(reloaded, ids, mask), logits, 1e-6, "logits after reload")
    hf = BertForSequenceClassification.from_pretrained(str(tmp_path / "m")).eval()
    with torch.no_grad():
        hf_logits = hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits
    assert_close_to_scale(hf_logits.numpy(), logits, 1e-4, "transformers' logits")


@pytest.mark.slow
def test_the_trainer_imports_neither_transformers_nor_torch():
    # Every sweep trial pays its imports; transformers (and torch through it) cost over 2 s.
    code = (
        "import sys, kubejax.trainer.train; "
        "print(sorted({'transformers', 'torch'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_config_fields_of_the_wrong_type_or_range_are_named(tmp_path):
    for values, message in [
        ({"hidden_size": "wide"}, "hidden_size: must be a positive integer, got 'wide'"),
        ({"num_hidden_layers": 0}, "num_hidden_layers: must be a positive integer"),
        ({"hidden_dropout_prob": "x"}, "hidden_dropout_prob: must be a non-negative number"),
        ({"attention_probs_dropout_prob": 1.0}, "attention_probs_dropout_prob: must be in [0, 1)"),
        ({"classifier_dropout": 1.5}, "classifier_dropout: must be in [0, 1), got 1.5"),
        ({"hidden_size": 30, "num_attention_heads": 4}, "not a multiple of num_attention_heads"),
        ({"hidden_act": "swish"}, "hidden_act: 'swish' is not supported (gelu, gelu_new, "),
    ]:
        (tmp_path / "config.json").write_text(json.dumps(values))
        with pytest.raises(ValueError, match=re.escape(message)):
            weights.load_config(tmp_path)
    with pytest.raises(ValueError, match="hiden_size: not a BERT config field"):
        weights.BertConfig.from_dict({"hiden_size": 32}, strict=True)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        weights.load_config(tmp_path)


def test_checkpoint_folder_problems_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        weights.load_config(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors"):
        weights.read_tensors(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a folder"):
        weights.resolve_model_dir(str(tmp_path / "missing" / "model"))


@pytest.mark.slow
def test_the_cpu_evaluation_step_keeps_xlas_default_ynnpack_fusions(minilm_dir):
    # Asking XLA for YNNPACK's products alone, as the evaluation step once did, measured slower
    # (float32 1 %, bfloat16 7 %; bench/NOTES.md, attempt 42) than its default fusions, which
    # also hand YNNPACK the reductions and the softmax around the attention products.
    import jax.numpy as jnp

    from kubejax.models.kernels import matrices_in
    from kubejax.trainer import distributed
    from kubejax.trainer.steps import make_eval_step

    cfg = weights.load_config(minilm_dir)
    model = BertClassifier(cfg, 5, jnp.bfloat16, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    ids, mask = _inputs(cfg.vocab_size)
    batch = {  # one review a row
        "input_ids": ids,
        "segments": mask,
        "positions": np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape),
        "starts": np.zeros((len(ids), 1), np.int32),
        "labels": np.zeros((len(ids), 1), np.int32),
        "weights": np.ones((len(ids), 1), np.float32),
    }
    eval_step = make_eval_step(graphdef, distributed.data_mesh())
    hlo = eval_step.lower(matrices_in(params, jnp.bfloat16), batch).compile().as_text()
    kinds = [set(re.findall(r"= \S+ (\w[\w-]*)\(", body)) for body in _ynn_fusions(hlo).values()]
    assert any("reduce" in ops and "dot" not in ops for ops in kinds), kinds
    assert any({"dot", "exponential"} <= ops for ops in kinds), kinds


@pytest.mark.slow
def test_the_cpu_train_step_gives_ynnpack_every_weight_gradient_product(minilm_dir):
    # XLA derives a dense layer's weight gradient (and the attention's key and value gradients)
    # as a product contracting the token axis of both operands, which YNNPACK does not take;
    # XLA's own loops ran them at a third of its speed. model.dense's and model.matmul's
    # backward transposes one operand first (bench/NOTES.md).
    import optax

    from kubejax.models.bert import Dense
    from kubejax.trainer import distributed
    from kubejax.trainer.steps import make_train_step

    model, _ = _ours(minilm_dir)
    graphdef, params = nnx.split(model, nnx.Param)
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    mesh = distributed.data_mesh()
    ids, mask = _inputs(30522, batch=8, length=128)
    labels = np.zeros((1, 8), np.int32)
    batch = {"input_ids": ids[None], "attention_mask": mask[None], "labels": labels}
    step = make_train_step(graphdef, tx, mesh, 0)
    hlo = step.lower(params, tx.init(params), batch, 0, np.float32(0.1)).compile().as_text()
    entry = hlo[hlo.index("\nENTRY") :]
    kernels = {
        tuple(node.kernel.shape) for _, node in nnx.iter_graph(model) if isinstance(node, Dense)
    }
    outside = [
        line.strip()[:120]
        for line in entry.splitlines()
        if re.search(r"= f32\[(\d+),(\d+)\]\{1,0\} dot\(", line)
        and tuple(map(int, re.search(r"f32\[(\d+),(\d+)\]", line).groups())) in kernels
    ]
    # The attention's batched products ([batch, heads, tokens, tokens or head_dim]).
    outside += [
        line.strip()[:120]
        for line in entry.splitlines()
        if re.search(r"= f32\[\d+,\d+,\d+,\d+\]\{[\d,]+\} dot\(", line)
    ]
    assert not outside, outside
    assert len(re.findall(r"__ynn_fusion", hlo)) > 20


@pytest.mark.slow
def test_bfloat16_products_sum_in_float32(minilm_dir):
    # XLA's CPU backend runs a bfloat16 product in YNNPACK's bfloat16 kernels only when it asks
    # for a float32 result: with a bfloat16 result it ran no faster than float32 (model.product;
    # bench/NOTES.md, attempt 33): the dense layers' and the attention's products in the
    # bfloat16 train step, forward and backward.
    import jax.numpy as jnp
    import optax

    from kubejax.trainer import distributed
    from kubejax.trainer.steps import make_train_step

    cfg = weights.load_config(minilm_dir)
    model = BertClassifier(cfg, 5, jnp.bfloat16, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    ids, mask = _inputs(30522, batch=8, length=64)
    labels = np.zeros((1, 8), np.int32)
    batch = {"input_ids": ids[None], "attention_mask": mask[None], "labels": labels}
    step = make_train_step(graphdef, tx, distributed.data_mesh(), 0)
    text = step.lower(params, tx.init(params), batch, 0, np.float32(0.1)).as_text()
    typed = r"dot_general .*: \(tensor<\S+x(\w+)>, tensor<\S+x(\w+)>\) -> tensor<\S+x(\w+)>"
    dots = re.findall(typed, text)
    assert dots.count(("bf16", "bf16", "f32")) > 100, sorted(set(dots))
    # The rest: the last layer's [CLS] attention, 4 einsums and their 8 gradients of a few
    # hundred thousand FLOPs, left in bfloat16: XLA's CPU runtime has no bfloat16 product with
    # a float32 result outside YNNPACK, which does not take their layout.
    assert len(dots) - dots.count(("bf16", "bf16", "f32")) <= 12, sorted(set(dots))
    # And XLA keeps them in bfloat16: a weight gradient's transposed operand, or an attention
    # operand in head-major order, left as a view had XLA convert both operands and run the
    # product in float32 (model._in_memory; bench/NOTES.md, attempt 37).
    hlo = step.lower(params, tx.init(params), batch, 0, np.float32(0.1)).compile().as_text()
    products = []
    for body in _ynn_fusions(hlo).values():
        types = dict(re.findall(r"(%[\w.-]+) = (\w+\[[\d,]*\])", body))
        dot = r"= \w+\[([\d,]+)\]\S* dot\((%[\w.-]+), (%[\w.-]+)\),[^\n]*?lhs_contracting_dims"
        for out, a, b, axis in re.findall(dot + r"={(\d+)", body):
            a_type, a_shape = types[a].rstrip("]").split("[")
            depth = int(a_shape.split(",")[int(axis)])
            flops = 2 * depth * math.prod(map(int, out.split(",")))
            products.append((flops, a_type, types[b].split("[")[0]))
    # Over 10 MFLOP: the 5 layers before the last, 6 dense products forward and 12 backward,
    # 2 attention products forward and 4 backward each (the rest: the last layer's [CLS]
    # position, the pooler and the classifier, over the batch's 8 rows).
    large = [p for p in products if p[0] >= 10**7]
    assert len(large) == 5 * (6 + 12 + 2 + 4), len(large)
    upcast = [p for p in large if p[1:] != ("bf16", "bf16")]
    assert not upcast, f"{len(upcast)} of {len(large)} products in float32: {upcast[:5]}"


def _bfloat16_gradient_jaxpr(model_dir, length: int) -> tuple[weights.BertConfig, str]:
    """The jaxpr of the gradient of a bfloat16 model's logits over 3 rows of `length` tokens."""
    import jax
    import jax.numpy as jnp

    cfg = weights.load_config(model_dir)
    model = BertClassifier(cfg, 5, jnp.bfloat16, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    ids, mask = _inputs(cfg.vocab_size, batch=3, length=length)

    def loss(params):
        return nnx.merge(graphdef, params)(ids, mask).sum()

    return cfg, str(jax.make_jaxpr(jax.grad(loss))(params))


@pytest.mark.slow
def test_a_bfloat16_model_casts_the_embedding_rows_it_takes_not_the_tables(minilm_dir):
    # nnx.Embed casts its whole table to the compute dtype: a 30,522 x 384 convert every
    # bfloat16 step, and the gradient scattered into a zeroed table of its own for every piece
    # of a batch (model._rows; bench/NOTES.md, attempt 38).
    cfg, text = _bfloat16_gradient_jaxpr(minilm_dir, length=32)
    tables = [(cfg.vocab_size, cfg.hidden_size), (cfg.max_position_embeddings, cfg.hidden_size)]
    for rows, width in tables:
        assert f"[{rows},{width}] = convert_element_type" not in text, (rows, width)
    assert f"bf16[3,32,{cfg.hidden_size}] = convert_element_type" in text


@pytest.mark.slow
def test_a_bfloat16_model_computes_its_activation_in_float32(minilm_dir):
    # In bfloat16 every intermediate of the GELU and of its gradient was rounded to bfloat16
    # and back, a dozen converts an element that XLA's CPU backend keeps (bench/NOTES.md,
    # attempt 40): the activation runs in float32 between one cast in and one out.
    cfg, text = _bfloat16_gradient_jaxpr(minilm_dir, length=16)
    width = cfg.intermediate_size
    assert re.findall(rf"f32\[3,16,{width}\] = erf", text)
    assert not re.findall(rf"bf16\[[\d,]*{width}\] = (erf|exp|mul|add)", text)


def test_off_cpu_bfloat16_products_return_bfloat16(monkeypatch):
    # A GPU's matrix units sum bfloat16 in float32 whatever the result's dtype; a float32 result
    # there only adds memory traffic and a cast back (model.product; bench/NOTES.md, attempt 35).
    import jax
    import jax.numpy as jnp

    from kubejax.models.kernels import dense, matmul

    def dots() -> list[tuple[str, str, str]]:
        """The operand and result types of the products of a dense layer and an attention
        product, forward and backward (traced afresh: JAX caches traces)."""

        def loss(x, kernel, bias, other):
            return matmul(dense(x, kernel, bias)[None], other).astype(jnp.float32).sum()

        x, other = jnp.ones((4, 8), jnp.bfloat16), jnp.ones((1, 3, 2), jnp.bfloat16)
        kernel, bias = jnp.ones((8, 3)), jnp.zeros(3)
        lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(x, kernel, bias, other)
        typed = r"dot_general .*: \(tensor<\S+x(\w+)>, tensor<\S+x(\w+)>\) -> tensor<\S+x(\w+)>"
        return re.findall(typed, lowered.as_text())

    on_cpu = dots()
    assert on_cpu and set(on_cpu) == {("bf16", "bf16", "f32")}, on_cpu
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    off_cpu = dots()
    assert len(off_cpu) == len(on_cpu) and set(off_cpu) == {("bf16", "bf16", "bf16")}, off_cpu


@pytest.mark.slow
def test_a_bfloat16_model_gives_the_float32_models_logits_and_gradients(minilm_dir):
    # The compute dtype of the compiled pipeline's training (parameters stay float32): the same
    # loss, logits and gradients as float32 up to bfloat16's 8 bits of precision.
    import jax
    import jax.numpy as jnp

    from kubejax.trainer.steps import loss_fn

    ids, mask = _inputs(30522, batch=4, length=48)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": np.array([0, 1, 2, 3])}
    found = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        cfg = weights.load_config(minilm_dir)
        model = BertClassifier(cfg, 5, dtype, rngs=nnx.Rngs(0))
        weights.load_pretrained(model, weights.read_tensors(minilm_dir))
        graphdef, params = nnx.split(model, nnx.Param)

        def loss(p, graphdef=graphdef):
            return loss_fn(graphdef, p, batch, None, deterministic=True)

        (value, (_, logits)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
        assert logits.dtype == jnp.float32
        found[dtype] = value, logits, jax.tree.leaves(grads)
    (loss32, logits32, grads32), (loss16, logits16, grads16) = found.values()
    assert abs(float(loss16) - float(loss32)) < 2e-3 * abs(float(loss32))
    assert_close_to_scale(logits16, logits32, 5e-2, "logits")
    assert all(g.dtype == jnp.float32 for g in grads16)
    for g16, g32 in zip(grads16, grads32, strict=True):
        if float(np.abs(g32).max()) > 1e-6:
            assert_close_to_scale(g16, g32, 0.2, "gradient")


@pytest.mark.parametrize(
    ("rows", "length", "budget", "expected"),
    [(32, 128, 1024, 8), (16, 512, 1024, 2), (7, 256, 1024, 1), (32, 32, 1024, 32),
     (4, 2048, 1024, 1), (12, 128, 1024, 6), (32, 128, 0, 32)],
)  # fmt: skip
def test_a_piece_is_the_most_rows_dividing_the_batch_within_the_token_budget(
    rows, length, budget, expected
):
    from kubejax.trainer.steps import piece_rows

    assert piece_rows(rows, length, budget) == expected


def _tiny_classifier(dropout: float = 0.0):
    from kubejax.models.bert import BertConfig as OurConfig

    cfg = OurConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        vocab_size=100, max_position_embeddings=512, hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )  # fmt: skip
    return BertClassifier(cfg, 5, rngs=nnx.Rngs(0))


@pytest.mark.slow
def test_a_batch_in_pieces_gives_the_whole_batchs_gradients_and_logits():
    # On CPU the steps run a device's batch in pieces of CPU_PIECE_TOKENS tokens; the mean of
    # the pieces' gradients is the batch's (equal pieces), the logits are the same rows'.
    import jax

    from kubejax.trainer.steps import _gradients, _logits_in_pieces

    model = _tiny_classifier()
    graphdef, params = nnx.split(model, nnx.Param)
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 100, (1, 12, 256)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[0, 3, 100:] = 0  # padding in one row of one piece
    batch = {"input_ids": ids, "attention_mask": mask, "labels": rng.integers(0, 5, (1, 12))}
    key = jax.random.key(0)
    # Jitted as the train step runs them (op by op, each shape's every operation compiles).
    gradients = jax.jit(functools.partial(_gradients, graphdef), static_argnames="budget")
    whole = gradients(params, batch, key, budget=0)
    pieces = gradients(params, batch, key, budget=1024)  # 3 pieces of 4 rows
    np.testing.assert_allclose(float(pieces[0]), float(whole[0]), rtol=1e-5)
    assert float(pieces[1]) == float(whole[1])
    typical = max(float(np.abs(g).max()) for g in jax.tree.leaves(whole[2]))
    got = jax.tree_util.tree_flatten_with_path(pieces[2])[0]
    for (path, g), want in zip(got, jax.tree.leaves(whole[2]), strict=True):
        name = jax.tree_util.keystr(path)
        if "['key']['bias']" in name:  # zero by symmetry: rounding noise on both sides
            assert float(np.abs(g).max()) <= 1e-6 * typical, name
        else:
            assert_close_to_scale(g, want, 1e-4, name)
    flat = {  # one review a row, as the evaluation's packed batches hold it
        "input_ids": ids[0],
        "segments": mask[0],
        "positions": np.broadcast_to(np.arange(256, dtype=np.int32), (12, 256)),
        "starts": np.zeros((12, 1), np.int32),
    }
    assert_close_to_scale(
        _logits_in_pieces(model, flat, 1, 1024)[:, 0],
        model(ids[0], mask[0], deterministic=True),
        1e-5,
        "logits",
    )


@pytest.mark.slow
def test_the_cpu_train_step_keeps_its_temporaries_to_a_piece(monkeypatch):
    import optax

    from kubejax.trainer import distributed, steps

    graphdef, params = nnx.split(_tiny_classifier(dropout=0.1), nnx.Param)
    tx = optax.inject_hyperparams(optax.adamw)(learning_rate=0.1)
    ids = np.ones((1, 32, 256), np.int32)
    batch = {"input_ids": ids, "attention_mask": ids, "labels": np.zeros((1, 32), np.int32)}

    def temporaries() -> int:
        step = steps.make_train_step(graphdef, tx, distributed.data_mesh(), 0)
        compiled = step.lower(params, tx.init(params), batch, 0, np.float32(0.1)).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    pieces = temporaries()  # 8 pieces of 4 rows
    monkeypatch.setattr(steps, "CPU_PIECE_TOKENS", 0)
    assert pieces < temporaries() / 3


def test_dropout_bits_look_independent_and_uniform():
    import jax

    from kubejax.models.projection import dropout_bits

    bits = np.asarray(dropout_bits(jax.random.key(0), (64, 99, 101)))  # odd element count
    assert bits.dtype == np.uint16 and bits.shape == (64, 99, 101)
    flat = bits.reshape(-1).astype(np.int64)
    # Uniform: each of the 256 high-byte and low-byte values about equally often (chi-square
    # with 255 degrees of freedom; 330 is its 0.1 % tail).
    for byte in (flat >> 8, flat & 0xFF):
        counts = np.bincount(byte, minlength=256)
        expected = flat.size / 256
        assert ((counts - expected) ** 2 / expected).sum() < 330
    # Independent: neighbours (the two halves of one hash, and consecutive hashes) and the
    # same position under another key are uncorrelated.
    u = flat / 65535.0 - 0.5
    for lag in (1, 2, 101):
        assert abs(np.corrcoef(u[:-lag], u[lag:])[0, 1]) < 0.01
    other = np.asarray(dropout_bits(jax.random.key(1), (64, 99, 101))).reshape(-1) / 65535.0
    assert abs(np.corrcoef(u, other)[0, 1]) < 0.01
    # A function of the key alone.
    assert np.array_equal(bits, np.asarray(dropout_bits(jax.random.key(0), (64, 99, 101))))


def test_dropout_zeroes_the_rate_and_keeps_the_mean():
    import jax.numpy as jnp

    from kubejax.models.bert import Dropout

    x = jnp.ones((512, 1024))
    y = np.asarray(Dropout(0.1)(x, deterministic=False, rngs=nnx.Rngs(dropout=3)))
    dropped = (y == 0).mean()
    # 524,288 draws: the standard error of the fraction is 0.0004.
    assert abs(dropped - 0.1) < 0.002
    assert abs(y.mean() - 1.0) < 0.003
    assert np.allclose(y[y != 0], 1 / (1 - 6554 / 65536))
    assert np.array_equal(np.asarray(Dropout(0.1)(x, deterministic=True, rngs=None)), x)


@pytest.mark.slow
def test_off_cpu_dropout_bits_are_the_cpu_bits(monkeypatch):
    # Off CPU each element hashes its own half-word (so XLA can fuse the mask): the same bits.
    import jax

    from kubejax.models.projection import dropout_bits

    shapes = [(7,), (3, 5, 9), (2, 4, 64, 64)]
    on_cpu = [np.asarray(dropout_bits(jax.random.key(5), s)) for s in shapes]
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    for shape, expected in zip(shapes, on_cpu, strict=True):
        assert np.array_equal(np.asarray(dropout_bits(jax.random.key(5), shape)), expected)


@pytest.mark.slow
def test_softmax_dropout_equals_softmax_then_dropout_and_its_gradient():
    # The fused attention probabilities (used off CPU) against JAX's softmax and `Dropout`
    # under the same key, values and gradient, in float32 and in bfloat16.
    import jax
    import jax.numpy as jnp

    from kubejax.models.bert import Dropout, softmax_dropout

    rng = np.random.default_rng(0)
    scores = rng.normal(0, 3, (2, 3, 16, 24)).astype(np.float32)
    bias = np.zeros((2, 1, 1, 24), np.float32)
    bias[1, ..., 17:] = np.finfo(np.float32).min  # padded keys
    g = rng.normal(0, 1, scores.shape).astype(np.float32)
    key = jax.random.key(11)

    def reference(s):
        probs = jax.nn.softmax(s.astype(jnp.float32) + bias, axis=-1)
        rngs = nnx.Rngs(dropout=0)
        rngs.dropout = lambda: key
        return Dropout(0.1)(probs, deterministic=False, rngs=rngs)

    def ours(s):
        return softmax_dropout(s, bias, key, 0.1).astype(jnp.float32)

    for dtype, tolerance in ((jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)):
        s = jnp.asarray(scores, dtype)
        expected, expected_vjp = jax.vjp(reference, s.astype(jnp.float32))
        found, found_vjp = jax.vjp(ours, s)
        assert found.dtype == jnp.float32
        assert (np.asarray(found) == 0).sum() == (np.asarray(expected) == 0).sum()
        assert_close_to_scale(np.asarray(found), np.asarray(expected), tolerance, str(dtype))
        (grad,) = found_vjp(jnp.asarray(g))
        (expected_grad,) = expected_vjp(jnp.asarray(g))
        assert grad.dtype == dtype
        assert_close_to_scale(
            np.asarray(grad, np.float32), np.asarray(expected_grad), tolerance * 2, str(dtype)
        )


@pytest.mark.slow
def test_off_cpu_training_gives_the_cpu_forms_loss_and_gradients(monkeypatch):
    # Off CPU the attention's probabilities come from `softmax_dropout`, the products return
    # the operands' dtype and the dropout bits are elementwise: with the same dropout masks,
    # the float32 train loss and gradients of the CPU form.
    import jax

    from kubejax.models import bert as ours
    from kubejax.trainer.steps import loss_fn

    model = _tiny_classifier(dropout=0.1)
    graphdef, params = nnx.split(model, nnx.Param)
    ids, mask = _inputs(100, batch=4, length=24)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": np.array([0, 1, 2, 3])}
    calls = []
    fused = ours.softmax_dropout

    def counted(*args):
        calls.append(args[0].shape)
        return fused(*args)

    def loss_and_grads():
        """Traced afresh (JAX caches traces), jitted."""
        grad_fn = jax.value_and_grad(loss_fn, argnums=1, has_aux=True)
        step = jax.jit(lambda p, key: grad_fn(graphdef, p, batch, key, False))
        (loss, _), grads = step(params, jax.random.key(2))
        return float(loss), grads

    cpu_loss, cpu_grads = loss_and_grads()
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(ours, "softmax_dropout", counted)
    gpu_loss, gpu_grads = loss_and_grads()
    assert calls == [(4, 2, 24, 24), (4, 2, 1, 24)]  # the last layer: [CLS] alone
    assert abs(gpu_loss - cpu_loss) <= 1e-6 * abs(cpu_loss)
    expected = weights.export_tensors(nnx.merge(graphdef, cpu_grads))
    found = weights.export_tensors(nnx.merge(graphdef, gpu_grads))
    assert found.keys() == expected.keys() and len(found) > 30
    for name, grad in found.items():
        if name.endswith(ZERO_GRADIENT_BY_SYMMETRY):  # rounding noise on both sides
            assert np.abs(grad).max() < 1e-9 and np.abs(expected[name]).max() < 1e-9, name
            continue
        assert_close_to_scale(grad, expected[name], 1e-5, name)
