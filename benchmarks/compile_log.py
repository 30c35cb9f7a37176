"""Where a trainer run's compile time goes: its log, written with `JAX_LOG_COMPILES=1`, read
into each program's compile seconds, grouped by the run's phase: the set-up (up to the first
line), the first step, and after it (evaluation, export).

    JAX_LOG_COMPILES=1 python -m kubejax.trainer ... > run.log 2>&1
    python benchmarks/compile_log.py run.log
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict

COMPILED = re.compile(r"Finished XLA compilation of (\S+) in ([0-9.]+) sec")
CACHE_HIT = re.compile(r"Persistent compilation cache hit for '([^']+)'")
#: The trainer's lines that end a phase, and the phase that follows each.
PHASES = (("kubejax trainer:", "first step"), ("first step ", "after the first step"))


def summary(lines) -> str:
    """Each phase's programs (name, seconds, whether the cache had it), heaviest first."""
    phase, programs, hits = "setup", defaultdict(list), set()
    for line in lines:
        for marker, following in PHASES:
            if line.startswith(marker):
                phase = following
        hit = CACHE_HIT.search(line)
        if hit:
            hits.add(hit.group(1))
        done = COMPILED.search(line)
        if done:
            name = done.group(1)
            cached = name.replace("(", "_").rstrip(")") in {h.split("-")[0] for h in hits}
            programs[phase].append((name, float(done.group(2)), cached))
            hits.clear()
    out = []
    for phase, rows in programs.items():
        total = sum(s for _, s, _ in rows)
        out.append(f"{phase}: {len(rows)} programs, {total:.1f} s compiling")
        for name, seconds, cached in sorted(rows, key=lambda r: -r[1])[:12]:
            out.append(f"  {seconds:7.2f} s  {name}{'  (cache hit)' if cached else ''}")
    return "\n".join(out) + "\n"


def main() -> None:
    for path in sys.argv[1:]:
        with open(path, errors="replace") as f:
            sys.stdout.write(f"{path}\n{summary(f)}")


if __name__ == "__main__":
    main()
