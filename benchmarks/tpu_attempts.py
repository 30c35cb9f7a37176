"""The TPU attempts of bench/NOTES.md: one benchmark case (`bench_tpu.cases`) run by the trainer
under variants of the decoder that are not settings (every intermediate saved, the classifier's
last layer inside the scan, k layers a scan iteration, splash's block sizes, q, k and v each
its own product), or with settings over the case's (`unrolled`: `scan_layers` false; `mu-bf16`:
Adam's first moment in bfloat16), each measured as `bench_tpu.py` measures it;
`profile` also traces three steps and writes the TPU's time per XLA operation, heaviest first.

    python benchmarks/tpu_attempts.py --work .bench-tpu --out OUT \\
        qwen05b-full-256:base+profile qwen05b-full-256:unrolled qwen05b-full-2048:nocond

All attempts run in this one process, one after another (a process start and the TPU runtime's
set-up once, not per attempt). Writes OUT/attempts.jsonl (a line per attempt) and
OUT/profile-CASE-VARIANTS.txt.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import glob
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from functools import partial
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).parent))

import bench_tpu

#: Settings over the case's, by variant name.
SETTINGS = {
    "block1024": {"attention_block": 1024},
    "xla": {"attention": "xla"},
    "chunked": {"attention": "chunked"},
    "remat-none": {"remat": "none"},
    "remat-full": {"remat": "full"},
    "unrolled": {"scan_layers": False},  # the stacked layers run one by one
    "accum2": {"grad_accum_steps": 2},  # the same batch in two micro-batches
    "accum4": {"grad_accum_steps": 4},
    "mu-bf16": {"mu_dtype": "bfloat16"},  # Adam's first moment in bfloat16
}


def _save_all(stack: contextlib.ExitStack) -> None:
    """Every remat policy saves every intermediate (as an unrolled program without
    `jax.checkpoint` does)."""
    import jax

    from kubejax.models import decoder

    everything = jax.checkpoint_policies.everything_saveable
    stack.enter_context(
        mock.patch.dict(decoder.REMAT_POLICIES, {k: everything for k in decoder.REMAT_POLICIES})
    )


def _nocond(stack: contextlib.ExitStack) -> None:
    """The classifier's last layer computed whole inside the scan (no `lax.cond`), its last
    tokens read after the final norm."""
    import jax.numpy as jnp

    from kubejax.models import decoder

    def call(self, input_ids, attention_mask, *, positions=None, starts=None,
             deterministic=True, rngs=None):  # fmt: skip
        tokens = decoder.tokens_of(attention_mask, positions)
        last = decoder.last_tokens(tokens.segments, None if starts is None else starts.shape[1])
        hidden = self.model(input_ids, tokens, None, decoder.dropout_key(deterministic, rngs))
        hidden = jnp.take_along_axis(hidden, last[..., None], axis=1)
        logits = self.score(hidden).astype(jnp.float32)
        return logits[:, 0] if starts is None else logits

    stack.enter_context(mock.patch.object(decoder.DecoderClassifier, "__call__", call))


def _lm_every_token(stack: contextlib.ExitStack, whole: bool = False) -> None:
    """The peers' work (`bench_tpu_peers.py`, `bench_tpu_keras.py`): a causal LM's loss over
    every token of the row, each token's next one the target, through the tied vocabulary head
    (the embedding table) with float32 logits, as Tunix and keras-hub compute it; the
    classifier's head takes no part. The same decoder, attention, remat and optimizer as the
    case's. The head runs as the trainer's causal-LM loss runs it, a vocabulary chunk at a
    time (`chunked_head.log_probs`); `whole`: the logits [rows, length, vocab] at once,
    as before (`lm-every-token-whole`)."""
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from kubejax.models import chunked_head, decoder
    from kubejax.models.kernels import product
    from kubejax.trainer import steps

    def loss_fn(graphdef, params, batch, key, deterministic, frozen=None, totals=None):
        model = nnx.merge(graphdef, params) if frozen is None else nnx.merge(
            graphdef, params, frozen)  # fmt: skip
        ids = batch["input_ids"]
        tokens = decoder.tokens_of(batch["attention_mask"], None)
        hidden = model.model(ids, tokens, None, None)  # every token's
        if whole:
            table = model.model.embed_tokens.embedding[...].astype(hidden.dtype)
            logits = product(hidden[:, :-1], table.T).astype(jnp.float32)
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:])
        else:  # the classifier's tied table, through the causal LM's chunked head
            table = model.model.embed_tokens.embedding[...]
            cap = model.config.final_logit_softcapping
            ce = -chunked_head.log_probs(hidden[:, :-1], table, ids[:, 1:], cap)[0]
        w = (batch["attention_mask"][:, 1:] > 0).astype(jnp.float32)
        # This micro-batch's share of the step's mean (`totals`: the step's reviews, a row each).
        share = 1.0 if totals is None else ids.shape[0] / totals[1]
        loss = (ce * w).sum() / jnp.maximum(w.sum(), 1.0) * share
        return loss, (jnp.zeros((), jnp.float32), None)

    stack.enter_context(mock.patch.object(steps, "loss_fn", loss_fn))


def _decoder_attribute(name: str, value):
    def patch(stack: contextlib.ExitStack) -> None:
        """Every `DecoderModel` made with `name` set to `value` (`scan_unroll` k: k layers a
        loop iteration of the scan)."""
        from kubejax.models import decoder

        init = decoder.DecoderModel.__init__

        def patched_init(self, *args, **kwargs):
            init(self, *args, **kwargs)
            setattr(self, name, value)

        stack.enter_context(mock.patch.object(decoder.DecoderModel, "__init__", patched_init))

    return patch


def _apart(stack: contextlib.ExitStack) -> None:
    """q, k and v each their own product (`decoder.SIDE_BY_SIDE` off), as before T14."""
    from kubejax.models import decoder

    stack.enter_context(mock.patch.object(decoder, "SIDE_BY_SIDE", False))


#: Splash's block sizes (the fused backward kernel has no dq blocks).
BLOCKS = ("block_q", "block_kv", "block_kv_compute", "block_q_dkv", "block_kv_dkv",
          "block_kv_dkv_compute")  # fmt: skip


def _splash_blocks(**over):
    def patch(stack: contextlib.ExitStack) -> None:
        """Splash's block sizes with `over` (`use_fused_bwd_kernel` False: the two backward
        kernels, dq's blocks those of dk and dv)."""
        from jax.experimental.pallas.ops.tpu.splash_attention import (
            splash_attention_kernel as kernel,
        )

        from kubejax.models import attention

        sizes = kernel.BlockSizes

        def with_over(**kwargs):
            kwargs.update(over)
            if not kwargs.get("use_fused_bwd_kernel", True):
                kwargs.update(block_q_dq=kwargs["block_q_dkv"], block_kv_dq=kwargs["block_kv_dkv"])
            return sizes(**kwargs)

        attention._splash_kernel.cache_clear()
        stack.callback(attention._splash_kernel.cache_clear)
        stack.enter_context(mock.patch.object(kernel, "BlockSizes", with_over))

    return patch


