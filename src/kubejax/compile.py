"""Compile the pipelines and every component to YAML (the `compiled/` folder)."""

from __future__ import annotations

from pathlib import Path

from kfp import compiler


def compile_all(output_dir: str | Path = "compiled") -> list[Path]:
    """Write `<name>.yaml` per pipeline and `components/<name>.yaml` per component."""
    from kubejax import components
    from kubejax.pipelines.yelp import PIPELINES

    out = Path(output_dir)
    (out / "components").mkdir(parents=True, exist_ok=True)
    written = []
    for name, pipeline in PIPELINES.items():
        path = out / f"{name}.yaml"
        compiler.Compiler().compile(pipeline, str(path))
        written.append(path)
    for name in components.__all__:
        path = out / "components" / f"{name.replace('_', '-')}.yaml"
        compiler.Compiler().compile(getattr(components, name), str(path))
        written.append(path)
    return written
