"""The peer side of the TPU benchmark (issue 64, item 5): Tunix (PyPI `google-tunix` 0.1.7, git
tag v0.1.7, commit ce63a9fd) with qwix 0.1.8 for LoRA, on the chip kubejax is measured on, at
kubejax's shapes and settings:

- `qwen25-05b-full`: the Qwen2.5-0.5B shape (24 layers, hidden 896, 14 heads, 2 KV heads, head_dim
  64, MLP 4864, vocab 151,936, tied embeddings), full fine-tuning, sequence 2048;
- `qwen25-05b-lora`: the same shape, LoRA rank 16, alpha 32 on q/k/v/o, sequence 2048;
- `llama32-1b-lora`: the Llama-3.2-1B shape (16 layers, hidden 2048, 32 heads, 8 KV heads,
  head_dim 64, MLP 8192, vocab 128,256, tied), LoRA r16 q/k/v/o, sequence 2048.

Everything is Tunix's own, as its docs and CLI use it: `tunix.models.qwen2` / `tunix.models.llama3`
(their ModelConfig presets, checked against the table here), random bfloat16 weights from
`tunix.models.dummy_model_creator`, LoRA through `qwix.LoraProvider` + `qwix.apply_lora_to_model`
(as `tunix/cli/utils/model.py` applies it, then `tunix.rl.reshard.reshard_model_to_mesh`),
`tunix.sft.peft_trainer.PeftTrainer` with its own default loss (next-token cross-entropy over
every target token the input mask keeps: here all of them) and its own jitted train step
(`jit_train_and_eval_step`), the inputs built by `tunix.sft.utils` as the CLI builds them, on a
1×1 ("fsdp", "tp") mesh. Optimizer: optax AdamW (lr 1e-5, weight decay 0.01) after clipping the
global norm at 1.0, moments in the parameters' dtype (optax's default). Qwen's splash attention
switch (`use_flash_attention`) is on at 2048; Tunix's Llama3 has none (it materialises the
scores). Remat: Tunix's `RematConfig` (NONE, BLOCK, DECODER); each case lists the settings it
tries, in order, the next one only after an out-of-memory failure.

Measured per case: the first step's wall time (tracing and compilation included), the median of
`--steps` steps after `--warmup` more (each `block_until_ready`), tokens/s, MFU against 197
TFLOP/s (v5e bf16) with FLOPs per token 6·N (LoRA: 4·N) + 12·L·H·T, N the non-embedding weights
(attention and MLP matrices), the device's peak memory (`memory_stats()["peak_bytes_in_use"]`),
and the same steps through `PeftTrainer.train()` (its own loop: metrics, throttling). Each case
runs in a process of its own, one after another; a failure (out of memory or any other) is
recorded with its error text and the run goes on.

    python3 benchmarks/bench_tpu_peers.py --pip-install /tmp/tunix-site     # on the TPU VM
    PYTHONPATH=$PYTHONPATH:/tmp/tunix-site python3 benchmarks/bench_tpu_peers.py --out DIR
    python benchmarks/bench_tpu_peers.py --smoke --out DIR    # tiny shapes: checks the script
    python benchmarks/bench_tpu_peers.py --download-wheels .whl-tpu   # here, before: the wheels

Appends one JSON line per case to DIR/tunix-cases.jsonl as each ends (its figures, or the error
text of each attempt), and rewrites DIR/tunix-results.json (the cases and the run's facts) and
DIR/tunix-results.md after each. `--pip-install` installs what the peer needs into a folder of
its own, without touching the machine's JAX or kubejax's packages: the wheels the TPU machine's
index lacks from `--wheels` (.whl-tpu, made by `--download-wheels`), the rest from its index.
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

#: Wheels the TPU machine's index lacks (or, for safetensors, lacks in the version Tunix pins:
#: < 0.8), carried in .whl-tpu: Tunix and qwix, and what `import tunix` needs beyond them
#: (tunix/__init__.py imports its trainers, hence metrax, clu, tensorboardX, perfetto, PIL,
#: sentencepiece, wrapt). Pure Python but for the last four (small cp311 manylinux wheels).
CARRIED = (
    "google-tunix==0.1.7", "qwix==0.1.8", "google-metrax==0.2.4", "clu==0.0.12",
    "perfetto==0.59.1", "tensorboardx==2.6.5", "safetensors==0.7.0", "pillow==13.0.0",
    "wrapt==2.5.2", "sentencepiece==0.2.3",
)  # fmt: skip
#: From the machine's own index, without their dependencies (those are listed: pip's closure of
#: these would also unpack jax, jaxlib and scipy, 500 MB, which the machine has already).
FROM_INDEX = (
    "flax==0.12.8", "optax==0.2.8", "orbax-checkpoint>=0.12,<0.13", "absl-py", "aiofiles",
    "anyio", "click", "etils", "filelock", "fsspec", "h11", "hf-xet", "httpcore2", "httpx2",
    "huggingface-hub", "humanize", "idna", "jaxtyping", "markdown-it-py", "mdurl",
    "ml-collections", "msgpack", "packaging", "pandas", "prometheus-client", "protobuf", "psutil",
    "pygments", "python-dateutil", "pyyaml", "rich", "simplejson", "six", "tensorstore", "tqdm",
    "treescope", "truststore", "typing-extensions", "uvloop", "wadler-lindig", "zipp",
)  # fmt: skip
INDEX_URL = "file:///opt/pypi/simple"


def pip_install_command(target: str, wheels: str, index_url: str = INDEX_URL) -> list[str]:
    """The install (the device README's recipe, one pip run): every package named, no
    dependency resolution, binary wheels only, into `target`."""
    return [
        sys.executable, "-m", "pip", "install", "--isolated", "-q", "--no-deps",
        "--only-binary=:all:", "--no-compile", "--no-cache-dir", "--upgrade",
        "--index-url", index_url, "--find-links", wheels, "--target", target,
        *CARRIED, *FROM_INDEX,
    ]  # fmt: skip


def pip_download_command(folder: str) -> list[str]:
    """Fetch CARRIED for the TPU machine (Python 3.11, x86-64 manylinux) into `folder`."""
    platforms = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
                 "manylinux2014_x86_64", "manylinux1_x86_64"]  # fmt: skip
    return [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--python-version", "3.11", "--implementation", "cp",
        *[a for p in platforms for a in ("--platform", p)], "-d", folder, *CARRIED,
    ]  # fmt: skip


#: v5e's bfloat16 peak by the spec sheet, TFLOP/s.
PEAK_TFLOPS = 197.0
TUNIX_VERSION, TUNIX_COMMIT = "0.1.7", "ce63a9fd65f02c4c398e74f000f98371c1575eb6"
QWIX_VERSION = "0.1.8"

#: The shapes (Hugging Face's config.json figures for Qwen/Qwen2.5-0.5B and
#: meta-llama/Llama-3.2-1B). `qkv_bias`: Qwen2's q/k/v projections carry biases.
SHAPES = {
    "qwen2.5-0.5b": dict(
        family="qwen2", layers=24, hidden=896, heads=14, kv_heads=2, head_dim=64, mlp=4864,
        vocab=151936, tied=True, rope_theta=1_000_000, norm_eps=1e-6, qkv_bias=True,
    ),
    "llama-3.2-1b": dict(
        family="llama3", layers=16, hidden=2048, heads=32, kv_heads=8, head_dim=64, mlp=8192,
        vocab=128256, tied=True, rope_theta=500_000, norm_eps=1e-5, qkv_bias=False,
        rope_scaling="llama3, factor 32",
    ),
}  # fmt: skip
#: `--smoke`: the same code paths at a tiny shape (2 layers, hidden 64), sequence 128, batch 2.
SMOKE_SHAPES = {
    "qwen2.5-0.5b": dict(
        SHAPES["qwen2.5-0.5b"], layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, mlp=128,
        vocab=1024,
    ),
    "llama-3.2-1b": dict(
        SHAPES["llama-3.2-1b"], layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, mlp=128,
        vocab=1024,
    ),
}  # fmt: skip
SMOKE_SEQ, SMOKE_BATCH = 128, 2

#: LoRA as kubejax's cases: rank 16, alpha 32, on the attention projections (qwix matches the
#: module path, as Tunix's QLoRA notebook writes it).
LORA = dict(rank=16, alpha=32.0, module_path=".*q_proj|.*k_proj|.*v_proj|.*o_proj")

QWEN_NOTES = (
    "Tunix's Qwen2: splash attention (use_flash_attention, blocks of 1024) under shard_map on the "
    "1x1 mesh; q/k/v biases; logits cast to float32 (B x T x 151,936) before the loss"
)
LLAMA_NOTES = (
    "Tunix 0.1.7's Llama3: no flash/splash switch (B x 32 x T x T scores materialised, softmax in "
    "float32); RoPE at theta 1e6 (apply_rope's default: the config's 500,000 is not passed) and "
    "no llama3 frequency scaling (factor 32): the same work, other frequencies; logits stay "
    "bfloat16 (log_softmax in bfloat16)"
)

#: The cases. `attempts`: Tunix settings tried in order, the next only after running out of
#: memory (remat: Tunix's RematConfig name). The first of each fits: Tunix's step compiled for a
#: TPU v5e on a CPU host (libtpu's compile-only device, `memory_analysis()`) needed, of 15.75 GiB,
#: 13.44 GiB for Qwen full at 4 × 2048 without remat (8.93 with BLOCK), 11.66 GiB for Qwen LoRA
#: without remat, and for Llama LoRA 24.73 GiB of temporaries alone without remat (no splash
#: switch: the scores are materialised) but 7.52 GiB with DECODER. BLOCK and DECODER both
#: recompute the whole forward (Tunix has no policy that saves the matmuls).
CASES = {
    "qwen25-05b-full": dict(
        shape="qwen2.5-0.5b", lora=False, seq=2048, flash=True, notes=QWEN_NOTES,
        attempts=[dict(batch=4, remat="NONE"), dict(batch=4, remat="BLOCK"),
                  dict(batch=4, remat="DECODER")],
    ),
    "qwen25-05b-lora": dict(
        shape="qwen2.5-0.5b", lora=True, seq=2048, flash=True, notes=QWEN_NOTES,
        attempts=[dict(batch=4, remat="NONE"), dict(batch=4, remat="BLOCK"),
                  dict(batch=4, remat="DECODER")],
    ),
    "llama32-1b-lora": dict(
        shape="llama-3.2-1b", lora=True, seq=2048, flash=None, notes=LLAMA_NOTES,
        attempts=[dict(batch=4, remat="DECODER"), dict(batch=2, remat="DECODER")],
    ),
}  # fmt: skip

#: A failure's error text, at most this many characters (the end kept: XLA's reason is last).
ERROR_CHARS = 6000
FAILURE_KEYS = {"peer", "case", "status", "error_kind", "error", "attempt"}
_OOM = re.compile(
    r"RESOURCE_EXHAUSTED|out of memory|Ran out of memory|exceed(s|ed)? .{0,40}(HBM|memory)"
    r"|HLO temporaries|Allocation .{0,60}bytes",
    re.IGNORECASE,
)


# ---------------------------------------------------------------------------------------------
# Counting (no JAX, no Tunix: tested in kubejax's CI)


def non_embedding_params(shape: dict) -> int:
    """N of the FLOP count: every layer's attention (q, k, v, o) and MLP (gate, up, down)
    matrices; no embedding, norm or bias."""
    h, d = shape["hidden"], shape["head_dim"]
    q = h * shape["heads"] * d
    kv = 2 * h * shape["kv_heads"] * d
    o = shape["heads"] * d * h
    return shape["layers"] * (q + kv + o + 3 * h * shape["mlp"])


def total_params(shape: dict) -> int:
    """Every weight of the model: N, the (tied) embedding, the norms, Qwen's q/k/v biases."""
    h, d, layers = shape["hidden"], shape["head_dim"], shape["layers"]
    embedding = shape["vocab"] * h * (1 if shape["tied"] else 2)
    norms = (2 * layers + 1) * h
    bias = layers * (shape["heads"] + 2 * shape["kv_heads"]) * d if shape["qkv_bias"] else 0
    return non_embedding_params(shape) + embedding + norms + bias


def lora_params(shape: dict, rank: int) -> int:
    """LoRA's trained weights on q, k, v and o: A (in × r) and B (r × out) for each."""
    h, d = shape["hidden"], shape["head_dim"]
    q_out, kv_out = shape["heads"] * d, shape["kv_heads"] * d
    per_layer = rank * ((h + q_out) + 2 * (h + kv_out) + (q_out + h))
    return shape["layers"] * per_layer


def flops_per_token(shape: dict, seq: int, lora: bool) -> int:
    """Training FLOPs per token by the count kubejax uses for every side: 6·N (LoRA: 4·N: the
    forward and the inputs' gradients, no frozen weight's gradient) + 12·L·H·T for attention
    (the full T×T product, not halved for the causal mask)."""
    n = non_embedding_params(shape)
    return (4 if lora else 6) * n + 12 * shape["layers"] * shape["hidden"] * seq


def lm_head_flops_per_token(shape: dict, lora: bool) -> int:
    """What the count above leaves out and a causal-LM loss does: the vocabulary projection, 2·V·H
    forward, as much for the inputs' gradient and (full fine-tuning) the weight's."""
    return (4 if lora else 6) * shape["vocab"] * shape["hidden"]


def mfu(tokens_per_s: float, flops_per_tok: float, peak_tflops: float = PEAK_TFLOPS) -> float:
    return tokens_per_s * flops_per_tok / (peak_tflops * 1e12)


def classify_error(text: str) -> str:
    """'oom' for the device running out of memory (at compilation or run time), else 'error'."""
    return "oom" if _OOM.search(text or "") else "error"


def failure_record(case: str, attempt: dict, error: str, kind: str | None = None) -> dict:
    """The record written in place of a case's figures when it fails."""
    error = error or ""
    return {
        "peer": "tunix",
        "case": case,
        "status": "failed",
        "error_kind": kind or classify_error(error),
        "error": error[-ERROR_CHARS:],
        "attempt": dict(attempt),
    }


def case_plan(name: str, smoke: bool, batch: int | None = None, remat: str | None = None):
    """(shape, seq, attempts) of a case: the table's, or the smoke shape's; `batch` / `remat`
    given on the command line replace the attempts with that one setting."""
    case = CASES[name]
    shape = (SMOKE_SHAPES if smoke else SHAPES)[case["shape"]]
    seq = SMOKE_SEQ if smoke else case["seq"]
    attempts = [dict(a) for a in case["attempts"]]
    if smoke:
        attempts = [dict(attempts[0], batch=SMOKE_BATCH)]
    if batch is not None or remat is not None:
        first = attempts[0]
        attempts = [dict(batch=batch or first["batch"], remat=remat or first["remat"])]
    return shape, seq, attempts


# ---------------------------------------------------------------------------------------------
# One case, in this process (Tunix needed from here on)


def _tunix_config(shape: dict, seq: int, remat: str, flash: bool, smoke: bool):
    """Tunix's ModelConfig of the shape: its own preset for the real shapes (checked against the
    table), the tiny one built the same way."""
    import dataclasses

    import jax.numpy as jnp

    if shape["family"] == "qwen2":
        from tunix.models.qwen2 import model as lib

        fields = dict(
            num_layers=shape["layers"], vocab_size=shape["vocab"], embed_dim=shape["hidden"],
            hidden_dim=shape["mlp"], num_heads=shape["heads"], head_dim=shape["head_dim"],
            num_kv_heads=shape["kv_heads"], rope_theta=shape["rope_theta"],
            norm_eps=shape["norm_eps"], use_tied_embedding=shape["tied"],
        )  # fmt: skip
        cfg = lib.ModelConfig(**fields) if smoke else lib.ModelConfig.qwen2p5_0p5b()
        extra = dict(
            dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, use_flash_attention=flash,
            flash_attention_block_size=min(1024, seq),
        )  # fmt: skip
        cfg = dataclasses.replace(cfg, remat_config=lib.RematConfig[remat], **extra)
        return lib.Qwen2, cfg, fields
    from tunix.models.llama3 import model as lib

    fields = dict(
        num_layers=shape["layers"], vocab_size=shape["vocab"], embed_dim=shape["hidden"],
        hidden_dim=shape["mlp"], num_heads=shape["heads"], head_dim=shape["head_dim"],
        num_kv_heads=shape["kv_heads"], rope_theta=shape["rope_theta"],
        norm_eps=shape["norm_eps"], weight_tying=shape["tied"],
    )  # fmt: skip
    cfg = lib.ModelConfig(**fields) if smoke else lib.ModelConfig.llama3p2_1b()
    return lib.Llama3, dataclasses.replace(cfg, remat_config=lib.RematConfig[remat]), fields


def _device_memory() -> dict:
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return {k: stats.get(k) for k in ("peak_bytes_in_use", "bytes_in_use", "bytes_limit")}


def run_case(name: str, attempt: dict, args) -> dict:
    """Build Tunix's model, trainer and step for one case and measure it."""
    started = time.perf_counter()
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    import qwix
    import tunix
    from flax import nnx
    from tunix.models import dummy_model_creator
    from tunix.rl import reshard
    from tunix.sft import peft_trainer, sharding_utils
    from tunix.sft import utils as sft_utils

    imported = time.perf_counter()
    case = CASES[name]
    shape, seq, _ = case_plan(name, args.smoke)
    batch, remat = attempt["batch"], attempt["remat"]
    platform = jax.devices()[0].platform
    flash_supported = case["flash"] is not None
    flash = bool(case["flash"]) and (platform == "tpu" or args.aot)
    if flash_supported and case["flash"] and not flash:
        flash_note = f"off: splash attention needs a TPU ({platform} here)"
    elif not flash_supported:
        flash_note = "unsupported: Tunix 0.1.7's Llama3 has no flash/splash switch"
    else:
        flash_note = "on" if flash else "off"

    model_class, cfg, fields = _tunix_config(shape, seq, remat, flash, args.smoke)
    if not args.smoke:  # Tunix's preset is the shape of the table
        preset = {k: getattr(cfg, k) for k in fields}
        assert preset == fields, f"Tunix's preset differs from the table: {preset} != {fields}"

    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    model = dummy_model_creator.create_dummy_model(model_class, cfg, mesh=mesh, dtype=jnp.bfloat16)
    jax.block_until_ready(nnx.state(model))
    built = time.perf_counter()

    lora = None
    if case["lora"]:
        # As tunix/cli/utils/model.py's apply_lora_to_model does it.
        provider = qwix.LoraProvider(
            module_path=LORA["module_path"], rank=LORA["rank"], alpha=LORA["alpha"]
        )
        model = qwix.apply_lora_to_model(
            model, provider, rngs=nnx.Rngs(params=0), **model.get_model_input()
        )
        model = reshard.reshard_model_to_mesh(model, mesh)
        jax.block_until_ready(nnx.state(model))
        lora = dict(LORA)
    lora_done = time.perf_counter()

    def count(kind) -> int:
        return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, kind)))

    params, lora_count = count(nnx.Param), count(nnx.LoRAParam)
    base_params = params - lora_count if issubclass(nnx.LoRAParam, nnx.Param) else params
    embedding = int(np.prod(model.embedder.input_embedding.shape))
    dtypes = sorted({str(x.dtype) for x in jax.tree.leaves(nnx.state(model, nnx.Param))})

    tx = optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(learning_rate=1e-5, weight_decay=0.01)
    )
    trainer = peft_trainer.PeftTrainer(
        model, tx, peft_trainer.TrainingConfig(eval_every_n_steps=10**9, max_steps=None)
    )

    def gen_model_input_fn(x):  # as tunix/cli/peft_main.py builds the model's inputs
        return {
            "input_tokens": x.input_tokens,
            "input_mask": x.input_mask,
            "positions": sft_utils.build_positions_from_mask(x.input_mask),
            "attention_mask": sft_utils.make_causal_attn_mask(x.input_mask),
        }

    trainer = trainer.with_gen_model_input_fn(gen_model_input_fn)
    tokens = batch * seq
    fpt = flops_per_token(shape, seq, case["lora"])
    head = lm_head_flops_per_token(shape, case["lora"])
    record = {
        "peer": "tunix",
        "case": name,
        "status": "ok",
        "attempt": dict(attempt),
        "smoke": bool(args.smoke),
        "shape": case["shape"] + (" (tiny: smoke)" if args.smoke else ""),
        "model_class": f"{model_class.__module__}.{model_class.__name__}",
        "config": {k: getattr(cfg, k) for k in fields},
        "seq": seq,
        "batch": batch,
        "tokens_per_step": tokens,
        "remat": remat,
        "flash_attention": flash,
        "flash_attention_note": flash_note,
        "flash_attention_block_size": getattr(cfg, "flash_attention_block_size", None),
        "lora": lora,
        "param_dtypes": dtypes,
        "compute_dtype": "bfloat16",
        "optimizer": "optax.chain(clip_by_global_norm(1.0), adamw(1e-5, weight_decay=0.01)); "
        "moments in the parameters' dtype",
        "loss": "PeftTrainer's default loss (_default_loss_fn): next-token softmax "
        "cross-entropy of every target token (one_hot x log_softmax), mean over the mask (all "
        "ones)",
        "notes": case["notes"],
        "params_total": base_params,
        "params_embedding": embedding,
        "params_non_embedding_model": base_params - embedding,
        "params_lora": lora_count,
        "n_non_embedding_flops": non_embedding_params(shape),
        "flops_per_token": fpt,
        "lm_head_flops_per_token": head,
        "import_s": round(imported - started, 2),
        "build_s": round(built - imported, 2),
        "lora_apply_s": round(lora_done - built, 2),
        "versions": _versions(tunix, jax),
    }
    if args.aot:
        return {**record, **_aot_memory(trainer, batch, seq)}

    rng = np.random.default_rng(0)
    host_batch = peft_trainer.TrainingInput(
        input_tokens=rng.integers(1, shape["vocab"], (batch, seq)).astype(np.int32),
        input_mask=np.ones((batch, seq), dtype=np.bool_),
    )
    with mesh:
        train_step, _ = trainer.jit_train_and_eval_step(cache_nnx_graph=True)
        device_batch = sharding_utils.shard_input(host_batch, trainer.config.data_sharding_axis)
        jax.block_until_ready(device_batch)
        t = time.perf_counter()
        loss, _, grad_norm = train_step(device_batch)
        jax.block_until_ready((loss, grad_norm))
        first_step = time.perf_counter() - t
        first_loss = float(loss)
        for _ in range(args.warmup):
            jax.block_until_ready(train_step(device_batch))
        times = []
        for _ in range(args.steps):
            t = time.perf_counter()
            loss, _, grad_norm = train_step(device_batch)
            jax.block_until_ready((loss, grad_norm))
            times.append(time.perf_counter() - t)
        memory = _device_memory()
        last_loss = float(loss)
        loop_s = None
        if args.loop_steps:  # the same step through Tunix's own loop (compiled already)
            t = time.perf_counter()
            trainer.train([host_batch] * args.loop_steps)
            loop_s = (time.perf_counter() - t) / args.loop_steps

    peak = None
    if args.peak:  # after the measurement, so that it changes nothing in it
        try:
            peak = matmul_peak_tflops(1024 if args.smoke else 8192)
        except Exception as exc:  # the figures stand without it
            print(f"matmul peak not measured: {exc}", file=sys.stderr)
    step = statistics.median(times)
    tps = tokens / step
    return {
        **record,
        "first_step_s": round(first_step, 3),
        "step_s_median": round(step, 5),
        "step_s_all": [round(x, 5) for x in times],
        "tokens_per_s": round(tps, 1),
        "mfu_197": round(mfu(tps, fpt), 4),
        "mfu_197_incl_lm_head": round(mfu(tps, fpt + head), 4),
        "loop_step_s": None if loop_s is None else round(loop_s, 5),
        "loop_tokens_per_s": None if loop_s is None else round(tokens / loop_s, 1),
        "bf16_matmul_tflops": peak,
        "mfu_measured_peak": None if not peak else round(mfu(tps, fpt, peak), 4),
        "loss_first": round(first_loss, 4),
        "loss_last": round(last_loss, 4),
        "peak_hbm_bytes": memory["peak_bytes_in_use"],
        "peak_hbm_gib": None
        if memory["peak_bytes_in_use"] is None
        else round(memory["peak_bytes_in_use"] / 2**30, 3),
        "hbm_limit_bytes": memory["bytes_limit"],
        "device": jax.devices()[0].device_kind,
        "platform": platform,
    }


