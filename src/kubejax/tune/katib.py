"""Katib as the sweep engine (`tuner katib`): one `Experiment` (`kubeflow.org/v1beta1`) whose
trials are the same TrainJobs or JAXJobs the Optuna path creates.

Facts from Katib v0.19.0 (`../shared/SWEEPS.md`, its Go types and webhook validator): the
search space maps to `parameters` (double/int with `min`, `max`, `step` and a `logUniform`
distribution for log scales; categorical choices as strings), the objective to `objective`, the
algorithm to Katib's suggestion services, the median pruner to `medianstop`. Metrics reach Katib
through the StdOut collector: the trainer's worker 0 (the trial's primary pod) prints each
evaluation as `eval_accuracy=0.61 eval_loss=1.23` (its `katib_metrics` setting). StdOut rather
than Push: Push needs the `kubeflow-katib` gRPC client in the image and a route to Katib's DB
manager from every pod, and Katib's early stopping reads what a collector sidecar saw; the
sidecar problems reported for TrainJob trials are of the File collector (katib#2616), and the
primary container's exit ends the StdOut one. A trial's output folder is named after the trial
(`${trialSpec.Name}`), so the trial table, MLflow runs and report come from the same files as
the Optuna path's.

`check_experiment` holds the rules Katib's validating webhook enforces
(`pkg/webhook/v1beta1/experiment/validator`), so a rendered Experiment is known to pass before
any cluster sees it.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kubejax.outputs import read_metrics
from kubejax.tune.space import RESOURCE_PARAMS, SweepError

GROUP, VERSION = "kubeflow.org", "v1beta1"
EXPERIMENTS, TRIALS = "experiments", "trials"
EXPERIMENT_LABEL = "katib.kubeflow.org/experiment"
#: kubejax's algorithm names → Katib's suggestion algorithms (the Optuna names first).
ALGORITHMS = {
    "random": "random",
    "grid": "grid",
    "tpe": "tpe",
    "cmaes": "cmaes",
    "multivariate-tpe": "multivariate-tpe",
    "bayesianoptimization": "bayesianoptimization",
    "hyperband": "hyperband",
}
PRUNERS = ("none", "median")
#: The placeholder of the trial's own name (a trial parameter referring to its metadata).
TRIAL_NAME = "trialName"
#: How each engine's job tells Katib it ended, which pod prints the metrics, in which container.
JOB_CONTRACTS = {
    "trainjob": {
        "successCondition": 'status.conditions.#(type=="Complete")#|#(status=="True")#',
        "failureCondition": 'status.conditions.#(type=="Failed")#|#(status=="True")#',
        "primaryPodLabels": {
            "jobset.sigs.k8s.io/replicatedjob-name": "node",
            "batch.kubernetes.io/job-completion-index": "0",
        },
        "primaryContainerName": "node",
    },
    "jaxjob": {
        "successCondition": 'status.conditions.#(type=="Succeeded")#|#(status=="True")#',
        "failureCondition": 'status.conditions.#(type=="Failed")#|#(status=="True")#',
        "primaryPodLabels": {"training.kubeflow.org/job-role": "master"},
        "primaryContainerName": "jax",
    },
}
_PARAM_TYPES = ("double", "int", "categorical", "discrete")
_DISTRIBUTIONS = ("", "uniform", "logUniform", "normal", "logNormal")
_META = re.compile(
    r"^\$\{trialSpec\.(Name|Namespace|Kind|APIVersion|(Labels|Annotations)\[.+\])\}$"
)
_PLACEHOLDER = re.compile(r"\$\{trialParameters\.[^}]+\}")


def placeholder(name: str) -> str:
    """What a trial's job reads for the trial parameter `name`."""
    return "${trialParameters." + name + "}"