PATCHES = {
    "two-bwd": _splash_blocks(use_fused_bwd_kernel=False),
    "kv1024": _splash_blocks(block_kv=1024, block_kv_dkv=1024),
    "bq1024": _splash_blocks(block_q=1024, block_q_dkv=1024),
    "bkv1024c": _splash_blocks(
        block_kv=1024, block_kv_compute=1024, block_kv_dkv=1024, block_kv_dkv_compute=1024
    ),
    "b256": _splash_blocks(**dict.fromkeys(BLOCKS, 256)),
    "kseq": _splash_blocks(k_layout=2),  # QKVLayout.SEQ_MINOR: keys [d, length]
    "save-all": _save_all,
    "nocond": _nocond,
    "unroll2": _decoder_attribute("scan_unroll", 2),
    "unroll3": _decoder_attribute("scan_unroll", 3),
    "unroll4": _decoder_attribute("scan_unroll", 4),
    "lm-every-token": _lm_every_token,
    "lm-every-token-whole": partial(_lm_every_token, whole=True),
    "apart": _apart,
}


def _profiled(stack: contextlib.ExitStack, trace_dir: str, first: int = 4, count: int = 3):
    """Trace train steps `first` .. `first + count - 1` (after the first's compile)."""
    import jax

    from kubejax.trainer import ahead

    make = ahead.StepAhead.train_step  # the run's step, compiled ahead or made then

    def make_traced(*args, **kwargs):
        step = make(*args, **kwargs)
        calls = {"n": 0}

        def traced(*a, **k):
            calls["n"] += 1
            if calls["n"] == first:
                jax.block_until_ready(a[:2])
                jax.profiler.start_trace(trace_dir)
            out = step(*a, **k)
            if calls["n"] == first + count - 1:
                jax.block_until_ready(out)
                jax.profiler.stop_trace()
            return out

        # The trainer compiles the step ahead to say its memory (`train.step_program`).
        traced.func = getattr(step, "func", step)
        traced.keywords = getattr(step, "keywords", {})
        return traced

    stack.enter_context(mock.patch.object(ahead.StepAhead, "train_step", make_traced))


