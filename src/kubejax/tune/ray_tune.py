"""Ray Tune as the sweep controller (`tuner ray`): ASHA and Population Based Training over the
same kubejax jobs the Optuna path runs (local processes or cluster jobs, either engine).

Ray Tune runs inside the sweep step (`ray.init` sized to it, no dashboard). Each Tune trial is a
function that creates the trial's job, reads its metrics.json as the job writes it, reports
each new evaluation to Tune and deletes the job however the trial ends (done, stopped early by
ASHA, paused by PBT, failed, or the sweep cancelled): its `finally` runs in every case. A
trial's Tune checkpoint is a small folder holding a pointer (the job's output folder and the
step) to the job's own Orbax checkpoint of that evaluation. When PBT exploits, the bottom
trial restarts from a copy of the donor's pointer: its next job gets a new output folder seeded
with a copy of the donor's Orbax checkpoint of that step, and the trainer resumes from it with
the mutated settings (it takes the learning rate, the schedule position and the weight decay of
its own settings on resume, the optimizer state as saved).

Ray is an optional extra (`pip install 'kubejax[ray]'`): it is imported only here, only when
`tuner ray` runs.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from kubejax.outputs import read_metrics
from kubejax.tune.space import SweepError

SCHEDULERS = ("none", "asha", "pbt")
ALGORITHMS = ("random", "grid", "tpe")
POINTER = "pointer.json"
CHECKPOINTS = "checkpoints"
INSTALL = "pip install 'kubejax[ray]'"


def require_ray() -> None:
    """SweepError in one line when Ray Tune is not installed."""
    try:
        import ray  # noqa: F401
        from ray import tune  # noqa: F401
    except ImportError as err:
        raise SweepError(
            f"tuner: ray needs Ray Tune, which is not installed ({err.name}); install it with "
            f"{INSTALL}"
        ) from err


def check_sweep(cfg) -> None:
    """What the Ray path cannot run, refused before anything starts (one line each)."""
    require_ray()
    if cfg.algorithm not in ALGORITHMS:
        raise SweepError(
            f"algorithm: {cfg.algorithm!r} is not one tuner=ray runs ({', '.join(ALGORITHMS)}; "
            "tpe is Ray's OptunaSearch)"
        )
    if cfg.scheduler not in SCHEDULERS:
        raise SweepError(f"scheduler: {cfg.scheduler!r} is not one of {', '.join(SCHEDULERS)}")
    for name, entry in cfg.space.items():
        if "when" in entry:
            raise SweepError(
                f"search_space.{name}.when: tuner=ray has no conditional dimensions; use "
                "tuner=optuna, or search the dimension unconditionally"
            )
        if cfg.algorithm == "grid" and entry["type"] != "categorical" and not entry.get("step"):
            raise SweepError(f"search_space.{name}: grid needs a step or choices")
    if cfg.scheduler == "pbt":
        for name in mutations(cfg):
            if name not in cfg.space:
                raise SweepError(
                    f"pbt_mutations: {name} is not in search_space (PBT resamples a mutated "
                    f"setting from its entry; searched: {', '.join(cfg.space)})"
                )
        if cfg.algorithm == "grid":
            raise SweepError("algorithm: PBT explores by mutation; use random or tpe with it")


def mutations(cfg) -> list[str]:
    """The settings PBT mutates (`pbt_mutations`, comma-separated)."""
    return [n.strip() for n in cfg.pbt_mutations.split(",") if n.strip()]


def domain(entry: dict):
    """A search-space entry as a Ray Tune domain."""
    from ray import tune

    if entry["type"] == "categorical":
        return tune.choice(entry["choices"])
    low, high, step = entry["low"], entry["high"], entry.get("step")
    if entry["type"] == "int":
        if entry.get("log"):
            return tune.lograndint(low, high + 1)
        return tune.qrandint(low, high, step) if step else tune.randint(low, high + 1)
    if entry.get("log"):
        return tune.loguniform(low, high)
    return tune.quniform(low, high, step) if step else tune.uniform(low, high)


def grid_values(entry: dict) -> list:
    """Every value of a grid dimension: the choices, or low to high by step."""
    if entry["type"] == "categorical":
        return list(entry["choices"])
    n = math.floor((entry["high"] - entry["low"]) / entry["step"] + 1e-9) + 1
    values = [entry["low"] + i * entry["step"] for i in range(n)]
    return [int(v) for v in values] if entry["type"] == "int" else [round(v, 12) for v in values]


def param_space(cfg) -> dict:
    """Tune's param_space: domains, or grid_search lists for `grid`."""
    from ray import tune

    if cfg.algorithm == "grid":
        return {n: tune.grid_search(grid_values(e)) for n, e in cfg.space.items()}
    return {n: domain(e) for n, e in cfg.space.items()}