def check_sweep(cfg, engine: str) -> None:
    """What Katib cannot run, refused before anything is created (one line naming the
    setting and what is allowed): a local backend, an algorithm or pruner Katib lacks,
    conditional or resource dimensions."""
    if engine not in JOB_CONTRACTS:
        raise SweepError(
            "tuner: katib runs its trials as cluster jobs (backend trainjob, jaxjob, kubernetes "
            f"or auto in a cluster), not on backend {engine}; use tuner=optuna there"
        )
    if cfg.algorithm not in ALGORITHMS:
        raise SweepError(
            f"algorithm: {cfg.algorithm!r} is not one Katib runs ({', '.join(ALGORITHMS)})"
        )
    if cfg.pruner not in PRUNERS:
        raise SweepError(
            f"pruner: {cfg.pruner!r} has no Katib counterpart; with tuner=katib use "
            "median (Katib's medianstop) or none"
        )
    for name, entry in cfg.space.items():
        if "when" in entry:
            raise SweepError(
                f"search_space.{name}.when: Katib has no conditional parameters; use "
                "tuner=optuna, or search the dimension unconditionally"
            )
        if name in RESOURCE_PARAMS:
            raise SweepError(
                f"search_space.{name}: Katib substitutes parameters into the trial's strings, "
                "not its worker count or resources; use tuner=optuna to search resources"
            )
    if cfg.algorithm == "hyperband":
        _check_hyperband(cfg)


def _check_hyperband(cfg) -> None:
    entry = cfg.space.get("max_steps")
    if entry is None or entry["type"] != "int":
        raise SweepError(
            "algorithm: Katib's hyperband needs a resource dimension: an int max_steps entry "
            "in search_space (the budget it grows)"
        )
    eta = 3
    needed = math.ceil(eta ** math.floor(math.log(entry["high"]) / math.log(eta)))
    if cfg.parallelism < needed:
        raise SweepError(
            f"parallelism: Katib's hyperband with max_steps up to {entry['high']} runs "
            f"{needed} trials at once; set parallelism to at least {needed}"
        )


def parameters(space: dict[str, dict]) -> list[dict]:
    """The search space as Katib's `parameters` (every value a string)."""
    out = []
    for name, entry in space.items():
        if entry["type"] == "categorical":
            choices = entry["choices"]
            numeric = all(isinstance(c, int | float) and not isinstance(c, bool) for c in choices)
            out.append({
                "name": name,
                "parameterType": "discrete" if numeric else "categorical",
                "feasibleSpace": {"list": [_text(c) for c in choices]},
            })  # fmt: skip
            continue
        feasible = {"min": _text(entry["low"]), "max": _text(entry["high"])}
        if entry.get("step") is not None:
            feasible["step"] = _text(entry["step"])
        feasible["distribution"] = "logUniform" if entry.get("log") else "uniform"
        kind = "double" if entry["type"] == "float" else "int"
        out.append({"name": name, "parameterType": kind, "feasibleSpace": feasible})
    return out


def _text(value) -> str:
    return json.dumps(value) if not isinstance(value, str) else value


def value_of(entry: dict, text: str):
    """A parameter assignment (a string) as the search space's type."""
    if entry["type"] == "float":
        return float(text)
    if entry["type"] == "int":
        return int(float(text))
    return next((c for c in entry["choices"] if _text(c) == text), text)


