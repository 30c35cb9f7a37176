"""The search space: its JSON form, validation, and what Optuna makes of it."""

from __future__ import annotations

import itertools
import json
from typing import Any

import optuna

from kubejax.errors import KubejaxError

ALGORITHMS = ("grid", "random", "tpe", "cmaes")
PRUNERS = ("none", "median", "successive_halving", "hyperband")
PARAM_TYPES = ("float", "int", "categorical")


class SweepError(KubejaxError, RuntimeError):
    """The sweep cannot go on (bad space, too many failed trials)."""


#: Search dimensions that are not trainer settings: the trial job's worker count.
RESOURCE_PARAMS = ("replicas", "devices_per_worker")
_KEYS = {
    "float": {"type", "low", "high", "log", "step", "when"},
    "int": {"type", "low", "high", "log", "step", "when"},
    "categorical": {"type", "choices", "when"},
}


def parse_space(space: str | dict) -> dict[str, dict]:
    """Validate a search space (JSON text or dict); errors name the bad entry.

    Entries: {"type": "float", "low", "high", "log"?, "step"?}, {"type": "int", "low", "high",
    "step"?, "log"?}, {"type": "categorical", "choices": [...]}. Any entry may carry
    "when": {earlier entry: value or [values]}: the dimension exists only in trials where that
    holds (Optuna's define-by-run), e.g. Lion's b1 only when optimizer is lion. `replicas`
    (workers per trial: positive integers) sits beside the trainer settings.
    """
    if isinstance(space, str):
        try:
            space = json.loads(space)
        except json.JSONDecodeError as err:
            raise SweepError(f"search_space: not valid JSON ({err})") from err
    if not isinstance(space, dict) or not space:
        raise SweepError("search_space: must be a non-empty JSON object of name → entry")
    out: dict[str, dict] = {}
    for name, entry in space.items():
        out[name] = _parse_entry(f"search_space.{name}", entry, out)
    for name, least, meaning in (("replicas", 1, "workers per trial"),
                                 ("devices_per_worker", 0, "GPUs per worker")):  # fmt: skip
        if name in out:
            _check_count(name, out[name], least, meaning)
    return out


def _parse_entry(where: str, entry, earlier: dict[str, dict]) -> dict:
    if not isinstance(entry, dict):
        raise SweepError(f"{where}: must be an object with a 'type'")
    kind = entry.get("type")
    if kind not in PARAM_TYPES:
        raise SweepError(f"{where}.type: {kind!r} is not one of {', '.join(PARAM_TYPES)}")
    unknown = set(entry) - _KEYS[kind]
    if unknown:
        raise SweepError(f"{where}: unknown keys {sorted(unknown)}; allowed {sorted(_KEYS[kind])}")
    if "when" in entry:
        _check_when(where, entry["when"], earlier)
    if kind == "categorical":
        choices = entry.get("choices")
        if not isinstance(choices, list) or not choices:
            raise SweepError(f"{where}.choices: must be a non-empty list")
        return entry
    for key in ("low", "high"):
        v = entry.get(key)
        if (
            not isinstance(v, int | float)
            or isinstance(v, bool)
            or (kind == "int" and not float(v).is_integer())
        ):
            raise SweepError(
                f"{where}.{key}: must be a{'n integer' if kind == 'int' else ' number'}"
            )
    if entry["low"] >= entry["high"]:
        raise SweepError(f"{where}: low ({entry['low']}) must be below high ({entry['high']})")
    if entry.get("log") and entry["low"] <= 0:
        raise SweepError(f"{where}.low: must be positive with log scale")
    if entry.get("log") and entry.get("step") is not None and kind == "float":
        raise SweepError(f"{where}: step and log cannot be combined")
    step = entry.get("step")
    if step is not None and (not isinstance(step, int | float) or step <= 0):
        raise SweepError(f"{where}.step: must be positive")
    num = float if kind == "float" else int
    return {**entry, "low": num(entry["low"]), "high": num(entry["high"])}


