"""The sweep controller: an Optuna study whose trials are jobs running in parallel.

One loop asks Optuna for trials (ask/tell), launches each as a job through the job client,
follows the intermediate eval metrics that every trial writes to `<trial output>/metrics.json`
(`evals`: a list of {step, <metric>, ...}), reports them to the pruner, deletes the job of a
pruned trial, and tells Optuna each result. The study lives in Optuna RDB storage (sqlite in
the workspace by default), so a retried sweep continues it and re-attaches to the trials' jobs
that are still running.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import optuna

from kubejax import tracking
from kubejax.errors import InfeasibleError
from kubejax.flags import setting as _f
from kubejax.jobs.client import FAILED, SUCCEEDED, SUSPENDED, JAXJobClient
from kubejax.jobs.launch import delete_on_sigterm
from kubejax.jobs.spec import JAXJobSpec, job_name
from kubejax.outputs import read_metrics
from kubejax.tune.katib import ALGORITHMS as KATIB_ALGORITHMS
from kubejax.tune.optimizationjob import ALGORITHMS as OPTIMIZATIONJOB_ALGORITHMS
from kubejax.tune.optimizationjob import refuse_algorithm
from kubejax.tune.ray_tune import ALGORITHMS as RAY_ALGORITHMS
from kubejax.tune.space import (
    ALGORITHMS,
    PRUNERS,
    RESOURCE_PARAMS,
    SweepError,
    grid,
    make_pruner,
    make_sampler,
    max_replicas,
    parse_space,
    suggest,
)

DIRECTIONS = ("maximize", "minimize")
TUNERS = ("optuna", "katib", "ray", "optimizationjob")
POLL_SECONDS = 5.0
JOB_ATTR, OUTPUT_ATTR, STEPS_ATTR = "kubejax_job", "kubejax_output", "kubejax_steps"
#: Workers of a trial's job, and when it started and ended (seconds since the epoch).
WORKERS_ATTR, START_ATTR, END_ATTR = "kubejax_workers", "kubejax_start", "kubejax_end"
#: A trial asked of Optuna but never started (it waited for workers when its sweep died).
NOT_STARTED_ATTR = "kubejax_not_started"
#: Why a trial was pruned before it started (its settings do not fit the devices).
SKIPPED_ATTR = "kubejax_skipped"
#: The trial of the run's default settings (the first of the study).
DEFAULTS_ATTR = "kubejax_defaults"
_STATE_NAMES = {
    optuna.trial.TrialState.COMPLETE: "complete",
    optuna.trial.TrialState.PRUNED: "pruned",
    optuna.trial.TrialState.FAIL: "failed",
}


@dataclass
class SweepConfig:
    """How the study searches."""

    space: dict[str, dict] = field(
        metadata={"help": "search space: JSON object of trainer setting → entry (or @file.json)"}
    )
    objective: str = _f("eval_accuracy", "a key of the trials' eval records to optimise")
    direction: str = _f("maximize", "maximize or minimize")
    tuner: str = _f(
        "optuna",
        "optuna (the study runs in the sweep step), katib (a Katib Experiment on the cluster, "
        "whose trials are the same jobs; Katib is deprecated upstream in favour of "
        "OptimizationJob), ray (Ray Tune in the sweep step: ASHA, PBT) or optimizationjob (a "
        "Kubeflow Trainer OptimizationJob of the same TrainJobs: random or grid, no early "
        "stopping, at most 100 trials)",
    )
    algorithm: str = _f(
        "tpe",
        "grid, random, tpe or cmaes; with tuner katib also multivariate-tpe, "
        "bayesianoptimization or hyperband; with tuner optimizationjob random or grid only",
    )
    max_trials: int = _f(8, "trials in the study, counting those of earlier attempts")
    parallelism: int = _f(2, "trials running at once")
    max_workers: int = _f(
        0, "workers all running trials may use together (a trial waits until it fits); 0 = any"
    )
    max_failed_trials: int = _f(2, "more failed trials than this stop the sweep")
    trial_timeout: float = _f(3600.0, "seconds per trial")
    pruner: str = _f("median", "none, median, successive_halving or hyperband")
    pruner_min_steps: int = _f(1, "no pruning before this eval step")
    scheduler: str = _f(
        "none", "tuner ray: none, asha (early stopping) or pbt (Population Based Training)"
    )
    reduction_factor: int = _f(3, "tuner ray, asha: the fraction 1/n of trials kept at a rung")
    perturbation_interval: int = _f(
        0, "tuner ray, pbt: training steps between exploits (0: the trials' eval_every)"
    )
    pbt_mutations: str = _f(
        "learning_rate",
        "tuner ray, pbt: the searched settings PBT mutates (comma-separated), e.g. "
        "learning_rate,weight_decay",
    )
    seed: int = _f(0, "seed of the sampler")
    defaults: dict = field(
        default_factory=dict,
        metadata={
            "help": "the run's default settings as a point of the space (JSON): the study's "
            "first trial, the candidate the sweep must beat; empty: the trainer trials' own "
            "(the final training's settings, their fixed ones, then the trainer's defaults)"
        },
    )
    min_gain_se: float = _f(
        2.0,
        "the best trial replaces the defaults' only when it beats it by more than this many "
        "standard errors of the difference of their evaluations (where known)",
    )
    eval_examples: int = _f(
        0,
        "validation examples each trial's evaluation scores (an accuracy's standard error "
        "sqrt(p(1-p)/n) comes from it); 0: unknown (the trainer trials: the dataset's)",
    )
    storage: str = _f("", "Optuna RDB URL; empty: in memory")
    study_name: str = _f("kubejax-sweep", "the study's name in its storage")
    poll_seconds: float = _f(POLL_SECONDS, "how often the trials are looked at")

    def __post_init__(self):
        self.space = parse_space(self.space)
        if self.direction not in DIRECTIONS:
            raise SweepError(f"direction: {self.direction!r} is not one of {', '.join(DIRECTIONS)}")
        if self.tuner not in TUNERS:
            raise SweepError(f"tuner: {self.tuner!r} is not one of {', '.join(TUNERS)}")
        algorithms = {"katib": KATIB_ALGORITHMS, "ray": RAY_ALGORITHMS}.get(self.tuner, ALGORITHMS)
        if self.tuner == "optimizationjob" and self.algorithm not in OPTIMIZATIONJOB_ALGORITHMS:
            raise refuse_algorithm(self.algorithm)
        if self.algorithm not in algorithms:
            raise SweepError(
                f"algorithm: {self.algorithm!r} is not one of {', '.join(algorithms)}"
                + {"katib": " (Katib's)", "ray": " (with tuner ray)"}.get(self.tuner, "")
            )
        if self.scheduler != "none" and self.tuner == "optimizationjob":
            raise SweepError(
                f"scheduler: {self.scheduler} is Ray Tune's; OptimizationJob has no schedulers "
                "(ASHA, PBT); use tuner=ray"
            )
        if self.scheduler != "none" and self.tuner != "ray":
            raise SweepError(
                f"scheduler: {self.scheduler} is Ray Tune's; set tuner=ray, or use pruner with "
                f"tuner={self.tuner}"
            )
        if self.pruner not in PRUNERS:
            raise SweepError(f"pruner: {self.pruner!r} is not one of {', '.join(PRUNERS)}")
        if self.tuner == "optuna":
            make_sampler(self.algorithm, self.space, self.seed)  # the space suits it
        for name in ("max_trials", "parallelism"):
            if int(getattr(self, name)) < 1:
                raise SweepError(f"{name}: must be at least 1, got {getattr(self, name)}")
        if self.max_workers < 0:
            raise SweepError(f"max_workers: must be 0 or more, got {self.max_workers}")
        top = max_replicas(self.space)
        if self.max_workers and top and top > self.max_workers:
            raise SweepError(
                f"max_workers: {self.max_workers} is below the {top} workers that "
                "search_space.replicas can give one trial"
            )
        if self.max_failed_trials < 0:
            raise SweepError(f"max_failed_trials: must be 0 or more, got {self.max_failed_trials}")
        if self.trial_timeout <= 0:
            raise SweepError(f"trial_timeout: must be positive, got {self.trial_timeout}")
        if self.min_gain_se < 0:
            raise SweepError(f"min_gain_se: must be 0 or more, got {self.min_gain_se}")
        if self.eval_examples < 0:
            raise SweepError(f"eval_examples: must be 0 or more, got {self.eval_examples}")
        if not isinstance(self.defaults, dict):
            raise SweepError("defaults: must be a JSON object of searched setting → value")
        unknown = sorted(set(self.defaults) - set(self.space))
        if unknown:
            raise SweepError(
                f"defaults: {', '.join(unknown)} not in search_space ({', '.join(self.space)})"
            )


@dataclass
class SweepResult:
    """What a sweep found."""

    best_params: dict
    best_value: float
    best_trial: int
    trials: list[dict] = field(default_factory=list)
    #: the defaults' trial (its number; None: it did not run) and what the sweep keeps:
    #: "best" (the best trial's params) or "defaults" (the best did not beat them beyond the
    #: noise); `decide` sets these
    defaults_trial: int | None = None
    choice: str = "best"
    #: best − defaults (objective's direction: positive is better), its standard error, and
    #: why the choice was made, in one line
    gain: float | None = None
    gain_se: float | None = None
    reason: str = ""

    @property
    def defaults_value(self) -> float | None:
        """The defaults' trial's objective (None: it did not complete)."""
        t = self.trial(self.defaults_trial)
        return t["value"] if t is not None and t["state"] == "complete" else None

    @property
    def chosen_params(self) -> dict:
        """What the final training takes from the sweep: the best trial's params, or the
        defaults' trial's when they were kept (the final training's own settings, where
        the defaults came from them), resources aside (the final training has its own)."""
        if self.choice != "defaults":
            return dict(self.best_params)
        params = self.trial(self.defaults_trial)["params"]
        return {k: v for k, v in params.items() if k not in RESOURCE_PARAMS}

    def trial(self, number: int | None) -> dict | None:
        """The record of trial `number`, or None."""
        return next((t for t in self.trials if t["number"] == number), None)

    @property
    def counts(self) -> dict[str, int]:
        out = {"complete": 0, "pruned": 0, "failed": 0}
        for t in self.trials:
            out[t["state"]] = out.get(t["state"], 0) + 1
        return out

    @property
    def trial_steps(self) -> int:
        return sum(int(t.get("steps") or 0) for t in self.trials)


#: (trial number, params, output folder, job name) → the trial's job.
TrialSpecFactory = Callable[[int, dict, str, str], JAXJobSpec]


@dataclass
class _Active:
    trial: optuna.Trial
    name: str
    output_dir: str
    started: float  # time.monotonic(), for the trial timeout (from admission, under Kueue)
    workers: int = 1
    reported: int = 0  # eval records already reported
    queued: bool = False  # held by Kueue when last looked at


class Controller:
    """Runs one study: re-attach to a previous attempt's trials, keep `parallelism` trials
    running (fill), follow them (poll), and tell Optuna how each ended (finish)."""

    def __init__(self, cfg, trial_spec, trials_root, client, tracker, log):
        self.cfg, self.trial_spec, self.client = cfg, trial_spec, client
        self.tracker, self.log = tracker, log
        self.trials_root = Path(trials_root)
        self.trials_root.mkdir(parents=True, exist_ok=True)
        self.active: dict[int, _Active] = {}
        # A trial asked of Optuna that waits for workers: (trial, params, job spec, output dir).
        self.pending: tuple[optuna.Trial, dict, JAXJobSpec, str] | None = None
        self.failures: list[str] = []
        self.study = optuna.create_study(
            study_name=cfg.study_name,
            storage=cfg.storage or None,
            load_if_exists=True,
            direction=cfg.direction,
            sampler=make_sampler(cfg.algorithm, cfg.space, cfg.seed),
            pruner=make_pruner(cfg.pruner, min_steps=cfg.pruner_min_steps),
        )
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.max_trials = cfg.max_trials
        fresh = not self.study.get_trials(deepcopy=False)
        # The defaults run first, once, enqueued by the attempt that creates the study: the
        # sweep can then only replace them with something it measured better (`decide`).
        if fresh and cfg.defaults:
            self.study.enqueue_trial(cfg.defaults, user_attrs={DEFAULTS_ATTR: True})
        if cfg.algorithm == "grid":
            # GridSampler stops the study from inside, which ask/tell does not allow: the grid
            # points are enqueued instead, once, by the attempt that creates the study.
            points = [p for p in grid(cfg.space) if p != cfg.defaults]
            first = 1 if cfg.defaults else 0
            self.max_trials = min(cfg.max_trials, len(points) + first)
            if fresh:
                for point in points[: self.max_trials - first]:
                    self.study.enqueue_trial(point)

    def run(self) -> SweepResult:
        """Run the study to `max_trials`; the best trial and every trial's record."""
        self.reattach()
        with delete_on_sigterm(self.client, lambda: [a.name for a in self.active.values()]):
            while self.active or self.pending or self.launched() < self.max_trials:
                self.fill()
                for number in list(self.active):
                    self.poll(number)
                if len(self.failures) > self.cfg.max_failed_trials:
                    self.stop()
                if self.active:
                    time.sleep(self.client.poll_interval(self.cfg.poll_seconds))
        return self.result()

    def reattach(self) -> None:
        """Follow the trials a previous attempt left running; those whose job is gone failed."""
        running = (optuna.trial.TrialState.RUNNING,)
        for ft in self.study.get_trials(deepcopy=False, states=running):
            # Optuna has no public handle for a RUNNING trial of a loaded study.
            trial = optuna.trial.Trial(self.study, ft._trial_id)
            name = ft.user_attrs.get(JOB_ATTR)
            if name is None:  # it was waiting for workers: it never ran
                trial.set_user_attr(NOT_STARTED_ATTR, True)
                self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
                continue
            try:
                self.client.get_job(name)
            except KeyError:
                self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
                self.log(f"sweep: trial {ft.number} was lost with the previous attempt; failed")
                continue
            output_dir, workers = ft.user_attrs[OUTPUT_ATTR], ft.user_attrs.get(WORKERS_ATTR, 1)
            self.active[ft.number] = _Active(trial, name, output_dir, time.monotonic(), workers)
            self.log(f"sweep: re-attached to trial {ft.number} (job {name})")
        failed = self.study.get_trials(states=(optuna.trial.TrialState.FAIL,))
        self.failures += [
            f"trial {t.number}: failed in an earlier attempt"
            for t in failed
            if not t.user_attrs.get(NOT_STARTED_ATTR)
        ]

    def launched(self) -> int:
        """Trials started so far, in this attempt and earlier ones."""
        waiting = optuna.trial.TrialState.WAITING  # enqueued grid points not yet started
        return sum(t.state != waiting for t in self.study.get_trials(deepcopy=False))

    def workers_in_use(self) -> int:
        """Workers of the trials running now."""
        return sum(a.workers for a in self.active.values())

    def fill(self) -> None:
        """Start trials until `parallelism` run, the study has `max_trials`, or the next trial
        does not fit in the worker budget (it waits, asked, for running trials to end)."""
        while len(self.active) < self.cfg.parallelism:
            if self.pending is None:
                if self.launched() >= self.max_trials:
                    return
                trial = self.study.ask()
                params = suggest(trial, self.cfg.space)
                out_dir = str(self.trials_root / f"trial-{trial.number:03d}")
                name = job_name(
                    self.cfg.study_name, str(trial.number), prefix=f"trial-{trial.number}"
                )
                try:
                    spec = self.trial_spec(trial.number, params, out_dir, name)
                except InfeasibleError as err:
                    self.skip(trial, params, str(err))
                    continue
                self.pending = (trial, params, spec, out_dir)
            trial, params, spec, out_dir = self.pending
            budget = self.cfg.max_workers
            # Trials in a Kueue queue are all submitted: Kueue admits what its quota holds.
            over = budget and self.workers_in_use() + spec.replicas > budget
            if over and not spec.queue_name:
                return
            self.pending = None
            self.start(trial, params, spec, out_dir)

    def skip(self, trial: optuna.Trial, params: dict, reason: str) -> None:
        """A trial whose settings the devices cannot run (`InfeasibleError`: the mesh, the
        memory plan): pruned before any job, its reason in the log line, in Optuna and in an
        MLflow run of its own; not a failure (the budget of failed trials stays whole)."""
        first = reason.splitlines()[0]
        trial.set_user_attr(NOT_STARTED_ATTR, True)
        trial.set_user_attr(SKIPPED_ATTR, first)
        trial.set_user_attr(STEPS_ATTR, 0)
        self.study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        self.tracker.skipped_run(
            f"trial-{trial.number}",
            params,
            {"kubejax.trial": str(trial.number), "kubejax.trial_state": "pruned",
             "kubejax.skipped": reason[:5000]},
        )  # fmt: skip
        self.log(f"sweep: trial {trial.number} pruned before it started: {first}; {params}")

    def start(self, trial: optuna.Trial, params: dict, spec: JAXJobSpec, out_dir: str) -> None:
        """Create a trial's job and follow it."""
        trial.set_user_attr(JOB_ATTR, spec.name)
        trial.set_user_attr(OUTPUT_ATTR, out_dir)
        trial.set_user_attr(WORKERS_ATTR, spec.replicas)
        trial.set_user_attr(START_ATTR, time.time())
        self.client.create_job(spec)
        self.active[trial.number] = _Active(
            trial, spec.name, out_dir, time.monotonic(), spec.replicas
        )
        self.log(
            f"sweep: trial {trial.number} started as job {spec.name} on {spec.replicas} "
            f"worker(s): {params}"
        )

    def poll(self, number: int) -> None:
        """Report a trial's new evals to the pruner; finish it if pruned, done or failed."""
        a = self.active[number]
        metrics = read_metrics(a.output_dir)
        evals = metrics.get("evals", [])
        for rec in evals[a.reported :]:
            if self.cfg.objective not in rec:
                continue
            a.trial.report(float(rec[self.cfg.objective]), int(rec["step"]))
            a.reported += 1
            final_step = rec["step"] == metrics.get("total_steps")
            # The defaults' trial is the reference every other is judged against: never cut.
            reference = a.trial.user_attrs.get(DEFAULTS_ATTR, False)
            if not final_step and not reference and a.trial.should_prune():
                self.client.delete_job(a.name)
                self.finish(number, optuna.trial.TrialState.PRUNED, reason=f"at step {rec['step']}")
                return
        status = self.client.get_job(a.name)
        if status.state == SUSPENDED:  # waiting in Kueue: the trial's clock has not started
            a.started = time.monotonic()
            if not a.queued:
                reason = self.client.queue_reason(status)
                self.log(f"sweep: trial {number} queued" + (f": {reason}" if reason else ""))
            a.queued = True
            return
        if a.queued:
            self.log(f"sweep: trial {number} admitted")
            a.queued = False
        if status.state == SUCCEEDED:
            value = metrics.get("final", {}).get(self.cfg.objective)
            if value is None and evals:
                value = evals[-1].get(self.cfg.objective)
            self.client.delete_job(a.name)
            if value is None or not math.isfinite(float(value)):
                self.failures.append(f"trial {number}: no {self.cfg.objective} in its metrics")
                self.finish(number, optuna.trial.TrialState.FAIL, reason=self.failures[-1])
            else:
                self.finish(number, optuna.trial.TrialState.COMPLETE, float(value))
        elif status.state == FAILED or time.monotonic() - a.started > self.cfg.trial_timeout:
            cond = status.condition(FAILED) or {
                "reason": "Timeout",
                "message": f"ran past {self.cfg.trial_timeout}s",
            }
            tail = self.client.failure_log(a.name).strip()
            self.client.delete_job(a.name)
            last = tail.splitlines()[-1] if tail else ""
            self.failures.append(
                f"trial {number}: {cond.get('reason')}: {cond.get('message')}"
                + (f" (last log line: {last})" if last else "")
            )
            self.finish(number, optuna.trial.TrialState.FAIL, reason=self.failures[-1])

    def finish(self, number: int, state, value=None, reason: str = "") -> None:
        """Tell Optuna how a trial ended, and mark its MLflow run."""
        a = self.active.pop(number)
        metrics = read_metrics(a.output_dir)
        steps = int(metrics.get("step", 0))
        a.trial.set_user_attr(STEPS_ATTR, steps)
        a.trial.set_user_attr(END_ATTR, time.time())
        complete = state == optuna.trial.TrialState.COMPLETE
        self.study.tell(a.trial, value if complete else None, state=state)
        label = _STATE_NAMES[state]
        if metrics.get("mlflow_run_id"):
            tag_trial_run(self.tracker, metrics["mlflow_run_id"], label)
        self.log(
            f"sweep: trial {number} {label}"
            + (f" ({self.cfg.objective}={value:.4f})" if value is not None else "")
            + (f": {reason}" if reason else "")
            + f" after {steps} steps"
        )

    def stop(self) -> None:
        """Too many failures: delete the running trials' jobs and fail the sweep."""
        if self.pending is not None:
            self.pending[0].set_user_attr(NOT_STARTED_ATTR, True)
            self.study.tell(self.pending[0], state=optuna.trial.TrialState.FAIL)
            self.pending = None
        for a in list(self.active.values()):
            self.client.delete_job(a.name)
            self.finish(a.trial.number, optuna.trial.TrialState.FAIL, reason="sweep stopped")
        raise SweepError(
            f"max_failed_trials: {len(self.failures)} trials failed (limit "
            f"{self.cfg.max_failed_trials}):\n" + "\n".join(self.failures)
        )

    def result(self) -> SweepResult:
        """Every trial that ran or was skipped, with its record, and the best one; an error if
        none completed."""
        trials = [
            _record(t)
            for t in self.study.get_trials(deepcopy=False)
            if t.state in _STATE_NAMES
            and (not t.user_attrs.get(NOT_STARTED_ATTR) or t.user_attrs.get(SKIPPED_ATTR))
        ]
        if not any(t["state"] == "complete" for t in trials):
            raise SweepError("max_trials: no trial completed; see the trials' errors above")
        best = self.study.best_trial
        return SweepResult(dict(best.params), float(best.value), best.number, trials)


