"""Tiny random decoder checkpoints of every family, saved with transformers (offline)."""

from __future__ import annotations

from pathlib import Path

#: Per family: transformers' config class arguments of a tiny model. Sizes differ between
#: families on purpose (head_dim apart from hidden / heads, GQA groups, biases, windows).
TINY = {
    "llama": dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=300, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
        },
        max_position_embeddings=256, tie_word_embeddings=True, pad_token_id=0,
    ),
    "mistral": dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, vocab_size=300, sliding_window=7, head_dim=24,
        max_position_embeddings=256, pad_token_id=0,
    ),
    "qwen2": dict(
        hidden_size=56, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=300, rope_theta=1000000.0, rms_norm_eps=1e-6,
        max_position_embeddings=256, tie_word_embeddings=True, pad_token_id=0,
    ),
    "qwen3": dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, vocab_size=300, max_position_embeddings=256,
        tie_word_embeddings=False, pad_token_id=0,
    ),
    "gemma3_text": dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=300, sliding_window=6,
        sliding_window_pattern=3, query_pre_attn_scalar=24, rope_theta=1000000.0,
        rope_local_base_freq=10000.0, rope_scaling={"rope_type": "linear", "factor": 8.0},
        max_position_embeddings=256, pad_token_id=0,
    ),
}  # fmt: skip


def hf_config(family: str, **overrides):
    """transformers' config of the tiny `family` model."""
    from transformers import AutoConfig

    return AutoConfig.for_model(family, **{**TINY[family], **overrides})


def save_tiny(family: str, folder: Path, head: str = "causal-lm", seed: int = 0, **overrides):
    """A random tiny `family` model saved with `save_pretrained` (float32); returns transformers'
    model in eval mode. `head`: "causal-lm", "classification" (3 labels) or "base"."""
    import torch
    from transformers import (
        AutoModel,
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
    )

    torch.manual_seed(seed)
    if head == "classification":
        overrides.setdefault("num_labels", 3)
    cfg = hf_config(family, **overrides)
    cls = {
        "causal-lm": AutoModelForCausalLM,
        "classification": AutoModelForSequenceClassification,
        "base": AutoModel,
    }[head]
    model = cls.from_config(cfg, torch_dtype=torch.float32).eval()
    # Random norm weights: the checkpoint's ones and zeros would hide a swapped or missing norm.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.2 + (0.0 if family == "gemma3_text" else 1.0))
            elif name.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.1)
    model.save_pretrained(str(folder))
    return model


def save_tiny_tokenizer(folder: Path, vocab_size: int = 400) -> int:
    """A byte-level BPE tokenizer of `vocab_size` trained on SYNTHETIC reviews (the library's
    `write_bpe_tokenizer`); returns its vocabulary size."""
    from kubejax.data.synthetic import write_bpe_tokenizer

    return write_bpe_tokenizer(folder, vocab_size)
