"""The local run's budgets and its terminal output (no pipeline is run here)."""

from __future__ import annotations

import io
import json

import pytest

from kubejax.local_run import (
    PROFILES,
    RunLog,
    choose_profile,
    describe_budget,
    embedded_params,
    local_args,
)

PROFILE_CASES = [
    ("embedded data, no profile", None, {}, "demo"),
    ("own data, no profile", None, {"source": "reviews.csv"}, "quick"),
    ("own data, full", "full", {"source": "reviews.csv"}, "full"),
    ("embedded data, quick", "quick", {}, "quick"),
]


@pytest.mark.parametrize(
    ("name", "asked", "overrides", "expected"), PROFILE_CASES, ids=[c[0] for c in PROFILE_CASES]
)
def test_profile_choice(name, asked, overrides, expected):
    assert choose_profile(asked, overrides) == expected


@pytest.mark.parametrize(
    ("asked", "overrides", "message"),
    [
        ("demo", {"source": "reviews.csv"}, "demo is sized for the embedded synthetic data"),
        ("huge", {}, "'huge' is not one of demo, quick, full"),
    ],
)
def test_bad_profile_is_refused_naming_the_flag(asked, overrides, message):
    with pytest.raises(ValueError, match="--profile") as err:
        choose_profile(asked, overrides)
    assert message in str(err.value)


def test_only_the_demo_profile_caps_the_evaluation(tmp_path):
    demo, quick, full = (embedded_params(tmp_path, p) for p in ("demo", "quick", "full"))
    assert demo["max_test_samples"] == 500
    assert quick["max_test_samples"] == full["max_test_samples"] == 0
    assert quick["max_length"] == 128 and full["max_length"] == 256
    assert "max_steps" not in quick["train_hyperparameters"]  # whole epochs
    assert full["train_hyperparameters"]["epochs"] == 3
    for params in (quick, full):
        assert params["train_hyperparameters"]["max_length"] == params["max_length"]


@pytest.mark.slow
def test_budget_line_says_what_applies(tmp_path):
    demo = describe_budget("demo", embedded_params(tmp_path, "demo"))
    assert demo.startswith("budget: profile demo: max_length 64; 4 trials × 12 steps")
    assert "final training 50 steps on 2 worker(s)" in demo and "test ≤ 500 rows" in demo
    quick = describe_budget("quick", embedded_params(tmp_path, "quick"))
    assert "final training 1 epoch(s)" in quick and "validation ≤ 1000 rows" in quick
    assert "every row of every split" in describe_budget("full", embedded_params(tmp_path, "full"))
    llm = describe_budget("llm", embedded_params(tmp_path, "llm", "kubejax-llm"))
    assert llm.startswith("budget: profile llm: max_length 64; 2 trials × 12 steps")
    assert set(PROFILES) == {"demo", "quick", "full", "llm"}


KFP_LINES = """\
06:00:00.000 - INFO - Executing task \x1b[96m'train'\x1b[0m
06:00:00.001 - INFO - Streamed logs:
    [KFP Executor 2026-12-03 06:00:00,100 INFO]: Got executor_input:
    {"inputs": {}}
    kubejax: launching JAXJob kubejax-train-1 (2 worker(s), local backend)
    [worker-1] step 5/10 | loss 1.0
    [worker-0] step 5/10 | loss 1.0 | lr 1e-04 | 20 ex/s
    [worker-0] Traceback (most recent call last):
06:00:03.000 - ERROR - Task \x1b[96m'train'\x1b[0m finished with status \x1b[91mFAILURE\x1b[0m
"""


def test_run_log_filters_the_terminal_and_keeps_everything(tmp_path):
    terminal = io.StringIO()
    with RunLog(tmp_path / "run.log", terminal) as log:
        for chunk in (KFP_LINES[:50], KFP_LINES[50:]):  # writes need not end at a newline
            print(chunk, end="")
    shown = terminal.getvalue()
    assert "train: started" in shown and "train: FAILURE in" in shown
    assert "[worker-0] step 5/10" in shown and "kubejax: launching JAXJob" in shown
    assert "[worker-1] step" not in shown.split("FAILURE")[0]  # only worker 0's progress
    assert "Traceback" in shown.split("FAILURE")[1]  # a failed task's last lines are shown
    assert "executor_input" not in shown.split("FAILURE")[0]
    assert (tmp_path / "run.log").read_text() == KFP_LINES
    assert [t["task"] for t in log.tasks] == ["train"] and log.tasks[0]["status"] == "FAILURE"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_run_log_shows_a_task_bar_on_a_terminal_only(tmp_path):
    terminal = _Terminal()
    with RunLog(tmp_path / "run.log", terminal, total_tasks=5):
        print(KFP_LINES, end="")
    shown = terminal.getvalue()
    assert "pipeline:" in shown and "1/5" in shown and "train: FAILURE in" in shown
    piped = io.StringIO()
    with RunLog(tmp_path / "piped.log", piped, total_tasks=5):
        print(KFP_LINES, end="")
    assert "1/5" not in piped.getvalue() and "\r" not in piped.getvalue()


@pytest.mark.slow
def test_the_yelp_pipeline_counts_its_tasks_inside_conditions():
    from kubejax.local_run import task_count
    from pipelines.yelp import train_eval_pipeline, yelp_pipeline

    assert task_count(yelp_pipeline) == 5  # prepare, sweep, train, evaluate, register (If)
    assert task_count(train_eval_pipeline) == 3  # prepare, train, evaluate


def test_run_log_verbose_shows_everything(tmp_path):
    terminal = io.StringIO()
    with RunLog(tmp_path / "run.log", terminal, verbose=True):
        print(KFP_LINES, end="")
    assert terminal.getvalue() == KFP_LINES