def trial_function(
    factory,
    *,
    backend: str,
    backend_options: dict,
    trials_root: str,
    study: str,
    objective: str,
    poll_seconds: float,
) -> Callable[[dict], None]:
    """The Tune trainable: one job a start (or restart after a PBT exploit), its evaluations
    reported with a pointer checkpoint each, the job deleted whatever ends the trial."""

    def run(config: dict) -> None:
        from ray import tune

        from kubejax.jobs.client import FAILED, JAXJobClient
        from kubejax.jobs.spec import job_name

        config = {k: v.item() if hasattr(v, "item") else v for k, v in config.items()}
        trial_id = tune.get_context().get_trial_id()
        out, start_step, donor = _output_for(Path(trials_root), trial_id, tune.get_checkpoint())
        restart = int(out.name.rsplit("-", 1)[1])
        name = job_name(study, trial_id, str(restart), prefix=f"trial-{trial_id[-5:]}-{restart}")
        (out / "trial.json").write_text(json.dumps(
            {"trial_id": trial_id, "params": config, "job": name, "restart": restart,
             "donor": donor, "start_step": start_step, "start": time.time()}))  # fmt: skip
        spec = factory(f"{trial_id}-{restart}", config, str(out), name)
        client = JAXJobClient(backend, **backend_options)
        # A pause (PBT's exploit) stops this function without its `finally`: the start before
        # this one may have left its job; it goes now.
        end_jobs(client, Path(trials_root), f"trial-{trial_id}-*", keep=out)
        try:
            client.create_job(spec)
            _follow(client, name, out, start_step, objective, poll_seconds, FAILED)
        finally:
            client.delete_job(name)  # done, stopped early, paused or failed: no job is left
            client.close()
            _note_end(out)

    return run


def end_jobs(client, root: Path, pattern: str = "trial-*", keep: Path | None = None) -> None:
    """Delete the jobs of trial starts under `root` (matching `pattern`, but `keep`) that have
    not ended, and mark them ended."""
    for path in root.glob(f"{pattern}/trial.json"):
        if path.parent == keep:
            continue
        with contextlib.suppress(OSError, json.JSONDecodeError):
            data = json.loads(path.read_text())
            if "end" in data:
                continue
            with contextlib.suppress(Exception):  # gone already, or never created
                client.delete_job(data["job"])
            _note_end(path.parent)


def _output_for(root: Path, trial_id: str, checkpoint) -> tuple[Path, int, str]:
    """This start's output folder (a new one per start: `trial-<id>-<n>`), the step it resumes
    from (0: fresh) and the donor's output folder ('' when fresh); a restart's folder starts
    with a copy of the donor's Orbax checkpoint of the pointed step."""
    n = len(list(root.glob(f"trial-{trial_id}-*")))
    out = root / f"trial-{trial_id}-{n}"
    out.mkdir(parents=True)
    if checkpoint is None:
        return out, 0, ""
    with checkpoint.as_directory() as folder:
        pointer = json.loads((Path(folder) / POINTER).read_text())
    step = copy_donor_checkpoint(Path(pointer["output_dir"]), int(pointer["step"]), out)
    return out, step, pointer["output_dir"]


