"""The docs' reference pages, generated from the code at every build.

Pipeline and component parameters come from their signatures and docstrings (the same text KFP
puts in the compiled YAML's descriptions), trainer, data and sweep settings from the typed
configs' fields (`kubejax.flags.setting`'s help), the commands from the `kubejax` parser. The
pages are written under `docs/reference/` (git-ignored) when Sphinx starts, so nothing here is
written twice and a parameter without a description fails the build.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import typing
from pathlib import Path

import docstring_parser

HERE = Path(__file__).resolve().parent.parent / "reference"
#: Parameters KFP fills in itself: not a user's to set.
INTERNAL = {"task_config"}


class MissingDoc(ValueError):
    """A parameter or setting with no description: the reference would be incomplete."""


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _default(value) -> str:
    if value is inspect.Parameter.empty:
        return "required"
    if isinstance(value, dict | list):
        value = json.dumps(value)
    elif isinstance(value, str) and value.startswith(("{", "[")):
        value = json.dumps(json.loads(value))
    return f"`{_cell(repr(value) if isinstance(value, str) else value)}`"


def _type(annotation) -> str:
    if annotation is inspect.Parameter.empty:
        return ""
    if typing.get_origin(annotation) is typing.Annotated:
        # kfp's Input[Model] / Output[Model]: Annotated[Model, InputAnnotation].
        artifact, marker = typing.get_args(annotation)[:2]
        side = "Output" if "Output" in getattr(marker, "__name__", str(marker)) else "Input"
        return f"`{side}[{artifact.__name__}]`"
    if typing.get_origin(annotation) is not None:
        return f"`{_cell(str(annotation).replace('typing.', ''))}`"
    return f"`{_cell(getattr(annotation, '__name__', str(annotation)))}`"


def function_table(func, what: str) -> str:
    """Parameter | Type | Default | Meaning, for a component's or pipeline's function."""
    docs = {p.arg_name: p.description for p in docstring_parser.parse(func.__doc__ or "").params}
    rows = ["| Parameter | Type | Default | Meaning |", "| --- | --- | --- | --- |"]
    for name, param in inspect.signature(func).parameters.items():
        if name in INTERNAL:
            continue
        if not docs.get(name):
            raise MissingDoc(f"{what}: parameter {name} has no description in its docstring")
        rows.append(
            f"| `{name}` | {_type(param.annotation)} | {_default(param.default)} "
            f"| {_cell(docs[name])} |"
        )
    return "\n".join(rows)


def _summary(func) -> str:
    doc = docstring_parser.parse(func.__doc__ or "")
    return "\n\n".join(t for t in (doc.short_description, doc.long_description) if t)


def _returns(func) -> str:
    doc = docstring_parser.parse(func.__doc__ or "")
    if not doc.returns or not doc.returns.description:
        raise MissingDoc(f"{func.__name__}: its docstring has no Returns section")
    return doc.returns.description


def pipelines_page() -> str:
    """Every compiled pipeline's parameters."""
    from kubejax.pipelines.catalog import PIPELINES

    parts = [
        "# Pipeline parameters",
        "",
        "Generated from the pipelines' signatures and docstrings (`pipelines/`). Each pipeline "
        "is compiled to `compiled/<name>.yaml`; `kubejax submit --pipeline NAME --param "
        "KEY=VALUE` or the KFP UI's run form sets these.",
    ]
    for name, pipeline in PIPELINES.items():
        func = pipeline.pipeline_func
        parts += [
            "",
            f"## `{name}`",
            "",
            pipeline.description or "",
            "",
            _summary(func),
            "",
            function_table(func, f"pipeline {name}"),
        ]
    return "\n".join(parts) + "\n"


def components_page() -> str:
    """Every component's inputs and outputs."""
    from kubejax import components

    parts = [
        "# Component parameters",
        "",
        "Generated from the components' signatures and docstrings (`components/`). Load them "
        "from `compiled/components/<name>.yaml` or import them from `kubejax.components` "
        "(see [Reuse the components](../components.md)). `Input[...]` and `Output[...]` are "
        "artifacts; the rest are parameters.",
    ]
    for name in components.__all__:
        component = getattr(components, name)
        func = component.python_func
        parts += [
            "",
            f"## `{component.name}` (`kubejax.components.{name}`)",
            "",
            _summary(func),
            "",
            function_table(func, f"component {name}"),
            "",
            f"**Returns**: {_cell(_returns(func))}",
        ]
    return "\n".join(parts) + "\n"


def config_table(cls) -> str:
    """Setting | Type | Default | Meaning, for a typed config's fields."""
    hints = typing.get_type_hints(cls)
    rows = ["| Setting | Type | Default | Meaning |", "| --- | --- | --- | --- |"]
    for f in dataclasses.fields(cls):
        text = f.metadata.get("help")
        if not text:
            raise MissingDoc(f"{cls.__name__}.{f.name} has no help")
        if f.default is not dataclasses.MISSING:
            default = _default(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = _default(f.default_factory())
        else:
            default = "required"
        tp = hints[f.name]
        rows.append(
            f"| `{f.name}` | `{_cell(getattr(tp, '__name__', str(tp)))}` | {default} "
            f"| {_cell(text)} |"
        )
    return "\n".join(rows)


def settings_page() -> str:
    """The trainer's, data preparation's and the sweep's settings."""
    from kubejax.data.prepare import PrepareConfig
    from kubejax.trainer.config import TrainConfig
    from kubejax.tune.controller import SweepConfig

    return "\n".join(
        [
            "# Settings",
            "",
            "Generated from the typed configs' fields. The trainer's are the keys of the "
            "`hyperparameters` dicts, of a search space and of `--flag value` after `--` "
            "(`python -m kubejax.trainer --help` prints them too; a flag is the setting with "
            "dashes: `learning_rate` is `--learning-rate`).",
            "",
            "## Trainer (`kubejax.trainer.config.TrainConfig`)",
            "",
            config_table(TrainConfig),
            "",
            "## Data preparation (`kubejax.data.prepare.PrepareConfig`)",
            "",
            "`kubejax prepare` and the `prepare-yelp` component.",
            "",
            config_table(PrepareConfig),
            "",
            "## Sweep (`kubejax.tune.controller.SweepConfig`)",
            "",
            "`kubejax tune` and the `tune-sweep` component.",
            "",
            config_table(SweepConfig),
            "",
        ]
    )


def cli_page() -> str:
    """`kubejax <command> --help` for every command."""
    from kubejax.cli import build_parser

    parser = build_parser()
    parts = [
        "# Commands",
        "",
        "Generated from the `kubejax` parser. Trainer settings go after `--` "
        "(see [Settings](settings.md)).",
        "",
        "```text",
        parser.format_help().rstrip(),
        "```",
    ]
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, command in sub.choices.items():
        command.formatter_class = lambda prog: argparse.HelpFormatter(prog, width=96)
        parts += ["", f"## `kubejax {name}`", "", "```text", command.format_help().rstrip(), "```"]
    return "\n".join(parts) + "\n"


PAGES = {
    "pipelines.md": pipelines_page,
    "components.md": components_page,
    "settings.md": settings_page,
    "cli.md": cli_page,
}


def write_pages(folder: Path = HERE) -> list[Path]:
    """Write every generated page (only where its text changed, so Sphinx rebuilds little)."""
    written = []
    for name, render in PAGES.items():
        path = folder / name
        text = render()
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
        written.append(path)
    return written


def setup(app):
    """The Sphinx extension: write the pages before Sphinx reads the sources."""
    app.connect("builder-inited", lambda app: write_pages())
    return {"parallel_read_safe": True, "parallel_write_safe": True}
