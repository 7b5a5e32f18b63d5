"""Rounding-error lean of O on planted rows, per arithmetic and mode (docs/design.md §1).

Usage: python benchmarks/bias_lean.py [--rows 4096]
Rows: max r_m at key 0 (and key 1 when tied), 62 other keys 10-14 nats lower, V < 0 in
[-2.5, -1.5]. lean = mean(err)/mean(|err|) of O against FP64: -1 means every error has
V's sign, 0 no lean. The planted rows are the ones tests/kernels/test_reference.py asserts on.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

TESTS = pathlib.Path(__file__).resolve().parents[1] / "tests"
sys.path[:0] = [str(TESTS), str(TESTS / "kernels")]  # test_reference and its oracle
from test_reference import _bias_rows, _lean, _row_errors  # noqa: E402

from flashwatch import Mode  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4096)
    n = ap.parse_args().rows
    print(f"{n} rows per case; standard error of a lean ≈ {n ** -0.5:.3f}")
    print("| r_m | row | paper STANDARD | paper BETA | fused STANDARD | fused BETA |")
    print("|---|---|---|---|---|---|")
    for r_max in ((0.0, 0.0), (1.5, 1.5), (1.0, 3.0)):
        for tied in (True, False):
            s, v = _bias_rows(n, tied, seed=0, r_max=r_max)
            cells = [
                f"{_lean(_row_errors(s, v, modes=(mode,), arithmetic=ar)):+.3f}"
                for ar in ("paper", "fused") for mode in (Mode.STANDARD, Mode.BETA)
            ]
            r = f"{r_max[0]:g}" if r_max[0] == r_max[1] else f"U({r_max[0]:g}, {r_max[1]:g})"
            print(f"| {r} | {'two tied maxima' if tied else 'single max'} | "
                  + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
