"""The real model's step timed before a local LLM run (`kubejax.launchers.probe`), and the budget
made from it: the timing's arithmetic, the budget's use of it, the plan that probes only where
its first estimate is long, and one real probe of a tiny decoder (a trainer process)."""

from __future__ import annotations

import dataclasses

import pytest

from kubejax.launchers import probe
from kubejax.models.shape import ModelShape
from kubejax.tune import budget as b

XEON = b.Machine("float32", 364.0, 0.0, 2)
SHAPE = ModelShape(weights=100_000_000, layers=12, hidden=768)
TIMED = b.StepTiming(rows=16, length=128, step_s=4.0, flop_s=2.0e11, job_start_s=9.0,
                     compile_s=30.0, wall_s=60.0)  # fmt: skip


def test_the_timing_is_the_median_step_after_the_first():
    metrics = {
        "train": [{"step": 1, "examples_per_s": 0.5}, {"step": 2, "examples_per_s": 4.0},
                  {"step": 3, "examples_per_s": 2.0}, {"step": 4, "examples_per_s": 8.0}],
        "final": {"first_step_s": 34.0, "phases_s": {"setup": 9.5}},
    }  # fmt: skip
    timing = probe.read_timing(metrics, 16, 128, SHAPE, "lora", 70.0)
    assert timing.step_s == 4.0  # 16 rows at 4 ex/s; the others 2 s and 8 s
    assert timing.compile_s == 30.0 and timing.job_start_s == 9.5 and timing.wall_s == 70.0
    assert timing.flop_s == pytest.approx(16 * 128 * SHAPE.train_flops(128, "lora") / 4.0)
    with pytest.raises(probe.ProbeError, match="no step after the first"):
        probe.read_timing({**metrics, "train": metrics["train"][:1]}, 16, 128, SHAPE, "lora", 1)


def test_a_timed_machine_costs_its_jobs_at_the_timed_speed_start_and_compile():
    timed = dataclasses.replace(XEON, measured=TIMED)
    assert timed.speed == TIMED.flop_s != XEON.speed
    assert timed.job_start_s() == 9.0 and XEON.job_start_s() == b.JOB_START_S
    assert timed.compile_s(False) == 30.0 and timed.compile_s(True) == b.COMPILE_S["warm"]
    job = b.Job(steps=10, batch=16, length=128, evals=1, eval_examples=64)
    fixed = b.TASK_START_S + 9.0 + job.busy_seconds(30.0) + b.TRAIN_FINISH_S
    assert b.train_seconds(timed, SHAPE, job, warm=False) == pytest.approx(
        fixed + job.flops(SHAPE) / TIMED.flop_s
    )
    assert "the real model's step timed now: 16 × 128 tokens in 4.00 s" in timed.describe()


def test_the_probes_settings_are_the_trials_in_one_shape_with_nothing_kept():
    trial = {"learning_rate": 2e-4, "dtype": "auto", "peft": "lora", "lora_rank": 16,
             "max_steps": 48, "bucket_multiple": 32, "mlflow_tracking_uri": "http://x"}  # fmt: skip
    settings = probe.probe_settings(trial, rows=16, length=96)
    assert settings["lora_rank"] == 16 and settings["dtype"] == "auto"
    assert (settings["max_steps"], settings["global_batch_size"]) == (probe.PROBE_STEPS, 16)
    assert settings["max_length"] == settings["bucket_multiple"] == 96
    assert not settings["save_final"] and settings["checkpoint_every"] == 0
    assert settings["mlflow_tracking_uri"] == "" and settings["log_every"] == 1


def _plan_args(tmp_path, tiny_decoder_dir):
    from kubejax.data.synthetic import write_yelp_dir

    source = tmp_path / "reviews"
    write_yelp_dir(source, 300, 60, seed=0)
    return {"source": str(source), "base_model": str(tiny_decoder_dir), "max_length": 64,
            "max_validation_samples": 50, "max_trials": 4, "parallelism": 2, "replicas": 1,
            "trial_replicas": 1, "task": "classification", "peft": "lora", "lora_rank": 4,
            "trial_hyperparameters": {"max_steps": 12, "eval_every": 6, "global_batch_size": 8},
            "train_hyperparameters": {"epochs": 1, "global_batch_size": 8}}  # fmt: skip


