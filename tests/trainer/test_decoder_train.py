"""Fine-tuning the decoder families through the trainer: prepared data from a byte-level BPE
tokenizer, training, the exported model, evaluation and the served model's predictions."""

from __future__ import annotations

import functools
import json
import logging
import re
import shutil

import numpy as np
import pytest

from kubejax.trainer.train import main
from tests.helpers import assert_close_to_scale, tiny_args
from tests.models.decoders import TINY, save_tiny


@pytest.mark.parametrize("family", list(TINY))
@pytest.mark.slow
def test_each_family_fine_tunes_as_a_classifier(
    family, tiny_decoder_dir, prepared_decoder, tmp_path
):
    """A few steps of each family from a base (`*ForCausalLM`) checkpoint: the score head is
    fresh, the loss falls, and the exported folder evaluates as a classifier."""
    from kubejax.evaluate import evaluate_model

    model_dir = tmp_path / family
    vocab = json.loads((tiny_decoder_dir / "config.json").read_text())["vocab_size"]
    save_tiny(family, model_dir, vocab_size=vocab, max_position_embeddings=128)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_decoder_dir / name, model_dir / name)
    out = tmp_path / "out"
    args = tiny_args(
        model_dir, prepared_decoder, out, max_steps=24, global_batch_size=16, learning_rate=1e-2
    )
    assert main(args) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    losses = [row["loss"] for row in metrics["train"]]
    assert np.mean(losses[-6:]) < np.mean(losses[:6]), losses
    config = json.loads((out / "model" / "config.json").read_text())
    assert config["model_type"] == family and config["id2label"]["4"] == "5"
    result = evaluate_model(out / "model", prepared_decoder)
    assert result["examples"] == 300 and 0.0 <= result["accuracy"] <= 1.0


@pytest.mark.slow
def test_served_decoder_predicts_labels(tiny_decoder_dir, prepared_decoder, tmp_path):
    """The MLflow pyfunc model of a fine-tuned decoder: texts in, labels and probabilities out,
    the same as evaluation's predictions for those texts."""
    import pandas as pd

    from kubejax.mlflow_model import BertTextClassifier

    out = tmp_path / "out"
    assert main(tiny_args(tiny_decoder_dir, prepared_decoder, out, max_steps=3)) == 0
    served = BertTextClassifier()
    served._load(out / "model")
    texts = ["The tacos were amazing and the staff friendly.", "Cold food, rude waiter."]
    table = served.predict(None, pd.DataFrame({"text": texts}))
    probs = table[[f"prob_{i}" for i in range(1, 6)]].to_numpy()
    np.testing.assert_allclose(probs.sum(1), 1.0, rtol=1e-5)
    assert list(table["label"]) == [str(i + 1) for i in probs.argmax(1)]