def _record(t: optuna.trial.FrozenTrial) -> dict:
    """A trial as the sweep reports it; cost is workers × seconds its job ran."""
    start, end = t.user_attrs.get(START_ATTR), t.user_attrs.get(END_ATTR)
    workers = t.user_attrs.get(WORKERS_ATTR, 1)
    seconds = (end - start) if start is not None and end is not None else None
    return {
        "number": t.number,
        "state": _STATE_NAMES[t.state],
        "value": t.value,
        "params": t.params,
        "steps": t.user_attrs.get(STEPS_ATTR, 0),
        "intermediate": {str(k): v for k, v in sorted(t.intermediate_values.items())},
        "job": t.user_attrs.get(JOB_ATTR, ""),
        "workers": workers,
        "start": start,
        "end": end,
        "worker_seconds": None if seconds is None else round(workers * seconds, 2),
        **({"skipped": t.user_attrs[SKIPPED_ATTR]} if SKIPPED_ATTR in t.user_attrs else {}),
        **({"defaults": True} if t.user_attrs.get(DEFAULTS_ATTR) else {}),
    }


def standard_error(objective: str, value: float | None, examples: int | None) -> float | None:
    """The standard error of a trial's evaluation: an accuracy's binomial one, sqrt(p(1-p)/n)
    over its `examples` scored; None where unknown (another objective, n not known)."""
    if value is None or not examples or "accuracy" not in objective or not 0 <= value <= 1:
        return None
    return math.sqrt(value * (1 - value) / examples)