def copy_donor_checkpoint(donor: Path, step: int, out: Path, attempts: int = 5) -> int:
    """Copy the donor's Orbax checkpoint of `step` into `out`'s checkpoints and return the step
    copied. A donor whose job runs on keeps its last `keep_checkpoints` only, so by the time
    PBT exploits it the pointed one may be gone: then its latest complete one, which is the
    donor's state PBT means to copy, only newer. FileNotFoundError when it has none left."""
    for _ in range(attempts):
        saved = sorted((int(p.name) for p in (donor / CHECKPOINTS).glob("*") if p.name.isdigit()),
                       reverse=True)  # fmt: skip
        if step in saved:  # the pointed one first
            saved.remove(step)
            saved.insert(0, step)
        for candidate in saved:
            target = out / CHECKPOINTS / str(candidate)
            try:  # the donor's job may delete it while it is copied: then the next one
                shutil.copytree(donor / CHECKPOINTS / str(candidate), target)
                return candidate
            except (OSError, shutil.Error):
                shutil.rmtree(target, ignore_errors=True)
    raise FileNotFoundError(f"PBT: the donor {donor} has no checkpoint left to copy")


def _follow(client, name, out: Path, start_step: int, objective: str, poll: float, failed):
    """Report each new evaluation of the job (with a pointer checkpoint) until it ends;
    RuntimeError naming the job when it failed."""
    from ray import tune

    reported = start_step
    while True:
        status = client.get_job(name)
        for rec in _evals(out):
            if rec["step"] <= reported or objective not in rec:
                continue
            with tempfile.TemporaryDirectory() as folder:
                pointer = {"output_dir": str(out), "step": rec["step"]}
                (Path(folder) / POINTER).write_text(json.dumps(pointer))
                checkpoint = tune.Checkpoint.from_directory(folder)
                metrics = {k: v for k, v in rec.items() if isinstance(v, int | float)}
                tune.report(metrics, checkpoint=checkpoint)
            reported = rec["step"]
        if status.finished:
            if status.state == failed:
                cond = status.condition(failed) or {}
                reason, message = cond.get("reason"), cond.get("message")
                raise RuntimeError(f"job {name} failed: {reason}: {message}")
            return
        time.sleep(client.poll_interval(poll))


def _evals(out: Path) -> list[dict]:
    return read_metrics(out).get("evals", [])


def _note_end(out: Path) -> None:
    path = out / "trial.json"
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "end": time.time()}))


def scheduler(cfg, max_t: int, grace: int):
    """The Tune scheduler of `cfg.scheduler` over the trials' training step."""
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler, PopulationBasedTraining

    if cfg.scheduler == "asha":
        return _sparing(ASHAScheduler, cfg.defaults)(
            time_attr="step", max_t=max_t, grace_period=grace, reduction_factor=cfg.reduction_factor
        )
    if cfg.scheduler == "pbt":
        return _pbt_class(PopulationBasedTraining)(
            time_attr="step",
            perturbation_interval=cfg.perturbation_interval,
            hyperparam_mutations={n: domain(cfg.space[n]) for n in mutations(cfg)},
            quantile_fraction=0.25,
        )
    return FIFOScheduler()


def _pbt_class(base):
    """Ray's PBT without its time-sharing pauses where nothing waits for a slot.

    Ray's asynchronous PBT pauses a trial at each perturbation while any other trial is
    pending or paused, so that trials take turns; the one the exploit pauses (to restore it
    from its donor) then cascades into every trial pausing and resuming at every interval. A
    pause costs a job here (a new job, its start and compilation, resumed from the checkpoint),
    so a trial is paused only to give its slot to a trial that has not started yet."""
    from ray.tune.experiment import Trial
    from ray.tune.schedulers import TrialScheduler

    class PBT(base):
        def on_trial_result(self, tune_controller, trial, result):
            decision = super().on_trial_result(tune_controller, trial, result)
            # A trial not yet started waits for a slot; a pending one with results is only
            # on its way back from a pause (an exploit).
            waiting = any(
                t.status == Trial.PENDING and not t.last_result
                for t in tune_controller.get_trials()
                if t is not trial
            )
            if decision == TrialScheduler.PAUSE and not waiting:
                return TrialScheduler.CONTINUE
            return decision

    return PBT


def _sparing(base, defaults: dict):
    """A Tune scheduler that never stops the defaults' trial early: it is the reference the
    sweep's choice weighs every other trial against (`kubejax.tune.controller.decide`)."""
    from ray.tune.schedulers import TrialScheduler

    class Sparing(base):
        def on_trial_result(self, tune_controller, trial, result):
            decision = super().on_trial_result(tune_controller, trial, result)
            if defaults and is_defaults(trial.config, defaults):
                return TrialScheduler.CONTINUE
            return decision

    return Sparing