LLM_SPACE_NAMES = {"learning_rate", "lora_rank", "lora_alpha"}


@pytest.mark.parametrize("profile", ["quick", "full"])
def test_a_local_llm_run_searches_the_llm_space_with_the_pipelines_lora_defaults(tmp_path, profile):
    """quick and full on the LLM pipeline keep its search space (learning rate, LoRA rank and
    alpha), its LoRA settings and learning rate (2e-4, not the encoder budgets' 1e-4 or
    5e-5), with the profile's length and batch; the encoder pipeline keeps the encoder's."""
    from kubejax.pipelines.catalog import PIPELINES
    from kubejax.pipelines.llm import LLM_TRAIN_HP

    own = ["source=reviews.csv", "base_model=/models/decoder"]
    chosen, _, args = local_args(tmp_path, PIPELINES["kubejax-llm"], own, profile)
    assert chosen == profile
    assert set(json.loads(args["search_space"])) == LLM_SPACE_NAMES
    assert "lora_rank" not in args and "lora_alpha" not in args  # the pipeline's 16 and 32
    train = args["train_hyperparameters"]
    assert train["learning_rate"] == LLM_TRAIN_HP["learning_rate"] == 2e-4
    assert train["dtype"] == args["trial_hyperparameters"]["dtype"] == "auto"
    assert train["max_length"] == PROFILES[profile]["max_length"]
    assert "learning_rate" not in args["trial_hyperparameters"]  # searched
    assert args["pruner"] == ("hyperband" if profile == "full" else "median")
    _, _, encoder = local_args(tmp_path, PIPELINES["kubejax-yelp"], own[:1], profile)
    assert set(json.loads(encoder["search_space"])) == {"learning_rate", "warmup_ratio"}


def test_a_users_settings_keys_merge_into_the_profiles(tmp_path):
    """--param trial_hyperparameters='{"dtype": ...}' changes that key alone: the profile's
    steps, batch and evaluation stay, and the names given say which keys were set."""
    from kubejax.pipelines.catalog import PIPELINES

    from kubejax.local_run import given_settings

    llm = PIPELINES["kubejax-llm"]
    own = ["source=reviews.csv", "base_model=/m",
           'trial_hyperparameters={"dtype": "float32", "max_length": 96}']  # fmt: skip
    _, _, args = local_args(tmp_path, llm, own, "quick")
    profile = PROFILES["quick"]["trial_hyperparameters"]
    trial = args["trial_hyperparameters"]
    assert (trial["dtype"], trial["max_length"]) == ("float32", 96)
    assert {k: trial[k] for k in ("max_steps", "global_batch_size", "eval_every")} == {
        k: profile[k] for k in ("max_steps", "global_batch_size", "eval_every")
    }
    assert args["train_hyperparameters"]["global_batch_size"] == 16  # untouched
    names = given_settings([*own, "sweep_budget_share=0.5"], llm)
    assert {"trial_hyperparameters.dtype", "trial_hyperparameters.max_length",
            "sweep_budget_share", "source"} <= names  # fmt: skip
    assert "trial_hyperparameters.max_steps" not in names


def test_the_users_search_space_wins_and_the_llm_profile_keeps_the_llm_space(tmp_path):
    from kubejax.pipelines.catalog import PIPELINES

    llm = PIPELINES["kubejax-llm"]
    mine = json.dumps({"lora_dropout": {"type": "float", "low": 0.0, "high": 0.2}})
    own = ["source=reviews.csv", "base_model=/m", f"search_space={mine}"]
    assert local_args(tmp_path, llm, own, None)[2]["search_space"] == mine
    chosen, defaults, args = local_args(tmp_path, llm, [], None)  # the embedded decoder
    assert chosen == "llm" and args["base_model"] == defaults["base_model"]
    assert set(json.loads(args["search_space"])) == LLM_SPACE_NAMES
    with pytest.raises(ValueError, match="--profile: demo runs the encoder pipelines"):
        local_args(tmp_path, llm, [], "demo")


BAD_LLM_RUNS = [
    ("sweep_budget_share=0", "sweep_budget_share: '0' is not in (0, 1]"),
    ("sweep_budget_share=1.5", "sweep_budget_share: '1.5' is not in (0, 1]"),
    ('search_space={"lora_ranks": {"type": "int", "low": 4, "high": 8}}',
     "search_space.lora_ranks: not a setting the trainer takes"),
    # Every rank's memory plan exceeds the trials' 1 GiB, the defaults' included.
    ('search_space={"lora_rank": {"type": "categorical", "choices": [100000, 200000]}}',
     "search_space: no point can run, not even {'lora_rank': 100000} nor the defaults' "
     "{'lora_rank': 150000}"),
    ("algorithm=annealing", "algorithm: 'annealing' is not one of"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("param", "message"), BAD_LLM_RUNS, ids=["zero", "over", "name", "memory", "algorithm"]
)
@pytest.mark.slow
def test_bad_llm_runs_exit_2_in_one_line_before_any_trial(tmp_path, capsys, param, message):
    from kubejax.cli import main

    trial = json.dumps({"max_steps": 4, "eval_every": 2, "device_memory": "1GiB",
                        "global_batch_size": 8, "max_length": 64})  # fmt: skip
    argv = ["run", "--local", "--profile", "llm", "--workdir", str(tmp_path / "run"),
            "--param", param, "--param", f"trial_hyperparameters={trial}",
            "--param", "lora_rank=150000"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "run" / "pipeline-root").exists()  # no step ran
