"""What a sweep leaves for people: every trial as JSON, and an HTML report."""

from __future__ import annotations

import html
import json
import warnings
from pathlib import Path

import numpy as np
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
                "defaults_trial": result.defaults_trial,
                "defaults_value": result.defaults_value,
                "sweep_gain": result.gain,
                "sweep_gain_se": result.gain_se,
                "choice": result.choice,
                "reason": result.reason,
                "chosen_params": result.chosen_params,
                "counts": result.counts,
                "trial_steps": result.trial_steps,
                "trials": result.trials,
            },
            indent=1,
        )
    )


def write_report(result: SweepResult, cfg: SweepConfig, path: str | Path) -> None:
    """HTML: Optuna's plots of the study (history, intermediate values, importances, parallel
    coordinates, slices), the objective against cost, and the trials table."""
    rows = [
        {
            "trial": t["number"] if not t.get("defaults") else f"{t['number']} (defaults)",
            "state": t["state"],
            cfg.objective: t["value"],
            "± se": t.get("se"),
            "steps": t["steps"],
            "workers": t.get("workers", 1),
            "worker_s": t.get("worker_seconds"),
            **t["params"],
        }
        for t in result.trials
    ]
    figures = sweep_figures(result, cfg)
    versus = versus_rows(result, cfg)
    sections = [
        f"<p>Best trial {result.best_trial}: {cfg.objective} = {result.best_value:.4f} with "
        f"<code>{json.dumps(result.best_params)}</code>. Trials: {result.counts}; "
        f"trial-steps: {result.trial_steps}.</p>",
        "<h2>The best trial beside the defaults' trial</h2>"
        + report.table(versus, columns=list(dict.fromkeys(k for r in versus for k in r)))
        + f"<p>{html.escape(result.reason)}</p>",
        *(report.svg(fig) for fig in figures.values()),
        "<h2>Trials</h2>" + report.table(rows),
    ]
    report.close(figures.values())
    Path(path).write_text(report.page("Hyperparameter sweep", sections))


def versus_rows(result: SweepResult, cfg: SweepConfig) -> list[dict]:
    """The best trial and the defaults' trial side by side, and the sweep's gain (best −
    defaults in the objective's direction) with its standard error."""
    rows = []
    for label, number in (("best trial", result.best_trial), ("defaults", result.defaults_trial)):
        t = result.trial(number)
        if t is None:
            rows.append({"": label, "trial": "did not run"})
            continue
        rows.append(
            {
                "": label,
                "trial": t["number"],
                "state": t["state"],
                cfg.objective: t["value"],
                "± se": t.get("se"),
                "examples": t.get("eval_examples"),
                "params": json.dumps(t["params"]),
            }
        )
    gain = {cfg.objective: result.gain, "± se": result.gain_se}
    rows.append({"": "sweep gain", "trial": "", "state": "", **gain, "examples": "",
                 "params": f"kept: {result.choice}"})  # fmt: skip
    return rows


def summary_markdown(result: SweepResult, cfg: SweepConfig) -> str:
    """The sweep's outcome in Markdown (the KFP UI shows it): the best trial beside the
    defaults' trial, the gain and its standard error, and what the final training takes."""
    rows = versus_rows(result, cfg)
    keys = list(dict.fromkeys(k for r in rows for k in r))

    def cell(v) -> str:
        text = f"{v:.4f}" if isinstance(v, float) else ("" if v is None else str(v))
        return text.replace("|", "\\|")

    lines = [
        "# Hyperparameter sweep",
        "",
        "| " + " | ".join(keys) + " |",
        "|" + "---|" * len(keys),
        *("| " + " | ".join(cell(r.get(k)) for k in keys) + " |" for r in rows),
        "",
        result.reason + ".",
        "",
        f"The final training takes `{json.dumps(result.chosen_params)}` "
        f"({'the defaults' if result.choice == 'defaults' else 'the best trial'}'s settings). "
        f"Trials: {result.counts}; trial-steps: {result.trial_steps}.",
    ]
    return "\n".join(lines) + "\n"


def _space_holding(space: dict[str, dict], trials: list[dict]) -> dict[str, dict]:
    """`space` with each dimension reaching every value its trials took (a default that
    joined the search: `kubejax.tune.space.default_point`)."""
    out = {name: dict(entry) for name, entry in space.items()}
    for t in trials:
        for name, value in t["params"].items():
            entry = out.get(name)
            if entry is None:
                continue
            if entry["type"] == "categorical":
                if value not in entry["choices"]:
                    entry["choices"] = [*entry["choices"], value]
            else:
                entry["low"], entry["high"] = min(entry["low"], value), max(entry["high"], value)
    return out


