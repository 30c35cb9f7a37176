#!/usr/bin/env bash
# The causal-LM loss through the vocabulary head in chunks
# (src/kubejax/models/chunked_head.py). On one TPU v5e: Qwen2.5-0.5B's shape (scratch bf16
# weights, Adam's first moment in bf16, remat minimal, layers scanned), full fine-tuning, a
# causal LM trained on EVERY token of 4 rows x 2,048 tokens in ONE batch (no micro-batches):
# the peers' work of bench/tpu-results.md's "lm-every-token" rows (31,039 tokens/s in two
# micro-batches, unrolled; out of memory in one batch: 16.88 GiB of temporaries; Tunix 33,050).
#
#   OUT=/some/dir bash bench/tpu-lm-head.sh        # repo at cwd; ~2-3 minutes
#
# 1. Always: kubejax's own train step (the trainer's model, optimizer and `make_train_step`),
#    the loss of `tpu_attempts.py`'s `lm-every-token` variant, random token ids; 12 steps.
#    Prints tokens/s (median of steps 2-12), the compiled step's memory (XLA's analysis) and
#    the device's peak bytes in use. Needs no data.
# 2. Where .bench-tpu/data-2048 and .bench-tpu/tokenizer were carried (prepared on a CPU with
#    `python benchmarks/bench_tpu.py --prepare-only --work .bench-tpu`): the same case through
#    the trainer as a job runs it (`tpu_attempts.py qwen05b-full-2048:lm-every-token`, with
#    grad_accum_steps 1), its row printed.
# SMOKE=1 runs part 1 at tiny shapes (on a CPU: checks the script).
set -euo pipefail
: "${OUT:?set OUT to the output folder}"
mkdir -p "$OUT"
if [ -z "${SMOKE:-}" ]; then
  source bench/tpu-env.sh
else
  export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD/src:$PWD"
fi

python3 - <<'EOF' 2>&1 | tee "$OUT/ce-step.log"
import contextlib, json, os, statistics, sys, time

sys.path.insert(0, "benchmarks")
import jax
import numpy as np

import bench_tpu
import tpu_attempts
from kubejax.trainer import distributed
from kubejax.trainer.config import TrainConfig
from kubejax.trainer.model_setup import classifier_for, split_trainable
from kubejax.trainer.optimizer import make_optimizer
from kubejax.trainer.steps import make_train_step
from kubejax.trainer.train import make_mesh, place_state, step_program

smoke = bool(os.environ.get("SMOKE"))
shape = dict(bench_tpu.QWEN_05B)
rows, length, steps = 4, 2048, 12
if smoke:
    shape.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2)
    length, steps = 128, 4
cfg = TrainConfig(
    model="scratch", scratch_config=json.dumps(shape), data_dir="-", output_dir="-",
    task="causal-lm", global_batch_size=rows, max_length=length, grad_accum_steps=1,
    remat="minimal", dtype="bfloat16", param_dtype="bfloat16", mu_dtype="bfloat16",
    learning_rate=5e-5,
)
device = jax.devices()[0]
print("device:", device.device_kind, "| jax", jax.__version__, flush=True)
mesh, sizes = make_mesh(cfg)
model, _, _ = classifier_for(cfg, 5, None, None, steps)
print("attention:", model.model.attention.implementation, "| remat:", model.model.remat,
      "| scanned:", model.model.scan, flush=True)
graphdef, params, frozen = split_trainable(cfg, model, mesh)
tx = make_optimizer(cfg)
params, opt_state, shardings = place_state(params, tx, mesh)
rng = np.random.default_rng(0)
ids = rng.integers(1, shape["vocab_size"], (1, rows, length)).astype(np.int32)
local = {"input_ids": ids, "attention_mask": np.ones_like(ids),
         "labels": np.zeros((1, rows), np.int32)}
batch = distributed.global_batch(local, mesh, leading=1)
lr = np.float32(cfg.learning_rate)
times = []
with contextlib.ExitStack() as stack:
    tpu_attempts.PATCHES["lm-every-token"](stack)  # every token's next one, chunked head
    train_step = make_train_step(graphdef, tx, mesh, 0, None, shardings)
    program = None
    for i in range(steps):
        t0 = time.perf_counter()
        params, opt_state, metrics = train_step(params, opt_state, batch, i, lr)
        loss = float(metrics["loss"])  # waits for the step
        times.append(time.perf_counter() - t0)
        print(f"step {i}: {times[-1]:.3f} s, loss {loss:.4f}", flush=True)
        if i == 0:
            program = step_program(train_step, params, opt_state, batch, i, lr)
median = statistics.median(times[1:])
gib = 2**30
stats = device.memory_stats() or {}
result = {
    "case": "qwen05b-full-2048 lm-every-token, 4 x 2048 in one batch, chunked head",
    "tokens_per_s": round(rows * length / median),
    "step_s_median": round(median, 4),
    "first_step_s": round(times[0], 1),
    "step_program_gib": {k: round(v / gib, 2) for k, v in program.items()},
    "device_peak_gib": round(stats.get("peak_bytes_in_use", 0) / gib, 2),
    "device_limit_gib": round(stats.get("bytes_limit", 0) / gib, 2),
}
print("RESULT", json.dumps(result), flush=True)
with open(os.path.join(os.environ["OUT"], "ce-step.json"), "w") as f:
    json.dump(result, f, indent=1)
EOF

if [ -z "${SMOKE:-}" ] && [ -d .bench-tpu/data-2048 ] && [ -d .bench-tpu/tokenizer ]; then
  KUBEJAX_BENCH_SETTINGS='{"grad_accum_steps": 1}' KUBEJAX_BENCH_NO_PLAN_CHECK=1 \
    timeout 150 python3 benchmarks/tpu_attempts.py --work .bench-tpu --out "$OUT/attempts" \
    qwen05b-full-2048:lm-every-token 2>&1 | tail -n 30 | tee "$OUT/ce-trainer.log"
  peak=$(find "$OUT"/attempts/runs -path "*/resources/worker-0.json" 2>/dev/null | head -n 1)
  [ -n "$peak" ] && python3 -c "import json,sys; s=json.load(open(sys.argv[1])); \
print('trainer device peak: %.2f GiB' % (s.get('peak_device_mb', 0) / 1024))" "$peak" || true
else
  echo "trainer run skipped: .bench-tpu/data-2048 and .bench-tpu/tokenizer not carried"
fi
