"""Hyperparameter sweeps: an Optuna study whose trials are JAXJobs running in parallel.

    result = tune(space={"learning_rate": {"type": "float", "low": 1e-5, "high": 1e-3,
                                           "log": True}},
                  trial_spec=my_spec_factory, max_trials=8, parallelism=2)

One controller loop asks Optuna for trials (ask/tell), launches each as a JAXJob through the
JAXJob client, follows the intermediate eval metrics that every trial writes to
`<trial output>/metrics.json` (`evals`: a list of {step, <metric>, ...}), reports them to the
pruner, deletes the job of a pruned trial, and tells Optuna each result. The study lives in
Optuna RDB storage (sqlite in the workspace by default), so a retried sweep continues it, and
re-attaches to the trials' jobs that are still running.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna

from kubejax import report, tracking
from kubejax.errors import KubejaxError
from kubejax.jaxjob.client import FAILED, SUCCEEDED, JAXJobClient
from kubejax.jaxjob.launch import delete_on_sigterm
from kubejax.jaxjob.spec import JAXJobSpec, job_name

ALGORITHMS = ("grid", "random", "tpe", "cmaes")
PRUNERS = ("none", "median", "successive_halving", "hyperband")
DIRECTIONS = ("maximize", "minimize")
PARAM_TYPES = ("float", "int", "categorical")
POLL_SECONDS = 5.0
JOB_ATTR, OUTPUT_ATTR, STEPS_ATTR = "kubejax_job", "kubejax_output", "kubejax_steps"


class SweepError(KubejaxError, RuntimeError):
    """The sweep cannot go on (bad space, too many failed trials)."""


# ---------------------------------------------------------------------------------------------
# Search space


def parse_space(space: str | dict) -> dict[str, dict]:
    """Validate a search space (JSON text or dict); errors name the bad entry.

    Entries: {"type": "float", "low", "high", "log"?, "step"?}, {"type": "int", "low", "high",
    "step"?, "log"?}, {"type": "categorical", "choices": [...]}.
    """
    if isinstance(space, str):
        try:
            space = json.loads(space)
        except json.JSONDecodeError as err:
            raise SweepError(f"search_space: not valid JSON ({err})") from err
    if not isinstance(space, dict) or not space:
        raise SweepError("search_space: must be a non-empty JSON object of name → entry")
    out = {}
    for name, entry in space.items():
        where = f"search_space.{name}"
        if not isinstance(entry, dict):
            raise SweepError(f"{where}: must be an object with a 'type'")
        kind = entry.get("type")
        if kind not in PARAM_TYPES:
            raise SweepError(f"{where}.type: {kind!r} is not one of {', '.join(PARAM_TYPES)}")
        allowed = {
            "float": {"type", "low", "high", "log", "step"},
            "int": {"type", "low", "high", "log", "step"},
            "categorical": {"type", "choices"},
        }[kind]
        unknown = set(entry) - allowed
        if unknown:
            raise SweepError(f"{where}: unknown keys {sorted(unknown)}; allowed {sorted(allowed)}")
        if kind == "categorical":
            choices = entry.get("choices")
            if not isinstance(choices, list) or not choices:
                raise SweepError(f"{where}.choices: must be a non-empty list")
        else:
            num = float if kind == "float" else int
            for key in ("low", "high"):
                v = entry.get(key)
                if (
                    not isinstance(v, int | float)
                    or isinstance(v, bool)
                    or (kind == "int" and not float(v).is_integer())
                ):
                    raise SweepError(
                        f"{where}.{key}: must be a{'n integer' if kind == 'int' else ' number'}"
                    )
            if entry["low"] >= entry["high"]:
                raise SweepError(
                    f"{where}: low ({entry['low']}) must be below high ({entry['high']})"
                )
            if entry.get("log") and entry["low"] <= 0:
                raise SweepError(f"{where}.low: must be positive with log scale")
            if entry.get("log") and entry.get("step") is not None and kind == "float":
                raise SweepError(f"{where}: step and log cannot be combined")
            step = entry.get("step")
            if step is not None and (not isinstance(step, int | float) or step <= 0):
                raise SweepError(f"{where}.step: must be positive")
            entry = {**entry, "low": num(entry["low"]), "high": num(entry["high"])}
        out[name] = entry
    return out


def suggest(trial: optuna.Trial, space: dict[str, dict]) -> dict[str, Any]:
    """Parameter values for one trial."""
    params = {}
    for name, e in space.items():
        if e["type"] == "float":
            params[name] = trial.suggest_float(
                name, e["low"], e["high"], log=bool(e.get("log")), step=e.get("step")
            )
        elif e["type"] == "int":
            params[name] = trial.suggest_int(
                name, e["low"], e["high"], step=e.get("step") or 1, log=bool(e.get("log"))
            )
        else:
            params[name] = trial.suggest_categorical(name, e["choices"])
    return params


def _grid(space: dict[str, dict]) -> dict[str, list]:
    grid = {}
    for name, e in space.items():
        if e["type"] == "categorical":
            grid[name] = list(e["choices"])
        elif e.get("step") is not None:
            n = round((e["high"] - e["low"]) / e["step"]) + 1
            grid[name] = [e["low"] + i * e["step"] for i in range(n)]
        elif e["type"] == "int" and not e.get("log"):
            grid[name] = list(range(e["low"], e["high"] + 1))
        else:
            raise SweepError(
                f"search_space.{name}: grid search needs 'choices' or a 'step' for {e['type']}"
            )
    return grid


def make_sampler(algorithm: str, space: dict[str, dict], seed: int) -> optuna.samplers.BaseSampler:
    """The Optuna sampler for an algorithm name."""
    if algorithm == "grid":
        # Grid points are enqueued by `tune` (GridSampler stops the study from inside, which
        # the ask/tell loop does not allow); the sampler only validates the grid here.
        _grid(space)
        return optuna.samplers.RandomSampler(seed=seed)
    if algorithm == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if algorithm == "tpe":
        return optuna.samplers.TPESampler(seed=seed)
    if algorithm == "cmaes":
        cat = [n for n, e in space.items() if e["type"] == "categorical"]
        if cat:
            raise SweepError(f"algorithm: cmaes cannot search categorical parameters {cat}")
        return optuna.samplers.CmaEsSampler(seed=seed)
    raise SweepError(f"algorithm: {algorithm!r} is not one of {', '.join(ALGORITHMS)}")


def make_pruner(name: str, *, min_steps: int = 1, max_steps: int = 0) -> optuna.pruners.BasePruner:
    """The Optuna pruner for a pruner name; steps are the trainer's eval steps."""
    if name == "none":
        return optuna.pruners.NopPruner()
    if name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=min_steps)
    if name == "successive_halving":
        return optuna.pruners.SuccessiveHalvingPruner(
            min_resource=max(min_steps, 1), reduction_factor=3
        )
    if name == "hyperband":
        return optuna.pruners.HyperbandPruner(
            min_resource=max(min_steps, 1), max_resource=max_steps or "auto", reduction_factor=3
        )
    raise SweepError(f"pruner: {name!r} is not one of {', '.join(PRUNERS)}")


