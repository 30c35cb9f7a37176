"""What a model's FLOPs depend on, read from its config.json's values: the standard count the
plan, the trainer's choices, the sweep's budget and the benchmarks use. Per training token
6·N for a whole model, 4·N with LoRA (the frozen weights get no gradient of their own), plus
12·L·H·T for attention; per evaluated token 2·N + 4·L·H·T (N: the non-embedding weights, L
layers, H the width, T the sequence)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelShape:
    """What the FLOPs of a model depend on: layers, width, non-embedding weights."""

    layers: int
    hidden: int
    weights: int

    @classmethod
    def of(cls, config: dict) -> ModelShape:
        """From a Hugging Face config.json's values (a decoder's or a BERT's)."""
        h, layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
        inter = int(config.get("intermediate_size") or 4 * h)
        if config.get("model_type") == "bert":
            per_layer = 4 * h * h + 2 * h * inter
        else:
            heads = int(config["num_attention_heads"])
            head_dim = int(config.get("head_dim") or h // heads)
            kv = int(config.get("num_key_value_heads") or heads)
            per_layer = 2 * h * heads * head_dim + 2 * h * kv * head_dim + 3 * h * inter
        return cls(layers, h, layers * per_layer)

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelShape | None:
        """From a model folder's config.json; None when there is none (a hub id)."""
        path = Path(folder).expanduser() / "config.json"
        if not path.is_file():
            return None
        return cls.of(json.loads(path.read_text()))

    def train_flops(self, length: int, peft: str) -> float:
        """Training FLOPs per token at sequence `length`: (4 with LoRA, else 6)·N + 12·L·H·T."""
        per_weight = 6 if peft in ("none", "") else 4
        return per_weight * self.weights + 12 * self.layers * self.hidden * length

    def eval_flops(self, length: int) -> float:
        """Forward FLOPs per token: 2·N + 4·L·H·T."""
        return 2 * self.weights + 4 * self.layers * self.hidden * length
