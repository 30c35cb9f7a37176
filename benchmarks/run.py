"""`make bench`: every benchmark in one run, written to bench/results.json and bench/results.md
(each figure beside its peer and its target, the machine named).

    .venv/bin/python benchmarks/run.py [--out bench] [--only train,eval]

With `--only`, the other benchmarks' figures already in the results file stay, and `runs` says
which machine and day each benchmark's figures come from.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import bench_decoder
import bench_evaluate
import bench_scaling
import bench_sweep
import bench_tokenize
import bench_train
from common import machine

ROOT = Path(__file__).parents[1]
#: Targets on a 2-core CPU machine (issue #17): (key, comparison, value).
TARGETS = {
    "train_vs_torch_ratio": (">=", 1.5),
    "mfu": (">=", 0.65),
    "dp_scaling_efficiency": (">=", 0.9),
    "bucketing_speedup": (">=", 2.0),
    "real_token_fraction": (">=", 0.85),
    "eval_vs_torch_ratio": (">=", 2.0),
    "sweep_trial_overhead_s": ("<=", 10.0),
    "pruning_saved_fraction": (">=", 0.5),
    # Issue #43: full fine-tuning of a Qwen2.5-0.5B-shaped decoder, sequence 256, float32.
    "decoder_vs_torch_ratio": (">=", 1.2),
    "decoder_mfu": (">=", 0.5),
    # Issue #44: FSDP at most 15 % slower than data parallelism for a model that fits both.
    "fsdp_vs_dp_ratio": (">=", 0.85),
    "lora_vs_peft_ratio": (">=", 1.3),
}
#: Each figure's peer measured in the same run.
PEERS = {
    "train_examples_per_s": "train_peer_examples_per_s",
    "mfu": "peer_mfu",
    "train_bf16_examples_per_s": "train_bf16_peer_examples_per_s",
    "mfu_bf16": "peer_mfu_bf16",
    "eval_examples_per_s": "eval_peer_examples_per_s",
    "eval_bf16_examples_per_s": "eval_bf16_peer_examples_per_s",
    "bucketed_examples_per_s": "padded_512_examples_per_s",
    "real_token_fraction": "real_token_fraction_padded_512",
    "dp_two_processes_examples_per_s": "dp_one_process_one_core_examples_per_s",
    "decoder_train_tokens_per_s": "decoder_train_peer_tokens_per_s",
    "decoder_mfu": "decoder_peer_mfu",
    "decoder_train_peak_rss_gb": "decoder_train_peer_peak_rss_gb",
    "fsdp_examples_per_s": "fsdp_dp_examples_per_s",
    "lora_train_tokens_per_s": "lora_peer_tokens_per_s",
    "lora_optimizer_state_mb": "full_optimizer_state_mb",
    "qlora_nf4_model_mb": "lora_model_mb",
    "qlora_int8_model_mb": "lora_model_mb",
    "qlora_nf4_tokens_per_s": "lora_train_tokens_per_s",
    "qlora_int8_tokens_per_s": "lora_train_tokens_per_s",
    "qlora_nf4_load_peak_rss_delta_gb": "decoder_load_peak_rss_delta_gb",
    "qlora_int8_load_peak_rss_delta_gb": "decoder_load_peak_rss_delta_gb",
}
BENCHMARKS = {
    "train": bench_train.measure,
    "eval": bench_evaluate.measure,
    "scaling": bench_scaling.measure,
    "prep": bench_tokenize.measure,
    "sweep": bench_sweep.measure,
    "decoder": bench_decoder.measure,
    "fsdp": bench_decoder.fsdp_vs_dp,
    "fsdp_cap": bench_decoder.largest_under_cap,
    "lora": bench_decoder.lora_vs_peft,
    "pbt": bench_sweep.pbt_vs_tpe,
}


def met(key: str, value) -> bool | None:
    if key not in TARGETS or not isinstance(value, int | float):
        return None
    op, target = TARGETS[key]
    return value >= target if op == ">=" else value <= target


def markdown(results: dict) -> str:
    runs = "".join(
        f"- `{name}`: {run['machine']}, {run['date']}\n" for name, run in results["runs"].items()
    )
    rows = [
        f"# kubejax benchmarks\n\nLast run {results['machine']}, {results['date']}, "
        f"{results['wall_s']:.0f} s (`make bench`). Each benchmark's figures come from:\n\n"
        f"{runs}",
        "| figure | value | peer (same run) | target | met |",
        "| --- | --- | --- | --- | --- |",
    ]
    for key, value in results["figures"].items():
        peer = results["figures"].get(PEERS.get(key, ""), "")
        op, target = TARGETS.get(key, ("", ""))
        ok = met(key, value)
        mark = "" if ok is None else ("yes" if ok else "**no**")
        rows.append(f"| `{key}` | {value} | {peer} | {op} {target} | {mark} |")
    return "\n".join(rows) + "\n"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=str(ROOT / "bench"))
    p.add_argument("--only", default=",".join(BENCHMARKS), help="comma-separated subset")
    args = p.parse_args()
    chosen = args.only.split(",")
    unknown = sorted(set(chosen) - set(BENCHMARKS))
    if unknown:
        p.error(f"--only: unknown {unknown}; known: {', '.join(BENCHMARKS)}")
    out = Path(args.out)
    previous = {}
    if set(chosen) != set(BENCHMARKS) and (out / "results.json").is_file():
        previous = json.loads((out / "results.json").read_text())
    figures, seconds = dict(previous.get("figures", {})), dict(previous.get("seconds", {}))
    today = datetime.date.today().isoformat()
    runs = previous.get("runs") or {
        name: {"machine": previous["machine"], "date": previous["date"]}
        for name in previous.get("seconds", {})
    }
    t0 = time.monotonic()
    for name in chosen:
        t = time.monotonic()
        print(f"bench: {name} …", file=sys.stderr, flush=True)
        figures.update(BENCHMARKS[name]())
        seconds[name] = round(time.monotonic() - t, 1)
        runs[name] = {"machine": machine(), "date": today}
    results = {
        "machine": machine(),
        "date": today,
        "wall_s": round(time.monotonic() - t0, 1),
        "seconds": seconds,
        "runs": runs,
        "figures": figures,
        "targets": {k: f"{op} {v}" for k, (op, v) in TARGETS.items()},
        "met": {k: met(k, figures[k]) for k in TARGETS if k in figures},
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "results.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
