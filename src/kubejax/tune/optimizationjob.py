"""Kubeflow Trainer's `OptimizationJob` as the sweep engine (`tuner optimizationjob`): one
`trainer.kubeflow.org/v1alpha1` OptimizationJob whose `trainJobTemplate` is the TrainJob kubejax
launches for one trial.

What was read (kubeflow/trainer master, August 2026; schema in `../shared/crds/
trainer-optimizationjob-v1alpha1/`): the API types (`pkg/apis/trainer/v1alpha1/
optimizationjob_types.go`, #3552) — one objective (`metric`, `direction` Maximize|Minimize),
`searchAlgorithm` random (`seed`) or grid (the CRD's CEL rule: grid needs every parameter
categorical), parameters `uniform`/`logUniform` (`Int`|`Float`, bounds as strings) or
`categorical` (≤ 100 strings of ≤ 64 characters), `numTrials` and `parallelTrials` ≤ 100 (and
parallelTrials ≤ numTrials), a spec that cannot change after creation, `status.conditions` and
`status.result` (`trainJobName`, `parameters`). Master holds no controller: KEP-3562
(`proposals/2605-optimization-job-crd`) and the two open controller pull requests (d9989e8,
c453a13) agree that the controller creates each trial as a TrainJob named
`<job>-trial-<i>`, controlled by the OptimizationJob (ownerReference), copies the template's
spec and appends each assignment to `spec.trainer.env` as `KUBEFLOW_TRAINER_OPT_<NAME>` (the
name upper-cased) — no substitution into args — and records it in annotations; it reads each
trial's metrics from the TrainJob's `status.trainerStatus.metrics` (Trainer's `TrainJobStatus`
gate; kubejax's trainer posts its evaluations there, `kubejax.trainer.trainer_status`), picks
the best trial into `status.result`, and sets conditions `Created`, `Running`, then `Complete`
or `Failed` (reasons such as AllTrialsFailed, SuggestionServiceFailed).

Assumed where the code is not merged: those env names and condition types; trials found by
their controller ownerReference (the PRs label them differently); a trial's metric is the last
value it posted (kubejax's trainer posts the final evaluation last). The trainer reads its
assignments with `kubejax.trainer.config.assigned_flags`; a trial learns its own name (output
folder, MLflow run) from its pod's JobSet label through the downward API (`TRIAL_NAME_ENV`),
which Kubernetes expands in the container's args as `$(KUBEJAX_TRIAL_NAME)`.

`check_optimization_job` holds the CRD's rules that a JSON schema cannot say (its CEL rules),
so a rendered job is known to pass before any cluster sees it.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kubejax.flags import OPTIMIZATION_ENV_PREFIX
from kubejax.jobs.trainjob import API_GROUP, POD_JOB_LABEL
from kubejax.outputs import read_metrics
from kubejax.tune.space import RESOURCE_PARAMS, SweepError, _grid_axes

GROUP, VERSION = API_GROUP, "v1alpha1"
KIND, PLURAL = "OptimizationJob", "optimizationjobs"
TRAINJOBS = "trainjobs"
#: The CRD's limits: trials (in all and at once), choices of a categorical parameter, and
#: the length of a parameter's name and of each value.
MAX_TRIALS, MAX_CHOICES, MAX_TEXT = 100, 100, 64
#: kubejax's algorithm names → the OptimizationJob's searchAlgorithm.
ALGORITHMS = ("random", "grid")
#: What each algorithm kubejax knows runs on instead, for the refusal.
_ELSEWHERE = {
    "tpe": "tuner=optuna or katib",
    "cmaes": "tuner=optuna or katib",
    "multivariate-tpe": "tuner=katib",
    "bayesianoptimization": "tuner=katib",
    "hyperband": "tuner=katib (or tuner=ray, scheduler=asha)",
}
#: The env var of a trial's own TrainJob name (its pods' JobSet label, downward API).
TRIAL_NAME_ENV = "KUBEJAX_TRIAL_NAME"
#: How the trial's name stands in its args (Kubernetes expands it from the container's env).
TRIAL_NAME_REF = f"$({TRIAL_NAME_ENV})"


def refuse_algorithm(algorithm: str) -> SweepError:
    """The one-line refusal of an algorithm the OptimizationJob lacks, naming where it runs."""
    where = _ELSEWHERE.get(algorithm, "tuner=optuna")
    return SweepError(
        f"algorithm: {algorithm!r} is not one OptimizationJob runs (random or grid; Bayesian "
        f"search is future work upstream, kubeflow/trainer#3802); use {where}"
    )


def env_name(parameter: str) -> str:
    """The env var an OptimizationJob trial gets for `parameter` (the controller's rule)."""
    return OPTIMIZATION_ENV_PREFIX + parameter.upper().replace("-", "_")


def check_sweep(cfg, engine: str | None = None) -> None:
    """What an OptimizationJob cannot run, refused before anything is created (one line naming
    the setting, what is allowed and the engine that can); the job engine too when given."""
    if engine is not None and engine != "trainjob":
        raise SweepError(
            "tuner: optimizationjob runs its trials as Kubeflow Trainer TrainJobs (backend "
            f"trainjob, or kubernetes/auto on a cluster serving Trainer), not on backend {engine}; "
            "use tuner=optuna there"
        )
    if cfg.algorithm not in ALGORITHMS:
        raise refuse_algorithm(cfg.algorithm)
    if cfg.pruner != "none":
        raise SweepError(
            f"pruner: {cfg.pruner} — OptimizationJob has no early stopping (future work upstream, "
            "kubeflow/trainer#3802); set pruner=none, or use tuner=optuna (median, "
            "successive_halving, hyperband) or tuner=katib (median as medianstop)"
        )
    if cfg.scheduler != "none":
        raise SweepError(
            f"scheduler: {cfg.scheduler} is Ray Tune's; OptimizationJob has no schedulers "
            "(ASHA, PBT); use tuner=ray"
        )
    if cfg.max_trials > MAX_TRIALS:
        raise SweepError(
            f"max_trials: {cfg.max_trials} is more than the {MAX_TRIALS} trials an "
            "OptimizationJob runs (its CRD's numTrials limit); use tuner=optuna or katib"
        )
    metrics = [m for m in cfg.objective.replace(";", ",").split(",") if m.strip()]
    if len(metrics) != 1:
        raise SweepError(
            f"objective: {cfg.objective!r} names {len(metrics)} metrics; an OptimizationJob "
            "optimises one (its CRD's objectives hold one), as every kubejax tuner does: "
            "name one (eval_accuracy or eval_loss); the trials log the others"
        )
    if len(cfg.objective) > MAX_TEXT:
        raise SweepError(f"objective: longer than the CRD's {MAX_TEXT} characters")
    for name, entry in cfg.space.items():
        if "when" in entry:
            raise SweepError(
                f"search_space.{name}.when: OptimizationJob has no conditional parameters; use "
                "tuner=optuna, or search the dimension unconditionally"
            )
        if name in RESOURCE_PARAMS:
            raise SweepError(
                f"search_space.{name}: an OptimizationJob passes parameters to the trainer as "
                "env vars, not to its worker count or resources; use tuner=optuna to search "
                "resources"
            )
        if len(name) > MAX_TEXT:
            raise SweepError(f"search_space.{name}: longer than the CRD's {MAX_TEXT} characters")
    parameters(cfg.space, cfg.algorithm)  # the space fits the CRD's parameter forms


def _text(value) -> str:
    """A value as the CRD's strings (a JSON number's text: matches its Double pattern)."""
    if isinstance(value, str):
        return value
    if isinstance(value, float):
        value = float(f"{value:.12g}")  # 0.15000000000000002 → 0.15
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value)) if value != 0 else "0"
    return json.dumps(value)


