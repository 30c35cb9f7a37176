"""Fine-tuning the decoder families through the trainer: prepared data from a byte-level BPE
tokenizer, training, the exported model, evaluation and the served model's predictions."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from kubejax.trainer.train import main
from tests.helpers import tiny_args
from tests.models.decoders import TINY, save_tiny


@pytest.mark.parametrize("family", list(TINY))
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


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ({"dropout": 0.1}, "dropout: 0.1, but decoder models train without dropout"),
        ({"task": "causal-lm"}, "task: 'causal-lm' is not one of classification"),
    ],
)
def test_decoder_settings_refused_before_training(
    flags, expected, tiny_decoder_dir, prepared_decoder, tmp_path, capsys
):
    out = tmp_path / "out"
    assert main(tiny_args(tiny_decoder_dir, prepared_decoder, out, **flags)) == 2
    assert expected in capsys.readouterr().err
    assert not (out / "model").exists() and not (out / "metrics.json").exists()
