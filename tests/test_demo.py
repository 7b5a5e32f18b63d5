"""flashwatch/demo.py, flashwatch/report/runreport.py and the CLI around them, end to end."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from flashwatch.cli import main
from flashwatch.report.runreport import PLOTS

RUN_FILES = ("flashwatch.jsonl", "train.jsonl", "watcher_state.pt", "head_modes.json",
             "summary.json")


def _cli():
    exe = shutil.which("flashwatch", path=str(Path(sys.executable).parent))
    assert exe is not None, "the flashwatch console script is not installed"
    return exe


def _check_report(run: Path):
    assert main(["report", str(run)]) == 0
    for name in PLOTS:
        png = run / name
        assert png.stat().st_size > 5_000, name  # a real picture, not an empty canvas
        with open(png, "rb") as f:
            head = f.read(24)
        assert head[:8] == b"\x89PNG\r\n\x1a\n"
        width = int.from_bytes(head[16:20], "big")
        height = int.from_bytes(head[20:24], "big")
        assert width == 1000 and 300 <= height <= 1200, (name, width, height)
    md = (run / "report.md").read_text()
    assert "# flashwatch run report" in md and "## Mode changes" in md
    return md


def test_demo_end_to_end_then_report(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["demo", "--steps", "6", "--every", "2", "--port", "0", "--out",
                 str(run)]) == 0
    out = capsys.readouterr().out
    assert str(run) in out and "flashwatch report" in out
    for name in RUN_FILES:
        assert (run / name).is_file(), name
    summary = json.loads((run / "summary.json").read_text())
    assert summary["ended"] == "completed" and summary["steps_done"] == 6
    lines = (run / "flashwatch.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [0, 2, 4]
    modes = json.loads((run / "head_modes.json").read_text())
    assert len(modes) == 4 and all(len(m) == 4 for m in modes.values())
    state = torch.load(run / "watcher_state.pt", weights_only=False)
    assert state["step"] == 6
    md = _check_report(run)
    assert "completed" in md


@pytest.mark.parametrize("argv", [
    ["demo", "--steps", "0"], ["demo", "--steps", "x"], ["demo", "--port", "70000"],
    ["demo", "--mitigation", "on"], ["demo", "--every", "-1"], ["report"],
])
def test_bad_arguments_exit_2_with_a_message(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert "error" in capsys.readouterr().err


def test_demo_on_a_taken_port_says_one_line_naming_the_flag(tmp_path, capsys):
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        run = tmp_path / "run"
        assert main(["demo", "--steps", "2", "--port", str(port), "--out", str(run)]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert f"port {port}" in err and "--port N" in err and "--port 0" in err, err
    assert "PrometheusSink" not in err, err
    assert not run.exists()  # no empty run directory
    assert captured.out == ""


def test_report_on_a_directory_without_a_run_exits_2(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "flashwatch.jsonl" in capsys.readouterr().err


def test_ctrl_c_leaves_a_complete_readable_run(tmp_path):
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([_cli(), "demo", "--steps", "100000", "--every", "1", "--port",
                             "0", "--out", str(run)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            train = run / "train.jsonl"
            if train.is_file() and len(train.read_text().splitlines()) >= 3:
                break
            time.sleep(0.5)
        else:
            pytest.fail("the demo made no progress in 240 s")
        proc.send_signal(signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired as e:
            proc.kill()
            tail = (e.output or b"")[-3000:]
            pytest.fail(f"the demo did not stop within 120 s of SIGINT; its output ends:\n"
                        f"{tail.decode(errors='replace') if isinstance(tail, bytes) else tail}")
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out
    assert "interrupted" in out
    for name in RUN_FILES:
        assert (run / name).is_file(), name
    assert json.loads((run / "summary.json").read_text())["ended"] == "interrupted"
    _check_report(run)


def test_closing_lines_name_a_command_that_writes_the_dashboards(tmp_path, capsys):
    """With the exporter on, the demo ends by naming `flashwatch dashboards`, which a pip
    user has (the repository's dashboards/ folder they have not); the named command runs."""
    import io
    import re

    from flashwatch.demo import _print_next_steps

    stream = io.StringIO()
    _print_next_steps(tmp_path / "run", exporter=object(), stream=stream)
    text = stream.getvalue()
    assert "see docs/dashboards.md" not in text
    command = re.search(r"`flashwatch (dashboards --out) DIR`", text)
    assert command, text
    assert main([*command.group(1).split(), str(tmp_path / "d")]) == 0
    capsys.readouterr()
    assert (tmp_path / "d" / "grafana" / "flashwatch.json").is_file()