def experiment(cfg, name: str, trial_job: dict, engine: str, flags: dict[str, str]) -> dict:
    """The Experiment of sweep `cfg` named `name`, whose trials run `trial_job` (a TrainJob or
    JAXJob manifest with each searched setting's value at `placeholder(setting)` and the
    trial's name at `placeholder(TRIAL_NAME)`); `flags`: the searched settings."""
    objective_metrics = ("eval_accuracy", "eval_loss")
    spec = {
        "objective": {
            "type": cfg.direction,
            "objectiveMetricName": cfg.objective,
            "additionalMetricNames": [m for m in objective_metrics if m != cfg.objective],
            # The last evaluation is the trial's result, as in the Optuna path.
            "metricStrategies": [{"name": cfg.objective, "value": "latest"}],
        },
        "algorithm": _algorithm(cfg),
        "parameters": parameters(cfg.space),
        "parallelTrialCount": cfg.parallelism,
        "maxTrialCount": cfg.max_trials,
        "maxFailedTrialCount": min(cfg.max_failed_trials, cfg.max_trials),
        "metricsCollectorSpec": {"collector": {"kind": "StdOut"}},
        "trialTemplate": {
            "retain": False,
            "trialParameters": [
                {
                    "name": TRIAL_NAME,
                    "reference": "${trialSpec.Name}",
                    "description": "the trial's name: its job's and its output folder's",
                },
                *(
                    {"name": n, "reference": n, "description": f"trainer setting {n}"}
                    for n in flags
                ),
            ],
            "trialSpec": trial_job,
            **JOB_CONTRACTS[engine],
        },
    }
    if cfg.pruner == "median":
        spec["earlyStopping"] = {
            "algorithmName": "medianstop",
            "algorithmSettings": [
                {"name": "min_trials_required", "value": "3"},
                {"name": "start_step", "value": str(max(cfg.pruner_min_steps, 1))},
            ],
        }
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "Experiment",
        "metadata": {"name": name, "labels": {"kubejax.dev/sweep": "true"}},
        "spec": spec,
    }


def _algorithm(cfg) -> dict:
    settings = []
    if cfg.algorithm in ("random", "tpe", "multivariate-tpe", "cmaes", "bayesianoptimization"):
        settings.append({"name": "random_state", "value": str(cfg.seed)})
    if cfg.algorithm == "hyperband":
        settings += [
            {"name": "resource_name", "value": "max_steps"},
            {"name": "r_l", "value": str(cfg.space["max_steps"]["high"])},
            {"name": "eta", "value": "3"},
        ]
    return {"algorithmName": ALGORITHMS[cfg.algorithm], "algorithmSettings": settings}


def check_experiment(exp: dict) -> None:
    """Katib's webhook rules for an Experiment: ValueError naming the first broken one."""
    name = exp.get("metadata", {}).get("name", "")
    if not re.match(r"^[a-z]([-a-z0-9]*[a-z0-9])?$", name):
        raise ValueError(f"metadata.name: {name!r} must be lower-case alphanumerics and '-'")
    spec = exp["spec"]
    trials, parallel = spec.get("maxTrialCount"), spec.get("parallelTrialCount")
    failed = spec.get("maxFailedTrialCount")
    if (trials is not None and trials <= 0) or (parallel is not None and parallel <= 0):
        raise ValueError("spec.maxTrialCount and spec.parallelTrialCount must be above 0")
    if failed is not None and (failed < 0 or (trials is not None and failed > trials)):
        raise ValueError("spec.maxFailedTrialCount must be in [0, spec.maxTrialCount]")
    if parallel is not None and trials is not None and parallel > trials:
        raise ValueError("spec.parallelTrialCount must not exceed spec.maxTrialCount")
    _check_objective(spec.get("objective"))
    if spec.get("algorithm", {}).get("algorithmName") not in ALGORITHMS.values():
        raise ValueError("spec.algorithm.algorithmName: not one of Katib's suggestion services")
    stopping = spec.get("earlyStopping")
    if stopping is not None and stopping.get("algorithmName") != "medianstop":
        raise ValueError("spec.earlyStopping.algorithmName: Katib has medianstop only")
    if spec.get("resumePolicy", "") not in ("", "Never", "LongRunning", "FromVolume"):
        raise ValueError("spec.resumePolicy: Never, LongRunning or FromVolume")
    _check_parameters(spec.get("parameters") or [])
    _check_trial_template(spec.get("trialTemplate"), {p["name"] for p in spec["parameters"]})
    kind = spec.get("metricsCollectorSpec", {}).get("collector", {}).get("kind", "StdOut")
    if kind not in ("StdOut", "Push", "File", "TensorFlowEvent", "PrometheusMetric", "Custom"):
        raise ValueError(f"spec.metricsCollectorSpec.collector.kind: {kind!r} is unknown")