# ---------------------------------------------------------------------------------------------
# The controller


@dataclass
class SweepConfig:
    """How the study searches."""

    space: dict[str, dict]
    objective: str = "eval_accuracy"  # a key of the trials' eval records
    direction: str = "maximize"
    algorithm: str = "tpe"
    max_trials: int = 8  # trials in the study, counting those of earlier attempts
    parallelism: int = 2  # trials running at once
    max_failed_trials: int = 2  # more failures than this stop the sweep
    trial_timeout: float = 3600.0  # seconds per trial
    pruner: str = "median"
    pruner_min_steps: int = 1  # no pruning before this eval step
    seed: int = 0
    storage: str = ""  # Optuna RDB URL; empty: in memory
    study_name: str = "kubejax-sweep"
    poll_seconds: float = POLL_SECONDS

    def __post_init__(self):
        self.space = parse_space(self.space)
        if self.direction not in DIRECTIONS:
            raise SweepError(f"direction: {self.direction!r} is not one of {', '.join(DIRECTIONS)}")
        if self.algorithm not in ALGORITHMS:
            raise SweepError(f"algorithm: {self.algorithm!r} is not one of {', '.join(ALGORITHMS)}")
        if self.pruner not in PRUNERS:
            raise SweepError(f"pruner: {self.pruner!r} is not one of {', '.join(PRUNERS)}")
        for name in ("max_trials", "parallelism"):
            if int(getattr(self, name)) < 1:
                raise SweepError(f"{name}: must be at least 1, got {getattr(self, name)}")
        if self.max_failed_trials < 0:
            raise SweepError(f"max_failed_trials: must be 0 or more, got {self.max_failed_trials}")


