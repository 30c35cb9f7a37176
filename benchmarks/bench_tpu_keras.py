"""The TPU benchmark's second peer (issue 64, item 5): keras-hub 0.32.0 on Keras 3.15.1's JAX
backend, on the chip kubejax and Tunix are measured on, at the same shapes and settings
(`bench_tpu_peers.SHAPES`, `CASES`: the Qwen2.5-0.5B shape full fine-tuning and LoRA, the
Llama-3.2-1B shape LoRA, sequence 2048).

Everything is keras-hub's own, as its guides use it: `keras_hub.models.QwenBackbone` /
`Llama3Backbone` at the shape (random weights, bfloat16 dtype policy), the `*CausalLM` task on
it without a preprocessor, LoRA by `backbone.enable_lora(16, [query, key, value,
attention_output])` (keras-hub's q/k/v/o layer names; Keras's LoRA of a per-head projection
keeps A per head, hidden × heads × 16, and trains the projections' biases),
`CausalLM.compile` with AdamW (lr 1e-5, weight decay 0.01, global norm clipped at 1.0),
sparse cross-entropy from logits and no metric, `jit_compile=True`, and Keras's `fit` over
batches of `batch` × 2048 token ids (every token's next token the target). Remat, after an
out-of-memory only: each decoder layer checkpointed (`jax.checkpoint`, Keras's own remat), its
`training` flag held out of the trace. Keras's `RematScope(mode="full")` cannot be used on these
models in Keras 3.15.1: it wraps the layer's call in `jax.checkpoint` with every argument traced,
`training=True` included, and the layers' `if training` then fails while the model builds (seen
on the chip and on the CPU).

Measured per case as `bench_tpu_peers.py` measures Tunix: the first step's wall (tracing and
compilation included), the median step after `--warmup` more (each step's loss read back, so
the step is done), tokens/s, MFU against 197 TFLOP/s by the same FLOP count (6·N, LoRA 4·N,
+ 12·L·H·T; the vocabulary head given apart), the device's peak memory, and whether Keras took
its TPU splash-attention path (`make_splash_mha` called) or fell back to XLA's attention.

    python3 benchmarks/bench_tpu_keras.py --pip-install /tmp/keras-site --wheels .whl-tpu
    PYTHONPATH=$PYTHONPATH:/tmp/keras-site python3 benchmarks/bench_tpu_keras.py --out DIR
    python benchmarks/bench_tpu_keras.py --download-wheels .whl-tpu   # here, before
    python benchmarks/bench_tpu_keras.py --smoke --out DIR   # tiny shapes, any JAX device

keras-hub's metadata requires tensorflow-text (with it TensorFlow, too large to carry to the
TPU machine); keras-hub imports and trains on JAX without it, so its wheels are installed
without dependency resolution: the ones carried (`CARRIED`) beside what the machine's index
and bench/tpu-env.sh give (flax, optax, rich, absl, tokenizers, pyyaml, tqdm). Each case in a
process of its own; writes DIR/keras-results.json and a line per case to DIR/keras-cases.jsonl.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from bench_tpu_peers import (  # the peers' shapes, cases and count
    CASES,
    PEAK_TFLOPS,
    SHAPES,
    SMOKE_BATCH,
    SMOKE_SEQ,
    SMOKE_SHAPES,
    classify_error,
    flops_per_token,
    lm_head_flops_per_token,
    mfu,
)

KERAS_VERSION, KERAS_HUB_VERSION = "3.15.1", "0.32.0"
#: keras, keras-hub and what `import keras_hub` needs beyond the TPU machine's JAX, flax's and
#: optax's dependencies (kagglehub's HTTP client among them): pure Python but for optree,
#: h5py, regex and charset-normalizer (cp311 manylinux wheels).
CARRIED = (
    f"keras=={KERAS_VERSION}", f"keras-hub=={KERAS_HUB_VERSION}", "namex==0.1.0",
    "optree==0.20.0", "h5py==3.16.0", "regex==2026.5.9", "kagglehub==1.0.3",
    "kagglesdk==0.1.28", "requests==2.32.5", "urllib3==2.5.0", "certifi==2025.8.3",
    "idna==3.10", "charset-normalizer==3.4.3",
)  # fmt: skip
#: keras-hub's names of the attention's q, k, v and o projections (Qwen's and Llama's).
LORA_LAYERS = ["query", "key", "value", "attention_output"]
LORA_RANK = 16
#: Tried in order, the next only after running out of memory; remat "layers": every decoder
#: layer checkpointed (`checkpoint_decoder_layers`).
ATTEMPTS = [
    dict(batch=4, remat=None), dict(batch=4, remat="layers"), dict(batch=2, remat="layers"),
    dict(batch=1, remat="layers"),
]  # fmt: skip


def pip_install_command(target: str, wheels: str) -> list[str]:
    """CARRIED from the `wheels` folder alone, no dependency resolution, into `target`."""
    return [
        sys.executable, "-m", "pip", "install", "--isolated", "-q", "--no-deps", "--no-index",
        "--only-binary=:all:", "--no-compile", "--find-links", wheels, "--target", target,
        *CARRIED,
    ]  # fmt: skip


def pip_download_command(folder: str) -> list[str]:
    """CARRIED for the TPU machine (Python 3.11, x86-64 manylinux) into `folder`."""
    platforms = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
    return [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--python-version", "3.11", "--implementation", "cp",
        *[a for p in platforms for a in ("--platform", p)], "-d", folder, *CARRIED,
    ]  # fmt: skip


def backbone_arguments(shape: dict) -> dict:
    """keras-hub's backbone arguments for one of the benchmark's shapes."""
    args = dict(
        vocabulary_size=shape["vocab"], num_layers=shape["layers"],
        num_query_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
        hidden_dim=shape["hidden"], intermediate_dim=shape["mlp"],
        rope_max_wavelength=shape["rope_theta"], layer_norm_epsilon=shape["norm_eps"],
        tie_word_embeddings=shape["tied"], dtype="bfloat16",
    )  # fmt: skip
    if shape["family"] == "llama3":  # Llama 3.2's frequency scaling (factor 32)
        args.update(rope_frequency_adjustment_factor=32.0, rope_low_freq_factor=1.0,
                    rope_high_freq_factor=4.0, rope_pretraining_sequence_length=8192)  # fmt: skip
    if shape["hidden"] // shape["heads"] != shape["head_dim"]:
        raise ValueError(f"keras-hub's heads are hidden / heads wide, not {shape['head_dim']}")
    return args


def checkpoint_decoder_layers(backbone) -> None:
    """Every decoder layer of `backbone` recomputed in the backward pass: its call under
    `jax.checkpoint` (what Keras's remat is on JAX) with `training` bound outside the trace."""
    import functools

    import jax

    for layer in backbone.transformer_layers:

        def checkpointed(*args, _call=layer.call, training=None, **kwargs):
            def call(*a, **k):
                return _call(*a, training=training, **k)

            return jax.checkpoint(call)(*args, **kwargs)

        # Keras calls `self.call`; the signature it inspected at construction stays.
        layer.call = functools.wraps(layer.call)(checkpointed)


def build(shape: dict, lora: bool, remat: str | None):
    """The causal LM of `shape` (random bfloat16 weights), LoRA on q/k/v/o where asked,
    compiled for training."""
    import keras
    import keras_hub

    family = {"qwen2": "Qwen", "llama3": "Llama3"}[shape["family"]]
    backbone = getattr(keras_hub.models, f"{family}Backbone")(**backbone_arguments(shape))
    if remat == "layers":
        checkpoint_decoder_layers(backbone)
    model = getattr(keras_hub.models, f"{family}CausalLM")(backbone=backbone, preprocessor=None)
    if lora:
        backbone.enable_lora(LORA_RANK, target_layer_names=LORA_LAYERS)
    optimizer = keras.optimizers.AdamW(learning_rate=1e-5, weight_decay=0.01, global_clipnorm=1.0)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=optimizer, loss=loss, weighted_metrics=[], jit_compile=True)
    return model


