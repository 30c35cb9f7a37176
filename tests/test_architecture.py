"""The layers: components/pipelines → launchers → jobs / tune / trainer → models → tracking /
data.

A module may import from its own layer or a lower one, never from a higher one; the launchers
(which run in every KFP task) import no ML framework.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).parents[1] / "src" / "kubejax"

#: package → packages it must never import.
FORBIDDEN = {
    "trainer": ("kubejax.launchers", "kubejax.tune", "kubejax.jobs", "kubejax.components"),
    "tune": ("kubejax.launchers", "kubejax.trainer", "kubejax.components", "kubejax.pipelines"),
    "jobs": ("kubejax.launchers", "kubejax.tune", "kubejax.trainer", "kubejax.components"),
    "models": ("kubejax.launchers", "kubejax.tune", "kubejax.trainer", "kubejax.jobs"),
    "data": ("kubejax.launchers", "kubejax.tune", "kubejax.trainer", "kubejax.jobs"),
    "launchers": ("kubejax.components", "kubejax.pipelines", "kubejax.local_run"),
}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_import_from_a_higher_layer(package):
    for path in (SRC / package).rglob("*.py"):
        for name in _imports(path):
            bad = [f for f in FORBIDDEN[package] if name == f or name.startswith(f + ".")]
            assert not bad, f"{path.relative_to(SRC)} imports {name}"


def test_the_launchers_import_no_ml_framework():
    code = (
        "import sys, kubejax.launchers.train, kubejax.launchers.sweep, kubejax.tune; "
        "print(sorted(m for m in ('jax', 'flax', 'optax', 'orbax', 'transformers', 'torch') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
