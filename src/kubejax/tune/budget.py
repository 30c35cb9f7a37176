"""What a local run of the LLM pipeline will cost, stated before it starts, and the sweep sized
to a share of it.

Each step's seconds are its work in FLOPs over this machine's speed, plus the fixed costs of
starting processes and compiling. The FLOPs are the standard count the plan and the
benchmarks use (`benchmarks/common.py`): per training token 6·N for a whole model, 4·N with
LoRA (the frozen weights get no gradient of their own), plus 12·L·H·T for attention; per
evaluated token 2·N + 4·L·H·T (N: the non-embedding weights, L layers, H the width, T the
sequence; a causal-lm's head reads only the answer's positions). The speed is a float32 or
bfloat16 n×n matmul measured now, as `benchmarks/common.py`'s `matmul_peak_gflops` measures
it, times the share of it kubejax's trainer reaches (`EFFICIENCY`, measured); the fixed costs
(`TASK_START_S` ...) were measured on a 2-core Xeon.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from kubejax.models.shape import ModelShape
from kubejax.tune.space import SweepError

#: The trainer's share of the measured matmul speed, by compute dtype: LoRA (rank 8, attention)
#: on Qwen2-shaped decoders, 16 rows of 64 tokens a step, one process on the 2 cores of a Xeon
#: (AMX), JAX 0.10: a 132M-weight decoder's step against float32 (364 GFLOP/s n=1024 matmul
#: here) 0.59; in bfloat16 (1,887 GFLOP/s) 0.11 (its step was no faster than float32's). A
#: 22.5M-weight one reached 0.14 of bfloat16's: smaller models' budgets come out high (29 %
#: there), the safe side of a limit. docs/tune.md has the runs.
EFFICIENCY = {"float32": 0.59, "bfloat16": 0.11}
#: The fixed costs, measured on the 2-core Xeon with `kubejax run --local --profile llm` (the
#: embedded decoder, whose FLOPs take next to nothing: its steps' seconds are these).
#: Seconds a kfp.local task takes beyond its work: a Python process importing kfp, kubejax and
#: the component, reading its inputs and writing its outputs.
TASK_START_S = 1.8
#: A training job's start before its first step and its end after the last (the worker
#: process, JAX, the prepared data and the model read; metrics, MLflow). Jobs running side by
#: side start side by side.
JOB_START_S = 3.0
#: Compiling a job's train and eval programs: from JAX's persistent cache (these programs ran
#: here before), or afresh. XLA compiles on every core: two jobs compiling at once took twice
#: as long (10 s each, 5 s alone).
COMPILE_S = {"warm": 1.5, "cold": 5.0}
#: A training step's fixed cost beyond its FLOPs (dispatch, the input pipeline, the optimizer's
#: update, the log line): the embedded 0.6M-weight decoder's steps took 60 ms alone, 120 ms
#: with a second job beside it (one process already runs on every core).
STEP_S = 0.045
#: An evaluation's fixed cost a batch (the scoring batches' host work).
EVAL_BATCH_S = 0.05
#: The sweep step's own work beside its trials: the checks and the memory plan, the study, the
#: MLflow parent run, the report's figures.
SWEEP_FIXED_S = 5.0
#: The final training's end: the merged model and its adapter exported, MLflow's figures.
TRAIN_FINISH_S = 3.0
#: The evaluation step's model load and compile beside its FLOPs, and its report.
EVALUATE_FIXED_S = 4.0
#: Rows a second the prepare step reads and tokenizes (a fast tokenizer, reviews of a few
#: hundred characters).
PREPARE_ROWS_PER_S = 20000.0
#: The smallest evaluation that tells two candidates 5 points apart (p ≈ 0.8: the difference's
#: standard error sqrt(2·p(1-p)/n) at most 2.5 points) — and the most the sweep scores.
EVAL_EXAMPLES_FOR = {"min": 128, "wanted": 512}
#: A trial shorter than this share of the final training ranks nothing the final training
#: would agree with: fewer trials before shorter ones.
MIN_TRIAL_SHARE = 0.25


@dataclass
class Machine:
    """This machine's speed for the run: the matmul measured now, and the other work on its
    cores (processes running beside this one, counted now, `busy_others`); once the real
    model's step has been timed here (`kubejax.launchers.probe`), its speed and its job's start and
    compile in place of the matmul's and the constants' (`measured`)."""

    dtype: str
    gflops: float
    others: float
    cores: int
    measured: StepTiming | None = None

    @property
    def efficiency(self) -> float:
        """The trainer's share of the matmul speed (`EFFICIENCY`)."""
        return EFFICIENCY.get(self.dtype, EFFICIENCY["float32"])

    def job_start_s(self) -> float:
        """A training job's start before its first step (`JOB_START_S`, or as timed)."""
        return JOB_START_S if self.measured is None else self.measured.job_start_s

    def compile_s(self, warm: bool) -> float:
        """A job's compile, afresh or from JAX's persistent cache (`COMPILE_S`, or as timed:
        the timed job compiled afresh; its programs are then in the cache for the others)."""
        if self.measured is None or warm:
            return COMPILE_S["warm" if warm else "cold"]
        return self.measured.compile_s

    @property
    def speed(self) -> float:
        """FLOP/s the trainer reaches now. The matmul, measured now, carries the present load
        into the FLOPs' seconds; the fixed costs are the idle machine's: other processes
        counted busy when a run started (`busy_others`: 2 and 3.7 of them on the 2-core Xeon)
        slowed the embedded decoder's run 1.2x and 1.05x, not the 2x and 2.9x their share of
        the cores would (how long they go on is not known at the start). Once the real
        model's step was timed: the FLOP/s of that step."""
        if self.measured is not None:
            return self.measured.flop_s
        return self.gflops * 1e9 * self.efficiency

    def describe(self) -> str:
        """Where the speed comes from, in one line."""
        busy = (
            f"; {self.others:.1f} other process(es) busy on its cores now: the run takes "
            "longer while they go on"
            if self.others >= 0.25
            else ""
        )
        if self.measured is not None:
            return f"{self.measured.describe()}{busy}"
        return (
            f"{self.dtype} matmul measured now {self.gflops:.0f} GFLOP/s on {self.cores} "
            f"core(s) × {self.efficiency} (kubejax's trainer, measured: docs/tune.md) = "
            f"{self.speed / 1e9:.0f} GFLOP/s{busy}"
        )