def _check_objective(objective: dict | None) -> None:
    if not objective:
        raise ValueError("spec.objective: must be specified")
    if objective.get("type") not in ("minimize", "maximize"):
        raise ValueError("spec.objective.type: must be minimize or maximize")
    metric = objective.get("objectiveMetricName")
    if not metric:
        raise ValueError("spec.objective.objectiveMetricName: must be specified")
    if metric in objective.get("additionalMetricNames", []):
        raise ValueError("spec.objective.additionalMetricNames: must not hold the objective")


def _check_parameters(params: list[dict]) -> None:
    if not params:
        raise ValueError("spec.parameters: must be specified")
    for i, p in enumerate(params):
        where, space = f"spec.parameters[{i}]", p.get("feasibleSpace") or {}
        if p.get("parameterType") not in _PARAM_TYPES:
            raise ValueError(f"{where}.parameterType: {p.get('parameterType')!r} unsupported")
        if space.get("distribution", "") not in _DISTRIBUTIONS:
            raise ValueError(f"{where}.feasibleSpace.distribution: unsupported")
        if not space:
            raise ValueError(f"{where}.feasibleSpace: must be specified")
        ranged = p["parameterType"] in ("double", "int")
        if ranged and (space.get("list") or not space.get("min") or not space.get("max")):
            raise ValueError(f"{where}.feasibleSpace: min and max (no list) for {p['name']}")
        if not ranged and {"min", "max", "step"} & set(space):
            raise ValueError(f"{where}.feasibleSpace: a list only for {p['name']}")
        if any(not isinstance(v, str) for k, v in space.items() if k != "list"):
            raise ValueError(f"{where}.feasibleSpace: every value must be a string")


def _check_trial_template(template: dict | None, names: set[str]) -> None:
    if not template:
        raise ValueError("spec.trialTemplate: must be specified")
    if not template.get("primaryContainerName"):
        raise ValueError("spec.trialTemplate.primaryContainerName: must be specified")
    if not template.get("successCondition") or not template.get("failureCondition"):
        raise ValueError("spec.trialTemplate: successCondition and failureCondition required")
    trial_spec = template.get("trialSpec")
    if not trial_spec or template.get("trialParameters") is None:
        raise ValueError("spec.trialTemplate: trialSpec and trialParameters required")
    text = json.dumps(trial_spec)
    seen: set[str] = set()
    for p in template["trialParameters"]:
        name, ref = p.get("name", ""), p.get("reference", "")
        if not name or not ref or "{" in name or "}" in name or name in seen:
            raise ValueError(f"spec.trialTemplate.trialParameters: bad or repeated {name!r}")
        seen.add(name)
        if not _META.match(ref) and ref not in names:
            raise ValueError(f"spec.trialTemplate.trialParameters: {ref!r} is no parameter")
        if placeholder(name) not in text:
            raise ValueError(f"spec.trialTemplate: trial parameter {name} is not used")
        text = text.replace(placeholder(name), "test-value")
    left = _PLACEHOLDER.findall(text)
    if left:
        raise ValueError(f"spec.trialTemplate: {left} are not trial parameters")
    meta = trial_spec.get("metadata", {})
    if meta.get("name") or meta.get("namespace"):
        raise ValueError("spec.trialTemplate.trialSpec: metadata.name and namespace must be unset")
    if not trial_spec.get("apiVersion") or not trial_spec.get("kind"):
        raise ValueError("spec.trialTemplate.trialSpec: apiVersion and kind required")