#: `--aot`: the TPU the step is compiled for, compile-only, on a CPU host with libtpu installed.
AOT_TOPOLOGY = "v5e:1x1"
AOT_ENV = {"TPU_WORKER_HOSTNAMES": "localhost", "TPU_ACCELERATOR_TYPE": "v5litepod-1"}


def _aot_memory(trainer, batch: int, seq: int) -> dict:
    """Compile PeftTrainer's own step body (`_train_step`, the optimizer donated as its
    `nnx.jit` donates it) for a TPU v5e compile-only device and read XLA's memory analysis: what
    the step needs on the chip, without one. Out of memory raises, as on the chip."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.experimental import topologies
    from tunix.sft import peft_trainer

    topology = topologies.get_topology_desc(AOT_TOPOLOGY, "tpu", chips_per_host_bounds=(1, 1, 1))
    mesh = jax.sharding.Mesh(np.array(topology.devices).reshape(1, 1), ("fsdp", "tp"))
    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    graphdef, state = nnx.split((trainer.model, trainer.optimizer))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=whole), state)
    inputs = peft_trainer.TrainingInput(
        input_tokens=jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=whole),
        input_mask=jax.ShapeDtypeStruct((batch, seq), jnp.bool_, sharding=whole),
    )

    def step(state, inputs):
        model, optimizer = nnx.merge(graphdef, state)
        loss, _, grad_norm = trainer._train_step(model, optimizer, inputs)
        return loss, grad_norm, nnx.state((model, optimizer))

    t = time.perf_counter()
    with mesh:
        lowered = jax.jit(step, donate_argnums=0).lower(abstract, inputs)
    compiled = lowered.compile()
    seconds = time.perf_counter() - t
    m = compiled.memory_analysis()
    total = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
    total += m.temp_size_in_bytes
    return {
        "aot_device": topology.devices[0].device_kind,
        "aot_lower_compile_s": round(seconds, 1),
        "aot_argument_bytes": m.argument_size_in_bytes,
        "aot_temp_bytes": m.temp_size_in_bytes,
        "aot_total_bytes": total,
        "aot_total_gib": round(total / 2**30, 2),
        "aot_splash_kernel": "tpu_custom_call" in lowered.as_text(),
    }


def _versions(tunix, jax) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {"tunix": getattr(tunix, "__version__", None), "jax": jax.__version__}
    for dist in ("qwix", "flax", "optax", "jaxlib", "libtpu", "google-metrax"):
        try:
            found[dist] = version(dist)
        except PackageNotFoundError:
            found[dist] = None
    return found


def matmul_peak_tflops(n: int, repeats: int = 10) -> float:
    """A bf16 n³ matmul through XLA, the mean of `repeats` after one (TPU.md's 165 TFLOP/s was
    measured so): what the chip reaches, for a second MFU."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    t = time.perf_counter()
    for _ in range(repeats):
        out = f(a)
    out.block_until_ready()
    return round(2 * n**3 / ((time.perf_counter() - t) / repeats) / 1e12, 2)


