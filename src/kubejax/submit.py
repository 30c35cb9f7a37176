"""Upload the compiled pipeline to a KFP server and create a run of it (`kubejax submit`).

The run's accelerator settings are checked first, as the launchers will check them in the run
(`kubejax.launchers.common.place_workers`): a TPU type GKE lacks, a topology it does not offer,
GPU counts or worker counts that contradict the slice are refused before anything is uploaded.
"""

from __future__ import annotations

import time
from importlib.util import find_spec
from pathlib import Path

from kubejax.launchers.common import GPU, place_workers
from kubejax.local_run import parse_params, pipeline_inputs
from kubejax.version import __version__

#: The pipelines' worker settings: the final training's, and (prefix `trial_`) the sweep's.
_WORKER_SETS = ("", "trial_")


def check_accelerator(pipeline, arguments: dict) -> None:
    """A run's accelerator settings (the arguments over the pipeline's defaults) against the
    TPU table, for the final training and the sweep's trials; TPUError names the pipeline
    parameter."""
    inputs = pipeline.component_spec.inputs or {}
    if "accelerator" not in inputs:
        return

    def value(name: str):
        return arguments[name] if name in arguments else inputs[name].default

    for prefix in _WORKER_SETS:
        if f"{prefix}replicas" not in inputs:
            continue
        names = {k: f"{prefix}{k}" for k in ("replicas", "gpus_per_worker", "tpu_topology")}
        gpus = int(value(f"{prefix}gpus_per_worker") or 0)
        place_workers(
            {"resources": {"limits": {GPU: gpus}}},
            replicas=int(value(f"{prefix}replicas")),
            accelerator=value("accelerator"),
            tpu_topology=value(f"{prefix}tpu_topology"),
            names=names,
        )


def compiled_pipeline(pipeline: str) -> Path:
    """The compiled YAML of a pipeline, from the installed package (`kubejax.compiled`); found
    without importing it, so no bytecode is written beside the YAMLs."""
    spec = find_spec("kubejax.compiled")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("--package: kubejax.compiled is not installed; pass a compiled YAML")
    return Path(next(iter(spec.submodule_search_locations))) / f"{pipeline}.yaml"


def _package(pipeline: str, package: str | None) -> Path:
    if package:
        if not Path(package).is_file():
            raise ValueError(f"--package: {package} does not exist")
        return Path(package)
    return compiled_pipeline(pipeline)


def submit(
    host: str,
    pipeline: str,
    params: list[str],
    *,
    namespace: str | None = None,
    experiment: str = "kubejax",
    package: str | None = None,
    run_name: str | None = None,
) -> str:
    """Upload `pipeline` (a new version when it exists), create a run; return the run's URL.

    The token comes from the kfp client's usual sources (KF_PIPELINES_SA_TOKEN_PATH, the
    in-cluster service-account token, or the kubeconfig's credentials).
    """
    import kfp

    from kubejax.pipelines.catalog import PIPELINES

    if pipeline not in PIPELINES:
        raise ValueError(f"--pipeline: {pipeline!r} is not one of {', '.join(PIPELINES)}")
    path = _package(pipeline, package)
    arguments = parse_params(params, pipeline_inputs(PIPELINES[pipeline]))
    check_accelerator(PIPELINES[pipeline], arguments)
    client = kfp.Client(host=host, namespace=namespace)
    exp = client.create_experiment(experiment, namespace=namespace)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    pipeline_id = client.get_pipeline_id(pipeline)
    if pipeline_id is None:
        uploaded = client.upload_pipeline(str(path), pipeline_name=pipeline, namespace=namespace)
        pipeline_id = uploaded.pipeline_id
        version_id = client.list_pipeline_versions(pipeline_id).pipeline_versions[0]
        version_id = version_id.pipeline_version_id
    else:
        version = client.upload_pipeline_version(
            str(path),
            pipeline_version_name=f"{pipeline}-{__version__}-{stamp}",
            pipeline_id=pipeline_id,
        )
        version_id = version.pipeline_version_id
    run = client.run_pipeline(
        experiment_id=exp.experiment_id,
        job_name=run_name or f"{pipeline}-{stamp}",
        pipeline_id=pipeline_id,
        version_id=version_id,
        params=arguments,
    )
    return f"{host.rstrip('/')}/#/runs/details/{run.run_id}"