@dataclass
class KatibRun:
    """Following one Experiment: `custom` is a kubernetes CustomObjectsApi."""

    custom: object
    namespace: str
    name: str
    log: Callable[[str], None] = print
    poll_seconds: float = 5.0
    trial_name: str = ""

    def _call(self, verb: str, *args, **kw):
        method = getattr(self.custom, f"{verb}_namespaced_custom_object")
        return method(GROUP, VERSION, self.namespace, *args, **kw)

    def start(self, exp: dict, first_trial: dict | None = None) -> None:
        """Create the Experiment, its `first_trial` (the defaults', `defaults_trial`) before
        it so that Katib's controller counts it from its first look; or re-attach to the
        Experiment of its name (a retried step)."""
        from kubernetes.client.rest import ApiException

        try:
            self._call("get", EXPERIMENTS, self.name)
            self.log(f"sweep: re-attached to Katib Experiment {self.namespace}/{self.name}")
            return
        except ApiException as err:
            if err.status != 404:
                raise
        if first_trial is not None:
            self.trial_name = first_trial["metadata"]["name"]
            run_spec = first_trial["spec"]["runSpec"]
            run_spec["metadata"] = {**run_spec["metadata"], "namespace": self.namespace}
            metadata = {**first_trial["metadata"], "namespace": self.namespace}
            try:
                self._call("create", TRIALS, {**first_trial, "metadata": metadata})
            except ApiException as err:
                if err.status != 409:  # made by an attempt that died before its Experiment
                    raise
            self.log(f"sweep: created the defaults' Trial {self.namespace}/{self.trial_name}")
        metadata = {**exp["metadata"], "namespace": self.namespace}
        self._call("create", EXPERIMENTS, {**exp, "metadata": metadata})
        self.log(f"sweep: created Katib Experiment {self.namespace}/{self.name}")

    def delete(self) -> None:
        """Delete the Experiment (the trials it made and their jobs go with it) and the
        defaults' Trial kubejax made (its job with it)."""
        with contextlib.suppress(Exception):
            self._call("delete", EXPERIMENTS, self.name)
        with contextlib.suppress(Exception):
            self._call("delete", TRIALS, defaults_trial_name(self.name))

    def wait(self) -> dict:
        """Read the Experiment until it has succeeded (returned); SweepError in one line when
        it failed."""
        shown = ""
        while True:
            exp = self._call("get", EXPERIMENTS, self.name)
            status = exp.get("status") or {}
            counts = ", ".join(
                f"{status[k]} {k.removeprefix('trials').lower() or 'created'}"
                for k in ("trials", "trialsRunning", "trialsSucceeded", "trialsFailed",
                          "trialsEarlyStopped")
                if status.get(k)
            )  # fmt: skip
            if counts and counts != shown:
                self.log(f"sweep: Katib Experiment {self.name}: trials {counts}")
                shown = counts
            done = {c.get("type"): c for c in status.get("conditions") or []
                    if str(c.get("status")) == "True"}  # fmt: skip
            if "Failed" in done:
                c = done["Failed"]
                raise SweepError(
                    f"tuner: Katib Experiment {self.name} failed: {c.get('reason', 'Failed')}: "
                    f"{c.get('message', '')}"
                )
            if "Succeeded" in done:
                return exp
            time.sleep(self.poll_seconds)

    def trials(self) -> list[dict]:
        """The Experiment's Trials, oldest first."""
        items = self._call("list", TRIALS, label_selector=f"{EXPERIMENT_LABEL}={self.name}").get(
            "items", []
        )
        return sorted(items, key=lambda t: (t["metadata"].get("creationTimestamp", ""),
                                            t["metadata"]["name"]))  # fmt: skip


def defaults_trial_name(experiment_name: str) -> str:
    """The name of the Experiment's Trial of the defaults (its job's and output folder's)."""
    return f"{experiment_name}-defaults"


