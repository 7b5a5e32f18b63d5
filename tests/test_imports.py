"""`import flashwatch` leaves Triton (and torch._dynamo, which imports it) unimported: a
CPU-only user or `flashwatch --help` does not pay Triton's ~2 s import (RESULTS.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_flashwatch_does_not_import_triton():
    code = ("import sys, flashwatch, flashwatch.cli; flashwatch.cli.build_parser(); "
            "print(sorted(m for m in ('triton', 'torch._dynamo') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout
