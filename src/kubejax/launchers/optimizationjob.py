"""The sweep as a Kubeflow Trainer OptimizationJob (`tuner optimizationjob`): its
`trainJobTemplate` is the TrainJob kubejax launches for one trial, the job is created or
re-attached, followed, deleted on a cancelled run, and its trial TrainJobs turned into the
Optuna path's outputs (`kubejax.tune.optimizationjob` says what was read of Trainer's code and
what was assumed)."""

from __future__ import annotations

import json
from collections.abc import Callable

from kubejax import tracking
from kubejax.jobs.client import JAXJobClient
from kubejax.jobs.launch import on_sigterm
from kubejax.jobs.trainjob import build_trainjob_manifest
from kubejax.tune import optimizationjob as oj
from kubejax.tune.controller import SweepConfig, SweepResult, TrialSpecFactory, tag_trial_run
from kubejax.tune.space import SweepError, lowest_point


def trial_trainjob(cfg: SweepConfig, factory: TrialSpecFactory, trials_root: str) -> dict:
    """The TrainJob `factory` makes for one trial, as the template the controller copies: no
    name or namespace, no searched setting among the trainer's args (the controller passes
    them as KUBEFLOW_TRAINER_OPT_* env, which the trainer reads after its args), and the
    trial's own name (output folder, MLflow run name and tags) as `$(KUBEJAX_TRIAL_NAME)`,
    which Kubernetes expands from the env entry `oj.trial_env` adds."""
    trial = oj.TRIAL_NAME_REF
    spec = factory(trial, lowest_point(cfg.space), f"{trials_root}/{trial}", cfg.study_name)
    manifest = build_trainjob_manifest(spec)
    manifest["metadata"].pop("name")
    manifest["metadata"].pop("namespace", None)
    trainer = manifest["spec"]["trainer"]
    args, kept = trainer["args"], []
    searched = {"--" + n.replace("_", "-") for n in cfg.space}
    negated = {"--no-" + f[2:] for f in searched}
    i = 0
    while i < len(args):
        if args[i] in searched and i + 1 < len(args) and not args[i + 1].startswith("--"):
            i += 2  # a setting and its value
            continue
        if args[i] in searched or args[i] in negated:
            i += 1  # a true/false setting
            continue
        if args[i] == "--mlflow-tags" and i + 1 < len(args):
            tags = json.loads(args[i + 1])
            # The job's name in the tags is the trial's, not the sweep's.
            tags.update({k: trial for k, v in tags.items() if v == cfg.study_name})
            kept += [args[i], json.dumps(tags)]
            i += 2
            continue
        kept.append(args[i])
        i += 1
    trainer["args"] = kept
    trainer["env"] = [*trainer.get("env", []), *oj.trial_env()]
    return manifest


def sweep_with_optimizationjob(
    cfg: SweepConfig,
    factory: TrialSpecFactory,
    client: JAXJobClient,
    trials_root: str,
    *,
    tracker: tracking.Tracker,
    replicas: int,
    log: Callable[[str], None] = print,
) -> SweepResult:
    """Run the sweep as the OptimizationJob `cfg.study_name` (re-attached when it exists),
    with the defaults (`cfg.defaults`, when given and `max_trials` > 1) as a TrainJob beside
    it; the best trial (its `status.result`) and every trial's record, each trial's MLflow
    run tagged with its state as in the Optuna path."""
    oj.check_sweep(cfg, client.engine)
    with_defaults = bool(cfg.defaults) and cfg.max_trials > 1
    template = trial_trainjob(cfg, factory, trials_root)
    job = oj.optimization_job(cfg, cfg.study_name, template, oj.trial_count(cfg, with_defaults))
    oj.check_optimization_job(job)
    first = oj.defaults_trainjob(job, cfg.defaults) if with_defaults else None
    custom, namespace = client.custom_objects()
    run = oj.OptimizationRun(custom, namespace, cfg.study_name, log, cfg.poll_seconds)
    with on_sigterm(run.delete):
        run.start(job, first)
        done = run.wait()
    trials = oj.trial_records(cfg, run.trials(), trials_root, replicas)
    for t in trials:
        run_id = t.pop("mlflow_run_id")
        if run_id:
            tag_trial_run(tracker, run_id, t["state"])
    best_name, params = oj.result_params(cfg, done)
    best = next((t for t in trials if t["job"] == best_name), None)
    if best is None or best["state"] != "complete":
        raise SweepError(
            f"max_trials: OptimizationJob {cfg.study_name} ended without a best trial with "
            f"{cfg.objective} in status.result (trial {best_name or 'none'}); its controller "
            "reads each trial's metric from the TrainJob's status: enable Trainer's "
            "TrainJobStatus feature gate, and see the trials (kubectl get trainjobs)"
        )
    best_params = {**best["params"], **params}
    log(f"sweep: OptimizationJob's best trial {best['job']}: {cfg.objective}={best['value']:.4f}")
    return SweepResult(best_params, float(best["value"]), best["number"], trials)
