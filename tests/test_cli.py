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


def _tree(folder) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


SHIPPED = {"grafana/flashwatch.json", "grafana/provisioning/dashboards/flashwatch.yaml",
           "grafana/provisioning/alerting/flashwatch-alerts.yaml",
           "prometheus/flashwatch-rules.yml", "prometheus/flashwatch-rules.test.yml",
           "prometheus/flashwatch-scrape.yml"}  # docs/dashboards.md's table


def test_dashboards_writes_the_shipped_files(tmp_path, capsys):
    from pathlib import Path

    out = tmp_path / "new" / "dash"  # created, parents too
    assert main(["dashboards", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    written = _tree(out)
    assert set(written) == SHIPPED
    repo = Path(__file__).resolve().parent.parent / "flashwatch" / "dashboards"
    assert written == _tree(repo)  # byte for byte what the package holds
    for rel in SHIPPED:
        assert str(out / rel) in printed
    assert "flashwatch-scrape.yml" in printed.splitlines()[-1]  # the next step names it


def test_dashboards_out_a_file_exits_2_naming_the_flag(tmp_path, capsys):
    file = tmp_path / "f"
    file.write_text("x")
    assert main(["dashboards", "--out", str(file)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--out" in err and "not a directory" in err
    assert file.read_text() == "x"


def test_write_dashboards_rejects_a_non_path():
    from flashwatch.cli import write_dashboards

    with pytest.raises(TypeError, match="out must be a str or Path, got int"):
        write_dashboards(3)