@dataclass
class SweepResult:
    """What a sweep found."""

    best_params: dict
    best_value: float
    best_trial: int
    trials: list[dict] = field(default_factory=list)

    @property
    def counts(self) -> dict[str, int]:
        out = {"complete": 0, "pruned": 0, "failed": 0}
        for t in self.trials:
            out[t["state"]] = out.get(t["state"], 0) + 1
        return out

    @property
    def trial_steps(self) -> int:
        return sum(int(t.get("steps") or 0) for t in self.trials)


#: (trial number, params, output folder, job name) → the trial's JAXJob.
TrialSpecFactory = Callable[[int, dict, str, str], JAXJobSpec]


def _read_metrics(output_dir: str) -> dict:
    path = Path(output_dir) / "metrics.json"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}  # not written yet, or being replaced


@dataclass
class _Active:
    trial: optuna.Trial
    name: str
    output_dir: str
    started: float
    reported: int = 0  # eval records already reported


def tune(
    cfg: SweepConfig,
    trial_spec: TrialSpecFactory,
    trials_root: str | Path,
    *,
    client: JAXJobClient | None = None,
    tracker: tracking.Tracker | None = None,
    log: Callable[[str], None] = print,
) -> SweepResult:
    """Run the study to `max_trials`; return the best trial and every trial's record.

    `trial_spec(number, params, output_dir, job_name)` builds the JAXJob of a trial.
    """
    client = client or JAXJobClient("auto")
    tracker = tracker or tracking.Tracker()
    direction = cfg.direction
    study = optuna.create_study(
        study_name=cfg.study_name,
        storage=cfg.storage or None,
        load_if_exists=True,
        direction=direction,
        sampler=make_sampler(cfg.algorithm, cfg.space, cfg.seed),
        pruner=make_pruner(cfg.pruner, min_steps=cfg.pruner_min_steps),
    )
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if cfg.algorithm == "grid":
        grid = _grid(cfg.space)
        points = [
            dict(zip(grid, combo, strict=True)) for combo in itertools.product(*grid.values())
        ]
        cfg.max_trials = min(cfg.max_trials, len(points))
        if not study.get_trials(deepcopy=False):
            for point in points[: cfg.max_trials]:
                study.enqueue_trial(point)
    trials_root = Path(trials_root)
    trials_root.mkdir(parents=True, exist_ok=True)
    active: dict[int, _Active] = {}
    failures: list[str] = []

    # A retried sweep re-attaches to its trials that are still running.
    for ft in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        name = ft.user_attrs.get(JOB_ATTR)
        try:
            if name is None:
                raise KeyError(name)
            client.get_job(name)
            # Optuna has no public handle for a RUNNING trial of a loaded study.
            trial = optuna.trial.Trial(study, ft._trial_id)
            active[ft.number] = _Active(trial, name, ft.user_attrs[OUTPUT_ATTR], time.monotonic())
            log(f"sweep: re-attached to trial {ft.number} (JAXJob {name})")
        except KeyError:
            study.tell(ft.number, state=optuna.trial.TrialState.FAIL)
            log(f"sweep: trial {ft.number} was lost with the previous attempt; marked failed")
    failures += [
        f"trial {t.number}: failed in an earlier attempt"
        for t in study.get_trials(states=(optuna.trial.TrialState.FAIL,))
    ]

    def launched() -> int:
        waiting = optuna.trial.TrialState.WAITING  # enqueued grid points not yet started
        return sum(t.state != waiting for t in study.get_trials(deepcopy=False))

    def finish(number: int, state, value=None, reason: str = "") -> None:
        a = active.pop(number)
        metrics = _read_metrics(a.output_dir)
        steps = int(metrics.get("step", 0))
        a.trial.set_user_attr(STEPS_ATTR, steps)
        study.tell(
            a.trial, value if state == optuna.trial.TrialState.COMPLETE else None, state=state
        )
        label = {
            optuna.trial.TrialState.COMPLETE: "complete",
            optuna.trial.TrialState.PRUNED: "pruned",
            optuna.trial.TrialState.FAIL: "failed",
        }[state]
        run_id = metrics.get("mlflow_run_id")
        if run_id:
            tracker_tag_trial(tracker, run_id, label)
        log(
            f"sweep: trial {number} {label}"
            + (f" ({cfg.objective}={value:.4f})" if value is not None else "")
            + (f": {reason}" if reason else "")
            + f" after {steps} steps"
        )

    def stop_all() -> list[str]:
        return [a.name for a in active.values()]

    with delete_on_sigterm(client, stop_all):
        while active or launched() < cfg.max_trials:
            while len(active) < cfg.parallelism and launched() < cfg.max_trials:
                trial = study.ask()
                params = suggest(trial, cfg.space)
                out_dir = str(trials_root / f"trial-{trial.number:03d}")
                name = job_name(cfg.study_name, str(trial.number), prefix=f"trial-{trial.number}")
                trial.set_user_attr(JOB_ATTR, name)
                trial.set_user_attr(OUTPUT_ATTR, out_dir)
                spec = trial_spec(trial.number, params, out_dir, name)
                client.create_job(spec)
                active[trial.number] = _Active(trial, name, out_dir, time.monotonic())
                log(f"sweep: trial {trial.number} started as JAXJob {name}: {params}")
            for number, a in list(active.items()):
                metrics = _read_metrics(a.output_dir)
                evals = metrics.get("evals", [])
                pruned = False
                for rec in evals[a.reported :]:
                    if cfg.objective in rec:
                        a.trial.report(float(rec[cfg.objective]), int(rec["step"]))
                        a.reported += 1
                        final_step = rec["step"] == metrics.get("total_steps")
                        if not final_step and a.trial.should_prune():
                            pruned = True
                            break
                if pruned:
                    client.delete_job(a.name)
                    finish(
                        number,
                        optuna.trial.TrialState.PRUNED,
                        reason=f"at step {evals[a.reported - 1]['step']}",
                    )
                    continue
                status = client.get_job(a.name)
                if status.state == SUCCEEDED:
                    value = metrics.get("final", {}).get(cfg.objective)
                    if value is None and evals:
                        value = evals[-1].get(cfg.objective)
                    client.delete_job(a.name)
                    if value is None or not math.isfinite(float(value)):
                        failures.append(f"trial {number}: no {cfg.objective} in its metrics")
                        finish(number, optuna.trial.TrialState.FAIL, reason=failures[-1])
                    else:
                        finish(number, optuna.trial.TrialState.COMPLETE, float(value))
                elif status.state == FAILED or time.monotonic() - a.started > cfg.trial_timeout:
                    cond = status.condition(FAILED) or {
                        "reason": "Timeout",
                        "message": f"ran past {cfg.trial_timeout}s",
                    }
                    tail = client.failure_log(a.name)
                    client.delete_job(a.name)
                    last = tail.strip().splitlines()[-1] if tail.strip() else ""
                    failures.append(
                        f"trial {number}: {cond.get('reason')}: {cond.get('message')}"
                        + (f" (last log line: {last})" if last else "")
                    )
                    finish(number, optuna.trial.TrialState.FAIL, reason=failures[-1])
            if len(failures) > cfg.max_failed_trials:
                for a in list(active.values()):
                    client.delete_job(a.name)
                    finish(a.trial.number, optuna.trial.TrialState.FAIL, reason="sweep stopped")
                raise SweepError(
                    f"max_failed_trials: {len(failures)} trials failed (limit "
                    f"{cfg.max_failed_trials}):\n" + "\n".join(failures)
                )
            if active:
                time.sleep(cfg.poll_seconds)
    return _result(study, cfg)


