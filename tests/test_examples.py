"""examples/: each training script runs end to end (smoke tests, a few steps)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("script", ["train_plain.py", "train_lightning.py", "train_hf.py"])
def test_example_runs(script, tmp_path):
    assert len((ROOT / "examples" / script).read_text().splitlines()) < 100
    res = subprocess.run([sys.executable, str(ROOT / "examples" / script), "--steps", "6",
                          "--out", str(tmp_path)], capture_output=True, text=True,
                         timeout=600, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    if script == "train_plain.py":
        assert (tmp_path / "flashwatch.jsonl").stat().st_size > 0
        assert "final head modes" in res.stdout
    elif script == "train_hf.py":
        assert len((tmp_path / "flashwatch.jsonl").read_text().splitlines()) == 3  # steps 0, 2, 4
        assert int(re.search(r"logged (\d+) flashwatch keys", res.stdout)[1]) > 0
    else:
        metrics = list(tmp_path.rglob("metrics.csv"))
        assert metrics and "flashwatch/" in metrics[0].read_text()
