#!/usr/bin/env bash
# LLM hyperparameter optimization measured on a real decoder and real reviews: the defaults
# trained by hand against the default `kubejax-llm` local run (and, with --profiles quick,full,
# the larger sweep), each alone on this machine. Writes OUT/llm-hpo.json and OUT/llm-hpo.md.
#
#   bench/llm-hpo.sh MODEL_DIR DATA_DIR --text-column review --label-column sentiment \
#       [--task classification] [--profiles quick,full] [--out bench] [--work DIR]
#
# The model and the data stay out of the repository (../shared/REAL.md makes both offline).
set -euo pipefail
cd "$(dirname "$0")/.."
make --no-print-directory .venv/.installed-demo
exec .venv/bin/python benchmarks/llm_hpo.py "$@"