def measure(case: str, shape: dict, seq: int, batch: int, remat, warmup: int, steps: int) -> dict:
    """One attempt, in this process: build, train `warmup + steps + 1` steps, the figures."""
    import jax
    import keras
    import numpy as np
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel

    lora = CASES[case]["lora"]
    made = {"n": 0}
    make = splash_attention_kernel.make_splash_mha

    def counted(*args, **kwargs):
        made["n"] += 1
        return make(*args, **kwargs)

    splash_attention_kernel.make_splash_mha = counted
    t0 = time.perf_counter()
    model = build(shape, lora, remat)
    build_s = time.perf_counter() - t0
    n = warmup + steps + 1
    rng = np.random.default_rng(0)
    ids = rng.integers(1, shape["vocab"], size=(n * batch, seq + 1), dtype=np.int32)
    x = {"token_ids": ids[:, :-1], "padding_mask": np.ones((n * batch, seq), bool)}
    ends: list[float] = []

    class Timer(keras.callbacks.Callback):
        def on_train_batch_end(self, step, logs=None):
            float(logs["loss"])  # the step's loss on the host: the step is done
            ends.append(time.perf_counter())

    start = time.perf_counter()
    # Keras's own `fit` over the arrays: keras-hub's (its preprocessing pipeline, of which this
    # model has none) would need grain or TensorFlow to batch them.
    history = keras.Model.fit(
        model, x, ids[:, 1:], batch_size=batch, epochs=1, shuffle=False, verbose=0,
        callbacks=[Timer()],
    )  # fmt: skip
    times = [b - a for a, b in zip([start, *ends], ends, strict=False)]
    step_s = statistics.median(times[1 + warmup :])
    tokens_per_s = batch * seq / step_s
    flops = flops_per_token(shape, seq, lora)
    stats = jax.devices()[0].memory_stats() or {}
    return {
        "peer": "keras-hub",
        "case": case,
        "status": "ok",
        "attempt": {"batch": batch, "remat": remat},
        "seq": seq,
        "batch": batch,
        "build_s": round(build_s, 1),
        "first_step_s": round(times[0], 1),
        "step_s": round(step_s, 4),
        "tokens_per_s": round(tokens_per_s, 1),
        "mfu_197": round(mfu(tokens_per_s, flops), 4),
        "mfu_197_incl_lm_head": round(
            mfu(tokens_per_s, flops + lm_head_flops_per_token(shape, lora)), 4
        ),
        "splash_kernels_made": made["n"],
        "loss_first": round(float(history.history["loss"][0]), 4),
        "trainable_params": int(sum(np.prod(v.shape) for v in model.trainable_variables)),
        "device_peak_bytes": stats.get("peak_bytes_in_use"),
        "device": jax.devices()[0].device_kind,
        "versions": {
            "keras": keras.__version__,
            "keras_hub": _hub_version(),
            "jax": jax.__version__,
        },
    }


