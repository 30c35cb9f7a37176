"""Upload the compiled pipeline to a KFP server and create a run of it (`kubejax submit`)."""

from __future__ import annotations

import time
from importlib.util import find_spec
from pathlib import Path

from kubejax.local_run import parse_params, pipeline_inputs
from kubejax.version import __version__


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
