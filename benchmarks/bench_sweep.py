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