def tracker_tag_trial(tracker: tracking.Tracker, run_id: str, state: str) -> None:
    """Mark a trial's MLflow run with its sweep state (complete, pruned, failed) and end it."""
    status = {"complete": "FINISHED", "pruned": "KILLED", "failed": "FAILED"}[state]
    tracker.update_run(run_id, {"kubejax.trial_state": state}, status=status)


def _result(study: optuna.Study, cfg: SweepConfig) -> SweepResult:
    names = {
        optuna.trial.TrialState.COMPLETE: "complete",
        optuna.trial.TrialState.PRUNED: "pruned",
        optuna.trial.TrialState.FAIL: "failed",
    }
    trials = []
    for t in study.get_trials(deepcopy=False):
        if t.state not in names:
            continue
        trials.append(
            {
                "number": t.number,
                "state": names[t.state],
                "value": t.value,
                "params": t.params,
                "steps": t.user_attrs.get(STEPS_ATTR, 0),
                "intermediate": {str(k): v for k, v in sorted(t.intermediate_values.items())},
                "job": t.user_attrs.get(JOB_ATTR, ""),
            }
        )
    complete = [t for t in trials if t["state"] == "complete"]
    if not complete:
        raise SweepError("max_trials: no trial completed; see the trials' errors above")
    best = study.best_trial
    return SweepResult(dict(best.params), float(best.value), best.number, trials)