def _choices(name: str, values: list, why: str) -> dict:
    texts = list(dict.fromkeys(_text(v) for v in values))
    if len(texts) > MAX_CHOICES:
        raise SweepError(
            f"search_space.{name}: {len(texts)} values ({why}); an OptimizationJob's categorical "
            f"parameter takes at most {MAX_CHOICES}: widen the step or use tuner=optuna"
        )
    long = [t for t in texts if len(t) > MAX_TEXT]
    if long:
        raise SweepError(f"search_space.{name}: choice {long[0]!r} is over {MAX_TEXT} characters")
    return {"categorical": {"choices": texts}}


def parameters(space: dict[str, dict], algorithm: str) -> list[dict]:
    """The search space as the OptimizationJob's `parameters`: a float or int range as
    `uniform` or `logUniform` (`Float`|`Int`); categorical choices, a stepped range's values,
    and every dimension of a grid (the CRD's rule) as `categorical` strings."""
    axes = _grid_axes(space) if algorithm == "grid" else {}
    out = []
    for name, entry in space.items():
        if entry["type"] == "categorical":
            search = _choices(name, entry["choices"], "its choices")
        elif algorithm == "grid":
            search = _choices(name, axes[name], "its grid")
        elif entry.get("step") is not None:
            # The CRD's ranges have no step: the steps' values are its choices.
            search = _choices(name, _grid_axes({name: entry})[name], "its steps")
        else:
            kind = "logUniform" if entry.get("log") else "uniform"
            bounds = {"min": _text(entry["low"]), "max": _text(entry["high"])}
            search = {kind: {**bounds, "type": "Float" if entry["type"] == "float" else "Int"}}
        out.append({"name": name, "searchSpace": search})
    return out