def is_defaults(config: dict, defaults: dict) -> bool:
    """Whether a trial's config is the defaults' point."""
    plain = {k: v.item() if hasattr(v, "item") else v for k, v in config.items()}
    return bool(defaults) and all(plain.get(k) == v for k, v in defaults.items())


def search_alg(cfg):
    """Ray's search algorithm: its own random/grid variant generator (seeded), or
    OptunaSearch (TPE); either evaluates the defaults' point first (`points_to_evaluate`)."""
    first = [dict(cfg.defaults)] if cfg.defaults else None
    if cfg.algorithm != "tpe":
        from ray.tune.search.basic_variant import BasicVariantGenerator

        return BasicVariantGenerator(
            random_state=cfg.seed, max_concurrent=cfg.parallelism, points_to_evaluate=first
        )
    import optuna
    from ray.tune.search.optuna import OptunaSearch

    return OptunaSearch(sampler=optuna.samplers.TPESampler(seed=cfg.seed), points_to_evaluate=first)


def num_samples(cfg) -> int:
    """Tune's num_samples: `max_trials` (the defaults' point among them); for grid, one pass
    of the grid, plus one for the defaults' point (a point to evaluate takes a sample)."""
    if cfg.algorithm == "grid":
        return 2 if cfg.defaults else 1
    return cfg.max_trials


def records(cfg, trials_root: str, results, workers_of: Callable[[dict], int]) -> list[dict]:
    """Every Tune trial as the sweep's trial record (the Optuna path's form), numbered in
    start order with the defaults' trial (`cfg.defaults`) first and marked; PBT's restarts
    are one trial with its history of settings."""
    starts: dict[str, list[dict]] = {}
    for path in sorted(Path(trials_root).glob("trial-*/trial.json")):
        data = json.loads(path.read_text())
        starts.setdefault(data["trial_id"], []).append({**data, "output_dir": str(path.parent)})
    out = []
    for runs in starts.values():
        runs.sort(key=lambda d: d["restart"])
    ordered = sorted(starts.items(), key=lambda kv: kv[1][0]["start"])
    # The defaults' trial: the earliest whose first start took the defaults' point (a sample
    # of a categorical space may take it too, later).
    defaults = next((tid for tid, runs in ordered if is_defaults(runs[0]["params"], cfg.defaults)),
                    None)  # fmt: skip
    # Numbered as the search suggested them: the defaults' point first (a parallel trial
    # may have started a moment before it).
    ordered.sort(key=lambda kv: kv[0] != defaults)
    for number, (trial_id, runs) in enumerate(ordered):
        result = _result_of(results, trial_id)
        evals = [e for run in runs for e in _evals(Path(run["output_dir"]))
                 if e["step"] > run["start_step"]]  # fmt: skip
        evals.sort(key=lambda e: e["step"])
        state = _state(result, runs[-1]["output_dir"])
        value = evals[-1][cfg.objective] if state == "complete" and evals else None
        seconds = sum(r.get("end", r["start"]) - r["start"] for r in runs)
        workers = workers_of(runs[-1]["params"])
        out.append({
            "number": number,
            "state": state,
            "value": value,
            "params": runs[-1]["params"],
            "steps": max((e["step"] for e in evals), default=0),
            "intermediate": {str(e["step"]): e[cfg.objective] for e in evals
                             if cfg.objective in e},
            "job": runs[-1]["job"],
            "workers": workers,
            "start": runs[0]["start"],
            "end": runs[-1].get("end"),
            "worker_seconds": round(workers * seconds, 2),
            "trial_id": trial_id,
            "history": [{"params": r["params"], "start_step": r["start_step"],
                         "donor": r["donor"], "job": r["job"]} for r in runs],
            "checkpoint": str(Path(runs[-1]["output_dir"]) / CHECKPOINTS),
            "mlflow_run_ids": [_run_id(r["output_dir"]) for r in runs],
            **({"defaults": True} if trial_id == defaults else {}),
        })  # fmt: skip
    return out