def defaults_trial(exp: dict, point: dict) -> dict:
    """The Experiment's Trial of the defaults `point` (searched setting → value), built as
    Katib's experiment controller builds a Trial from a suggestion (`createTrialInstance`:
    the Experiment's labels and objective, the parameter assignments, the trial template with
    every trial parameter substituted as its manifest generator does, the run spec named
    after the Trial, the metrics collector, the primary pod and the conditions).

    Katib has no setting that makes a suggestion service start from a given point, so kubejax
    creates this Trial itself, before the Experiment: Katib's controller then counts it among
    the Experiment's trials (it lists Trials by the experiment label), towards maxTrialCount
    and parallelTrialCount, its suggestion services see its assignments and observation as
    any other trial's, and `currentOptimalTrial` weighs it. It has no owner (the Experiment
    does not exist yet): `KatibRun.delete` deletes it with the Experiment. No early-stopping
    rule is set on it: the defaults are the reference every other trial is judged against."""
    spec, name = exp["spec"], exp["metadata"]["name"]
    template = spec["trialTemplate"]
    trial = defaults_trial_name(name)
    values = {p["name"]: _text(point[p["name"]]) for p in spec["parameters"]}
    text = json.dumps(template["trialSpec"])
    for param in template["trialParameters"]:
        ref = param["reference"]
        value = trial if ref == "${trialSpec.Name}" else values[ref]
        text = text.replace(placeholder(param["name"]), value)
    run_spec = json.loads(text)
    run_spec["metadata"] = {**run_spec.get("metadata", {}), "name": trial}
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "Trial",
        "metadata": {
            "name": trial,
            "labels": {**exp["metadata"].get("labels", {}), EXPERIMENT_LABEL: name},
        },
        "spec": {
            "objective": spec["objective"],
            "parameterAssignments": [{"name": k, "value": v} for k, v in values.items()],
            "runSpec": run_spec,
            "retainRun": template.get("retain", False),
            "metricsCollector": spec["metricsCollectorSpec"],
            "primaryPodLabels": template["primaryPodLabels"],
            "primaryContainerName": template["primaryContainerName"],
            "successCondition": template["successCondition"],
            "failureCondition": template["failureCondition"],
        },
    }


#: A Trial's last true condition → the sweep's trial state.
_STATES = {"Succeeded": "complete", "EarlyStopped": "pruned", "Failed": "failed",
           "MetricsUnavailable": "failed", "Killed": "failed"}  # fmt: skip


def trial_records(cfg, trials: list[dict], trials_root: str, workers: int) -> list[dict]:
    """Katib's Trials as the sweep's trial records (as the Optuna path's `_record`): state,
    value from its observation, params in the space's types, steps and evaluations from the
    trial's metrics.json."""
    out = []
    defaults = defaults_trial_name(cfg.study_name)
    for number, t in enumerate(trials):
        status = t.get("status") or {}
        true = [c["type"] for c in status.get("conditions") or [] if str(c.get("status")) == "True"]
        state = next((_STATES[c] for c in reversed(true) if c in _STATES), None)
        if state is None:
            continue  # still running when the Experiment ended (it is deleted with it)
        metrics = {m["name"]: m for m in (status.get("observation") or {}).get("metrics", [])}
        observed = metrics.get(cfg.objective, {}).get("latest")
        value = float(observed) if state == "complete" and observed not in (None, "") else None
        assigned = {a["name"]: a["value"] for a in t["spec"].get("parameterAssignments", [])}
        output = read_metrics(Path(trials_root) / t["metadata"]["name"])
        start, end = _epoch(status.get("startTime")), _epoch(status.get("completionTime"))
        seconds = None if start is None or end is None else end - start
        out.append({
            "number": number,
            "state": state,
            "value": value,
            "params": {k: value_of(cfg.space[k], v) for k, v in assigned.items() if k in cfg.space},
            "steps": int(output.get("step", 0)),
            "intermediate": {str(e["step"]): e[cfg.objective] for e in output.get("evals", [])
                             if cfg.objective in e},
            "job": t["metadata"]["name"],
            "workers": workers,
            "start": start,
            "end": end,
            "worker_seconds": None if seconds is None else round(workers * seconds, 2),
            "mlflow_run_id": output.get("mlflow_run_id", ""),
            **({"defaults": True} if t["metadata"]["name"] == defaults else {}),
        })  # fmt: skip
    return out


def _epoch(text: str | None) -> float | None:
    if not text:
        return None
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