@dataclass
class StepTiming:
    """The real model's training step timed on this machine (`kubejax.launchers.probe`): `rows` ×
    `length` tokens a step in `step_s` (the median step after the first), the job's start
    before its first step, the first step's compile beyond a step, the probe's wall."""

    rows: int
    length: int
    step_s: float
    flop_s: float
    job_start_s: float
    compile_s: float
    wall_s: float

    def describe(self) -> str:
        """The timing in one line."""
        return (
            f"the real model's step timed now: {self.rows} × {self.length} tokens in "
            f"{self.step_s:.2f} s = {self.flop_s / 1e9:.0f} GFLOP/s; a job's start "
            f"{self.job_start_s:.0f} s, its compile {self.compile_s:.0f} s (probe "
            f"{self.wall_s:.0f} s)"
        )


def busy_others(samples: int = 20, every: float = 0.02) -> float:
    """Other processes keeping this machine's cores busy: the kernel's count of runnable tasks
    (/proc/loadavg's fourth field) less this one, averaged over `samples` looks, but no more
    than the last minute's load average (the first alone counts a moment's neighbour, the
    second alone a run that has just ended); 0 where /proc/loadavg cannot be read."""
    counts = []
    for _ in range(samples):
        try:
            fields = Path("/proc/loadavg").read_text().split()
            running, minute = int(fields[3].split("/")[0]), float(fields[0])
        except (OSError, IndexError, ValueError):
            return 0.0
        counts.append(max(0, running - 1))
        time.sleep(every)
    return min(sum(counts) / len(counts), minute)


def measure_machine(dtype: str = "float32", n: int = 1024, seconds: float = 0.5) -> Machine:
    """Time an n×n `dtype` matmul through XLA for about `seconds`
    (`kubejax.monitoring.matmul_gflops`), and count the other processes running now
    (`busy_others`)."""
    from kubejax.monitoring import matmul_gflops

    dtype = dtype if dtype in EFFICIENCY else "float32"
    others = busy_others()
    return Machine(dtype, matmul_gflops(dtype, n, seconds), others, os.cpu_count() or 1)


