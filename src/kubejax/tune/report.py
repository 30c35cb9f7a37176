"""What a sweep leaves for people: every trial as JSON, and an HTML report."""

from __future__ import annotations

import json
from pathlib import Path

import optuna

from kubejax import report
from kubejax.tune.controller import SweepConfig, SweepResult
from kubejax.tune.space import distributions


def write_trials(result: SweepResult, path: str | Path) -> None:
    """All trials as JSON."""
    Path(path).write_text(
        json.dumps(
            {
                "best_trial": result.best_trial,
                "best_value": result.best_value,
                "best_params": result.best_params,
                "counts": result.counts,
                "trial_steps": result.trial_steps,
                "trials": result.trials,
            },
            indent=1,
        )
    )


def write_report(result: SweepResult, cfg: SweepConfig, path: str | Path) -> None:
    """HTML: trials table, optimization history, intermediate curves, parameter importance."""
    done = [t for t in result.trials if t["value"] is not None]
    best_so_far, series = [], []
    better = max if cfg.direction == "maximize" else min
    for t in sorted(done, key=lambda t: t["number"]):
        series.append((t["number"], t["value"]))
        best_so_far.append((t["number"], better([v for _, v in series])))
    cost = [(t["worker_seconds"], t["value"]) for t in done if t.get("worker_seconds") is not None]
    curves = {
        f"trial {t['number']} ({t['state']})": [(int(k), v) for k, v in t["intermediate"].items()]
        for t in result.trials
    }
    rows = [
        {
            "trial": t["number"],
            "state": t["state"],
            cfg.objective: t["value"],
            "steps": t["steps"],
            "workers": t.get("workers", 1),
            "worker_s": t.get("worker_seconds"),
            **t["params"],
        }
        for t in result.trials
    ]
    sections = [
        f"<p>Best trial {result.best_trial}: {cfg.objective} = {result.best_value:.4f} with "
        f"<code>{json.dumps(result.best_params)}</code>. Trials: {result.counts}; "
        f"trial-steps: {result.trial_steps}.</p>",
        report.line_chart(
            "Optimization history (x: trial number)",
            {"objective": series, "best so far": best_so_far},
        ),
        report.line_chart(
            f"{cfg.objective} against cost (x: worker-seconds of the trial)",
            {"objective": sorted(cost)},
        ),
        report.line_chart(f"Intermediate {cfg.objective} per trial", curves),
        "<h2>Trials</h2>" + report.table(rows),
    ]
    importance = _importance(result, cfg)
    if importance:
        sections.append(
            report.bar_chart("Parameter importance", list(importance), list(importance.values()))
        )
    Path(path).write_text(report.page("Hyperparameter sweep", sections))


def _importance(result: SweepResult, cfg: SweepConfig) -> dict[str, float]:
    complete = [t for t in result.trials if t["state"] == "complete"]
    if len(complete) < 3 or len(cfg.space) < 2:
        return {}
    study = optuna.create_study(direction=cfg.direction)
    dists = distributions(cfg.space)
    for t in complete:
        own = {name: dists[name] for name in t["params"]}  # conditional dimensions may be absent
        study.add_trial(
            optuna.trial.create_trial(params=t["params"], distributions=own, value=t["value"])
        )
    try:
        return optuna.importance.get_param_importances(study)
    except (RuntimeError, ValueError, ImportError):
        return {}
