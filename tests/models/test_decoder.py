"""The decoder families against transformers' PyTorch models on the same weights (tiny random
checkpoints saved with `save_pretrained`, offline), and decoder checkpoints in and out."""

from __future__ import annotations

import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from kubejax.models import decoder_weights, weights
from kubejax.models.decoder import DecoderClassifier, DecoderConfig
from tests.helpers import assert_close_to_scale, compiled_call
from tests.models.decoders import TINY, save_tiny

FAMILIES = list(TINY)


def _batch(vocab: int, padding: str, length: int = 20):
    """Three rows of random ids (none equal to the pad id 0), the second and third shorter,
    padded on `padding`'s side; longer than every tiny sliding window."""
    rng = np.random.default_rng(0)
    ids = rng.integers(1, vocab, size=(3, length))
    lengths = [length, 14, 9]
    mask = np.zeros_like(ids)
    for row, n in enumerate(lengths):
        if padding == "right":
            mask[row, :n] = 1
        else:
            mask[row, length - n :] = 1
    ids[mask == 0] = 0
    return ids, mask


def _ours(folder, task: str, num_labels: int = 3):
    cfg = weights.load_config(folder)
    model, fresh = weights.from_checkpoint(folder, cfg, task, num_labels, jnp.float32)
    assert fresh == []
    return model


