"""Create a run of a compiled pipeline on a KFP server (`kubejax submit`)."""

from __future__ import annotations

from pathlib import Path

from kubejax.local_run import parse_params

COMPILED = Path(__file__).resolve().parents[2] / "compiled"


def _package(pipeline: str, package: str | None) -> Path:
    if package:
        if not Path(package).is_file():
            raise ValueError(f"--package: {package} does not exist")
        return Path(package)
    path = COMPILED / f"{pipeline}.yaml"
    if path.is_file():
        return path
    # Installed without the repository's compiled/: compile now.
    import tempfile

    from kubejax.compile import compile_all

    return compile_all(tempfile.mkdtemp(prefix="kubejax-compiled-"))[0].parent / path.name


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
    """Upload-free run creation from the compiled YAML; returns the run's URL.

    The token comes from the kfp client's usual sources (KF_PIPELINES_SA_TOKEN_PATH, the
    in-cluster service-account token, or the kubeconfig's credentials).
    """
    import kfp
    import yaml

    from kubejax.local_run import pipeline_inputs
    from kubejax.pipelines.yelp import PIPELINES

    if pipeline not in PIPELINES:
        raise ValueError(f"--pipeline: {pipeline!r} is not one of {', '.join(PIPELINES)}")
    path = _package(pipeline, package)
    name = yaml.safe_load(path.read_text())["pipelineInfo"]["name"]
    arguments = parse_params(params, pipeline_inputs(PIPELINES[pipeline]))
    client = kfp.Client(host=host, namespace=namespace)
    run = client.create_run_from_pipeline_package(
        str(path),
        arguments=arguments,
        run_name=run_name or f"{name}-run",
        experiment_name=experiment,
        namespace=namespace,
    )
    return f"{host.rstrip('/')}/#/runs/details/{run.run_id}"
