"""The fine-tuned classifier (or a decoder fine-tuned to answer with the label) as an MLflow
pyfunc model.

    model = mlflow.pyfunc.load_model(uri)
    model.predict(pd.DataFrame({"text": ["Great tacos!"]}))
    # → columns: label (name), label_id, and prob_<name> per class

The model folder (HF layout: config, weights, tokenizer, labels) is the pyfunc's artifact;
texts are tokenized as data preparation did (same tokenizer, same max_length). Compiled
programs go to JAX's persistent cache: JAX_COMPILATION_CACHE_DIR, else the user's cache folder
(`compile_cache.user_dir`).
"""

from __future__ import annotations

from pathlib import Path

import mlflow.pyfunc
import numpy as np
import pandas as pd

TEXT_COLUMN = "text"


class BertTextClassifier(mlflow.pyfunc.PythonModel):
    """pyfunc wrapper: DataFrame with a `text` column → labels and class probabilities."""

    def load_context(self, context) -> None:
        self._load(Path(context.artifacts["model"]))

    def _load(self, model_dir: Path) -> None:
        from kubejax.data.tokenizer import load_tokenizer
        from kubejax.models import weights
        from kubejax.trainer import compile_cache
        from kubejax.trainer.predict import Predictor

        # Each request shape compiles a program once in this process; with the cache, the
        # server's other workers and its next start load it instead.
        compile_cache.use_user_dir()
        self.settings = weights.read_settings(model_dir)
        self.max_length = int(self.settings["max_length"])
        model, self.label_names = weights.load_model_dir(model_dir)
        self.tokenizer = load_tokenizer(str(model_dir), self.max_length)
        # One predictor for every request, so each request shape is compiled once: a new one
        # in each request traced and compiled its programs again (0.56-0.60 s for one text).
        self.predictor = Predictor(model, self.settings.get("answers"))

    def predict(self, context, model_input: pd.DataFrame, params=None) -> pd.DataFrame:
        from kubejax.data.dataset import TokenizedSplit
        from kubejax.data.tokenizer import tokenize

        if TEXT_COLUMN not in model_input.columns:
            raise ValueError(
                f"model_input: needs a {TEXT_COLUMN!r} column, has {list(model_input.columns)}"
            )
        texts = model_input[TEXT_COLUMN].fillna("").astype(str).str.strip().tolist()
        answers = self.settings.get("answers")
        if answers is None:
            values, offsets, _ = tokenize(texts, self.tokenizer)
        else:  # a language model answers each review's prompt, as in training
            from kubejax.data.prompts import encode_prompts

            template, longest = self.settings["prompt_template"], max(map(len, answers))
            values, offsets, _ = encode_prompts(texts, self.tokenizer, template, longest)
        split = TokenizedSplit(values, offsets, np.zeros(len(texts), dtype=np.int32))
        logits = self.predictor.logits(split, 64, self.max_length)
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        ids = probs.argmax(-1)
        out = pd.DataFrame({"label": [self.label_names[i] for i in ids], "label_id": ids})
        for i, name in enumerate(self.label_names):
            out[f"prob_{name}"] = probs[:, i]
        return out