@pytest.mark.parametrize("head", ["classification", "causal-lm"])
@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.slow
def test_logits_match_transformers(tmp_path, family, padding, head):
    """The classifier's logits, and the language model's at every real token (padded
    positions' outputs are read by neither)."""
    ref = save_tiny(family, tmp_path, head=head)
    ids, mask = _batch(300, padding)
    with torch.no_grad():
        expected = ref(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits
    ours = np.asarray(compiled_call(_ours(tmp_path, head), ids, mask))
    expected = expected.numpy()
    if head == "causal-lm":
        ours, expected = ours[mask.astype(bool)], expected[mask.astype(bool)]
    assert_close_to_scale(ours, expected, 1e-4, f"{family} {head} logits")


def test_the_families_switches_are_read_from_their_configs(tmp_path):
    """What the parity tests rely on: each switch set where its family sets it."""
    configs = {}
    for family in FAMILIES:
        save_tiny(family, tmp_path / family, head="base")
        configs[family] = weights.load_config(tmp_path / family)
    assert configs["qwen2"].qkv_bias and not configs["qwen2"].o_bias
    assert configs["qwen3"].qk_norm and not configs["qwen3"].qkv_bias
    assert configs["llama"].rope["full_attention"].type == "llama3"
    assert configs["mistral"].layer_types == ["sliding_attention"] * 2
    assert configs["mistral"].sliding_window == 7 and configs["mistral"].head_dim == 24
    gemma = configs["gemma3_text"]
    assert gemma.gemma and gemma.qk_norm and gemma.attention_scale == 24**-0.5
    assert gemma.layer_types == ["sliding_attention", "sliding_attention", "full_attention"]
    assert gemma.rope["sliding_attention"].theta == 10000.0
    assert gemma.rope["full_attention"].type == "linear"


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_both_config_layouts_read_alike(tmp_path, family):
    """transformers 5.x writes `rope_parameters`; 4.x checkpoints carry `rope_theta` and
    `rope_scaling` (Gemma: `rope_local_base_freq`). Both give the same model config."""
    save_tiny(family, tmp_path, head="base")
    new = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" in new
    old = {k: v for k, v in new.items() if k not in ("rope_parameters", "dtype")}
    old.update(decoder_weights._old_rope_keys(DecoderConfig.from_dict(new)))
    assert "rope_parameters" not in old
    assert DecoderConfig.from_dict(old).rope == DecoderConfig.from_dict(new).rope


def test_bfloat16_sharded_checkpoint_loads(tmp_path):
    """A checkpoint stored in bfloat16 over several files (with its index) gives the model of
    its float32 values."""
    ref = save_tiny("qwen3", tmp_path / "f32", head="causal-lm")
    ref.to(torch.bfloat16).save_pretrained(str(tmp_path / "bf16"), max_shard_size="100KB")
    files = sorted(p.name for p in (tmp_path / "bf16").iterdir())
    assert decoder_weights.INDEX in files and sum(f.endswith(".safetensors") for f in files) > 2
    from transformers import AutoModelForCausalLM

    # The bfloat16-rounded weights in float32 (`ref.float()` would keep RoPE's frequencies
    # rounded to bfloat16 as well).
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path / "bf16"), dtype=torch.float32)
    ids, mask = _batch(300, "right")
    with torch.no_grad():
        expected = ref(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits
    ours = np.asarray(compiled_call(_ours(tmp_path / "bf16", "causal-lm"), ids, mask))
    real = mask.astype(bool)
    assert_close_to_scale(ours[real], expected.numpy()[real], 1e-4, "bf16 checkpoint logits")


@pytest.mark.parametrize("head", ["classification", "causal-lm"])
def test_the_matrices_load_in_the_param_dtype(tmp_path, head):
    """With `matrices` (a bfloat16 run's param_dtype) a float32 checkpoint's weight matrices
    and tables load in bfloat16, equal to the float32 load cast afterwards (which held the
    float32 model on the devices first); vectors and a classifier's head stay float32."""
    from flax import nnx

    from kubejax.models.kernels import matrices_in
    from kubejax.models.partitioning import is_matrix

    save_tiny("llama", tmp_path, head=head)
    cfg = weights.load_config(tmp_path)
    load = lambda **kw: weights.from_checkpoint(tmp_path, cfg, head, 3, jnp.float32, **kw)[0]  # noqa: E731
    ours, theirs = load(matrices=jnp.bfloat16), load()
    flat = nnx.to_flat_state(nnx.state(ours))
    expected = nnx.to_flat_state(matrices_in(nnx.state(theirs), jnp.bfloat16))
    for (path, mine), (_, cast) in zip(flat, expected, strict=True):
        value = mine[...]
        # A stacked layer's vectors are [layers, size]: matrices by their per-layer shape.
        if not is_matrix(".".join(map(str, path)), value.ndim) or path[0] == "score":
            assert value.dtype == jnp.float32, path
            continue
        assert value.dtype == jnp.bfloat16, path
        np.testing.assert_array_equal(value, cast[...], err_msg=str(path))


def test_a_checkpoint_that_does_not_match_its_config_is_named(tmp_path):
    from safetensors.numpy import load_file, save_file

    save_tiny("llama", tmp_path, head="causal-lm")
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.1.mlp.extra.weight"] = np.zeros(3, np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(KeyError) as err:
        _ours(tmp_path, "causal-lm")
    assert "missing model.layers.1.mlp.up_proj.weight" in str(err.value)
    assert "unexpected model.layers.1.mlp.extra.weight" in str(err.value)


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"model_type": "gpt2"}, r"model_type 'gpt2' is not supported \(bert, llama"),
        ({"model_type": "custom", "auto_map": {"AutoModel": "m.M"}}, r"needs the checkpoint's own"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, r"type 'yarn' is not supported"),
        ({"num_key_value_heads": 3}, r"num_attention_heads: 4 is not a multiple"),
    ],
)
def test_unsupported_configs_are_refused_naming_what_is_allowed(tmp_path, change, expected):
    save_tiny("llama", tmp_path, head="base")
    values = json.loads((tmp_path / "config.json").read_text())
    values.pop("rope_parameters") if "rope_scaling" in change else None
    (tmp_path / "config.json").write_text(json.dumps({**values, **change}))
    with pytest.raises(ValueError, match=expected):
        weights.load_config(tmp_path)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.slow
