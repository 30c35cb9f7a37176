"""Trial-steps with pruning against without, at the same best objective, on a fixed search.

    .venv/bin/python benchmarks/bench_sweep.py [--trials 24] [--steps 20]

Trials are real local JAXJobs of a cheap trial program (tests/trial_program.py) whose eval
metric is known, so the comparison is about the controller and the pruner alone.
Target: pruning saves at least half the steps.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import scratch_dir

ROOT = Path(__file__).parents[1]


def compare_pruners(trials: int = 24, steps: int = 20) -> dict:
    """Trial-steps and best value of the same random search under each pruner."""
    from kubejax.jobs.client import JAXJobClient
    from kubejax.jobs.spec import JAXJobSpec
    from kubejax.tune import SweepConfig, tune

    args = argparse.Namespace(trials=trials, steps=steps)
    program = ROOT / "tests" / "trial_program.py"

    def spec(number, params, out, name):
        flags = ["--output-dir", out, "--steps", str(args.steps), "--sleep", "0.05"]
        for k, v in params.items():
            flags += [f"--{k}", str(v)]
        return JAXJobSpec(
            name=name, image="local", command=[sys.executable, str(program)], args=flags
        )

    space = {
        "x": {"type": "float", "low": 0.0, "high": 1.0},
        "y": {"type": "float", "low": 0.0, "high": 1.0},
    }
    out = {}
    work = scratch_dir("kubejax-bench-sweep-")
    client = JAXJobClient("local", log_root=work / "logs")
    for pruner in ("none", "median", "successive_halving", "hyperband"):
        r = tune(
            SweepConfig(
                space=space,
                algorithm="random",
                max_trials=args.trials,
                parallelism=1,
                seed=7,
                pruner=pruner,
                poll_seconds=0.02,
                study_name=f"bench-{pruner}",
            ),
            spec,
            work / pruner,
            client=client,
            log=lambda _: None,
        )
        out[pruner] = {
            "trial_steps": r.trial_steps,
            "best_value": round(r.best_value, 6),
            "best_trial": r.best_trial,
            **r.counts,
        }
    base = out["none"]["trial_steps"]
    for row in out.values():
        row["steps_saved"] = round(1 - row["trial_steps"] / base, 3)
    return out


def measure(trials: int = 24, steps: int = 20) -> dict:
    """`pruning_saved_fraction`: the share of trial-steps the median pruner saves, at the same
    best value (checked)."""
    out = compare_pruners(trials, steps)
    same = out["median"]["best_value"] == out["none"]["best_value"]
    return {
        "pruning_saved_fraction": out["median"]["steps_saved"],
        "pruning_same_best_value": same,
        "pruning_saved_by_pruner": {k: v["steps_saved"] for k, v in out.items() if k != "none"},
    }


def _spent(cfg, data, root, fixed) -> dict:
    """One sweep's best value and what it cost (PBT's restarts are starts of one trial)."""
    from kubejax.launchers.sweep import sweep_with_jaxjobs

    result, _ = sweep_with_jaxjobs(cfg, data_dir=str(data), trials_root=str(root),
                                   hyperparameters=fixed, backend="local",
                                   log=lambda _: None)  # fmt: skip
    return {
        "best_eval_accuracy": round(result.best_value, 4),
        "best_params": result.best_params,
        "worker_seconds": round(sum(t["worker_seconds"] or 0 for t in result.trials), 1),
        "trials": len(result.trials),
        "trial_starts": sum(len(t.get("history", [None])) for t in result.trials),
        "exploits": sum(len(t.get("history", [None])) - 1 for t in result.trials),
    }


def pbt_vs_tpe(trials: int = 4, steps: int = 48, eval_every: int = 8) -> dict:
    """Ray Tune's PBT against the Optuna TPE sweep on the demo data (the synthetic Yelp reviews,
    MiniLM, the demo's trial settings): the best validation accuracy of each and what it cost
    in worker-seconds. The TPE sweep runs trials until it has spent PBT's worker-seconds (its
    study resumed with more trials while the budget left pays for one). Reported, no
    target."""
    from kubejax.data.prepare import PrepareConfig, prepare_yelp
    from kubejax.data.synthetic import write_yelp_dir
    from kubejax.local_run import DEMO_TEST_ROWS, DEMO_TRAIN_ROWS, offline_model
    from kubejax.tune import SweepConfig

    work = scratch_dir("kubejax-bench-pbt-")
    source = write_yelp_dir(work / "yelp", DEMO_TRAIN_ROWS, DEMO_TEST_ROWS, seed=0)
    model = offline_model(work)
    data = work / "data"
    prepare_yelp(PrepareConfig(source=str(source), tokenizer=model, max_length=64,
                               max_validation_samples=200, max_test_samples=200), data,
                 progress=False)  # fmt: skip
    space = {"learning_rate": {"type": "float", "low": 1e-5, "high": 3e-3, "log": True}}
    fixed = {"model": model, "max_steps": steps, "eval_every": eval_every, "log_every": 8,
             "global_batch_size": 16, "max_length": 64, "bucket_multiple": 64,
             "max_eval_examples": 128, "eval_batch_size": 64}  # fmt: skip
    out = {}
    pbt = SweepConfig(space=space, seed=0, poll_seconds=0.5, study_name="bench-pbt",
                      tuner="ray", scheduler="pbt", algorithm="random", max_trials=trials,
                      parallelism=trials)  # fmt: skip
    out["pbt"] = _spent(pbt, data, work / "pbt", fixed)
    # TPE resumes its study (sqlite) with more trials until it has spent PBT's worker-seconds:
    # each round adds as many trials as the budget left pays for at its mean trial's cost.
    budget = out["pbt"]["worker_seconds"]
    max_trials = out["pbt"]["trial_starts"]
    while True:
        tpe = SweepConfig(space=space, seed=0, poll_seconds=0.5, study_name="bench-tpe",
                          storage=f"sqlite:///{work / 'tpe.db'}", tuner="optuna",
                          algorithm="tpe", pruner="none", parallelism=2,
                          max_trials=max_trials)  # fmt: skip
        out["tpe"] = _spent(tpe, data, work / "tpe", fixed)
        spent, done = out["tpe"]["worker_seconds"], out["tpe"]["trials"]
        more = round((budget - spent) / (spent / max(done, 1)))
        if more < 1:
            break
        max_trials = done + more
    return {
        "pbt_best_eval_accuracy": out["pbt"]["best_eval_accuracy"],
        "tpe_best_eval_accuracy": out["tpe"]["best_eval_accuracy"],
        "pbt_vs_tpe": out,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--trials", type=int, default=24)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    out = compare_pruners(args.trials, args.steps)
    print(
        json.dumps({"trials": args.trials, "steps_per_trial": args.steps, "results": out}, indent=1)
    )


if __name__ == "__main__":
    main()
