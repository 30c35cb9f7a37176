"""The local run's budget (`kubejax.tune.budget`): the FLOPs count against the model's own
weights, the sweep sized to its share, the share refused outside (0, 1], and a local LLM run's
plan before it starts. The whole run's budget against its measured wall is checked on the
embedded decoder's run in tests/test_pipeline_local.py."""

from __future__ import annotations

import json
import math

import pytest

from kubejax.tune import budget as b
from kubejax.tune.space import SweepError

# A machine as the 2-core Xeon measured it (float32 matmul 364 GFLOP/s), idle.
XEON = b.Machine("float32", 364.0, 0.0, 2)


@pytest.mark.parametrize("family", ["qwen2", "mistral", "qwen3"])
def test_the_flops_count_the_models_own_weights(family):
    """N, the non-embedding weights the FLOPs count, is the model's own count of its
    projection kernels (norms and biases aside: < 1 %; the language-model head reads only the
    answers' positions)."""
    import jax

    from kubejax.models.decoder import DecoderConfig
    from kubejax.trainer.plan import abstract_params
    from tests.models.decoders import hf_config

    config = hf_config(family).to_dict()
    params = abstract_params(DecoderConfig.from_dict(config), "causal-lm", 0)
    kernels = sum(
        x.size
        for path, x in jax.tree_util.tree_flatten_with_path(params)[0]
        if x.ndim >= 2 and not any(n in jax.tree_util.keystr(path) for n in ("embed", "head"))
    )
    shape = b.ModelShape.of(config)
    assert shape.weights == pytest.approx(kernels, rel=0.01)
    h, layers, n = shape.hidden, shape.layers, shape.weights
    assert shape.train_flops(64, "lora") == 4 * n + 12 * layers * h * 64
    assert shape.train_flops(64, "none") == 6 * n + 12 * layers * h * 64
    assert shape.eval_flops(64) == 2 * n + 4 * layers * h * 64


def _size(share: float, rest: float = 2000.0, **kw) -> b.SweepSize:
    shape = b.ModelShape(layers=12, hidden=1024, weights=132_000_000)
    settings = {"machine": XEON, "shape": shape, "rest_seconds": rest, "share": share,
                "most_trials": 8, "parallel": 2, "final_steps": 125, "batch": 16, "length": 128,
                "validation_rows": 1000, "peft": "lora", "warm": False, **kw}  # fmt: skip
    return b.size_sweep(**settings)


@pytest.mark.parametrize("share", [0.2, 0.4, 0.6])
def test_the_sweep_takes_at_most_its_share_of_the_run(share):
    size = _size(share)
    assert size.seconds / (size.seconds + 2000.0) <= share + 1e-9
    assert size.steps >= math.ceil(b.MIN_TRIAL_SHARE * 125) and size.trials >= 2
    assert b.EVAL_EXAMPLES_FOR["min"] <= size.eval_examples <= b.EVAL_EXAMPLES_FOR["wanted"]
    assert f"≤ {share:.0%} of the run" in size.why


def test_a_larger_share_buys_more_trials_and_larger_evaluations():
    sizes = [_size(s) for s in (0.2, 0.4, 0.6, 0.9)]
    work = [s.trials * (s.steps * 16 + 2 * s.eval_examples) for s in sizes]
    assert work == sorted(work) and work[0] < work[-1]
    unlimited = _size(1.0)
    assert (unlimited.trials, unlimited.steps) == (8, 125) and "no limit" in unlimited.why


def test_a_run_too_small_for_its_share_gets_the_least_sweep_and_says_so():
    size = _size(0.4, rest=5.0)
    assert (size.trials, size.steps) == (2, math.ceil(b.MIN_TRIAL_SHARE * 125))
    assert size.eval_examples == b.EVAL_EXAMPLES_FOR["min"] and "the least sweep" in size.why
    assert _size(0.4, validation_rows=200).eval_examples == 200