def _check_when(where: str, when, earlier: dict[str, dict]) -> None:
    if not isinstance(when, dict) or not when:
        raise SweepError(f"{where}.when: must be an object of earlier entry → value(s)")
    for name, values in when.items():
        if name not in earlier:
            raise SweepError(
                f"{where}.when: {name!r} is not an entry above this one "
                f"(known: {', '.join(earlier) or 'none'})"
            )
        choices = earlier[name].get("choices")
        for value in values if isinstance(values, list) else [values]:
            if choices is not None and value not in choices:
                raise SweepError(f"{where}.when.{name}: {value!r} is not one of {choices}")


def _check_count(name: str, entry: dict, least: int, meaning: str) -> None:
    values = entry.get("choices") or [entry.get("low")]
    if entry["type"] == "float" or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= least for v in values
    ):
        raise SweepError(
            f"search_space.{name}: {meaning} must be integers of at least {least} "
            "(an int range or integer choices)"
        )


def max_replicas(space: dict[str, dict]) -> int | None:
    """The largest worker count the space can give a trial (None: not searched)."""
    entry = space.get("replicas")
    if entry is None:
        return None
    return max(entry["choices"]) if entry["type"] == "categorical" else entry["high"]


def applies(entry: dict, params: dict) -> bool:
    """Whether a dimension exists for a trial with these earlier `params` (its `when`)."""
    return all(
        params.get(name) in (values if isinstance(values, list) else [values])
        for name, values in entry.get("when", {}).items()
    )


def suggest(trial: optuna.Trial, space: dict[str, dict]) -> dict[str, Any]:
    """Parameter values for one trial, define-by-run: a dimension whose `when` does not hold
    for the values chosen above it is not suggested at all."""
    params: dict[str, Any] = {}
    for name, e in space.items():
        if not applies(e, params):
            continue
        if e["type"] == "float":
            params[name] = trial.suggest_float(
                name, e["low"], e["high"], log=bool(e.get("log")), step=e.get("step")
            )
        elif e["type"] == "int":
            params[name] = trial.suggest_int(
                name, e["low"], e["high"], step=e.get("step") or 1, log=bool(e.get("log"))
            )
        else:
            params[name] = trial.suggest_categorical(name, e["choices"])
    return params


def _grid_axes(space: dict[str, dict]) -> dict[str, list]:
    grid = {}
    for name, e in space.items():
        if "when" in e:
            raise SweepError(
                f"search_space.{name}.when: grid search runs every combination; conditional "
                "dimensions need random or tpe"
            )
        if e["type"] == "categorical":
            grid[name] = list(e["choices"])
        elif e.get("step") is not None:
            n = round((e["high"] - e["low"]) / e["step"]) + 1
            grid[name] = [e["low"] + i * e["step"] for i in range(n)]
        elif e["type"] == "int" and not e.get("log"):
            grid[name] = list(range(e["low"], e["high"] + 1))
        else:
            raise SweepError(
                f"search_space.{name}: grid search needs 'choices' or a 'step' for {e['type']}"
            )
    return grid


def grid(space: dict[str, dict]) -> list[dict]:
    """Every point of a grid search, in order."""
    axes = _grid_axes(space)
    return [dict(zip(axes, combo, strict=True)) for combo in itertools.product(*axes.values())]


def make_sampler(algorithm: str, space: dict[str, dict], seed: int) -> optuna.samplers.BaseSampler:
    """The Optuna sampler for an algorithm name."""
    if algorithm == "grid":
        # Grid points are enqueued by `tune` (GridSampler stops the study from inside, which
        # the ask/tell loop does not allow); the sampler only validates the grid here.
        _grid_axes(space)
        return optuna.samplers.RandomSampler(seed=seed)
    if algorithm == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if algorithm == "tpe":
        return optuna.samplers.TPESampler(seed=seed)
    if algorithm == "cmaes":
        cat = [n for n, e in space.items() if e["type"] == "categorical"]
        if cat:
            raise SweepError(f"algorithm: cmaes cannot search categorical parameters {cat}")
        return optuna.samplers.CmaEsSampler(seed=seed)
    raise SweepError(f"algorithm: {algorithm!r} is not one of {', '.join(ALGORITHMS)}")


