"""The sweep as a Katib Experiment (`tuner katib`): its trial template built from the same trial
job the Optuna path creates, the Experiment created or re-attached, followed, deleted on a
cancelled run, and its Trials turned into the Optuna path's outputs."""

from __future__ import annotations

import json
import typing
from collections.abc import Callable

from kubejax import tracking
from kubejax.flags import base_type
from kubejax.jobs.client import JAXJobClient
from kubejax.jobs.launch import on_sigterm
from kubejax.jobs.spec import build_manifest
from kubejax.jobs.trainjob import build_trainjob_manifest
from kubejax.trainer.config import TrainConfig
from kubejax.tune import katib
from kubejax.tune.controller import SweepConfig, SweepResult, TrialSpecFactory, tag_trial_run
from kubejax.tune.space import SweepError, lowest_point

#: The job name a trial template is rendered with, then replaced by Katib's trial-name
#: placeholder: a valid job name that no path or setting of a sweep holds.
TRIAL_NAME_STAND_IN = "kubejax-katib-trial-name"


def trial_job(
    cfg: SweepConfig, factory: TrialSpecFactory, engine: str, trials_root: str
) -> tuple[dict, list[str]]:
    """The trial template: the job `factory` makes for the search space's lowest point, with
    each searched setting's flag value and the trial's name (job labels, output folder, MLflow
    run name) replaced by Katib's placeholders; and the searched settings."""
    hints = typing.get_type_hints(TrainConfig)
    for name in cfg.space:
        if base_type(hints.get(name, str)) is bool:
            raise SweepError(
                f"search_space.{name}: a true/false trainer setting is a flag of its own, "
                "which Katib cannot substitute; search it with tuner=optuna"
            )
    trial = katib.placeholder(katib.TRIAL_NAME)
    spec = factory(trial, lowest_point(cfg.space), f"{trials_root}/{trial}", TRIAL_NAME_STAND_IN)
    manifest = build_trainjob_manifest(spec) if engine == "trainjob" else build_manifest(spec)
    manifest["metadata"].pop("name")
    manifest["metadata"].pop("namespace", None)
    # The stand-in is the trial's job name (its labels, its MLflow tags); the study's name,
    # which the workspace's data and trials folders hold, is left as it is.
    manifest = json.loads(json.dumps(manifest).replace(TRIAL_NAME_STAND_IN, trial))
    container = (
        manifest["spec"]["trainer"]
        if engine == "trainjob"
        else manifest["spec"]["jaxReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    )
    args = container["args"]
    for name in cfg.space:
        flag = "--" + name.replace("_", "-")
        args[args.index(flag) + 1] = katib.placeholder(name)
    return manifest, list(cfg.space)


def sweep_with_katib(
    cfg: SweepConfig,
    factory: TrialSpecFactory,
    client: JAXJobClient,
    trials_root: str,
    *,
    tracker: tracking.Tracker,
    replicas: int,
    log: Callable[[str], None] = print,
) -> SweepResult:
    """Run the sweep as the Katib Experiment `cfg.study_name` (re-attached when it exists),
    its first Trial the defaults (`cfg.defaults`, when given); the best trial (Katib's
    `currentOptimalTrial`) and every trial's record, each trial's MLflow run tagged with its
    state as in the Optuna path."""
    katib.check_sweep(cfg, client.engine)
    manifest, flags = trial_job(cfg, factory, client.engine, trials_root)
    exp = katib.experiment(cfg, cfg.study_name, manifest, client.engine, flags)
    katib.check_experiment(exp)
    # The defaults as the Experiment's first Trial (`katib.defaults_trial`).
    first = katib.defaults_trial(exp, cfg.defaults) if cfg.defaults else None
    custom, namespace = client.custom_objects()
    run = katib.KatibRun(custom, namespace, cfg.study_name, log, cfg.poll_seconds)
    with on_sigterm(run.delete):
        run.start(exp, first)
        status = run.wait()["status"]
    trials = katib.trial_records(cfg, run.trials(), trials_root, replicas)
    for t in trials:
        run_id = t.pop("mlflow_run_id")
        if run_id:
            tag_trial_run(tracker, run_id, t["state"])
    best = next((t for t in trials if t["job"] == _best_name(status)), None)
    if best is None or best["state"] != "complete":
        raise SweepError(
            f"max_trials: no trial of Katib Experiment {cfg.study_name} completed with "
            f"{cfg.objective}; see its trials (kubectl get trials -l "
            f"{katib.EXPERIMENT_LABEL}={cfg.study_name})"
        )
    log(f"sweep: Katib's best trial {best['job']}: {cfg.objective}={best['value']:.4f}")
    return SweepResult(dict(best["params"]), float(best["value"]), best["number"], trials)


def _best_name(status: dict) -> str:
    return (status.get("currentOptimalTrial") or {}).get("bestTrialName", "")