def study_of(result: SweepResult, cfg: SweepConfig) -> optuna.Study:
    """An in-memory Optuna study holding the sweep's trials (states, params, values and
    intermediate values), for Optuna's own plots and importances."""
    study = optuna.create_study(direction=cfg.direction)
    dists = distributions(_space_holding(cfg.space, result.trials))
    states = {
        "complete": optuna.trial.TrialState.COMPLETE,
        "pruned": optuna.trial.TrialState.PRUNED,
        "failed": optuna.trial.TrialState.FAIL,
    }
    for t in result.trials:
        study.add_trial(
            optuna.trial.create_trial(
                state=states[t["state"]],
                params=t["params"],
                distributions={name: dists[name] for name in t["params"]},  # conditional ones
                value=t["value"] if t["state"] == "complete" else None,
                intermediate_values={int(k): v for k, v in t["intermediate"].items()},
            )
        )
    return study


def sweep_figures(result: SweepResult, cfg: SweepConfig) -> dict:
    """The sweep's figures by file name: Optuna's matplotlib plots, and the objective against
    each trial's cost in worker-seconds."""
    from optuna.visualization import matplotlib as plots

    study = study_of(result, cfg)
    complete = [t for t in result.trials if t["state"] == "complete"]
    wanted = {
        "optimization_history.svg": plots.plot_optimization_history,
        "intermediate_values.svg": plots.plot_intermediate_values,
        "parallel_coordinate.svg": plots.plot_parallel_coordinate,
        "slice.svg": plots.plot_slice,
    }
    if len(complete) >= 3 and len(cfg.space) >= 2:
        wanted["param_importances.svg"] = plots.plot_param_importances
    figures = {}
    # Optuna's plots switch matplotlib to its own style; rc_context puts ours back after.
    with warnings.catch_warnings(), report.pyplot().rc_context():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        for name, plot in wanted.items():
            try:
                axes = plot(study)
            except (RuntimeError, ValueError) as err:  # too few trials for this plot
                warnings.warn(f"sweep report: no {name} ({err})", stacklevel=2)
                continue
            fig = np.asarray(axes).flat[0].figure  # slice: one axes per parameter
            panels = np.asarray(axes).size
            fig.set_size_inches(max(report.SIZE[0], 3.2 * panels), report.SIZE[1] + 0.8)
            figures[name] = fig
    fig, ax = report.new_figure(
        f"{cfg.objective} against cost", "cost of the trial (worker-seconds)", cfg.objective
    )
    for workers in sorted({t.get("workers", 1) for t in complete}):
        points = [
            (t["worker_seconds"], t["value"])
            for t in complete
            if t.get("workers", 1) == workers and t.get("worker_seconds") is not None
        ]
        if points:
            ax.plot(*zip(*points, strict=True), "o", label=f"{workers} worker(s)")
    ax.legend()
    figures["objective_vs_cost.svg"] = fig
    if any(len(t.get("history", [])) > 1 for t in result.trials):
        figures["pbt_history.svg"] = pbt_history(result, cfg)
    return figures


def pbt_history(result: SweepResult, cfg: SweepConfig):
    """Population Based Training's history: each trial's objective over the training steps,
    a dashed line from each exploit's donor point to where the trial restarts, and the
    mutated settings over the steps in a second panel."""
    plt = report.pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(report.SIZE[0], report.SIZE[1] * 1.6))
    name = cfg.pbt_mutations.split(",")[0].strip()
    for t in result.trials:
        points = sorted((int(k), v) for k, v in t["intermediate"].items()) or [(0, 0.0)]
        (line,) = top.plot(*zip(*points, strict=True), ".-", label=f"trial {t['number']}")
        runs = t.get("history", [])
        for restart in runs[1:]:
            top.axvline(restart["start_step"], color=line.get_color(), linestyle=":", alpha=0.5)
        steps = [r["start_step"] for r in runs] + [t["steps"]]
        values = [r["params"].get(name) for r in runs]
        if values and all(isinstance(v, int | float) for v in values):
            bottom.step(steps, [*values, values[-1]], where="post", color=line.get_color())
    top.set_ylabel(cfg.objective)
    top.set_title("PBT: the objective by trial (dotted: an exploit and restart)")
    top.legend(fontsize="small")
    bottom.set_xlabel("training step")
    bottom.set_ylabel(name)
    bottom.set_title(f"{name} of each trial, mutated at each exploit")
    fig.tight_layout()
    return fig