def make_pruner(name: str, *, min_steps: int = 1, max_steps: int = 0) -> optuna.pruners.BasePruner:
    """The Optuna pruner for a pruner name; steps are the trainer's eval steps."""
    if name == "none":
        return optuna.pruners.NopPruner()
    if name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=min_steps)
    if name == "successive_halving":
        return optuna.pruners.SuccessiveHalvingPruner(
            min_resource=max(min_steps, 1), reduction_factor=3
        )
    if name == "hyperband":
        return optuna.pruners.HyperbandPruner(
            min_resource=max(min_steps, 1), max_resource=max_steps or "auto", reduction_factor=3
        )
    raise SweepError(f"pruner: {name!r} is not one of {', '.join(PRUNERS)}")


def distributions(space: dict[str, dict]) -> dict:
    d = {}
    for name, e in space.items():
        if e["type"] == "float":
            d[name] = optuna.distributions.FloatDistribution(
                e["low"], e["high"], log=bool(e.get("log")), step=e.get("step")
            )
        elif e["type"] == "int":
            d[name] = optuna.distributions.IntDistribution(
                e["low"], e["high"], log=bool(e.get("log")), step=e.get("step") or 1
            )
        else:
            d[name] = optuna.distributions.CategoricalDistribution(e["choices"])
    return d


def lowest_point(space: dict[str, dict]) -> dict:
    """A point of the search space (every dimension at its first value, conditional ones where
    they apply), to type-check the names and values a trial will pass to the trainer."""
    point: dict = {}
    for name, e in space.items():
        if applies(e, point):
            point[name] = e["choices"][0] if e["type"] == "categorical" else e["low"]
    return point


_NONE = object()


def _matching_choice(choices: list, value):
    """The choice equal to `value` (a rank of 32.0 is the choice 32; True is not 1), or
    `_NONE`."""
    for choice in choices:
        if isinstance(choice, bool) or isinstance(value, bool):
            if choice is value:
                return choice
        elif choice == value:
            return choice
    return _NONE


def _numeric(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def default_point(space: dict[str, dict], settings: dict) -> tuple[dict, dict[str, dict], list]:
    """The point of the search space where the run's defaults lie: each dimension's value in
    `settings` (the settings the run takes without a sweep), a conditional one only where its
    `when` holds there. Returns that point, the space widened to hold it (a categorical's
    choices gain the value, a range reaches it), and one note a widening. KeyError names a
    dimension `settings` lacks."""
    point: dict = {}
    widened: dict[str, dict] = {}
    notes = []
    for name, entry in space.items():
        if not applies(entry, point):
            widened[name] = entry
            continue
        if name not in settings:
            raise KeyError(name)
        value = settings[name]
        if entry["type"] == "categorical":
            match = _matching_choice(entry["choices"], value)
            if match is _NONE:
                entry = {**entry, "choices": [*entry["choices"], value]}
                notes.append(f"{name}: the default {value!r} joins the choices {entry['choices']}")
                match = value
            point[name] = match
        elif isinstance(value, str) and not _numeric(value):
            # A setting the run leaves to itself (grad_accum_steps `auto`): no point of the
            # range is its own, the range's first stands for it.
            notes.append(f"{name}: the default {value!r} is no number; the low {entry['low']} "
                         "stands for it")  # fmt: skip
            point[name] = entry["low"]
        else:
            value = float(value) if entry["type"] == "float" else int(value)
            if value < entry["low"] or value > entry["high"]:
                if entry.get("log") and value <= 0:
                    raise SweepError(
                        f"search_space.{name}: the run's default {value} lies outside this "
                        "log-scale range and cannot join it; set a positive default"
                    )
                low, high = min(entry["low"], value), max(entry["high"], value)
                notes.append(
                    f"{name}: the range [{entry['low']}, {entry['high']}] widened to "
                    f"[{low}, {high}] to hold the default {value}"
                )
                entry = {**entry, "low": low, "high": high}
            point[name] = value
        widened[name] = entry
    return point, widened, notes
