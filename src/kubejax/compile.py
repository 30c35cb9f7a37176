"""Compile the pipelines and every component to YAML (the `compiled/` folder)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from kfp import compiler

#: compiled/ is also the package `kubejax.compiled` (its YAMLs ship as package data).
_PACKAGE_INIT = (
    '"""The compiled pipelines and components (`kubejax compile`), shipped as package data."""\n'
)
_DICT_DEFAULT = re.compile(r"^(#\s+\w+: dict \[Default: )(\{.*\})(\])$")


def _stable_header(path: Path) -> None:
    """Sort the keys of dict defaults in kfp's header comment.

    kfp prints those defaults from a protobuf Struct, whose map order changes from one process
    to the next; sorting makes a compile reproducible, so `compiled/` can be checked against a
    fresh one.
    """
    lines = path.read_text().splitlines(keepends=True)
    for i, line in enumerate(lines):
        if not line.startswith("#"):
            break
        m = _DICT_DEFAULT.match(line.rstrip("\n"))
        if m:
            value = ast.literal_eval(m.group(2))
            lines[i] = f"{m.group(1)}{dict(sorted(value.items()))}{m.group(3)}\n"
    path.write_text("".join(lines))


def compile_all(output_dir: str | Path = "compiled") -> list[Path]:
    """Write `<name>.yaml` per pipeline and `components/<name>.yaml` per component."""
    from kubejax import components
    from kubejax.pipelines.catalog import PIPELINES

    out = Path(output_dir)
    (out / "components").mkdir(parents=True, exist_ok=True)
    (out / "__init__.py").write_text(_PACKAGE_INIT)
    written = []
    for name, pipeline in PIPELINES.items():
        path = out / f"{name}.yaml"
        compiler.Compiler().compile(pipeline, str(path))
        written.append(path)
    for name in components.__all__:
        path = out / "components" / f"{name.replace('_', '-')}.yaml"
        compiler.Compiler().compile(getattr(components, name), str(path))
        written.append(path)
    for path in written:
        _stable_header(path)
    return written