def op_kind(hlo: str) -> str:
    """What an XLA operation of a TPU trace (its event name: the HLO instruction) does, for the
    time by kind: splash's kernels, products (and the fusions around them), the optimizer's
    update, elementwise loops, reductions, copies, or the opcode."""
    head = hlo.split(" = ", 1)[0].lstrip("%").split(".")[0]
    if "splash" in head:
        return "splash backward" if "dkv" in head or "dq" in head else "splash forward"
    if "opt_state" in hlo:
        return "optimizer update"
    if head in ("convolution", "dot") or "kind=kOutput" in hlo:
        return "products"
    if "kind=kLoop" in hlo:
        return "elementwise (loop fusions)"
    if "kind=kInput" in hlo:
        return "reductions (input fusions)"
    return head


def op_table(trace_dir: str, steps: int = 3, top: int = 45) -> str:
    """The TPU's time per XLA operation over the traced steps, heaviest first, with each
    operation's category and the JAX operation it came from."""
    from jax.profiler import ProfileData

    files = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    if not files:
        return "no trace written\n"
    data = ProfileData.from_file(files[0])
    total: dict = defaultdict(float)
    count: dict = defaultdict(int)
    info: dict = {}
    by_category: dict = defaultdict(float)
    by_kind: dict = defaultdict(float)
    kind_ops: dict = defaultdict(int)
    lines_seen = []
    for plane in data.planes:
        if "TPU" not in plane.name:
            continue
        for line in plane.lines:
            lines_seen.append(f"{plane.name}: {line.name}")
            if line.name != "XLA Ops":
                continue
            for event in line.events:
                stats = dict(event.stats)
                total[event.name] += event.duration_ns
                count[event.name] += 1
                category = str(stats.get("hlo_category", "?"))
                by_category[category] += event.duration_ns
                kind = op_kind(event.name)
                by_kind[kind] += event.duration_ns
                kind_ops[kind] += 1
                if event.name not in info:
                    info[event.name] = (
                        category,
                        str(stats.get("tf_op", stats.get("name", "")))[-110:],
                        str(stats.get("long_name", ""))[:160],
                    )
    all_ns = sum(total.values()) or 1.0
    out = [f"lines: {lines_seen}", f"device time per step: {all_ns / steps / 1e6:.2f} ms", ""]
    out.append("by category:")
    for cat, ns in sorted(by_category.items(), key=lambda kv: -kv[1]):
        out.append(f"  {cat:28s} {ns / steps / 1e6:9.2f} ms/step  {ns / all_ns:6.1%}")
    out.append("by kind (ops a step):")
    for kind, ns in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        out.append(
            f"  {kind:28s} {ns / steps / 1e6:9.2f} ms/step  {ns / all_ns:6.1%}"
            f"  {kind_ops[kind] / steps:7.1f}"
        )
    out.append("")
    out.append("ms/step   share  calls/step  category  op  <- source | hlo")
    for name, ns in sorted(total.items(), key=lambda kv: -kv[1])[:top]:
        cat, src, long = info[name]
        out.append(
            f"{ns / steps / 1e6:8.3f} {ns / all_ns:6.1%} {count[name] / steps:6.1f}  {cat}  {name}"
            f"  <- {src} | {long}"
        )
    return "\n".join(out) + "\n"


