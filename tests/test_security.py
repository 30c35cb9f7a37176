"""The code's unsafe-call audit, by AST: no shell with user strings, no unsafe deserialisation,
no remote code. (Secrets: test_pipeline_local's *secret* test; RBAC: test_image_and_rbac.)"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
SOURCES = sorted(
    p
    for folder in ("src", "components", "pipelines", "benchmarks")
    for p in (ROOT / folder).rglob("*.py")
)
#: Modules that deserialise arbitrary objects.
UNSAFE_MODULES = {"pickle", "cPickle", "dill", "marshal", "shelve", "cloudpickle", "joblib"}


def _name(node: ast.AST) -> str:
    """`a.b.c` for an attribute chain or name, '' otherwise."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _name(node.value)
        return f"{base}.{node.attr}" if base else ""
    return ""


def _keyword(call: ast.Call, name: str):
    return next((k.value for k in call.keywords if k.arg == name), None)


def findings(tree: ast.AST) -> list[str]:
    """The unsafe calls and imports in one module."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            found += [f"import {n}" for n in names if n.split(".")[0] in UNSAFE_MODULES]
        if not isinstance(node, ast.Call):
            continue
        fn = _name(node.func)
        shell = _keyword(node, "shell")
        if shell is not None and not (isinstance(shell, ast.Constant) and shell.value is False):
            found.append(f"{fn}(shell=...)")
        if fn in ("eval", "exec", "os.system", "os.popen", "subprocess.getoutput"):
            found.append(fn)
        if fn.endswith("yaml.load") or fn.endswith("yaml.unsafe_load") or fn == "yaml.full_load":
            loader = _name(_keyword(node, "Loader") or ast.Name("")) if node.keywords else ""
            if "Safe" not in loader:
                found.append(f"{fn} without SafeLoader")
        if fn == "torch.load":
            safe = _keyword(node, "weights_only")
            if not (isinstance(safe, ast.Constant) and safe.value is True):
                found.append("torch.load without weights_only=True")
        remote = _keyword(node, "trust_remote_code")
        if remote is not None and not (isinstance(remote, ast.Constant) and remote.value is False):
            found.append(f"{fn}(trust_remote_code=...)")
    return found


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("subprocess.run(cmd, shell=True)", ["subprocess.run(shell=...)"]),
        ("subprocess.Popen(cmd, shell=flag)", ["subprocess.Popen(shell=...)"]),
        ("import pickle", ["import pickle"]),
        ("from marshal import loads", ["import marshal"]),
        ("yaml.load(text)", ["yaml.load without SafeLoader"]),
        ("yaml.load(text, Loader=yaml.SafeLoader)", []),
        ("torch.load(path)", ["torch.load without weights_only=True"]),
        ("torch.load(path, weights_only=True)", []),
        ("A.load(p, trust_remote_code=True)", ["A.load(trust_remote_code=...)"]),
        ("eval(text)", ["eval"]),
        ("os.system(cmd)", ["os.system"]),
        ("subprocess.run(['ls'], shell=False)", []),
    ],
)  # fmt: skip
def test_the_audit_finds_each_unsafe_form(code, expected):
    assert findings(ast.parse(code)) == expected


def test_no_unsafe_call_in_the_code():
    assert len(SOURCES) > 40
    found = {
        str(p.relative_to(ROOT)): f
        for p in SOURCES
        if (f := findings(ast.parse(p.read_text(), filename=str(p))))
    }
    assert found == {}
