"""A cheap trainer for the Ray Tune tests: a JAXJob command that checkpoints and resumes like
kubejax's trainer.

Its state is one number w, trained toward 1 by `w += learning_rate * (1 - w)` a step; eval
accuracy is w (so a larger learning rate, up to 1, is better). It evaluates and checkpoints
(`checkpoints/<step>/state.json`) every --eval-every steps, resumes from the newest checkpoint
in its output folder with its own --learning-rate (as the trainer does on resume), and keeps
metrics.json (train rows with the learning rate, evals) as the trainer writes it.

With --gate DIR each evaluation waits, before it is written, for the test to release it:
the program says `<output folder's name>@<step>.ready` in DIR and writes the evaluation once
`<...>@<step>.go` is there (tests/test_ray_tune.py fixes the order results reach the scheduler).
"""

import argparse
import json
import os
import time
from pathlib import Path

p = argparse.ArgumentParser()
p.add_argument("--output-dir", required=True)
p.add_argument("--learning-rate", type=float, required=True)
p.add_argument("--steps", type=int, default=12)
p.add_argument("--eval-every", type=int, default=2)
p.add_argument("--sleep", type=float, default=0.05)
p.add_argument("--gate", default="")
a = p.parse_args()
out = Path(a.output_dir)
out.mkdir(parents=True, exist_ok=True)
saved = sorted((int(d.name) for d in (out / "checkpoints").glob("*")), reverse=True)
w, start = 0.0, 0
if saved:
    start = saved[0]
    w = json.loads((out / "checkpoints" / str(start) / "state.json").read_text())["w"]
    print(f"resumed from step {start} with learning_rate {a.learning_rate}", flush=True)
train, evals = [], []


def write(status: str, step: int) -> None:
    data = {"status": status, "step": step, "total_steps": a.steps, "train": train,
            "evals": evals, "start_step": start}  # fmt: skip
    if status == "completed":
        data["final"] = {"eval_accuracy": w, "eval_loss": 1 - w}
    tmp = out / "metrics.json.tmp"
    tmp.write_text(json.dumps(data))
    os.replace(tmp, out / "metrics.json")


for step in range(start + 1, a.steps + 1):
    time.sleep(a.sleep)
    w += a.learning_rate * (1 - w)
    train.append({"step": step, "loss": 1 - w, "learning_rate": a.learning_rate})
    if step % a.eval_every == 0 or step == a.steps:
        folder = out / "checkpoints" / str(step)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "state.json").write_text(json.dumps({"w": w, "step": step}))
        if a.gate:
            (Path(a.gate) / f"{out.name}@{step}.ready").touch()
            while not (Path(a.gate) / f"{out.name}@{step}.go").exists():
                time.sleep(0.01)
        evals.append({"step": step, "eval_accuracy": w, "eval_loss": 1 - w})
        write("running", step)
write("completed", a.steps)
