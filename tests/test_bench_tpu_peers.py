"""The TPU benchmark's peer side (benchmarks/bench_tpu_peers.py: Tunix + qwix), checked where
neither is installed (CI): its parameter and FLOP counts against the models' published figures
and kubejax's own count, its case table, and its driver's failure handling end to end: a case
whose process runs out of memory is retried with the next setting and recorded, any other error
or a crash is recorded with its text, and the run goes on and writes its files. The measurement
itself needs Tunix (the TPU machine, or a scratch venv with `--smoke`)."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_tpu_peers.py"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


peers = _load("bench_tpu_peers", SCRIPT)
QWEN, LLAMA = peers.SHAPES["qwen2.5-0.5b"], peers.SHAPES["llama-3.2-1b"]


def test_parameter_counts_match_the_published_models():
    # Hugging Face's totals: Qwen/Qwen2.5-0.5B 494,032,768; meta-llama/Llama-3.2-1B 1,235,814,400.
    assert peers.total_params(QWEN) == 494_032_768
    assert peers.total_params(LLAMA) == 1_235_814_400
    assert peers.non_embedding_params(QWEN) == 357_826_560
    assert peers.non_embedding_params(LLAMA) == 973_078_528
    # PEFT's trainable count for r=16 on q_proj, k_proj, v_proj, o_proj.
    assert peers.lora_params(QWEN, 16) == 2_162_688
    assert peers.lora_params(LLAMA, 16) == 3_407_872


def test_the_flop_count_is_kubejax_s():
    decoder = _load("bench_decoder", ROOT / "benchmarks" / "bench_decoder.py")
    assert peers.non_embedding_params(QWEN) == decoder.non_embedding_params(decoder.QWEN25_05B)
    assert peers.flops_per_token(QWEN, 2048, lora=False) == decoder.flops_per_token(
        decoder.QWEN25_05B, 2048
    )
    # 6·N + 12·L·H·T; LoRA 4·N + 12·L·H·T.
    assert peers.flops_per_token(QWEN, 2048, lora=False) == 2_675_441_664
    assert peers.flops_per_token(QWEN, 2048, lora=True) == 1_959_788_544
    assert peers.flops_per_token(LLAMA, 2048, lora=True) == 4_697_620_480
    assert peers.lm_head_flops_per_token(QWEN, lora=False) == 6 * 151_936 * 896
    # At the peak's rate the MFU is 1; against a lower measured peak it is higher.
    rate = 197e12 / peers.flops_per_token(QWEN, 2048, lora=False)
    assert peers.mfu(rate, peers.flops_per_token(QWEN, 2048, lora=False)) == pytest.approx(1.0)
    assert peers.mfu(rate, peers.flops_per_token(QWEN, 2048, False), 165.0) > 1.19


def test_the_cases_are_the_issue_s():
    assert set(peers.CASES) == {"qwen25-05b-full", "qwen25-05b-lora", "llama32-1b-lora"}
    expected = {
        "qwen25-05b-full": ("qwen2.5-0.5b", False, True),
        "qwen25-05b-lora": ("qwen2.5-0.5b", True, True),
        "llama32-1b-lora": ("llama-3.2-1b", True, None),  # Tunix's Llama3 has no splash switch
    }
    for name, case in peers.CASES.items():
        assert (case["shape"], case["lora"], case["flash"]) == expected[name]
        assert case["seq"] == 2048
        assert case["attempts"][0]["batch"] == 4  # kubejax's 4 × 2048
        assert all(a["remat"] in ("NONE", "BLOCK", "DECODER") for a in case["attempts"])
    for shape in (QWEN, LLAMA):
        assert shape["heads"] * shape["head_dim"] == shape["hidden"] and shape["tied"]
    assert (QWEN["layers"], QWEN["mlp"], QWEN["vocab"], QWEN["kv_heads"]) == (24, 4864, 151936, 2)
    assert (LLAMA["layers"], LLAMA["mlp"], LLAMA["vocab"], LLAMA["kv_heads"]) == (
        16,
        8192,
        128256,
        8,
    )
    assert peers.LORA["rank"] == 16 and peers.LORA["alpha"] == 32.0
    # --smoke: one attempt at the tiny shape; --batch/--remat: one attempt as given.
    shape, seq, attempts = peers.case_plan("qwen25-05b-full", smoke=True)
    assert (shape["layers"], shape["hidden"], seq, attempts) == (2, 64, 128, [attempts[0]])
    assert attempts[0]["batch"] == 2
    _, _, attempts = peers.case_plan("llama32-1b-lora", False, batch=1, remat="BLOCK")
    assert attempts == [{"batch": 1, "remat": "BLOCK"}]


def test_failure_records():
    oom = (
        "jax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total "
        "memory required for HLO temporaries (24.73G) exceeds available HBM (15.75G)."
    )
    record = peers.failure_record(
        "llama32-1b-lora", {"batch": 4, "remat": "NONE"}, "x" * 9000 + oom
    )
    assert set(record) == peers.FAILURE_KEYS
    assert (record["status"], record["error_kind"], record["peer"]) == ("failed", "oom", "tunix")
    assert len(record["error"]) == peers.ERROR_CHARS and record["error"].endswith(oom)
    assert (
        peers.classify_error("XLA:TPU compile permanent error. Ran out of memory in hbm") == "oom"
    )
    assert peers.classify_error("ValueError: Incompatible shapes for broadcasting") == "error"
    assert peers.failure_record("c", {}, "", "skipped")["error_kind"] == "skipped"


def test_the_install_names_each_package_once_with_tunix_s_pins():
    command = peers.pip_install_command("/tmp/site-x", "/w")
    names = [re.split(r"[=<>]", n)[0] for n in (*peers.CARRIED, *peers.FROM_INDEX)]
    assert len(names) == len(set(names))
    assert {"google-tunix==0.1.7", "qwix==0.1.8"} <= set(peers.CARRIED)
    assert "safetensors==0.7.0" in peers.CARRIED  # Tunix 0.1.7 pins safetensors<0.8
    assert {"flax==0.12.8", "optax==0.2.8"} <= set(peers.FROM_INDEX)
    assert command[command.index("--target") + 1] == "/tmp/site-x"
    assert command[command.index("--find-links") + 1] == "/w"
    assert "--no-deps" in command and "--only-binary=:all:" in command
    assert command[command.index("--index-url") + 1] == "file:///opt/pypi/simple"
    assert command[-len(names) :] == [*peers.CARRIED, *peers.FROM_INDEX]
    download = peers.pip_download_command("/d")
    assert download[download.index("--python-version") + 1] == "3.11"
    assert download[-len(peers.CARRIED) :] == list(peers.CARRIED)


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _run(tmp_path: Path, stub: str, *args: str) -> subprocess.CompletedProcess:
    """The driver with a stand-in `qwix` package (imported first by each case's process) that
    does what `stub` says, so no case reaches Tunix."""
    fake = tmp_path / "stub" / "qwix"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(stub)
    env = {"PYTHONPATH": str(fake.parent), "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path / "out"), *args],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip


@pytest.mark.slow
def test_out_of_memory_is_retried_with_the_next_setting_and_recorded(tmp_path):
    stub = "raise RuntimeError('RESOURCE_EXHAUSTED: Ran out of memory on HBM (stand-in)')\n"
    run = _run(tmp_path, stub, "--cases", "qwen25-05b-full", "--min-retry-s", "0", "--no-peak")
    assert run.returncode == 0, run.stderr[-3000:]
    (record,) = _lines(tmp_path / "out" / "tunix-cases.jsonl")
    assert (record["status"], record["error_kind"]) == ("failed", "oom")
    assert "RESOURCE_EXHAUSTED" in record["error"] and "Traceback" in record["error"]
    assert [a["attempt"]["remat"] for a in record["attempts"]] == ["NONE", "BLOCK", "DECODER"]
    assert all(a["error_kind"] == "oom" for a in record["attempts"])
    summary = json.loads((tmp_path / "out" / "tunix-results.json").read_text())
    assert [c["case"] for c in summary["cases"]] == ["qwen25-05b-full"]
    assert summary["tunix_version"] == "0.1.7"
    assert "**oom**" in (tmp_path / "out" / "tunix-results.md").read_text()


@pytest.mark.slow
def test_other_failures_and_crashes_are_recorded_and_the_run_goes_on(tmp_path):
    # The first case's process raises, the second's dies without a word: both recorded, once.
    stub = (
        "import os, sys\n"
        "case = sys.argv[sys.argv.index('--child') + 1]\n"
        "if case == 'qwen25-05b-lora':\n"
        "    raise ValueError('Incompatible shapes (stand-in)')\n"
        "os._exit(3)\n"
    )
    cases = "qwen25-05b-lora,llama32-1b-lora"
    run = _run(tmp_path, stub, "--cases", cases, "--min-retry-s", "0", "--no-peak")
    assert run.returncode == 0, run.stderr[-3000:]
    out = tmp_path / "out"
    lora, llama = _lines(out / "tunix-cases.jsonl")
    assert (lora["error_kind"], len(lora["attempts"])) == ("error", 1)
    assert "ValueError: Incompatible shapes (stand-in)" in lora["error"]
    assert (llama["error_kind"], len(llama["attempts"])) == ("crash", 1)
    assert "exited 3" in llama["error"]
    assert sorted(p.name for p in out.iterdir()) == [
        "tunix-cases.jsonl", "tunix-results.json", "tunix-results.md",
    ]  # fmt: skip
    summary = json.loads((out / "tunix-results.json").read_text())
    assert [c["case"] for c in summary["cases"]] == ["qwen25-05b-lora", "llama32-1b-lora"]


def test_a_spent_budget_skips_the_case(tmp_path):
    run = _run(tmp_path, "raise SystemExit('not reached')\n", "--cases", "llama32-1b-lora",
               "--budget-s", "0")  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    (record,) = _lines(tmp_path / "out" / "tunix-cases.jsonl")
    assert record["error_kind"] == "skipped" and "budget" in record["error"]
    assert "not reached" not in record["error"]


# ---------------------------------------------------------------------------------------------
# The second peer, keras-hub (benchmarks/bench_tpu_keras.py): what runs without keras


def _keras_peer():
    sys.path.insert(0, str(SCRIPT.parent))
    return _load("bench_tpu_keras", SCRIPT.parent / "bench_tpu_keras.py")


def test_keras_hub_models_take_the_benchmark_shapes():
    """The backbones' arguments are the shapes' (Llama 3.2's frequency scaling included), in
    bfloat16; a shape whose heads are not hidden / heads wide is refused (keras-hub derives
    the head size)."""
    keras_peer = _keras_peer()
    qwen = keras_peer.backbone_arguments(keras_peer.SHAPES["qwen2.5-0.5b"])
    assert (qwen["num_layers"], qwen["hidden_dim"], qwen["num_query_heads"]) == (24, 896, 14)
    assert (qwen["num_key_value_heads"], qwen["intermediate_dim"]) == (2, 4864)
    assert qwen["vocabulary_size"] == 151936 and qwen["tie_word_embeddings"]
    assert qwen["dtype"] == "bfloat16" and "rope_frequency_adjustment_factor" not in qwen
    llama = keras_peer.backbone_arguments(keras_peer.SHAPES["llama-3.2-1b"])
    assert (llama["num_layers"], llama["hidden_dim"], llama["intermediate_dim"]) == (16, 2048, 8192)
    assert llama["rope_frequency_adjustment_factor"] == 32.0
    assert llama["rope_pretraining_sequence_length"] == 8192
    with pytest.raises(ValueError, match="hidden / heads"):
        keras_peer.backbone_arguments(dict(keras_peer.SHAPES["qwen2.5-0.5b"], head_dim=128))


def test_keras_hub_installs_from_the_carried_wheels_alone():
    """keras-hub's metadata asks for tensorflow-text (TensorFlow: too large to carry), so its
    wheels install unresolved, from the carried folder alone (no index), each pinned once."""
    keras_peer = _keras_peer()
    cmd = keras_peer.pip_install_command("/tmp/t", ".whl-tpu")
    assert {"--no-deps", "--no-index", "--only-binary=:all:"} <= set(cmd)
    names = [re.split("==", p)[0] for p in keras_peer.CARRIED]
    assert len(names) == len(set(names)) and all("==" in p for p in keras_peer.CARRIED)
    assert {"keras", "keras-hub", "kagglehub", "requests"} <= set(names)
    assert not any(n.startswith("tensorflow") for n in names)
    assert set(keras_peer.CARRIED) <= set(keras_peer.pip_download_command("w"))