def value_of(entry: dict, text: str):
    """An assignment (a string) as the search space's type."""
    if entry["type"] == "float":
        return float(text)
    if entry["type"] == "int":
        return int(float(text))
    return next((c for c in entry["choices"] if _text(c) == text), text)


def trial_count(cfg, defaults: bool) -> int:
    """The OptimizationJob's numTrials: `max_trials` less the defaults' trial kubejax runs
    beside it, at most the grid's points."""
    n = max(cfg.max_trials - (1 if defaults else 0), 1)
    if cfg.algorithm == "grid":
        points = 1
        for values in _grid_axes(cfg.space).values():
            points *= len(values)
        n = min(n, points)
    return n


def optimization_job(cfg, name: str, trainjob: dict, num_trials: int) -> dict:
    """The OptimizationJob of sweep `cfg` named `name`, running `num_trials` trials of the
    TrainJob manifest `trainjob` (its name and namespace dropped: the controller names
    trials)."""
    algorithm = {"random": {"seed": int(cfg.seed)}} if cfg.algorithm == "random" else {"grid": {}}
    kept = ("labels", "annotations")
    metadata = {k: v for k, v in trainjob.get("metadata", {}).items() if k in kept}
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "metadata": {"name": name, "labels": {"kubejax.dev/sweep": "true"}},
        "spec": {
            "objectives": [{"metric": cfg.objective, "direction": cfg.direction.capitalize()}],
            "searchAlgorithm": algorithm,
            "parameters": parameters(cfg.space, cfg.algorithm),
            "numTrials": num_trials,
            "parallelTrials": min(cfg.parallelism, num_trials, MAX_TRIALS),
            "trainJobTemplate": {"metadata": metadata, "spec": trainjob["spec"]},
        },
    }


def check_optimization_job(job: dict) -> None:
    """The CRD's CEL rules (the JSON schema holds the rest): ValueError naming the first
    broken one."""
    spec = job["spec"]
    if spec.get("parallelTrials", 1) > spec.get("numTrials", 1):
        raise ValueError("spec: parallelTrials cannot exceed numTrials")
    algorithm = spec.get("searchAlgorithm", {"random": {}})
    if len(algorithm) != 1:
        raise ValueError("spec.searchAlgorithm: exactly one of random, grid")
    if "grid" in algorithm and any(
        "categorical" not in p["searchSpace"] for p in spec["parameters"]
    ):
        raise ValueError("spec: grid search requires all parameters to be categorical")
    for p in spec["parameters"]:
        space = p["searchSpace"]
        if len(space) != 1:
            raise ValueError(f"spec.parameters[{p['name']}]: exactly one of uniform, "
                             "logUniform, categorical")  # fmt: skip
        for kind in ("uniform", "logUniform"):
            if kind in space:
                low, high = float(space[kind]["min"]), float(space[kind]["max"])
                if low >= high:
                    raise ValueError(f"spec.parameters[{p['name']}]: min must be below max")
                if kind == "logUniform" and low <= 0:
                    raise ValueError(f"spec.parameters[{p['name']}]: logUniform min must be > 0")
    meta = spec["trainJobTemplate"].get("metadata", {})
    if "name" in meta or "namespace" in meta:
        raise ValueError("spec.trainJobTemplate.metadata: name and namespace cannot be set")


def defaults_trial_name(job_name: str) -> str:
    """The name of the defaults' TrainJob kubejax runs beside the OptimizationJob."""
    return f"{job_name}-defaults"


