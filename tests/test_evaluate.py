"""Evaluation: metrics, the report and bad inputs."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
from sklearn.metrics import confusion_matrix, f1_score, precision_recall_fscore_support

from kubejax.evaluate import (
    EvaluationError,
    classification_metrics,
    evaluate_model,
    write_eval_report,
)
from tests.helpers import env_with_no_jax_cache


def test_classification_metrics_agree_with_sklearn():
    rng = np.random.default_rng(0)
    y, p = rng.integers(0, 4, 500), rng.integers(0, 4, 500)
    m = classification_metrics(y, p, 4)
    assert m["accuracy"] == pytest.approx((y == p).mean())
    assert m["macro_f1"] == pytest.approx(f1_score(y, p, average="macro"))
    prec, rec, _, support = precision_recall_fscore_support(y, p)
    np.testing.assert_allclose(m["precision"], prec)
    np.testing.assert_allclose(m["recall"], rec)
    assert m["support"] == support.tolist()
    assert m["confusion_matrix"] == confusion_matrix(y, p).tolist()


def test_evaluate_a_trained_model(trained_tiny, prepared, tmp_path):
    r = evaluate_model(trained_tiny / "model", prepared)
    assert r["examples"] == 300 and len(r["predictions"]) == 300
    assert 0 <= r["accuracy"] <= 1 and r["loss"] > 0 and r["examples_per_s"] > 0
    assert np.array(r["confusion_matrix"]).sum() == 300
    write_eval_report(r, tmp_path / "e.html")
    assert "Confusion matrix" in (tmp_path / "e.html").read_text()


def test_a_bfloat16_evaluation_agrees_with_float32(trained_tiny, prepared):
    f32 = evaluate_model(trained_tiny / "model", prepared)
    bf16 = evaluate_model(trained_tiny / "model", prepared, dtype="bfloat16")
    assert (f32["dtype"], bf16["dtype"]) == ("float32", "bfloat16")
    # bfloat16 operands (8 bits of precision) summed in float32: a different loss, near it.
    assert bf16["loss"] != f32["loss"]
    assert bf16["loss"] == pytest.approx(f32["loss"], rel=2e-2)
    agree = np.mean(np.array(bf16["predictions"]) == np.array(f32["predictions"]))
    assert agree >= 0.9, agree


def test_an_unknown_evaluation_dtype_is_named(trained_tiny, prepared):
    with pytest.raises(EvaluationError, match="dtype: 'float16' is not one of float32, bfloat16"):
        evaluate_model(trained_tiny / "model", prepared, dtype="float16")


def test_model_with_missing_files(trained_tiny, prepared, tmp_path):
    broken = shutil.copytree(trained_tiny / "model", tmp_path / "m")
    (broken / "model.safetensors").unlink()
    with pytest.raises(EvaluationError, match=r"model: .* lacks model\.safetensors"):
        evaluate_model(broken, prepared)


def test_dataset_without_test_split(trained_tiny, prepared, tmp_path):
    data = shutil.copytree(prepared, tmp_path / "d")
    shutil.rmtree(data / "test")
    with pytest.raises(
        EvaluationError, match=r"split: 'test' is not a split of .* \(it has train, validation\)"
    ):
        evaluate_model(trained_tiny / "model", data)


def test_num_labels_disagree(trained_tiny, prepared, tmp_path):
    data = shutil.copytree(prepared, tmp_path / "d")
    meta = json.loads((data / "metadata.json").read_text())
    meta["num_labels"] = 3
    (data / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(EvaluationError, match="num_labels: the model has 5 classes"):
        evaluate_model(trained_tiny / "model", data)


def test_the_served_model_compiles_each_request_shape_once(trained_tiny, monkeypatch):
    # The pyfunc model once built its evaluation step in every request, tracing and compiling
    # its programs again (0.56-0.60 s for one text on MiniLM): a request of a shape it has seen
    # must not trace the model again, nor one whose packed row holds another review count of
    # the same power of two.
    import pandas as pd

    from kubejax.mlflow_model import BertTextClassifier
    from kubejax.models.bert import BertClassifier

    served = BertTextClassifier()
    served._load(trained_tiny / "model")
    traces, call = [], BertClassifier.__call__

    def tracing(self, *args, **kwargs):
        traces.append(1)
        return call(self, *args, **kwargs)

    monkeypatch.setattr(BertClassifier, "__call__", tracing)
    asks = [["Great tacos, slow service."], ["Awful tacos, quick service."],
            ["Good.", "Bad.", "Fine."], ["Good.", "Bad.", "Fine.", "Meh."]]  # fmt: skip
    seen = []
    for texts in asks:
        out = served.predict(None, pd.DataFrame({"text": texts}))
        assert len(out) == len(texts)
        seen.append(len(traces))
    assert seen[0] > 0 and seen[1] == seen[0]  # one text, twice: traced once
    assert seen[2] > seen[1] and seen[3] == seen[2]  # 3 and 4 reviews a row: 4 slots both


_SERVE_ONE_TEXT = """
import sys
from pathlib import Path

import jax
import pandas as pd

events = []
jax.monitoring.register_event_listener(lambda event, **kw: events.append(event))
from kubejax.mlflow_model import BertTextClassifier

served = BertTextClassifier()
served._load(Path(sys.argv[1]))
served.predict(None, pd.DataFrame({"text": ["Great tacos, slow service."]}))
print(*(events.count(f"/jax/compilation_cache/cache_{e}") for e in ("hits", "misses")))
"""


def test_a_served_model_keeps_its_programs_in_the_user_cache(trained_tiny, tmp_path):
    # With no JAX cache set, every serving process compiled each request shape afresh (0.9-1.4
    # s on MiniLM); the next one (another worker, a restart) now loads them (0.27-0.45 s).
    env = env_with_no_jax_cache(tmp_path / "xdg")
    counts = []
    for _ in range(2):
        run = subprocess.run(
            [sys.executable, "-c", _SERVE_ONE_TEXT, str(trained_tiny / "model")],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stderr[-3000:]
        counts.append(tuple(int(n) for n in run.stdout.split()))
    (hits, misses), (hits_after, misses_after) = counts
    assert hits == 0 and misses > 0
    assert (hits_after, misses_after) == (misses, 0)
    assert any((tmp_path / "xdg" / "kubejax" / "jax").iterdir())