def attempt(
    case_name: str, variants: list[str], work: Path, out: Path, peak: float, smoke: bool = False
) -> dict:
    """One case under `variants`, in this process: its figures (bench_tpu's row)."""
    import jax

    from kubejax.trainer import train

    case = next(c for c in bench_tpu.cases(smoke) if c.name == case_name)
    settings = dict(case.settings)
    for v in variants:
        settings.update(SETTINGS.get(v, {}))
    case = bench_tpu.Case(case.name, case.model, case.data, settings, case.what, case.lora)
    label = f"{case_name}-{'_'.join(variants)}"  # the device tool returns [A-Za-z0-9._-] names
    run_dir = out / "runs" / label
    trace_dir = tempfile.mkdtemp(prefix="trace-")
    with contextlib.ExitStack() as stack:
        for v in variants:
            if v in PATCHES:
                PATCHES[v](stack)
            elif v == "profile":
                _profiled(stack, trace_dir, *((2, 2) if smoke else (4, 3)))
            elif v not in SETTINGS and v != "base":
                raise SystemExit(f"unknown variant {v!r}: {sorted([*PATCHES, *SETTINGS])}")
        t0 = time.monotonic()
        try:
            status = train.main(bench_tpu.trainer_args(case, work, run_dir))
        except Exception as err:  # an out-of-memory is a result here
            status = f"{type(err).__name__}: {str(err)[:300]}"
        wall = time.monotonic() - t0
    row: dict = {"attempt": label, "wall_s": round(wall, 1)}
    if status != 0:
        row["error"] = str(status)
    else:
        metrics = json.loads((run_dir / "metrics.json").read_text())
        rows, final = metrics["train"], metrics["final"]
        tokens = statistics.median(r["tokens_per_s"] for r in rows[1:])
        flops = bench_tpu.flops_per_token(case.model, settings["max_length"], case.lora) * tokens
        row.update(
            tokens_per_s=round(tokens),
            mfu_of_spec=round(flops / 1e12 / bench_tpu.PEAK_TFLOPS, 3),
            mfu_of_measured=round(flops / 1e12 / peak, 3) if peak else None,
            first_step_s=round(final.get("first_step_s") or 0.0, 1),
            step_program_gib=round((final.get("step_program_bytes") or 0) / 2**30, 2),
        )
        if {"lm-every-token", "lm-every-token-whole"} & set(variants):
            # The peers' count: their vocabulary head besides.
            head = (4 if case.lora else 6) * case.model["vocab_size"] * case.model["hidden_size"]
            row["mfu_incl_lm_head"] = round(
                (flops + head * tokens) / 1e12 / bench_tpu.PEAK_TFLOPS, 3
            )
    if "profile" in variants:
        (out / f"profile-{label}.txt").write_text(op_table(trace_dir, 2 if smoke else 3))
    jax.clear_caches()
    gc.collect()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, required=True, help="the datasets' folder")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--peak", type=float, default=0.0, help="the measured bf16 matmul TFLOP/s")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (checks the script)")
    p.add_argument("attempts", nargs="+", help="CASE:VARIANT[+VARIANT...]")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.update(bench_tpu_env(args.work))
    for spec in args.attempts:
        case_name, _, variants = spec.partition(":")
        variants = (variants or "base").split("+")
        row = attempt(case_name, variants, args.work, args.out, args.peak, args.smoke)
        print(json.dumps(row), flush=True)
        with open(args.out / "attempts.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")


def bench_tpu_env(work: Path) -> dict:
    """The trainer's job environment, as bench_tpu's runs get it (its own compilation cache)."""
    from common import job_env

    return {**job_env(), "JAX_COMPILATION_CACHE_DIR": str(work / "jax-cache-attempts")}


if __name__ == "__main__":
    main()