def defaults_trainjob(job: dict, point: dict) -> dict:
    """The defaults `point` as the TrainJob the controller would make of that assignment: the
    template's spec with each value appended to the trainer's env, named
    `defaults_trial_name`. No controller can be asked to start from a point, so kubejax creates
    it beside the OptimizationJob; owned by it (not as its controller: the controller neither
    counts nor manages it), it goes when the OptimizationJob is deleted."""
    name = job["metadata"]["name"]
    template = json.loads(json.dumps(job["spec"]["trainJobTemplate"]))
    spec = template["spec"]
    spec.setdefault("trainer", {})
    params = {p["name"] for p in job["spec"]["parameters"]}
    spec["trainer"]["env"] = [
        *spec["trainer"].get("env", []),
        *({"name": env_name(k), "value": _text(v)} for k, v in point.items() if k in params),
    ]
    meta = template.get("metadata", {})
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "TrainJob",
        "metadata": {**meta, "name": defaults_trial_name(name)},
        "spec": spec,
    }


def _owner(job: dict) -> dict:
    meta = job["metadata"]
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": meta["name"],
            "uid": meta["uid"], "controller": False, "blockOwnerDeletion": False}  # fmt: skip


def _true(obj: dict) -> dict[str, dict]:
    return {c.get("type"): c for c in (obj.get("status") or {}).get("conditions") or []
            if str(c.get("status")) == "True"}  # fmt: skip


def _ended(trainjob: dict) -> str:
    """complete, failed or '' (still running) from a TrainJob's conditions."""
    done = _true(trainjob)
    return "failed" if "Failed" in done else "complete" if "Complete" in done else ""


@dataclass
class OptimizationRun:
    """Following one OptimizationJob: `custom` is a kubernetes CustomObjectsApi."""

    custom: object
    namespace: str
    name: str
    log: Callable[[str], None] = print
    poll_seconds: float = 5.0
    uid: str = ""
    defaults: dict | None = field(default=None)

    def _call(self, verb: str, plural: str, *args, **kw):
        method = getattr(self.custom, f"{verb}_namespaced_custom_object")
        return method(GROUP, VERSION, self.namespace, plural, *args, **kw)

    def start(self, job: dict, defaults: dict | None = None) -> None:
        """Create the OptimizationJob, or re-attach to the one of its name (a retried step);
        then the defaults' TrainJob `defaults` beside it unless it exists."""
        from kubernetes.client.rest import ApiException

        try:
            found = self._call("get", PLURAL, self.name)
            self.log(f"sweep: re-attached to OptimizationJob {self.namespace}/{self.name}")
        except ApiException as err:
            if err.status != 404:
                raise
            metadata = {**job["metadata"], "namespace": self.namespace}
            found = self._call("create", PLURAL, {**job, "metadata": metadata})
            self.log(f"sweep: created OptimizationJob {self.namespace}/{self.name}")
        self.uid = found["metadata"].get("uid", "")
        if defaults is None:
            return
        self.defaults = defaults
        meta = {**defaults["metadata"], "namespace": self.namespace,
                "ownerReferences": [_owner(found)] if self.uid else []}  # fmt: skip
        try:
            self._call("create", TRAINJOBS, {**defaults, "metadata": meta})
            self.log(f"sweep: created the defaults' TrainJob {self.namespace}/{meta['name']}")
        except ApiException as err:
            if err.status != 409:  # made by an earlier attempt
                raise

    def delete(self) -> None:
        """Delete the OptimizationJob (its trials go with it) and the defaults' TrainJob."""
        with contextlib.suppress(Exception):
            self._call("delete", PLURAL, self.name)
        with contextlib.suppress(Exception):
            self._call("delete", TRAINJOBS, defaults_trial_name(self.name))

    def trials(self) -> list[dict]:
        """The trial TrainJobs (the controller's, then the defaults'), oldest first."""
        items = self._call("list", TRAINJOBS).get("items", [])
        defaults = defaults_trial_name(self.name)
        mine = [
            t for t in items
            if t["metadata"]["name"] == defaults
            or any(o.get("uid") == self.uid and o.get("controller")
                   for o in t["metadata"].get("ownerReferences") or [])
        ]  # fmt: skip
        return sorted(mine, key=lambda t: (t["metadata"]["name"] != defaults,
                                           t["metadata"].get("creationTimestamp", ""),
                                           t["metadata"]["name"]))  # fmt: skip

    def wait(self) -> dict:
        """Read the OptimizationJob (and the defaults' TrainJob) until both ended: the job when
        it is Complete, SweepError in one line when it Failed."""
        shown = ""
        while True:
            job = self._call("get", PLURAL, self.name)
            trials = self.trials()
            counts: dict[str, int] = {}
            for t in trials:
                state = _ended(t) or "running"
                counts[state] = counts.get(state, 0) + 1
            text = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
            if text and text != shown:
                self.log(f"sweep: OptimizationJob {self.name}: trials {text}")
                shown = text
            done = _true(job)
            if "Failed" in done:
                c = done["Failed"]
                raise SweepError(
                    f"tuner: OptimizationJob {self.name} failed: {c.get('reason', 'Failed')}: "
                    f"{c.get('message', '')}"
                )
            defaults = defaults_trial_name(self.name)
            waiting = self.defaults is not None and not any(
                t["metadata"]["name"] == defaults and _ended(t) for t in trials
            )
            if "Complete" in done and not waiting:
                return job
            time.sleep(self.poll_seconds)


