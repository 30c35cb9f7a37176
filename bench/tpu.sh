#!/usr/bin/env bash
# kubejax's decoders on one TPU chip, through the trainer as a job runs it (long context: 2,048
# and 8,192 tokens; a sweep trial's start from the compilation cache; a 270M decoder's epoch),
# after the on-chip checks of tests/tpu (benchmarks/bench_tpu.py). Writes OUT/tpu-results.json
# and OUT/tpu-results.md, and each run's log.
#
#   bench/tpu.sh [OUT] [--only CASE,...]
#
# Runs on a Cloud TPU VM whose Python has JAX with libtpu (the device tool's machine: JAX 0.10.2
# preinstalled, a local package index, no internet). The datasets are prepared on any machine
# first: `python benchmarks/bench_tpu.py --prepare-only --work .bench-tpu`, then carried.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench}
shift || true
source bench/tpu-env.sh
mkdir -p "$out"
python3 -m pytest -q -p no:cacheprovider tests/tpu 2>&1 | tee "$out/tpu-tests.log"
exec python3 benchmarks/bench_tpu.py --work .bench-tpu --out "$out" "$@"