def _machine_key() -> str:
    try:
        model = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        model = "unknown"
    return f"{model} × {os.cpu_count()}"


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def compiled_before(signature: str, memory: Path) -> bool:
    """Whether a run of this signature (`run_signature`: its model, its settings and JAX's
    cache folder) finished on this machine before, as `memory` (a JSON file) remembers: its
    programs are then in JAX's persistent cache."""
    return signature in _read(memory).get(_machine_key(), [])


def remember_run(signature: str, memory: Path) -> None:
    """Note in `memory` that a run of `signature` finished here (its programs are cached);
    the 50 latest are kept. A folder that cannot be written only costs the next estimate its
    knowledge of the cache."""
    data = _read(memory)
    runs = data.setdefault(_machine_key(), [])
    if signature not in runs:
        runs.append(signature)
        del runs[:-50]
    try:
        memory.parent.mkdir(parents=True, exist_ok=True)
        tmp = memory.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, memory)
    except OSError:
        pass


def run_signature(*parts) -> str:
    """A short name of what a run compiles (the model, the settings of its jobs)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass
class Job:
    """One training job's work: steps of `batch` rows of `length` tokens, `evals` evaluations
    of `eval_examples` rows in batches of `eval_batch`."""

    steps: int
    batch: int
    length: int
    evals: int
    eval_examples: int
    eval_batch: int = 64
    peft: str = "lora"

    def flops(self, shape: ModelShape) -> float:
        """The job's FLOPs: its steps' and its evaluations'."""
        train = self.steps * self.batch * self.length * shape.train_flops(self.length, self.peft)
        evals = self.evals * self.eval_examples * self.length * shape.eval_flops(self.length)
        return train + evals

    def busy_seconds(self, compile_s: float) -> float:
        """The job's seconds of work beyond its FLOPs on an idle machine that take every core
        (a second job beside it waits as for its FLOPs): compiling (`compile_s`), the steps'
        and the evaluation batches' fixed costs."""
        batches = self.evals * math.ceil(self.eval_examples / self.eval_batch)
        return compile_s + self.steps * STEP_S + batches * EVAL_BATCH_S


@dataclass
class Budget:
    """A local run's cost, step by step, in seconds."""

    steps: dict[str, float]
    notes: dict[str, str] = field(default_factory=dict)

    @property
    def total(self) -> float:
        """The whole run."""
        return sum(self.steps.values())

    @property
    def sweep_share(self) -> float:
        """The sweep's share of the whole."""
        return self.steps.get("sweep", 0.0) / self.total if self.total else 0.0

    def lines(self) -> list[str]:
        """One line a step, then the total."""
        out = [
            f"  {name:<15} ~{seconds:6.0f} s  {self.notes.get(name, '')}".rstrip()
            for name, seconds in self.steps.items()
        ]
        out.append(f"  {'total':<15} ~{self.total:6.0f} s")
        return out


def sweep_seconds(
    machine: Machine, shape: ModelShape, trial: Job, trials: int, parallel: int, warm: bool
) -> float:
    """The sweep step: its own work, then its trials `parallel` at a time: their starts side
    by side, their compiles, steps and FLOPs sharing the machine."""
    waves = math.ceil(trials / max(1, min(parallel, machine.cores)))
    # Each trial compiles its own programs: a LoRA rank or scale the search changes is a
    # program of its own (the learning rate is not: it is an argument of the step).
    busy = trials * trial.busy_seconds(machine.compile_s(warm))
    fixed = TASK_START_S + SWEEP_FIXED_S + waves * machine.job_start_s() + busy
    return fixed + trials * trial.flops(shape) / machine.speed


def train_seconds(machine: Machine, shape: ModelShape, job: Job, warm: bool) -> float:
    """The train step: one job, then its model's export."""
    fixed = (
        TASK_START_S + machine.job_start_s() + job.busy_seconds(machine.compile_s(warm))
        + TRAIN_FINISH_S
    )  # fmt: skip
    return fixed + job.flops(shape) / machine.speed


