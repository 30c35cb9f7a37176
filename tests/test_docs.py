"""The docs' generated reference: every parameter and setting, none undocumented.

The strict Sphinx build itself runs in `make test` (`sphinx-build -W -n`); these check what the
generator puts in the reference pages and that it refuses an undocumented parameter.
"""

import dataclasses
import importlib.util
import inspect
from pathlib import Path

import pytest
from kubejax.pipelines.catalog import PIPELINES

from kubejax import components
from kubejax.data.prepare import PrepareConfig
from kubejax.trainer.config import TrainConfig
from kubejax.tune.controller import SweepConfig

DOCS = Path(__file__).resolve().parent.parent / "docs"


def _generator():
    spec = importlib.util.spec_from_file_location(
        "kubejax_reference", DOCS / "_ext" / "kubejax_reference.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_reference_lists_every_pipeline_and_component_parameter_and_every_setting(tmp_path):
    ref = _generator()
    for path in ref.write_pages(tmp_path):
        assert path.read_text().startswith("# ")
    pipelines = (tmp_path / "pipelines.md").read_text()
    for name, pipeline in PIPELINES.items():
        assert f"## `{name}`" in pipelines
        for param in inspect.signature(pipeline.pipeline_func).parameters:
            assert f"| `{param}` |" in pipelines, (name, param)
    page = (tmp_path / "components.md").read_text()
    for name in components.__all__:
        func = getattr(components, name).python_func
        for param in inspect.signature(func).parameters:
            if param != "task_config":
                assert f"| `{param}` |" in page, (name, param)
    settings = (tmp_path / "settings.md").read_text()
    for cls in (TrainConfig, PrepareConfig, SweepConfig):
        for field in dataclasses.fields(cls):
            assert f"| `{field.name}` |" in settings, (cls.__name__, field.name)
    cli = (tmp_path / "cli.md").read_text()
    for command in ("prepare", "render", "launch", "plan", "tune", "evaluate", "run", "submit"):
        assert f"## `kubejax {command}`" in cli


def test_the_reference_refuses_a_parameter_without_a_description():
    ref = _generator()

    def step(documented: int, undocumented: str = ""):
        """A step.

        Args:
            documented: Has its line.
        """

    with pytest.raises(ref.MissingDoc, match="component step: parameter undocumented"):
        ref.function_table(step, "component step")

    @dataclasses.dataclass
    class Config:
        bare: int = 0

    with pytest.raises(ref.MissingDoc, match=r"Config\.bare has no help"):
        ref.config_table(Config)


def test_every_guide_is_in_the_site_and_linked_from_the_readme():
    index = (DOCS / "index.md").read_text()
    readme = (DOCS.parent / "README.md").read_text()
    guides = [p.stem for p in DOCS.glob("*.md") if p.stem != "index"]
    assert guides
    for guide in guides:
        assert f"\n{guide}\n" in index, f"{guide}.md is not in the site's toctree"
        assert f"docs/{guide}.md" in readme, f"the README does not link docs/{guide}.md"
    assert len(readme.splitlines()) <= 250
