"""flashwatch/cli.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

import flashwatch
from flashwatch.cli import main


def test_info_prints_versions(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"flashwatch {flashwatch.__version__}" in out and "reference" in out


@pytest.mark.parametrize("argv", [[], ["no-such-command"]])
def test_bad_arguments_exit_2_with_a_message(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert "usage: flashwatch" in capsys.readouterr().err


def test_console_script_is_installed():
    # The entry point from pyproject.toml, run as a user would.
    exe = __import__("shutil").which("flashwatch", path=str(__import__("pathlib").Path(
        sys.executable).parent))
    assert exe is not None
    res = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and flashwatch.__version__ in res.stdout


def test_diagnose_needs_data_and_a_checkpoint(capsys):
    for argv in (["diagnose", "ckpt.pt"], ["diagnose", "--data", "d.bin"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
        assert "usage: flashwatch diagnose" in capsys.readouterr().err


def test_diagnose_is_listed_in_the_help(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "diagnose" in capsys.readouterr().out