def child_main(args) -> int:
    """`--child`: one case in this process; its record goes to --result."""
    attempt = json.loads(args.attempt) if args.attempt else {}
    if args.aot:
        for key, value in AOT_ENV.items():
            os.environ.setdefault(key, value)
    try:
        record = run_case(args.child, attempt, args)
    except BaseException as exc:  # any failure: the case's record
        text = "".join(traceback.format_exception(exc))
        record = failure_record(args.child, attempt, text)
        print(text, file=sys.stderr, flush=True)
    Path(args.result).write_text(json.dumps(record, default=str))
    print(json.dumps({k: v for k, v in record.items() if k != "error"}, default=str), flush=True)
    return 0


# ---------------------------------------------------------------------------------------------
# The driver: each case in a process of its own, one after another


def _run_child(argv: list[str], result: Path, timeout: float) -> tuple[dict | None, str, str]:
    """Run a child, its stderr shown as it comes and its last lines kept; (record, stderr tail,
    why it ended without one)."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    tail: list[str] = []

    def pump(stream, sink, keep):
        for line in stream:
            sink.write(line)
            sink.flush()
            if keep:
                tail.append(line)
                del tail[:-200]

    threads = [
        threading.Thread(target=pump, args=(proc.stdout, sys.stdout, False), daemon=True),
        threading.Thread(target=pump, args=(proc.stderr, sys.stderr, True), daemon=True),
    ]
    for th in threads:
        th.start()
    why = ""
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
        why = f"timeout: killed after {timeout:.0f} s (the run's --budget-s)"
    for th in threads:
        th.join(timeout=10)
    record = json.loads(result.read_text()) if result.exists() else None
    if record is None and not why:
        why = f"crash: the case's process exited {code} without a record"
    return record, "".join(tail), why


def run_cases(args) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="bench-tpu-peers-"))
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    here = str(Path(__file__).resolve())
    deadline = time.monotonic() + args.budget_s
    base = [sys.executable, here, "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--loop-steps", str(args.loop_steps)]  # fmt: skip
    base += (["--smoke"] if args.smoke else []) + ([] if args.peak else ["--no-peak"])
    base += ["--aot"] if args.aot else []

    def child(name: str, attempt: dict, tag: str) -> dict:
        result = scratch / f"{tag}.json"
        argv = [*base, "--child", name, "--attempt", json.dumps(attempt), "--result", str(result)]
        for tries in range(2):
            left = deadline - time.monotonic()
            if left < 20:
                return failure_record(name, attempt, "not run: the run's --budget-s is spent",
                                      "skipped")  # fmt: skip
            result.unlink(missing_ok=True)
            record, tail, why = _run_child(argv, result, left)
            text = (record or {}).get("error", "") + tail
            if tries == 0 and "lockfile" in text:  # the chip not yet free: wait, once (KINDS.md)
                time.sleep(5)
                continue
            break
        if record is None:
            kind = "timeout" if why.startswith("timeout") else classify_error(tail)
            record = failure_record(name, attempt, f"{why}\n{tail}", kind if kind != "error"
                                    else "crash")  # fmt: skip
        return record

    facts = {
        "peer": "tunix",
        "tunix_version": TUNIX_VERSION,
        "tunix_commit": TUNIX_COMMIT,
        "qwix_version": QWIX_VERSION,
        "smoke": bool(args.smoke),
        "aot": bool(args.aot),
        "steps": args.steps,
        "warmup": args.warmup,
        "loop_steps": args.loop_steps,
        "peak_tflops_spec": PEAK_TFLOPS,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "flops": "per token 6·N (LoRA 4·N) + 12·L·H·T, N the non-embedding weights; "
        "*_incl_lm_head adds the vocabulary projection (6·V·H, LoRA 4·V·H)",
    }
    rows: list[dict] = []
    summary = {**facts, "cases": rows}
    (out / "tunix-cases.jsonl").unlink(missing_ok=True)
    for name in args.cases:
        _, _, attempts = case_plan(name, args.smoke, args.batch, args.remat)
        tried = []
        record = None
        for i, attempt in enumerate(attempts):
            if i and deadline - time.monotonic() < args.min_retry_s:
                tried.append(failure_record(name, attempt, "not run: too little of --budget-s "
                                            "left for another attempt", "skipped"))  # fmt: skip
                break
            record = child(name, attempt, f"{name}-{i}")
            tried.append({k: v for k, v in record.items() if k != "step_s_all"})
            if record["status"] == "ok" or record.get("error_kind") != "oom":
                break
        record["attempts"] = tried
        with (out / "tunix-cases.jsonl").open("a") as f:
            f.write(json.dumps(record, default=str) + "\n")
        print(json.dumps({"case": name, "status": record["status"],
                          "tokens_per_s": record.get("tokens_per_s"),
                          "mfu_197": record.get("mfu_197"),
                          "error_kind": record.get("error_kind")}), flush=True)  # fmt: skip
        rows.append(record)
        peaks = [r["bf16_matmul_tflops"] for r in rows if r.get("bf16_matmul_tflops")]
        summary = {**facts, "bf16_matmul_tflops_max": max(peaks, default=None), "cases": rows}
        (out / "tunix-results.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
        (out / "tunix-results.md").write_text(markdown(summary))
    return summary


def markdown(summary: dict) -> str:
    lines = [
        f"# Tunix {summary['tunix_version']} (commit {summary['tunix_commit'][:8]}) + qwix "
        f"{summary['qwix_version']}" + (" (smoke: tiny shapes)" if summary["smoke"] else ""),
        "",
        "| case | batch × seq | remat | splash | first step s | step s | tokens/s | MFU 197 | "
        "MFU 197 incl. LM head | loop tokens/s | peak HBM GiB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in summary["cases"]:
        a = r.get("attempt", {})
        if r["status"] != "ok":
            last = (r.get("error") or "").strip().splitlines()[-1:] or [""]
            lines.append(
                f"| {r['case']} | {a.get('batch')} × ? | {a.get('remat')} | | "
                f"**{r['error_kind']}**: {last[0][:160]} | | | | | | |"
            )
            continue
        if "aot_total_gib" in r:
            lines.append(
                f"| {r['case']} | {r['batch']} × {r['seq']} | {r['remat']} | "
                f"{'on' if r['flash_attention'] else 'off'} | compile-only ({r['aot_device']}): "
                f"{r['aot_total_gib']} GiB, {r['aot_lower_compile_s']} s to compile | | | | | | |"
            )
            continue
        lines.append(
            f"| {r['case']} | {r['batch']} × {r['seq']} | {r['remat']} | "
            f"{'on' if r['flash_attention'] else 'off'} | {r['first_step_s']} | "
            f"{r['step_s_median']} | {r['tokens_per_s']:,.0f} | {r['mfu_197']} | "
            f"{r['mfu_197_incl_lm_head']} | {r['loop_tokens_per_s'] or ''} | "
            f"{r['peak_hbm_gib'] if r['peak_hbm_gib'] is not None else ''} |"
        )
    if summary.get("bf16_matmul_tflops_max"):
        lines += ["", f"bf16 matmul in the run (best of the cases' processes): "
                  f"{summary['bf16_matmul_tflops_max']} TFLOP/s."]  # fmt: skip
    lines += ["", f"FLOPs: {summary['flops']}.", ""]
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench", help="folder for tunix-cases.jsonl, tunix-results.*")
    p.add_argument("--pip-install", metavar="DIR", help="install the peer into DIR, and stop")
    p.add_argument("--wheels", default=str(Path(__file__).resolve().parents[1] / ".whl-tpu"),
                   help="--pip-install's carried wheels")  # fmt: skip
    p.add_argument("--index-url", default=INDEX_URL, help="--pip-install's index")
    p.add_argument("--download-wheels", metavar="DIR", help="fetch the carried wheels, and stop")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {list(CASES)}")
    p.add_argument("--steps", type=int, default=10, help="measured steps (median)")
    p.add_argument("--warmup", type=int, default=2, help="steps after the first, not measured")
    p.add_argument("--loop-steps", type=int, default=5,
                   help="steps through PeftTrainer.train() afterwards (0: none)")  # fmt: skip
    p.add_argument("--smoke", action="store_true", help="tiny shapes: checks the script")
    p.add_argument("--batch", type=int, help="one attempt at this batch instead of the table's")
    p.add_argument("--remat", choices=["NONE", "BLOCK", "DECODER"],
                   help="one attempt with this Tunix remat instead of the table's")  # fmt: skip
    p.add_argument("--budget-s", type=float, default=500,
                   help="wall-clock budget of the whole run (cases past it are recorded as "
                   "skipped)")  # fmt: skip
    p.add_argument("--min-retry-s", type=float, default=100,
                   help="no out-of-memory retry with less of the budget left")  # fmt: skip
    p.add_argument("--no-peak", dest="peak", action="store_false",
                   help="skip the bf16 matmul peak")  # fmt: skip
    p.add_argument("--aot", action="store_true",
                   help="compile each attempt for a TPU v5e on this host (libtpu installed, no "
                   "chip) and record XLA's memory analysis instead of measuring")  # fmt: skip
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--attempt", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not args.child:
        args.cases = [c.strip() for c in args.cases.split(",") if c.strip()]
        unknown = [c for c in args.cases if c not in CASES]
        if unknown:
            p.error(f"unknown case(s) {unknown}: choose from {list(CASES)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(args)
    if args.pip_install or args.download_wheels:
        if args.pip_install:
            command = pip_install_command(args.pip_install, args.wheels, args.index_url)
        else:
            command = pip_download_command(args.download_wheels)
        print(" ".join(command), flush=True)
        return subprocess.run(command, env={**os.environ, "PIP_CONFIG_FILE": os.devnull}).returncode
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    summary = run_cases(args)
    failed = [r["case"] for r in summary["cases"] if r["status"] != "ok"]
    print(f"wrote {args.out}/tunix-results.json; failed: {failed or 'none'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