def decide(result: SweepResult, cfg: SweepConfig) -> SweepResult:
    """What the sweep keeps: its best trial, or the defaults' trial when the best does not
    beat it by more than `cfg.min_gain_se` standard errors of their difference (the two
    evaluations' errors combined, sqrt(se_best² + se_defaults²)); with no error known, any
    gain. Each trial's record gets its standard error (`se`) and examples; the result its
    `defaults_trial`, `choice`, `gain`, `gain_se` and the one-line `reason`."""
    for t in result.trials:
        t["eval_examples"] = t.get("eval_examples") or cfg.eval_examples or None
        t["se"] = standard_error(cfg.objective, t["value"], t["eval_examples"])
    defaults = next((t for t in result.trials if t.get("defaults")), None)
    best = result.trial(result.best_trial)
    result.defaults_trial = None if defaults is None else defaults["number"]
    result.choice, result.gain, result.gain_se = "best", None, None
    name = cfg.objective
    if defaults is None:
        result.reason = "no trial of the defaults ran: the best trial's settings are kept"
        return result
    if defaults["state"] != "complete":
        result.reason = (
            f"the defaults' trial {defaults['number']} {defaults['state']}: nothing to compare "
            f"the best trial {best['number']} with; its settings are kept"
        )
        return result
    sign = 1.0 if cfg.direction == "maximize" else -1.0
    result.gain = sign * (best["value"] - defaults["value"])
    errors = (best["se"], defaults["se"])
    if best is not defaults and None not in errors:
        result.gain_se = math.hypot(*errors)
    if best is defaults or result.gain <= 0:
        result.choice = "defaults"
        result.reason = (
            f"the defaults' trial {defaults['number']} is the best ({name}="
            f"{_pm(defaults)}): the final training keeps the defaults"
        )
        return result
    needed = cfg.min_gain_se * (result.gain_se or 0.0)
    versus = (
        f"best trial {best['number']} ({name}={_pm(best)}) against the defaults' trial "
        f"{defaults['number']} ({_pm(defaults)}): gain {result.gain:+.4f}"
    )
    if result.gain_se:
        versus += f" = {result.gain / result.gain_se:.1f} standard errors"
    if result.gain > needed:
        result.reason = f"{versus}; the best trial's settings replace the defaults"
        return result
    result.choice = "defaults"
    result.reason = (
        f"{versus}, within {cfg.min_gain_se:g} standard errors (the noise of evaluations on "
        f"{best['eval_examples']} examples): the final training keeps the defaults"
    )
    return result