def test_export_loads_in_transformers_with_our_logits(tmp_path, family):
    """The classifier's exported folder: transformers' AutoModelForSequenceClassification loads
    it (config, weights, pad token) and gives our logits; our loader reads it back."""
    from transformers import AutoModelForSequenceClassification

    save_tiny(family, tmp_path / "base", head="causal-lm")
    cfg = weights.load_config(tmp_path / "base")
    model, fresh = weights.from_checkpoint(tmp_path / "base", cfg, "classification", 4, jnp.float32)
    assert fresh == ["score"]
    weights.save_model_dir(model, tmp_path / "out", ["a", "b", "c", "d"], None, max_length=32)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"][0].endswith("ForSequenceClassification")
    assert config["pad_token_id"] is not None and "rope_parameters" not in config
    ids, mask = _batch(300, "right")
    ours = np.asarray(compiled_call(model, ids, mask))
    ref = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "out")).eval()
    with torch.no_grad():
        expected = ref(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits
    assert_close_to_scale(ours, expected.numpy(), 1e-4, f"{family} exported logits")
    reloaded, labels = weights.load_model_dir(tmp_path / "out")
    assert labels == ["a", "b", "c", "d"] and isinstance(reloaded, DecoderClassifier)
    np.testing.assert_array_equal(np.asarray(compiled_call(reloaded, ids, mask)), ours)


def test_export_in_shards_when_over_the_shard_size(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    ref = save_tiny("mistral", tmp_path / "base", head="causal-lm")
    model = _ours(tmp_path / "base", "causal-lm")
    monkeypatch.setattr(decoder_weights, "SHARD_BYTES", 40_000)
    weights.save_model_dir(model, tmp_path / "out", [], None)
    index = json.loads((tmp_path / "out" / decoder_weights.INDEX).read_text())
    assert len(set(index["weight_map"].values())) > 2
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    ids, mask = _batch(300, "right")
    with torch.no_grad():
        args = {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)}
        np.testing.assert_array_equal(reloaded(**args).logits.numpy(), ref(**args).logits.numpy())


@pytest.mark.slow
def test_packed_rows_give_each_sequences_own_logits(tmp_path):
    """Evaluation packs several reviews to a row (segments, positions per review): a decoder
    classifier reads each review's last token, as for the review alone."""
    from kubejax.data.dataset import TokenizedSplit
    from kubejax.trainer.predict import predict_logits

    save_tiny("gemma3_text", tmp_path, head="classification")
    model = _ours(tmp_path, "classification")
    rng = np.random.default_rng(1)
    lengths = rng.choice([4, 11, 29], size=12)  # three shapes to compile alone
    values = rng.integers(1, 300, size=int(lengths.sum())).astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    split = TokenizedSplit(values, offsets, np.zeros(12, np.int32))
    packed = predict_logits(model, split, batch_size=8, max_length=64)
    logits = jax.jit(lambda ids: model(ids, jnp.ones_like(ids)))
    alone = np.concatenate(
        [np.asarray(logits(values[a:b][None])) for a, b in itertools.pairwise(offsets)]
    )
    assert_close_to_scale(packed, alone, 1e-5, "packed logits")


@pytest.mark.slow
def test_one_training_step_matches_torch(tmp_path):
    """The loss before and after one AdamW step (clipped, no weight decay) equals transformers'
    + torch's on the same weights and batch."""
    import optax
    from flax import nnx

    from kubejax.trainer import distributed, steps

    ref = save_tiny("qwen2", tmp_path, head="classification")
    model = _ours(tmp_path, "classification")
    ids, mask = _batch(300, "right")
    labels = np.array([0, 2, 1])
    tx = optax.inject_hyperparams(
        lambda learning_rate: optax.chain(
            optax.clip_by_global_norm(1.0), optax.adamw(learning_rate, weight_decay=0.0)
        )
    )(learning_rate=0.0)
    graphdef, params = nnx.split(model)
    mesh = distributed.data_mesh()
    step = steps.make_train_step(graphdef, tx, mesh, 0)
    params = distributed.replicate(params, mesh)
    opt_state = tx.init(params)
    batch = {"input_ids": ids[None], "attention_mask": mask[None], "labels": labels[None]}
    params, opt_state, first = step(params, opt_state, batch, 0, np.float32(1e-3))
    _, _, second = step(params, opt_state, batch, 1, np.float32(1e-3))

    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.0)
    args = {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)}
    losses = []
    for _ in range(2):
        loss = torch.nn.functional.cross_entropy(ref(**args).logits, torch.tensor(labels))
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
    np.testing.assert_allclose([float(first["loss"]), float(second["loss"])], losses, rtol=1e-4)


