"""A cheap trial program for the sweep's tests: a JAXJob command that reports like the trainer.

Objective eval_accuracy = 1 - (x - 0.3)^2 - (y - 0.5)^2 / 4 at every eval step (so the
best is x=0.3, y=0.5); it writes metrics.json as the trainer does and exits 1 when x > --fail-above.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

p = argparse.ArgumentParser()
p.add_argument("--output-dir", required=True)
p.add_argument("--x", type=float, required=True)
p.add_argument("--y", type=float, default=0.5)
p.add_argument("--steps", type=int, default=10)
p.add_argument("--fail-above", type=float, default=2.0)
p.add_argument("--sleep", type=float, default=0.02)
a = p.parse_args()
out = Path(a.output_dir)
out.mkdir(parents=True, exist_ok=True)
if a.x > a.fail_above:
    print(f"x={a.x} is too large", flush=True)
    sys.exit(1)
value = 1 - (a.x - 0.3) ** 2 - (a.y - 0.5) ** 2 / 4
if os.environ.get("PROCESS_ID", "0") != "0":  # as in the trainer, worker 0 writes the metrics
    time.sleep(a.sleep * a.steps)
    sys.exit(0)
evals = []
for step in range(1, a.steps + 1):
    time.sleep(a.sleep)
    evals.append({"step": step, "eval_accuracy": value, "eval_loss": 1 - value})
    tmp = out / "metrics.json.tmp"
    tmp.write_text(
        json.dumps({"status": "running", "step": step, "total_steps": a.steps, "evals": evals})
    )
    os.replace(tmp, out / "metrics.json")
final = {"eval_accuracy": value, "eval_loss": 1 - value}
(out / "metrics.json").write_text(
    json.dumps(
        {
            "status": "completed",
            "step": a.steps,
            "total_steps": a.steps,
            "evals": evals,
            "final": final,
        }
    )
)