def _result_of(results, trial_id: str):
    """The trial's Tune Result, by the trial's own folder (named after its id), or None. Not by
    its metrics' `trial_id`: Tune sets a restored trial's last result to the restored
    checkpoint's metrics (`Trial.on_restore`), a donor's under PBT, and a completed trial of a
    PBT sweep on a loaded machine once came out `failed` without its Result."""
    return next((r for r in results if f"_{trial_id}_" in Path(r.path).name), None)


def _state(result, last_output: str) -> str:
    """complete (the last job ran to its end), pruned (stopped by the scheduler) or failed."""
    if result is None or result.error is not None:
        return "failed"
    metrics = read_metrics(last_output)
    if not metrics:
        return "failed"
    return "complete" if metrics.get("status") == "completed" else "pruned"


def _run_id(output_dir: str) -> str:
    return read_metrics(output_dir).get("mlflow_run_id", "")


def run(
    cfg,
    factory,
    trials_root: str,
    *,
    backend: str,
    backend_options: dict,
    workers_of: Callable[[dict], int],
    max_steps: int,
    grace_steps: int,
    log: Callable[[str], None] = print,
) -> tuple[list[dict], object]:
    """Run the sweep with Ray Tune in this process (`ray.init` sized to it, no dashboard):
    the trial records and Tune's ResultGrid. SIGTERM (a cancelled run) deletes every job still
    running before Ray stops."""
    import ray
    from ray import tune

    from kubejax.jobs.client import JAXJobClient
    from kubejax.jobs.launch import on_sigterm

    root = Path(trials_root)
    root.mkdir(parents=True, exist_ok=True)
    resources = {"kubejax_workers": cfg.max_workers} if cfg.max_workers else None
    ray.init(num_cpus=max(2, cfg.parallelism), include_dashboard=False, log_to_driver=False,
             resources=resources, configure_logging=False)  # fmt: skip

    def cancel() -> None:
        # Only the jobs here: Ray stops in the `finally` below, once the exit has left the
        # signal handler (stopping Ray inside it could deadlock with the interrupted fit).
        end_jobs(JAXJobClient(backend, **backend_options), root)

    try:
        fn = trial_function(factory, backend=backend, backend_options=backend_options,
                            trials_root=str(root), study=cfg.study_name,
                            objective=cfg.objective, poll_seconds=cfg.poll_seconds)  # fmt: skip

        # Trials only wait on jobs: a tenth of a CPU each; with a worker budget, a trial holds
        # its job's workers of the `kubejax_workers` resource while it runs.
        def needs(config: dict) -> dict:
            budget = {"kubejax_workers": workers_of(config)} if cfg.max_workers else {}
            return {"cpu": 0.1, **budget}

        trainable = tune.with_resources(fn, needs)
        tuner = tune.Tuner(
            trainable,
            param_space=param_space(cfg),
            tune_config=tune.TuneConfig(
                metric=cfg.objective,
                mode="max" if cfg.direction == "maximize" else "min",
                search_alg=search_alg(cfg),
                scheduler=scheduler(cfg, max_steps, grace_steps),
                num_samples=num_samples(cfg),
                # Ray's own generator holds the limit itself (`search_alg`).
                max_concurrent_trials=cfg.parallelism if cfg.algorithm == "tpe" else None,
            ),
            run_config=tune.RunConfig(
                name=cfg.study_name,
                storage_path=str(root.resolve() / "ray"),
                verbose=0,
                # Every pointer is kept (a few bytes each): PBT may copy any trial's latest,
                # and pruning old ones raced with its copies (a trial failed on a deleted one).
                checkpoint_config=tune.CheckpointConfig(num_to_keep=None),
            ),
        )
        cancelled = []
        with on_sigterm(lambda: (cancelled.append(True), cancel())):
            try:
                results = tuner.fit()
            except BaseException:
                if cancelled:  # Ray turns the handler's exit into its own; the step's is 143
                    raise SystemExit(143) from None
                raise
    finally:
        ray.shutdown()
        # Starts paused by PBT and never resumed (their function stopped without its finally).
        end_jobs(JAXJobClient(backend, **backend_options), root)
    log(f"sweep: Ray Tune ran {len(list(results))} trials ({cfg.scheduler} scheduler)")
    return records(cfg, str(root), list(results), workers_of), results