def test_a_long_first_estimate_is_timed_and_the_budget_made_again(
    tmp_path, tiny_decoder_dir, monkeypatch
):
    from kubejax.local_run import RUN_SETTINGS, plan_llm_run

    asked = {}

    def fake_probe(**kwargs):
        asked.update(kwargs)
        return TIMED

    monkeypatch.setattr(probe, "PROBE_FROM_S", 0.0)
    monkeypatch.setattr(probe, "probe_step", fake_probe)
    said = []
    plan = plan_llm_run(_plan_args(tmp_path, tiny_decoder_dir), dict(RUN_SETTINGS), set(), "sig",
                        say=said.append)  # fmt: skip
    assert len(said) == 1 and said[0].startswith("budget: first estimate ~")
    assert "timing the real model's step here" in said[0]
    assert asked["rows"] == 8 and asked["trial"]["lora_rank"] == 4  # the trials' step
    assert asked["trial"]["task"] == "classification" and asked["length"] % 32 == 0
    assert "the real model's step timed now" in plan.lines[0]
    assert plan.first_estimate is not None and plan.budget.total != plan.first_estimate.total
    assert plan.lines[-1].startswith("  the first estimate, from a matmul: ~")


def test_a_failed_probe_leaves_the_matmuls_budget(tmp_path, tiny_decoder_dir, monkeypatch):
    from kubejax.local_run import RUN_SETTINGS, plan_llm_run

    def failing(**_):
        raise probe.ProbeError("the step's probe failed (1): boom")

    monkeypatch.setattr(probe, "PROBE_FROM_S", 0.0)
    monkeypatch.setattr(probe, "probe_step", failing)
    plan = plan_llm_run(_plan_args(tmp_path, tiny_decoder_dir), dict(RUN_SETTINGS), set(), "s")
    assert plan.first_estimate is None and "matmul measured now" in plan.lines[0]
    assert plan.lines[-1] == "  the step's probe failed (1): boom; the budget stays the matmul's"


def test_a_short_first_estimate_is_not_timed(tmp_path, tiny_decoder_dir, monkeypatch):
    from kubejax.local_run import RUN_SETTINGS, plan_llm_run

    def never(**_):
        raise AssertionError("probed a run shorter than PROBE_FROM_S")

    monkeypatch.setattr(probe, "probe_step", never)
    plan = plan_llm_run(_plan_args(tmp_path, tiny_decoder_dir), dict(RUN_SETTINGS), set(), "s")
    assert plan.budget.total < probe.PROBE_FROM_S and plan.first_estimate is None


@pytest.mark.slow
def test_a_tiny_decoders_step_is_timed_by_its_trainer(tmp_path, tiny_decoder_dir):
    from kubejax.data import prepare

    args = _plan_args(tmp_path, tiny_decoder_dir)
    cfg = prepare.PrepareConfig(tokenizer=str(tiny_decoder_dir), source=args["source"])
    frames, _ = prepare.load_source(cfg)
    timing = probe.probe_step(
        model=str(tiny_decoder_dir), frames=frames,
        prepare={"text_column": "text", "label_column": "label", "task": "classification"},
        trial={"task": "classification", "peft": "lora", "lora_rank": 4, "learning_rate": 1e-3},
        rows=8, length=64, shape=ModelShape.from_folder(str(tiny_decoder_dir)), peft="lora",
    )  # fmt: skip
    assert (timing.rows, timing.length) == (8, 64)
    assert timing.step_s > 0 and timing.flop_s > 0 and timing.compile_s >= 0
    assert 0 < timing.job_start_s < timing.wall_s
