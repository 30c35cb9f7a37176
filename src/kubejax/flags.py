"""One way between a typed config dataclass and command-line flags, both directions.

TrainConfig, PrepareConfig and SweepConfig describe each field once (type, default and a
`help` entry in the field's metadata); the trainer's parser, the `kubejax` sub-commands and the
launchers' trainer arguments are all derived from that.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from collections.abc import Collection, Mapping
from typing import Any

from kubejax.errors import KubejaxError


class FlagError(KubejaxError, ValueError):
    """A value that does not fit its setting; the message names the setting."""


#: Kubeflow Trainer's OptimizationJob gives each trial TrainJob its assignment of parameter
#: `<name>` as the env var KUBEFLOW_TRAINER_OPT_<NAME> (the name upper-cased, '-' as '_'; the
#: open controller pull requests kubeflow/trainer d9989e8 and c453a13, KEP-3562 §8.2): here,
#: below the trainer and the sweep engines, which both read it.
OPTIMIZATION_ENV_PREFIX = "KUBEFLOW_TRAINER_OPT_"


def setting(default: Any, help: str, **metadata) -> Any:
    """A dataclass field with its help text (a mutable default becomes a factory)."""
    if isinstance(default, dict | list):
        return dataclasses.field(
            default_factory=lambda: type(default)(default), metadata={"help": help, **metadata}
        )
    return dataclasses.field(default=default, metadata={"help": help, **metadata})


def base_type(tp):
    """`int | None` → int: the type a flag's text is converted with."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return next(a for a in typing.get_args(tp) if a is not type(None))
    return typing.get_origin(tp) or tp


def int_or_text(text: str) -> int | str:
    """The value of an `int | str` setting (a count, or a word such as `auto`): an int where
    the text is one; the config's validation judges the rest."""
    try:
        return int(text)
    except ValueError:
        return text


def _is_int_or_text(tp) -> bool:
    return set(typing.get_args(tp)) - {type(None)} == {int, str}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    skip: Collection[str] = (),
    defaults: Mapping[str, Any] | None = None,
) -> None:
    """One --flag per field of the dataclass `cls`: its type, its default (or `defaults`
    overriding it), its help; booleans get --flag/--no-flag; fields without a default are
    required."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        missing = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        default = (defaults or {}).get(f.name, None if missing else _default(f))
        text = f.metadata.get("help", "").replace("%", "%%")  # argparse formats help with %
        if not missing:
            text += f" (default: {default!r})"
        tp = base_type(hints[f.name])
        if tp is bool:
            action = argparse.BooleanOptionalAction
            parser.add_argument(
                _flag(f.name), dest=f.name, action=action, default=default, help=text
            )
        else:
            kind = json.loads if tp in (dict, list) else tp
            if _is_int_or_text(hints[f.name]):
                kind = int_or_text
            parser.add_argument(
                _flag(f.name), dest=f.name, type=kind, default=default, required=missing, help=text
            )


def _default(f: dataclasses.Field) -> Any:
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def from_namespace(cls: type, namespace: argparse.Namespace, **overrides):
    """An instance of `cls` from the parsed flags that name its fields."""
    names = {f.name for f in dataclasses.fields(cls)}
    values = {k: v for k, v in vars(namespace).items() if k in names}
    return cls(**{**values, **overrides})


def to_flags(
    cls: type,
    values: Mapping[str, Any],
    *,
    where: str = "hyperparameters",
    reserved: Collection[str] = (),
) -> list[str]:
    """Flags for a mapping of `cls` field → value; unknown names are errors naming `where`.

    KFP passes dict parameters as protobuf Structs, whose numbers are all doubles: integral
    values of int settings are turned back into ints. None leaves a setting at its default.
    """
    hints = typing.get_type_hints(cls)
    args = []
    for key, value in values.items():
        if key not in hints:
            known = ", ".join(sorted(set(hints) - set(reserved)))
            raise FlagError(f"{where}: {key!r} is not a setting; known: {known}")
        if value is None:
            continue
        if base_type(hints[key]) is bool:
            if not isinstance(value, bool):
                raise FlagError(f"{where}: {key} must be true or false, got {value!r}")
            args.append(_flag(key) if value else "--no-" + key.replace("_", "-"))
            continue
        if base_type(hints[key]) is int and isinstance(value, float):
            if not value.is_integer():
                raise FlagError(f"{where}: {key} must be an integer, got {value}")
            value = int(value)
        if isinstance(value, dict | list):
            value = json.dumps(value)
        args += [_flag(key), str(value)]
    return args