@pytest.mark.parametrize("family", ["mistral", "gemma3_text"])
@pytest.mark.slow
def test_answer_scores_equal_transformers_log_likelihoods(tmp_path, family):
    """A language model's evaluation scores every label's answer after the prompt in one pass
    (answers as branches that see the prompt and themselves): each score equals the sum of the
    answer's log-probabilities that transformers gives for prompt + answer alone. Prompts run
    past the sliding windows."""
    from kubejax.data import dataset

    ref = save_tiny(family, tmp_path, head="causal-lm")
    model = _ours(tmp_path, "causal-lm")
    rng = np.random.default_rng(2)
    lengths = rng.integers(3, 20, size=5)
    values = rng.integers(1, 300, size=int(lengths.sum())).astype(np.int32)
    split = dataset.TokenizedSplit(values, np.concatenate([[0], np.cumsum(lengths)]), np.zeros(5))
    answers = [[5], [6, 7], [8, 9, 10]]
    (batch,) = dataset.scoring_batches(
        split, answers, batch_size=8, local_devices=1, bucket_multiple=8, max_length=64
    )
    inputs = {k: v for k, v in batch.items() if k not in ("rows", "labels", "weights")}
    ours = np.asarray(jax.jit(lambda kw: model.label_scores(**kw))(inputs))[:, 0]
    rows = batch["rows"][:, 0]
    expected = np.zeros((len(rows), len(answers)))
    for r, i in enumerate(rows):
        if i < 0:
            continue
        prompt = values[split.offsets[i] : split.offsets[i + 1]].tolist()
        for k, answer in enumerate(answers):
            with torch.no_grad():
                logits = ref(input_ids=torch.tensor([prompt + answer])).logits[0]
            logp = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1]
            expected[r, k] = float(logp[torch.arange(len(answer)), torch.tensor(answer)].sum())
    real = rows >= 0
    assert real.sum() == 5
    assert_close_to_scale(ours[real], expected[real], 1e-4, f"{family} answer scores")


@pytest.mark.slow
def test_the_answer_loss_equals_transformers_on_the_answer_tokens(tmp_path):
    """Training a language model: a batch of prompts with each row's answer after it
    (`dataset.with_answers`); the loss is the cross-entropy of the answer tokens alone, as
    transformers computes it with the prompt's labels masked (-100)."""
    from kubejax.data import dataset
    from kubejax.trainer.steps import loss_fn

    ref = save_tiny("qwen3", tmp_path, head="causal-lm")
    model = _ours(tmp_path, "causal-lm")
    rng = np.random.default_rng(3)
    lengths = np.array([7, 12, 4])
    values = rng.integers(1, 300, size=int(lengths.sum())).astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    split = dataset.TokenizedSplit(values, offsets, np.array([2, 0, 1], np.int32))
    answers = [[5], [6, 7], [8, 9, 10]]
    rows = np.arange(3)
    batch = dataset.with_answers(dataset.gather(split, rows, 16), split, rows, answers)
    from flax import nnx

    graphdef, params = nnx.split(model)
    loss, _ = jax.jit(lambda p, b: loss_fn(graphdef, p, b, None, True))(params, batch)
    ids = torch.tensor(batch["input_ids"]).long()
    labels = torch.full_like(ids, -100)
    for r, i in enumerate(rows):
        n, answer = lengths[i], answers[split.labels[i]]
        labels[r, n : n + len(answer)] = torch.tensor(answer)
    with torch.no_grad():
        out = ref(
            input_ids=ids, attention_mask=torch.tensor(batch["attention_mask"]), labels=labels
        )
    np.testing.assert_allclose(float(loss), float(out.loss), rtol=1e-4)