def _hub_version() -> str:
    import keras_hub

    return keras_hub.__version__


def run_case(case: str, smoke: bool, warmup: int, steps: int) -> dict:
    """A case's attempts in turn, the next after an out-of-memory only."""
    shape = (SMOKE_SHAPES if smoke else SHAPES)[CASES[case]["shape"]]
    seq = SMOKE_SEQ if smoke else CASES[case]["seq"]
    attempts = [dict(ATTEMPTS[0], batch=SMOKE_BATCH)] if smoke else ATTEMPTS
    failures = []
    for attempt in attempts:
        try:
            return {**measure(case, shape, seq, attempt["batch"], attempt["remat"], warmup, steps),
                    "failed_attempts": failures}  # fmt: skip
        except Exception as err:  # out of memory is a result; the next attempt may fit
            text = "".join(traceback.format_exception(err))[-4000:]
            failures.append({"attempt": attempt, "error_kind": classify_error(text),
                             "error": text})  # fmt: skip
            if failures[-1]["error_kind"] != "oom":
                break
    return {"peer": "keras-hub", "case": case, "status": "failed", "failed_attempts": failures}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("keras-out"))
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated case names")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (checks the script)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--pip-install", metavar="TARGET", help="install CARRIED into TARGET, exit")
    p.add_argument("--wheels", default=".whl-tpu", help="the carried wheels' folder")
    p.add_argument("--download-wheels", metavar="FOLDER", help="fetch CARRIED here, exit")
    p.add_argument("--one", help=argparse.SUPPRESS)  # a case, in this process
    args = p.parse_args()
    if args.download_wheels:
        sys.exit(subprocess.call(pip_download_command(args.download_wheels)))
    if args.pip_install:
        sys.exit(subprocess.call(pip_install_command(args.pip_install, args.wheels)))
    os.environ.setdefault("KERAS_BACKEND", "jax")
    if args.one:
        print(json.dumps(run_case(args.one, args.smoke, args.warmup, args.steps)), flush=True)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for case in [c for c in args.cases.split(",") if c]:
        if case not in CASES:
            sys.exit(f"--cases: {case!r} is not one of {', '.join(CASES)}")
        cmd = [sys.executable, __file__, "--one", case, "--warmup", str(args.warmup),
               "--steps", str(args.steps), *(["--smoke"] if args.smoke else [])]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        row = json.loads(lines[-1]) if lines else {
            "peer": "keras-hub", "case": case, "status": "failed",
            "failed_attempts": [{"error": (proc.stdout + proc.stderr)[-4000:]}],
        }  # fmt: skip
        rows.append(row)
        with open(args.out / "keras-cases.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        print(
            json.dumps(
                {
                    k: row.get(k)
                    for k in (
                        "case",
                        "status",
                        "tokens_per_s",
                        "mfu_197",
                        "first_step_s",
                        "splash_kernels_made",
                    )
                }
            )
        )
    result = {
        "peer": "keras-hub",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "smoke": args.smoke,
        "peak_tflops_spec": PEAK_TFLOPS,
        "cases": rows,
    }
    (args.out / "keras-results.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
