#!/usr/bin/env bash
# A run that fits itself on one TPU v5e chip: a Llama-3.2-1B-shaped scratch LoRA at 2,048 × 8 through
# `python -m kubejax.trainer` exactly as a job runs it, with NO tuning flags (no grad_accum_steps,
# remat, dtype, param_dtype, mu_dtype, attention, scan_layers: the trainer settles them itself),
# for 30 steps. Records the first line (what auto chose and why), tokens/s (the median step after
# the first), the first step's time, the wall, XLA's step program and the device's peak, in
# $OUT/tpu77.json, and the whole log in $OUT/tpu77.log. Modelled on bench/tpu.sh and
# benchmarks/bench_tpu.py (their Llama shape, data, environment and FLOP count).
#
#   OUT=/some/dir bash bench/tpu-fit.sh      # repo at cwd; JAX + libtpu first on PYTHONPATH
#
# Data: .bench-tpu/data-2048 (32 rows of 2,048 tokens) as `python benchmarks/bench_tpu.py
# --prepare-only --work .bench-tpu` makes it on the CPU; where only .bench-tpu/tokenizer came,
# the 2,048-token data is prepared here (seconds). About 2 minutes in all (~1 min for the
# packages on a fresh machine, a 1B model drawn, a ~5 s first compile, 30 steps of ~0.7 s).
set -euo pipefail
OUT=${OUT:-bench/tpu77}
mkdir -p "$OUT"
source bench/tpu-env.sh
work=.bench-tpu

python3 - "$work" <<'EOF'
import sys
from pathlib import Path

sys.path.insert(0, "benchmarks")
import bench_tpu  # noqa: E402

work = Path(sys.argv[1])
if not (work / "data-2048").is_dir():
    if not (work / "tokenizer").is_dir():
        sys.exit(f"tpu77: {work}/data-2048 and {work}/tokenizer are missing: run `python "
                 f"benchmarks/bench_tpu.py --prepare-only --work {work}` on the CPU and carry it")
    from bench_train import long_reviews

    from kubejax.data.prepare import PrepareConfig, prepare_yelp

    src = long_reviews(work / "reviews-2048.csv", 32, min_words=2048 * 5 // 4)
    config = PrepareConfig(tokenizer=str(work / "tokenizer"), source=str(src), max_length=2048,
                           num_labels=5)
    prepare_yelp(config, work / "data-2048", progress=False)
print("tpu77: data ready", flush=True)
EOF

python3 - "$work" "$OUT" <<'EOF'
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, "benchmarks")
import bench_tpu  # noqa: E402
from common import TRAINER, job_env  # noqa: E402

work, out = Path(sys.argv[1]), Path(sys.argv[2])
run = out / "run"
shutil.rmtree(run, ignore_errors=True)
cache = out / "jax-cache"
shutil.rmtree(cache, ignore_errors=True)  # the first compile is real, as a new user's
env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
env.update(job_env(), JAX_COMPILATION_CACHE_DIR=str(cache))
args = [
    "--model", "scratch", "--scratch-config", json.dumps(bench_tpu.LLAMA_1B),
    "--tokenizer", str(work / "tokenizer"), "--data-dir", str(work / "data-2048"),
    "--output-dir", str(run), "--peft", "lora", "--global-batch-size", "8",
    "--max-length", "2048", "--max-steps", "30",
    # Measurement, not tuning: a line a step, a small evaluation, no export.
    "--log-every", "1", "--max-eval-examples", "8", "--no-save-final",
]  # fmt: skip
t0 = time.monotonic()
try:
    proc = subprocess.run([*TRAINER, *args], env=env, capture_output=True, text=True,
                          timeout=200)
    code, log = proc.returncode, proc.stdout + proc.stderr
except subprocess.TimeoutExpired as err:
    code = "timeout"
    log = (err.stdout or b"").decode() + (err.stderr or b"").decode()
wall = time.monotonic() - t0
(out / "tpu77.log").write_text(log)
first = next((line for line in log.splitlines() if "kubejax trainer:" in line
              and "process(es)" in line), "")  # fmt: skip
row = {"case": "llama1b-lora-2048x8-no-flags", "command": "python -m kubejax.trainer "
       + " ".join(args), "exit": code, "wall_s": round(wall, 1), "first_line": first}
metrics_file = run / "metrics.json"
if code == 0 and metrics_file.is_file():
    metrics = json.loads(metrics_file.read_text())
    rows, final = metrics["train"], metrics["final"]
    tokens = statistics.median(r["tokens_per_s"] for r in rows[1:]) if len(rows) > 1 else 0.0
    flops = bench_tpu.flops_per_token(bench_tpu.LLAMA_1B, 2048, True) * tokens
    resources = run / "resources" / "worker-0.json"
    peak = json.loads(resources.read_text()).get("peak_device_mb", 0) if resources.is_file() else 0
    row.update(
        tokens_per_s=round(tokens),
        mfu_of_197=round(flops / 1e12 / bench_tpu.PEAK_TFLOPS, 3),
        first_step_s=round(final.get("first_step_s") or 0.0, 1),
        steps=final.get("steps"),
        step_program_gib=round((final.get("step_program_bytes") or 0) / 2**30, 2),
        device_peak_gib=round(peak / 1024, 2),
        phases_s=final.get("phases_s"),
    )
else:
    row["error"] = " | ".join([line for line in log.strip().splitlines() if line.strip()][-4:])
(out / "tpu77.json").write_text(json.dumps(row, indent=1) + "\n")
print(json.dumps(row, indent=1), flush=True)
EOF