@pytest.mark.slow
def test_causal_lm_fine_tunes_evaluates_and_serves(tiny_decoder_dir, prepared_prompts, tmp_path):
    """task causal-lm: the decoder learns to write each review's label after its prompt; the
    exported language model evaluates by scoring every label's answer, and the served model
    builds the same prompts (its predictions for test texts are evaluation's)."""
    import pandas as pd

    from kubejax.data.dataset import load_split
    from kubejax.evaluate import evaluate_model
    from kubejax.mlflow_model import BertTextClassifier

    out = tmp_path / "out"
    args = tiny_args(tiny_decoder_dir, prepared_prompts, out, max_steps=24, learning_rate=3e-3)
    assert main([*args, "--global-batch-size", "16"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    losses = [row["loss"] for row in metrics["train"]]
    assert np.mean(losses[-6:]) < np.mean(losses[:6]), losses
    config = json.loads((out / "model" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    settings = json.loads((out / "model" / "kubejax.json").read_text())
    assert (
        settings["task"] == "causal-lm"
        and settings["prompt_template"] == "Review: {review}\nRating:"
    )
    result = evaluate_model(out / "model", prepared_prompts)
    assert result["examples"] == 300 and len(result["confusion_matrix"]) == 5
    served = BertTextClassifier()
    served._load(out / "model")
    texts = load_split(prepared_prompts, "test", with_text=True).texts[:8]
    table = served.predict(None, pd.DataFrame({"text": texts}))
    assert list(table["label_id"]) == result["predictions"][:8]


def test_prompts_keep_the_template_and_fit_the_answers(tiny_decoder_dir, prepared_prompts):
    from kubejax.data.dataset import load_split, read_metadata
    from kubejax.data.tokenizer import load_tokenizer

    meta = read_metadata(prepared_prompts)
    assert meta["task"] == "causal-lm" and len(meta["answers"]) == 5
    tok = load_tokenizer(str(tiny_decoder_dir), 64).reference
    tail = tok.encode("\nRating:", add_special_tokens=False).ids
    split = load_split(prepared_prompts, "train")
    longest = max(map(len, meta["answers"]))
    for i in range(50):
        row = split.values[split.offsets[i] : split.offsets[i + 1]].tolist()
        assert row[0] == tok.token_to_id("<|begin_of_text|>") and row[-len(tail) :] == tail
        assert len(row) + longest <= 64
    assert meta["splits"]["train"]["truncation_rate"] > 0  # long reviews were cut to fit


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ({"dropout": 0.1}, "dropout: 0.1, but decoder models train without dropout"),
        ({"task": "causal-lm"}, "task: 'causal-lm', but"),
        ({"task": "generate"}, "task: 'generate' is not one of classification, causal-lm"),
    ],
)
def test_decoder_settings_refused_before_training(
    flags, expected, tiny_decoder_dir, prepared_decoder, tmp_path, capsys
):
    out = tmp_path / "out"
    assert main(tiny_args(tiny_decoder_dir, prepared_decoder, out, **flags)) == 2
    assert expected in capsys.readouterr().err
    assert not (out / "model").exists() and not (out / "metrics.json").exists()


@pytest.mark.slow
def test_unrolled_layers_train_as_the_scanned_ones(
    tiny_decoder_dir, prepared_decoder, tmp_path, capsys
):
    """`scan_layers` false runs the same stacked layers one by one: the same losses step by
    step as the scanned run (unset: auto, on a CPU the scan), and the first line says which
    ran and why."""
    losses = {}
    said = {
        None: "layers in one scan (auto: unrolled only on a TPU, this is a cpu)",
        False: "layers unrolled (as set)",
    }
    for scan, expected in said.items():
        out = tmp_path / f"scan-{scan}"
        flags = {} if scan is None else {"scan_layers": scan}
        args = tiny_args(tiny_decoder_dir, prepared_decoder, out, max_steps=3, **flags)
        assert main(args) == 0
        first = next(line for line in capsys.readouterr().out.splitlines() if "trainer:" in line)
        assert expected in first, first
        rows = json.loads((out / "metrics.json").read_text())["train"]
        losses[scan] = np.array([row["loss"] for row in rows])
    assert_close_to_scale(losses[False], losses[None], 1e-4, "losses")


@pytest.mark.parametrize(
    ("steps", "peft", "scan", "why"),
    [
        (12, "none", True, "auto: ~3 s of training, unrolled from ~20 min"),
        (5_000, "none", True, "auto: ~19 min of training, unrolled from ~20 min"),
        (6_000, "none", False, "auto: ~22 min of training, unrolled from ~20 min"),
        (6_000, "lora", True, "auto: ~16 min of training, unrolled from ~20 min"),
    ],
)
def test_on_a_tpu_the_layers_unroll_when_the_run_repays_the_compile(
    monkeypatch, steps, peft, scan, why
):
    """`scan_layers` unset on a TPU (a v5e faked at JAX's device list): the Qwen2.5-0.5B
    shape at 4 × 2,048 tokens (2.68 GFLOP a token, 6·N + 12·L·H·T; LoRA 4·N) trains at an
    estimated half of the chip's 197 TFLOP/s; its 24 layers' unrolled compile (3 s a layer)
    is repaid by steps 6 % faster from 20 minutes of training. Set, it is as set."""
    import jax

    from kubejax.models.weights import scratch_config
    from kubejax.trainer import model_setup
    from kubejax.trainer.config import TrainConfig

    class Chip:
        platform, device_kind = "tpu", "TPU v5 lite"

    monkeypatch.setattr(jax, "devices", lambda *a: [Chip()])
    monkeypatch.setattr(jax, "device_count", lambda *a: 1)
    qwen = scratch_config(json.dumps({
        "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896,
        "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
        "num_key_value_heads": 2,
    }))  # fmt: skip
    cfg = TrainConfig(model="scratch", global_batch_size=4, max_length=2048, peft=peft)
    assert model_setup.scan_choice(cfg, qwen, steps) == (scan, why)
    for scan_layers in (True, False):
        cfg = TrainConfig(model="scratch", scan_layers=scan_layers)
        assert model_setup.scan_choice(cfg, qwen, steps) == (scan_layers, "as set")
    Chip.device_kind = "TPU v3"  # a kind without a peak in kubejax.tpu: the scan
    cfg = TrainConfig(model="scratch")
    assert model_setup.scan_choice(cfg, qwen, steps) == (
        True,
        "auto: TPU v3's peak is not known here",
    )


@pytest.mark.slow
def test_scan_layers_is_refused_for_bert(tiny_model_dir, prepared, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(tiny_args(tiny_model_dir, prepared, out, scan_layers=False)) == 2
    assert "scan_layers: false applies to decoder models" in capsys.readouterr().err
    assert not (out / "metrics.json").exists()


def test_causal_lm_needs_a_decoder(tiny_model_dir, prepared_prompts, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(tiny_args(tiny_model_dir, prepared_prompts, out, max_length=64)) == 2
    assert "task: 'causal-lm' needs a decoder model" in capsys.readouterr().err
    assert not (out / "model").exists()


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({"prompt_template": "Rate this:"}, "prompt_template: 'Rate this:' must hold {review}"),
        ({"prompt_template": "{review} {stars}"}, "no other {...} field (found ['review', 'st"),
        ({"max_length": 10}, "max_length: 10 leaves"),
        ({"task": "chat"}, "task: 'chat' is not one of classification, causal-lm"),
    ],
)
def test_bad_prompt_settings_are_refused_before_writing(
    settings, expected, tiny_decoder_dir, yelp_dir, tmp_path
):
    from kubejax.data.prepare import PrepareConfig, PrepareError, prepare_yelp

    with pytest.raises(PrepareError, match=re.escape(expected)):
        cfg = PrepareConfig(tokenizer=str(tiny_decoder_dir), source=str(yelp_dir), **{
            "task": "causal-lm", "max_length": 64, **settings})  # fmt: skip
        prepare_yelp(cfg, tmp_path / "data", progress=False)
    assert not (tmp_path / "data").exists()


def test_a_label_without_answer_text_is_refused(tiny_decoder_dir, minilm_dir):
    from kubejax.data.prompts import PromptError, answer_ids
    from kubejax.data.tokenizer import load_tokenizer

    with pytest.raises(PromptError, match="label_names: the label ' ' gives an empty answer"):
        answer_ids(load_tokenizer(str(tiny_decoder_dir), 64), ["good", " "])


@pytest.mark.slow
def test_a_fresh_decoder_draws_its_matrices_at_once():
    """A scratch decoder's matrices are N(0, 0.02²) cut from one draw per width: each its own
    values (no two layers, nor two matrices, alike), the same for the same seed; the vectors
    (norms' scales) as the modules make them."""
    import jax
    from flax import nnx

    from kubejax.models import weights
    from kubejax.trainer.config import TrainConfig
    from kubejax.trainer.model_setup import INIT_STD, _fresh_model

    config = {**TINY["gemma3_text"], "model_type": "gemma3_text"}
    model_cfg = weights.scratch_config(json.dumps(config))

    def fresh(seed):
        cfg = TrainConfig(model="scratch", seed=seed, param_dtype="float32")
        return nnx.to_flat_state(nnx.state(_fresh_model(cfg, model_cfg, 3, jax.numpy.float32)))

    state, again, other = fresh(0), fresh(0), fresh(1)
    matrices = {k: np.asarray(v[...]) for k, v in state if k[-1] in ("kernel", "embedding")}
    assert {".".join(map(str, k[-2:])) for k in matrices} >= {
        "embed_tokens.embedding", "q_proj.kernel", "down_proj.kernel", "score.kernel"
    }  # fmt: skip
    firsts = set()
    for key, m in matrices.items():
        assert abs(m.std() / INIT_STD - 1) < 0.2 and abs(m.mean()) < 3 * INIT_STD, key
        rows = m.reshape(-1, m.shape[-1])
        firsts.add(rows[0].tobytes())
        if "layers" in map(str, key):  # each layer its own
            assert not np.array_equal(m[0], m[1]), key
    assert len(firsts) == len(matrices)
    for (k, v), (_, w), (_, u) in zip(state, again, other, strict=True):
        np.testing.assert_array_equal(v[...], w[...])
        if k in matrices:
            assert not np.array_equal(v[...], u[...]), k
        else:  # norms' scales: ones (or zeros for Gemma's 1 + w), not drawn
            assert np.all(np.asarray(v[...]) == np.asarray(v[...]).flat[0]), k


@pytest.mark.parametrize("peft", ["none", "lora", "scratch", "bert"])
@pytest.mark.slow
def test_the_train_step_compiled_ahead_is_the_run_s(
    peft, tiny_decoder_dir, prepared_decoder, tiny_model_dir, prepared, tmp_path, monkeypatch,
    caplog,
):  # fmt: skip
    """On an accelerator the train step's program compiles in a thread of its own from the
    model's shapes while the checkpoint loads (forced here on a CPU): the run takes that step
    and compiles nothing: a decoder's full fine-tuning and LoRA (its frozen base an input), a
    fresh decoder's, BERT's. A seed no other test uses: its program (the seed is in it) is
    compiled, not read from the suite's persistent cache."""
    import jax

    from kubejax.trainer import ahead, train

    monkeypatch.setattr(train, "StepAhead", functools.partial(ahead.StepAhead, on=True))
    seed = {"none": 7341, "lora": 7342, "scratch": 7343, "bert": 7344}[peft]
    model, data = (tiny_model_dir, prepared) if peft == "bert" else (tiny_decoder_dir,
                                                                      prepared_decoder)  # fmt: skip
    more = {}
    if peft == "scratch":  # a fresh decoder (its weights drawn on the device), with LoRA
        config = (tiny_decoder_dir / "config.json").read_text()
        more = {"scratch_config": config, "tokenizer": str(tiny_decoder_dir)}
        model, peft = "scratch", "lora"
    args = tiny_args(model, data, tmp_path / "out", max_steps=2, seed=seed,
                     peft="none" if peft == "bert" else peft, save_final=False, **more)  # fmt: skip
    jax.config.update("jax_log_compiles", True)
    try:
        with caplog.at_level(logging.WARNING, logger="jax._src"):
            assert main(args) == 0
    finally:
        jax.config.update("jax_log_compiles", False)
    said = [(r.threadName, r.getMessage()) for r in caplog.records]
    compiled = [t for t, m in said if "Finished XLA compilation of jit(train_step)" in m]
    assert compiled == ["step-ahead"], said  # not even read from the cache by the run


@pytest.mark.slow
def test_a_run_refused_while_its_step_compiles_ahead_exits_2(
    tiny_decoder_dir, prepared_decoder, tmp_path
):
    """A setting refused while the step's program compiles in its thread (forced here on a
    CPU): the trainer's one-line error and exit 2, not a process aborted under the compile."""
    import subprocess
    import sys

    args = tiny_args(tiny_decoder_dir, prepared_decoder, tmp_path / "out", device_memory="1MiB")
    code = (
        "import functools, sys\n"
        "from kubejax.trainer import ahead, train\n"
        "train.StepAhead = functools.partial(ahead.StepAhead, on=True)\n"
        f"sys.exit(train.main({args!r}))\n"
    )
    for _ in range(2):  # the abort came in two of three runs
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert run.returncode == 2, run.stderr[-2000:]
        assert "error: device_memory: the run needs" in run.stderr
        assert "terminate called" not in run.stderr