def _pm(t: dict) -> str:
    """A trial's value with its standard error, e.g. 0.8120 ± 0.0124."""
    return f"{t['value']:.4f}" + (f" ± {t['se']:.4f}" if t.get("se") is not None else "")


def tag_trial_run(tracker: tracking.Tracker, run_id: str, state: str) -> None:
    """Mark a trial's MLflow run with its sweep state (complete, pruned, failed) and end it."""
    status = {"complete": "FINISHED", "pruned": "KILLED", "failed": "FAILED"}[state]
    tracker.update_run(run_id, {"kubejax.trial_state": state}, status=status)


def tune(
    cfg: SweepConfig,
    trial_spec: TrialSpecFactory,
    trials_root: str | Path,
    *,
    client: JAXJobClient | None = None,
    tracker: tracking.Tracker | None = None,
    log: Callable[[str], None] = print,
) -> SweepResult:
    """Run the study to `max_trials`; return the best trial, every trial's record and the
    choice between the best and the defaults' trial (`decide`; the defaults, `cfg.defaults`,
    are the study's first trial).

    `trial_spec(number, params, output_dir, job_name)` builds the job of a trial.
    """
    client = client or JAXJobClient("auto")
    tracker = tracker or tracking.Tracker()
    return decide(Controller(cfg, trial_spec, trials_root, client, tracker, log).run(), cfg)