# ---------------------------------------------------------------------------------------------
# Outputs


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
            **t["params"],
        }
        for t in result.trials
    ]
    sections = [
        f"<p>Best trial {result.best_trial}: {cfg.objective} = {result.best_value:.4f} with "
        f"<code>{json.dumps(result.best_params)}</code>. Trials: {result.counts}; "
        f"trial-steps: {result.trial_steps}.</p>",
        report.line_chart(
            "Optimization history", {"objective": series, "best so far": best_so_far}
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
    dists = _distributions(cfg.space)
    for t in complete:
        study.add_trial(
            optuna.trial.create_trial(params=t["params"], distributions=dists, value=t["value"])
        )
    try:
        return optuna.importance.get_param_importances(study)
    except (RuntimeError, ValueError, ImportError):
        return {}


def _distributions(space: dict[str, dict]) -> dict:
    d = {}
    for name, e in space.items():
        if e["type"] == "float":
            d[name] = optuna.distributions.FloatDistribution(
                e["low"], e["high"], log=bool(e.get("log")), step=e.get("step")
            )
        elif e["type"] == "int":
            d[name] = optuna.distributions.IntDistribution(
                e["low"], e["high"], log=bool(e.get("log")), step=e.get("step") or 1
            )
        else:
            d[name] = optuna.distributions.CategoricalDistribution(e["choices"])
    return d


# ---------------------------------------------------------------------------------------------
# Trials that run the kubejax trainer


def _lowest_point(space: dict[str, dict]) -> dict:
    """A point of the search space (every dimension at its first value), to type-check the
    names and values a trial will pass to the trainer."""
    return {
        name: e["choices"][0] if e["type"] == "categorical" else e["low"]
        for name, e in space.items()
    }


def trainer_trial_spec(
    *,
    image: str,
    replicas: int,
    data_dir: str,
    hyperparameters: dict,
    parent_run_id: str = "",
    task_config=None,
    mlflow_tracking_uri: str = "",
    trial_timeout: float = 3600.0,
    extra_env: dict[str, str] | None = None,
) -> TrialSpecFactory:
    """Trial JAXJobs that train with the fixed `hyperparameters` plus the trial's params."""
    from kubejax.launcher import build_train_spec

    def make(number: int, params: dict, output_dir: str, name: str) -> JAXJobSpec:
        hp = {**hyperparameters, **params, "mlflow_run_name": f"trial-{number}"}
        if parent_run_id:
            hp["mlflow_parent_run_id"] = parent_run_id
        user_tags = json.loads(hyperparameters.get("mlflow_tags") or "{}")
        hp["mlflow_tags"] = json.dumps(
            {**user_tags, "kubejax.trial": str(number), "kubejax.jaxjob": name}
        )
        env = {**tracking.worker_env(mlflow_tracking_uri), **(extra_env or {})}
        return build_train_spec(
            name=name,
            image=image,
            replicas=replicas,
            data_dir=data_dir,
            output_dir=output_dir,
            hyperparameters=hp,
            task_config=task_config,
            restart_policy="Never",
            backoff_limit=0,
            active_deadline_seconds=int(trial_timeout),
            labels={"kubejax.dev/sweep": "true"},
            extra_env=env,
        )

    return make


def sweep_with_jaxjobs(
    cfg: SweepConfig,
    *,
    data_dir: str,
    trials_root: str,
    hyperparameters: dict,
    image: str,
    replicas: int = 1,
    backend: str = "auto",
    task_config=None,
    mlflow_tracking_uri: str = "",
    mlflow_experiment: str = "kubejax",
    tags: dict | None = None,
    extra_env: dict[str, str] | None = None,
    log: Callable[[str], None] = print,
) -> tuple[SweepResult, str]:
    """A sweep whose trials train the kubejax trainer; an MLflow parent run with one nested
    run per trial; `extra_env` goes to every trial's workers. Returns the result and the
    parent run id ('' without tracking)."""
    from kubejax.launcher import check_hyperparameters

    # The fixed settings, and each dimension at its lower end, before anything is created.
    check_hyperparameters({**hyperparameters, **_lowest_point(cfg.space)})
    tracker = tracking.create_tracker(
        mlflow_tracking_uri,
        mlflow_experiment,
        run_name=cfg.study_name,
        # Under KFP's MLflow integration the sweep nests under the task's run.
        parent_run_id=tracking.kfp_task_run() or None,
        tags=tracking.kfp_tags({"kubejax.step": "tune-sweep", **(tags or {})}),
    )
    tracker.log_params(
        {
            "sweep": {
                "algorithm": cfg.algorithm,
                "objective": cfg.objective,
                "direction": cfg.direction,
                "max_trials": cfg.max_trials,
                "parallelism": cfg.parallelism,
                "pruner": cfg.pruner,
                "seed": cfg.seed,
                "space": json.dumps(cfg.space),
            },
            "fixed": hyperparameters,
        }
    )
    client = JAXJobClient(backend)
    factory = trainer_trial_spec(
        image=image,
        replicas=replicas,
        data_dir=data_dir,
        hyperparameters={"mlflow_experiment": mlflow_experiment, **hyperparameters},
        parent_run_id=tracker.run_id or "",
        task_config=task_config,
        mlflow_tracking_uri=tracker.tracking_uri or "",
        trial_timeout=cfg.trial_timeout,
        extra_env=extra_env,
    )
    status = "FAILED"
    try:
        result = tune(cfg, factory, trials_root, client=client, tracker=tracker, log=log)
        tracker.log_params({f"best.{k}": v for k, v in result.best_params.items()})
        tracker.log_summary(
            {
                "best_value": result.best_value,
                "trial_steps": result.trial_steps,
                **{f"trials_{k}": v for k, v in result.counts.items()},
            }
        )
        best_job = next(t["job"] for t in result.trials if t["number"] == result.best_trial)
        tracker.set_tags(
            {"kubejax.best_trial": str(result.best_trial), "kubejax.best_jaxjob": best_job}
        )
        best_run = _read_metrics(str(Path(trials_root) / f"trial-{result.best_trial:03d}")).get(
            "mlflow_run_id"
        )
        if best_run:
            tracker.update_run(best_run, {"kubejax.best_trial": "true"})
        status = "FINISHED"
        return result, tracker.run_id or ""
    finally:
        tracker.finish(status)