@pytest.mark.parametrize("share", [0, -0.1, 1.5, "half", None])
def test_a_share_outside_0_1_is_refused_naming_the_setting(share):
    with pytest.raises(SweepError, match=r"^sweep_budget_share: .* is not in \(0, 1\]"):
        b.check_share(share)
    assert b.check_share("0.25") == 0.25 and b.check_share(1) == 1.0


def test_the_machine_is_measured_now():
    machine = b.measure_machine("float32", n=256, seconds=0.05)
    assert machine.gflops > 0 and machine.others >= 0 and machine.cores >= 1
    assert machine.speed == pytest.approx(machine.gflops * 1e9 * b.EFFICIENCY["float32"])
    assert "float32 matmul measured now" in machine.describe()


@pytest.mark.slow
def test_a_local_llm_plan_sizes_the_sweep_before_anything_runs(tmp_path, tiny_decoder_dir):
    """On the embedded synthetic data and a tiny decoder: every step costed, the trials sized
    (the profile's count and length replaced), a user's own trials left as given."""
    from kubejax.data.synthetic import write_yelp_dir
    from kubejax.local_run import RUN_SETTINGS, plan_llm_run

    source = tmp_path / "reviews"
    write_yelp_dir(source, 600, 100, seed=0)
    args = {"source": str(source), "base_model": str(tiny_decoder_dir), "max_length": 64,
            "max_validation_samples": 50, "max_trials": 4, "parallelism": 2, "replicas": 1,
            "trial_replicas": 1, "task": "causal-lm",
            "trial_hyperparameters": {"max_steps": 12, "eval_every": 6, "global_batch_size": 8},
            "train_hyperparameters": {"epochs": 1, "global_batch_size": 8,
                                      "eval_every": 20}}  # fmt: skip
    plan = plan_llm_run(args, dict(RUN_SETTINGS), set(), "sig")
    assert set(plan.budget.steps) == {"prepare", "sweep", "final training", "evaluation",
                                      "register"}  # fmt: skip
    assert all(v > 0 for v in plan.budget.steps.values())
    rows = {"train": 540, "validation": 50, "test": 100}  # 10 % of train carved out, capped
    assert f"({sum(rows.values())} rows: {rows})" in plan.budget.notes["prepare"]
    assert "67 steps of 8 × 64 tokens" in plan.budget.notes["final training"]  # 540 // 8
    sized = plan.args["trial_hyperparameters"]
    assert plan.args["max_trials"] >= 2 and 2 <= sized["max_steps"] <= 67
    assert sized["max_eval_examples"] == 50 and sized["eval_every"] == -(-sized["max_steps"] // 2)
    assert any("the sweep:" in line and "sweep_budget_share 0.3" in line for line in plan.lines)
    given = plan_llm_run(args, dict(RUN_SETTINGS), {"max_trials"}, "sig")
    assert given.args["max_trials"] == 4 and given.args["trial_hyperparameters"]["max_steps"] == 12
    assert "as given" in given.budget.notes["sweep"]
    # A user's trial keys that size nothing (a dtype) leave the sweep sized; a length does not.
    dtype_only = {"trial_hyperparameters", "trial_hyperparameters.dtype"}
    assert "as given" not in plan_llm_run(args, dict(RUN_SETTINGS), dtype_only,
                                          "sig").budget.notes["sweep"]  # fmt: skip
    steps = {"trial_hyperparameters", "trial_hyperparameters.max_steps"}
    assert "as given" in plan_llm_run(args, dict(RUN_SETTINGS), steps, "sig").budget.notes["sweep"]
    hub = plan_llm_run({**args, "base_model": "Qwen/Qwen2.5-0.5B"}, dict(RUN_SETTINGS), set(), "s")
    assert hub.budget is None and hub.lines[0].startswith("no budget: base_model")
    assert json.dumps(plan.args)  # the pipeline takes them as they are


@pytest.mark.slow
def test_a_plans_prediction_is_the_arithmetic_of_the_given_speeds(
    tmp_path, monkeypatch, tiny_decoder_dir
):
    """The budget's accuracy against a run's wall is a benchmark figure (bench/llm-hpo.sh), not
    a test: here the plan is the arithmetic of the speed it is given. Each step that computes
    (the sweep, the final training, the evaluation) is its fixed costs plus its FLOPs over the
    speed, so doubling the speed halves the part above the fixed costs; the steps that do not
    compute are their constants; the total is their sum."""
    from kubejax.data.synthetic import write_yelp_dir
    from kubejax.local_run import RUN_SETTINGS, plan_llm_run

    source = tmp_path / "reviews"
    write_yelp_dir(source, 600, 100, seed=0)
    args = {"source": str(source), "base_model": str(tiny_decoder_dir), "max_length": 64,
            "max_validation_samples": 50, "max_trials": 3, "parallelism": 2, "replicas": 1,
            "trial_replicas": 1, "task": "causal-lm",
            "trial_hyperparameters": {"max_steps": 12, "eval_every": 6, "global_batch_size": 8},
            "train_hyperparameters": {"epochs": 1, "global_batch_size": 8,
                                      "eval_every": 20}}  # fmt: skip
    steps = {}
    for gflops in (100.0, 200.0, 400.0):
        given = b.Machine("float32", gflops, 0.0, 2)
        monkeypatch.setattr(b, "measure_machine", lambda *_, _m=given, **__: _m)
        plan = plan_llm_run(args, dict(RUN_SETTINGS), {"max_trials", "trial_hyperparameters"},
                            f"sig-{gflops}")  # fmt: skip
        assert plan.budget.total == pytest.approx(sum(plan.budget.steps.values()))
        assert f"float32 matmul measured now {gflops:.0f} GFLOP/s" in plan.lines[0]
        steps[gflops] = plan.budget.steps
    rows = 540 + 50 + 100  # train (10 % carved out for validation, capped at 50), test
    for speed in steps.values():
        assert speed["prepare"] == pytest.approx(b.prepare_seconds(rows))
        assert speed["register"] == b.TASK_START_S
    for step in ("sweep", "final training", "evaluation"):
        slow, mid, fast = (steps[g][step] for g in (100.0, 200.0, 400.0))
        assert slow > mid > fast > 0, step
        assert slow - mid == pytest.approx(2 * (mid - fast), rel=1e-9), step


def test_a_finished_run_is_remembered_as_compiled(tmp_path):
    memory = tmp_path / "cache" / "local-runs.json"
    first, other = b.run_signature("kubejax-llm", "llm", []), b.run_signature("x")
    assert first != other and len(first) == 16 and not b.compiled_before(first, memory)
    b.remember_run(first, memory)
    assert b.compiled_before(first, memory) and not b.compiled_before(other, memory)


def test_the_summary_sets_each_steps_budget_beside_what_it_took():
    from kubejax.local_run import budget_said, measured_phases

    tasks = [{"task": "prepare-yelp", "seconds": 2.04}, {"task": "tune-sweep", "seconds": 90.0},
             {"task": "train", "seconds": 150.2}, {"task": "evaluate", "seconds": 20.0},
             {"task": "register-model", "seconds": None}]  # fmt: skip
    measured = measured_phases(tasks)
    assert measured == {"prepare": 2.0, "sweep": 90.0, "final training": 150.2,
                        "evaluation": 20.0}  # fmt: skip
    predicted = {"prepare": 3, "sweep": 100, "final training": 140, "evaluation": 25,
                 "register": 2}  # fmt: skip
    said = budget_said({"predicted": predicted, "predicted_total": 270, "measured": measured,
                        "measured_total": 265})  # fmt: skip
    assert said == (
        "budget against the run (predicted/measured): total 270/265 s; prepare 3/2 s, "
        "sweep 100/90 s, final training 140/150 s, evaluation 25/20 s"
    )