def evaluate_seconds(machine: Machine, shape: ModelShape, rows: int, length: int) -> float:
    """The evaluate step: the test split scored once."""
    batches = math.ceil(rows / 64)
    fixed = TASK_START_S + EVALUATE_FIXED_S + batches * EVAL_BATCH_S
    flops = rows * length * shape.eval_flops(length)
    return fixed + flops / machine.speed


def prepare_seconds(rows: int) -> float:
    """The prepare step: read, split and tokenize every row."""
    return TASK_START_S + rows / PREPARE_ROWS_PER_S


def check_share(share) -> float:
    """`sweep_budget_share` in (0, 1], or SweepError naming it."""
    try:
        value = float(share)
    except (TypeError, ValueError):
        value = math.nan
    if not 0 < value <= 1:
        raise SweepError(
            f"sweep_budget_share: {share!r} is not in (0, 1]; it is the share of the whole "
            "run the sweep may take (0.4: at most 40 %, 1: no limit)"
        )
    return value


@dataclass
class SweepSize:
    """What the sweep can afford: trials, their steps, their evaluations' examples."""

    trials: int
    steps: int
    eval_examples: int
    seconds: float
    why: str


def size_sweep(
    *,
    machine: Machine,
    shape: ModelShape,
    rest_seconds: float,
    share: float,
    most_trials: int,
    parallel: int,
    final_steps: int,
    batch: int,
    length: int,
    validation_rows: int,
    peft: str,
    warm: bool,
) -> SweepSize:
    """The sweep sized so that it takes at most `share` of the whole run (the rest costing
    `rest_seconds`). Its trials evaluate twice (half way, for the pruner, and at the end) on
    min(`EVAL_EXAMPLES_FOR["wanted"]`, the validation rows) examples, halved down to
    `EVAL_EXAMPLES_FOR["min"]` where the budget needs it; they run as long as the final
    training at most and at least `MIN_TRIAL_SHARE` of it, with fewer trials (down to 2: the
    defaults and one candidate) before smaller evaluations, and those before shorter trials.
    Where even the least of these costs more (a small run's fixed costs), it runs and `why`
    says so."""
    allowed = math.inf if share >= 1 else share / (1 - share) * rest_seconds

    def cost(trials: int, steps: int, n: int) -> float:
        trial = Job(steps, batch, length, 2, n, peft=peft)
        return sweep_seconds(machine, shape, trial, trials, parallel, warm)

    floor = min(final_steps, max(2, math.ceil(MIN_TRIAL_SHARE * final_steps)))
    sizes = []  # evaluation sizes, largest first: halved down to the least that ranks
    n = min(validation_rows, EVAL_EXAMPLES_FOR["wanted"])
    while True:
        sizes.append(n)
        if n <= EVAL_EXAMPLES_FOR["min"]:
            break
        n = max(EVAL_EXAMPLES_FOR["min"], n // 2)
    limit = "no limit" if share >= 1 else f"≤ {share:.0%} of the run"
    for n in sizes:
        for trials in range(max(2, most_trials), 1, -1):
            steps = _longest(lambda s, k=trials, m=n: cost(k, s, m), allowed, final_steps)
            if steps >= floor:
                why = f"{trials} trials × {steps} steps, evaluations of {n} examples: {limit}"
                return SweepSize(trials, steps, n, cost(trials, steps, n), why)
    # Even the least sweep that compares a candidate with the defaults (two trials of the
    # shortest useful length, the smallest evaluation that ranks) costs more: on a run this
    # small, its starts and compiles do.
    n = sizes[-1]
    why = (
        f"2 trials × {floor} steps, evaluations of {n} examples: the least sweep that "
        f"compares a candidate with the defaults, over {share:.0%} of a run this small"
    )
    return SweepSize(2, floor, n, cost(2, floor, n), why)


def _longest(cost, allowed: float, most: int) -> int:
    """The most steps (≤ `most`) whose `cost` stays within `allowed` (0: not even 1)."""
    if cost(most) <= allowed:
        return most
    low, high = 0, most
    while low < high:
        mid = (low + high + 1) // 2
        if cost(max(mid, 1)) <= allowed:
            low = mid
        else:
            high = mid - 1
    return low
