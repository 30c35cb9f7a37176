"""The GPU benchmark (bench/gpu.sh, benchmarks/bench_gpu.py), checked on this CPU: its smoke run
measures both sides with a tiny model, and without a GPU it stops with a clear error and writes
nothing; the machine line every benchmark writes names the CPU's family, model and matrix
features; the data-parallel figure is the median of alternated rounds; the bare-step benchmark
runs in the jobs' environment and writes what it is asked to. (`make bench`'s CPU benchmarks
are measurement, not tests.)"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
BENCH_GPU = ROOT / "benchmarks" / "bench_gpu.py"


@pytest.mark.slow
def test_the_gpu_benchmark_smoke_run_measures_both_sides_on_cpu(tmp_path, minilm_dir):
    """bert-base's case, the decoder's (tiny Llama) case and LoRA's (tiny Qwen, PEFT on
    the peer's side), each side measured."""
    # In two stages, as on a GPU node without the preparation's packages: the datasets prepared
    # first (--prepare-only), then measured from --work with a bare tokenizer folder.
    tokenizer, work = tmp_path / "tokenizer", tmp_path / "work"
    tokenizer.mkdir()
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(minilm_dir / name, tokenizer / name)
    given = ["--smoke", "--work", str(work), "--tokenizer", str(tokenizer)]
    run = subprocess.run(
        [sys.executable, str(BENCH_GPU), *given, "--prepare-only"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    datasets = [work / "data-128"]
    assert run.stdout.split() == [str(d) for d in datasets]
    written = {d: (d / "metadata.json").stat().st_mtime_ns for d in datasets}
    assert not (tmp_path / "gpu-results.json").exists()
    scratch = tmp_path / "scratch"  # the benchmark's own temporary folders go here
    scratch.mkdir()
    run = subprocess.run(
        [sys.executable, str(BENCH_GPU), *given, "--steps", "2", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "TMPDIR": str(scratch)},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    # The prepared datasets were used as they were.
    assert {d: (d / "metadata.json").stat().st_mtime_ns for d in datasets} == written
    # Its datasets, checkpoints and caches are gone (a full `make bench` writes several GB);
    # torch's own cache folder may stay.
    assert not [p.name for p in scratch.iterdir() if p.name.startswith("kubejax")]
    result = json.loads((tmp_path / "gpu-results.json").read_text())
    assert result["model"] == "tiny (smoke)"
    assert result["bf16_peak_tflops_xla"] > 0 and result["bf16_peak_tflops_torch"] > 0
    for key, batch in (("seq128", 4), ("llm_seq128", 2), ("lora_seq128", 2)):
        row = result[key]
        assert row["batch"] == batch
        assert row["examples_per_s"] > 0 and row["peer_examples_per_s"] > 0
        # The ratio is of the unrounded rates (rounded to 0.001), the rates are rounded to 0.01.
        ours, peer = row["examples_per_s"], row["peer_examples_per_s"]
        rounding = 0.0005 + ours / peer * (0.005 / ours + 0.005 / peer)
        assert abs(row["vs_torch"] - ours / peer) <= rounding
        assert 0 < row["mfu"] < 1 and 0 < row["peer_mfu"] < 1
    table = (tmp_path / "gpu-results.md").read_text()
    assert "| 128 | 4 |" in table and "| 128 (decoder) | 2 |" in table
    assert "| 128 (LoRA) | 2 |" in table
    assert f"LoRA against transformers + PEFT at 128: {result['lora_seq128']['vs_torch']}×" in table


@pytest.mark.slow
def test_the_gpu_benchmark_without_a_gpu_says_so_and_writes_nothing(tmp_path):
    run = subprocess.run(
        [sys.executable, str(BENCH_GPU), "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )  # fmt: skip
    assert run.returncode != 0
    assert "needs an NVIDIA GPU, and JAX found cpu only" in run.stderr
    assert not list(tmp_path.iterdir())


def test_the_gpu_benchmark_prepares_only_into_a_folder_it_is_given(tmp_path):
    run = subprocess.run(
        [sys.executable, str(BENCH_GPU), "--prepare-only", "--tokenizer", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 2
    assert "--prepare-only: needs --work" in run.stderr
    assert not list(tmp_path.iterdir())


def test_gpu_sh_without_nvidia_smi_says_so(tmp_path):
    # A PATH holding bash alone: no nvidia-smi, whatever this machine has.
    (tmp_path / "bash").symlink_to("/bin/bash")
    run = subprocess.run(
        ["/bin/bash", str(ROOT / "bench" / "gpu.sh")],
        capture_output=True, text=True, timeout=60, env={"PATH": str(tmp_path)},
    )  # fmt: skip
    assert run.returncode == 2
    assert "needs an NVIDIA GPU" in run.stderr


def _load(name: str):
    """benchmarks/`name`.py, loaded under a name of its own (the folder is not a package)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / f"benchmarks/{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_benchmark_names_the_cpus_family_model_and_matrix_features():
    # Run S (a Zen 4) and run T (an Intel Xeon with AMX) differ 2.3x in their float32 peak;
    # results.md must say which CPU each figure came from, not a marketing name alone.
    describe = _load("common").describe_cpu
    intel = (
        "processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 207\n"
        "model name\t: Intel(R) Xeon(R) Processor\nflags\t\t: fpu avx2 avx512f avx512_bf16 "
        "amx_bf16 amx_tile\n\nprocessor\t: 1\ncpu family\t: 6\nmodel\t\t: 207\n"
    )
    assert describe(intel) == (
        "Intel(R) Xeon(R) Processor (family 6 model 207, avx512f, avx512_bf16, amx_bf16)"
    )
    amd = "cpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512f\n"
    assert describe(amd) == "AMD EPYC (family 25 model 17, avx512f)"
    # An arm64 /proc/cpuinfo has neither a model name nor a family: the platform's name.
    arm = "processor\t: 0\nFeatures\t: fp asimd\n"
    assert describe(arm) == (platform.processor() or platform.machine())


def test_the_data_parallel_figure_is_the_median_of_alternated_rounds():
    # One round of the same code read 0.743 in run T and 0.797-0.847 an hour later: the figure
    # is each round's 2-process rate over twice its 1-process one, then the median of those.
    def metrics(step_rates: list[float], mean: float) -> dict:
        return {
            "train": [{"examples_per_s": r} for r in step_rates],
            "final": {"examples_per_s": mean},
        }

    pairs = [
        (metrics([1.0, 16.0, 16.2, 15.8], 15.0), metrics([1.0, 24.0, 24.5, 23.0], 22.0)),
        (metrics([1.0, 18.0, 18.1, 17.9], 17.0), metrics([1.0, 30.6, 30.0, 31.0], 29.0)),
        (metrics([1.0, 17.0, 16.9, 17.2], 16.0), metrics([1.0, 27.2, 27.0, 27.5], 26.0)),
    ]
    figures = _load("common").dp_figures(pairs)
    # Median steps after the first: (16.0, 24.0), (18.0, 30.6), (17.0, 27.2).
    assert figures["dp_scaling_efficiency_rounds"] == [0.75, 0.85, 0.8]
    assert figures["dp_scaling_efficiency"] == 0.8
    assert figures["dp_one_process_one_core_examples_per_s"] == 17.0
    assert figures["dp_two_processes_examples_per_s"] == 27.2
    assert figures["dp_scaling_efficiency_mean_of_steps"] == round(26.0 / 32.0, 3)


def test_qloras_figures_set_it_against_loras_run_of_the_same_settings():
    # The loss gap is the largest relative one over the steps (the same initial weights,
    # batch and steps on both sides); the model's bytes are the frozen base and what trains.
    bench = _load("bench_decoder")
    lora = {"losses": [2.0, 1.5, 1.0], "frozen_bytes": 0, "trained_bytes": 0}
    nf4 = {"losses": [2.02, 1.5, 0.99], "frozen_bytes": 3 * 2**20, "trained_bytes": 2**19,
           "step_s": 0.5, "peak_rss_gb": 1.234}  # fmt: skip
    assert bench._qlora_figures("nf4", lora, nf4, tokens=100) == {
        "qlora_nf4_model_mb": 3.5,
        "qlora_nf4_tokens_per_s": 200.0,
        "qlora_nf4_loss_gap": 0.01,
        "qlora_nf4_peak_rss_gb": 1.23,
    }


BENCH_STEP = ROOT / "benchmarks" / "bench_step.py"


@pytest.mark.slow
def test_the_step_benchmark_times_steps_in_the_jobs_environment(tmp_path, tiny_model_dir):
    # Started without the jobs' malloc setting, it re-executes itself with it, and says so.
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    env["XLA_FLAGS"] = "--xla_cpu_enable_fast_math=false"
    trace, hlo = tmp_path / "trace", tmp_path / "step.hlo"
    args = ["--model", str(tiny_model_dir), "--batch", "4", "--length", "32", "--steps", "2"]
    run = subprocess.run(
        [sys.executable, str(BENCH_STEP), *args, "--trace", str(trace), "--hlo", str(hlo)],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout)
    assert (result["batch"], result["length"], result["steps"]) == (4, 32, 2)
    assert 0 < result["step_s_min"] <= result["step_s_median"]
    # The step times to the microsecond: a tiny model's step is a few milliseconds.
    assert result["examples_per_s"] == pytest.approx(4 / result["step_s_median"], rel=0.01)
    assert result["peak_rss_gb"] > 0 and result["cpu_per_wall"] > 0
    assert "glibc.malloc.hugetlb=1" in result["glibc_tunables"]
    assert result["xla_flags"] == env["XLA_FLAGS"]
    assert list(trace.rglob("*.trace.json.gz")), "no profiler trace written"
    assert "ENTRY" in hlo.read_text()


def test_the_step_benchmark_refuses_a_step_count_below_one(tmp_path):
    run = subprocess.run(
        [sys.executable, str(BENCH_STEP), "--steps", "0"], capture_output=True, text=True
    )
    assert run.returncode == 2
    assert "--steps: must be at least 1, got 0" in run.stderr
    assert run.stdout == ""


@pytest.mark.slow
def test_the_gpu_benchmark_prepares_2048_tokens_with_minilms_tokenizer(tmp_path, minilm_dir):
    """The decoder case's 2,048-token rows: MiniLM's model has 512 positions, which its
    tokenizer folder's config would impose on the preparation (it stopped bench/gpu.sh before
    measuring); the benchmark prepares with the tokenizer's files alone."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_gpu

    data = bench_gpu.prepared(str(minilm_dir), 2048, 4, tmp_path)
    meta = json.loads((data / "metadata.json").read_text())
    assert meta["splits"]["train"]["length_max"] == 2048


def test_the_tpu_benchmark_counts_flops_and_writes_its_table():
    """bench/tpu.sh's figures: the FLOP count of each case (6·N, LoRA 4·N, + 12·L·H·T) and the
    table written from a run's results (bench/tpu-results.json, measured on the chip)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_tpu

    qwen = bench_tpu.QWEN_05B
    n = bench_tpu.non_embedding_params(qwen)
    assert n == 357_826_560  # Qwen2.5-0.5B: 494.0 M with its 136.2 M-entry embedding table
    assert bench_tpu.flops_per_token(qwen, 2048, lora=False) == 6 * n + 12 * 24 * 896 * 2048
    assert bench_tpu.flops_per_token(qwen, 2048, lora=True) == 4 * n + 12 * 24 * 896 * 2048
    assert bench_tpu.non_embedding_params(bench_tpu.LLAMA_1B) == 973_078_528
    names = [case.name for case in bench_tpu.cases()]
    assert len(set(names)) == len(names) >= 7
    result = json.loads((ROOT / "bench" / "tpu-results.json").read_text())
    table = bench_tpu.markdown(result)
    assert table == (ROOT / "bench" / "tpu-results.md").read_text()
    main_table = table.split("\n## ")[0]  # then the peer's comparison and the attempts
    assert main_table.count("\n| ") == len(result["cases"]) + 2  # the header, its rule, the rows
    sections = [
        r for r in (result.get("comparison"), result.get("keras"), result.get("attempts")) if r
    ]
    rows = sum(len(r["cases"] if isinstance(r, dict) else r) for r in sections)
    assert table.count("\n| ") - main_table.count("\n| ") == rows + 2 * len(sections)
    if result.get("keras"):  # each keras-hub case beside kubejax's figure for the same shape
        keras = table.split("## Against keras-hub")[1].split("\n## ")[0]
        assert all(f"| {c['case']} | " in keras for c in result["keras"]["cases"])


def test_the_tpu_profile_sums_each_operation_by_what_it_does():
    """`tpu_attempts.op_kind` on operations of a v5e step's trace (their HLO, shortened)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import tpu_attempts

    kinds = {
        "%splash_mha_dkv_segmented_no_residuals.46 = (f32[4,512,64]) custom-call(...)":
            "splash backward",
        "%splash_mha_fwd_segmented.3 = (bf16[4,14,2048,64]) custom-call(...)": "splash forward",
        "%fusion.2 = (bf16[151936,896]) fusion(bf16[151936,896] %params__embed, bf16[151936,896] "
        "%opt_state_inner_state_1__0__mu__embed), kind=kLoop": "optimizer update",
        "%fusion.7 = bf16[8192,896] fusion(bf16[8192,1152] %p, bf16[1152,896] %q), kind=kOutput":
            "products",
        "%convolution.12 = bf16[8192,128] convolution(bf16[8192,896] %x, bf16[896,128] %w)":
            "products",
        "%fusion.9 = bf16[8192,896] fusion(bf16[8192,896] %a), kind=kLoop":
            "elementwise (loop fusions)",
        "%copy.4 = bf16[4,2,2048,64] copy(bf16[4,2048,2,64] %k)": "copy",
    }  # fmt: skip
    assert {hlo: tpu_attempts.op_kind(hlo) for hlo in kinds} == kinds