def _epoch(text: str | None) -> float | None:
    if not text:
        return None
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def trial_records(cfg, trials: list[dict], trials_root: str, workers: int) -> list[dict]:
    """The trial TrainJobs as the sweep's trial records (as the Optuna path's `_record`):
    state from its conditions, the objective from its `status.trainerStatus` (else its
    metrics.json's last evaluation), params from its KUBEFLOW_TRAINER_OPT_* env in the space's
    types, steps and evaluations from its metrics.json."""
    out = []
    defaults = defaults_trial_name(cfg.study_name)
    by_env = {env_name(n): n for n in cfg.space}
    for number, t in enumerate(trials):
        state = _ended(t)
        if not state:
            continue  # still running when the job ended (it is deleted with it)
        name = t["metadata"]["name"]
        output = read_metrics(Path(trials_root) / name)
        progress = (t.get("status") or {}).get("trainerStatus") or {}
        posted = {m["name"]: m["value"] for m in progress.get("metrics", [])}
        evals = [e for e in output.get("evals", []) if cfg.objective in e]
        value = None
        if posted.get(cfg.objective) not in (None, ""):
            value = float(posted[cfg.objective])
        elif evals:
            value = float(evals[-1][cfg.objective])
        if state == "complete" and value is None:
            state = "failed"  # Katib's MetricsUnavailable: nothing to rank it by
        env = t["spec"].get("trainer", {}).get("env", [])
        params = {by_env[e["name"]]: value_of(cfg.space[by_env[e["name"]]], e.get("value", ""))
                  for e in env if e.get("name") in by_env}  # fmt: skip
        start = _epoch(t["metadata"].get("creationTimestamp"))
        ended = _true(t).get("Complete" if state == "complete" else "Failed") or {}
        end = _epoch(ended.get("lastTransitionTime"))
        seconds = None if start is None or end is None else end - start
        out.append({
            "number": number,
            "state": state,
            "value": value if state == "complete" else None,
            "params": params,
            "steps": int(output.get("step", 0)),
            "intermediate": {str(e["step"]): e[cfg.objective] for e in evals},
            "job": name,
            "workers": workers,
            "start": start,
            "end": end,
            "worker_seconds": None if seconds is None else round(workers * seconds, 2),
            "mlflow_run_id": output.get("mlflow_run_id", ""),
            **({"defaults": True} if name == defaults else {}),
        })  # fmt: skip
    return out


def trial_env() -> list[dict]:
    """The env entry that tells a trial its own TrainJob's name (`TRIAL_NAME_REF` in args)."""
    ref = {"fieldRef": {"fieldPath": f"metadata.labels['{POD_JOB_LABEL}']"}}
    return [{"name": TRIAL_NAME_ENV, "valueFrom": ref}]


def result_params(cfg, job: dict) -> tuple[str, dict]:
    """The best trial's TrainJob name and parameters from `status.result` ('' when absent)."""
    result = (job.get("status") or {}).get("result") or {}
    params = {p["name"]: value_of(cfg.space[p["name"]], p["value"])
              for p in result.get("parameters") or [] if p["name"] in cfg.space}  # fmt: skip
    return result.get("trainJobName", ""), params
