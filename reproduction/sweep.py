"""Run several (configuration, arm, seed) of reproduction.run side by side, one thread each.

    python -m reproduction.sweep --configs repeat-v32 --arms unmitigated auto fp32_o beta \
        --seeds 0 1 2 --jobs 2 --root runs/repro

Each run goes to ROOT/CONFIG/ARM-sSEED (its log: run.log there); runs whose summary.json
exists are skipped, so an interrupted sweep resumes.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from reproduction.run import ARMS, CONFIGS


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m reproduction.sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", required=True, choices=sorted(CONFIGS))
    p.add_argument("--arms", nargs="+", default=["unmitigated"], choices=ARMS)
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--root", type=Path, default=Path("runs/repro"))
    p.add_argument("--steps", type=int)
    p.add_argument("--save-every", type=int, default=0,
                   help="also save each run's weights every N steps (for grad_error)")
    a = p.parse_args(argv)
    todo = [(c, arm, s) for c in a.configs for s in a.seeds for arm in a.arms]
    running: list[tuple[subprocess.Popen, str]] = []
    failed = 0
    while todo or running:
        while todo and len(running) < a.jobs:
            c, arm, s = todo.pop(0)
            out = a.root / c / f"{arm}-s{s}"
            if (out / "summary.json").is_file():
                continue
            out.mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, "-m", "reproduction.run", "--config", c, "--arm", arm,
                   "--seed", str(s), "--out", str(out)]
            if a.steps:
                cmd += ["--steps", str(a.steps)]
            if a.save_every:
                cmd += ["--save-every", str(a.save_every)]
            log = open(out / "run.log", "w")  # noqa: SIM115  (closed with the process)
            running.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT),
                            str(out)))
            print(f"started {out}", flush=True)
        time.sleep(2)
        for proc, out in list(running):
            if proc.poll() is not None:
                running.remove((proc, out))
                failed += proc.returncode != 0
                print(f"{'done' if proc.returncode == 0 else 'FAILED'} {out}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
