"""Dependencies as users expect them: the core needs torch, numpy and prometheus-client
(Triton comes with CUDA torch; `[triton]` otherwise); Lightning, matplotlib and
transformers are extras, imported only where
they are used, and a missing extra is named in a one-line `pip install` message.

Each check runs a fresh interpreter in which the extras cannot be imported: a finder put
first on sys.meta_path raises ModuleNotFoundError for them, as if they were not installed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10: the dev extra installs tomli
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
CORE = {"torch", "numpy", "prometheus-client"}
EXTRAS = {"lightning": {"lightning"}, "report": {"matplotlib"},
          "transformers": {"transformers", "accelerate"},
          "torchtitan": {"torchtitan", "triton"}, "olmo-core": {"ai2-olmo-core"}}
# top-level modules of each extra (and of what the extras pull in)
NO_LIGHTNING = ("lightning", "pytorch_lightning", "lightning_fabric", "torchmetrics")
NO_PLOTS = ("matplotlib",)
NO_TRANSFORMERS = ("transformers", "accelerate")

BLOCKER = """
import sys

class _NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, _NotInstalled())
"""


def run_without(blocked: tuple[str, ...], code: str, cwd: Path) -> subprocess.CompletedProcess:
    src = BLOCKER.format(blocked=set(blocked)) + textwrap.dedent(code)
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-c", src], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def _name(requirement: str) -> str:
    return re.match(r"[A-Za-z0-9_.\-]+", requirement).group(0).lower()


def test_pyproject_core_and_extras():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert {_name(r) for r in project["dependencies"]} == CORE
    extras = project["optional-dependencies"]
    for extra, names in EXTRAS.items():
        assert {_name(r) for r in extras[extra]} == names, extra
    assert extras["all"] == ["flashwatch[lightning,report,transformers,triton]"]
    assert {_name(r) for r in extras["triton"]} == {"triton"}
    assert "flashwatch[all]" in extras["dev"]  # `make test` installs every extra
    makefile = (ROOT / "Makefile").read_text().splitlines()
    install = [line for line in makefile if "$(BIN)/pip install" in line and "-e " in line]
    assert install and all('".[all,dev]"' in line for line in install), install
    # .venv-trainers (tests/trainers): no extras, [transformers] clashes with OLMo-core
    trainers = [line for line in makefile if "$(TBIN)/pip install" in line and "-e " in line]
    assert trainers and all(line.endswith(" -e .") for line in trainers), trainers


def test_core_and_demo_run_without_any_extra(tmp_path: Path):
    done = run_without(NO_LIGHTNING + NO_PLOTS + NO_TRANSFORMERS, f"""
        import torch
        import flashwatch as fw
        import flashwatch.cli, flashwatch.report.runreport
        from flashwatch.integrations.prometheus import PrometheusSink
        from examples.gpt import GPT, GPTConfig

        torch.manual_seed(0)
        model = GPT(GPTConfig(block_size=8, n_layer=1, n_head=2, n_embd=16))
        with fw.watch(model, every_n_steps=1) as watcher:
            x = torch.randint(0, 256, (2, 9))
            _, loss = model(x[:, :-1], x[:, 1:])
            loss.backward()
            report = watcher.step()
        assert report is not None and len(report.heads) == 2, report
        assert flashwatch.cli.main(["info"]) == 0
        assert flashwatch.cli.main(["demo", "--steps", "2", "--every", "1", "--port", "0",
                                    "--out", {str(tmp_path / "demo")!r}]) == 0
        loaded = sorted(m for m in sys.modules if m.partition(".")[0] in
                        {set(NO_LIGHTNING + NO_PLOTS + NO_TRANSFORMERS)!r})
        assert not loaded, loaded
        print("core ok")
        """, tmp_path)
    assert done.returncode == 0 and "core ok" in done.stdout, done.stderr[-3000:]
    assert (tmp_path / "demo" / "flashwatch.jsonl").is_file()


def test_report_without_matplotlib_names_the_extra_in_one_line(tmp_path: Path):
    done = run_without(NO_PLOTS, f"""
        from flashwatch.cli import main
        sys.exit(main(["report", {str(tmp_path)!r}]))
        """, tmp_path)
    lines = done.stderr.strip().splitlines()
    assert done.returncode != 0 and len(lines) == 1, done.stderr[-3000:]
    assert "pip install 'flashwatch[report]'" in lines[0], lines
    assert not list(tmp_path.glob("*.png"))


def _import_error(blocked: tuple[str, ...], module: str, cwd: Path) -> str:
    done = run_without(blocked, f"""
        try:
            import {module}
        except ImportError as e:
            print(e)
        else:
            print("imported")
        """, cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def test_lightning_callback_without_lightning_names_the_extra(tmp_path: Path):
    msg = _import_error(NO_LIGHTNING, "flashwatch.integrations.lightning", tmp_path)
    assert "pip install 'flashwatch[lightning]'" in msg and "\n" not in msg, msg


def test_trainer_callback_without_transformers_names_the_extra(tmp_path: Path):
    msg = _import_error(NO_TRANSFORMERS, "flashwatch.integrations.transformers", tmp_path)
    assert "pip install 'flashwatch[transformers]'" in msg and "\n" not in msg, msg


@pytest.mark.parametrize("module, extra, blocked", [
    ("torchtitan", "torchtitan", ("torchtitan", "tyro")),
    ("olmo_core", "olmo-core", ("olmo_core",))])
def test_trainer_integrations_without_their_trainer_name_the_extra(tmp_path: Path, module,
                                                                    extra, blocked):
    msg = _import_error(blocked, f"flashwatch.integrations.{module}", tmp_path)
    assert f"pip install 'flashwatch[{extra}]'" in msg and "\n" not in msg, msg


def test_diagnose_on_a_hugging_face_folder_without_transformers_names_the_extra(tmp_path):
    """The CLI says it in one line (no traceback); load_tokens on a folder with a tokenizer
    raises the same ImportError, not a bare ModuleNotFoundError."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "tokenizer_config.json").write_text("{}")
    (tmp_path / "data.txt").write_text("hello world")
    done = run_without(NO_TRANSFORMERS, f"""
        from flashwatch.cli import main
        from flashwatch.diagnosis.load import load_tokens
        try:
            load_tokens({str(tmp_path / "data.txt")!r}, {str(hf)!r})
        except ImportError as e:
            print(type(e).__name__, e)
        sys.exit(main(["diagnose", {str(hf)!r}, "--data", {str(tmp_path / "data.txt")!r},
                       "--out", {str(tmp_path / "out")!r}]))
        """, tmp_path)
    want = ("flashwatch diagnose needs transformers, which is not installed; install it "
            "with: pip install 'flashwatch[transformers]'")
    assert done.stdout == f"ImportError {want}\n", done.stderr[-3000:]
    assert done.returncode == 2 and done.stderr == f"flashwatch diagnose: error: {want}\n", \
        done.stderr[-3000:]
    assert not (tmp_path / "out").exists()


HOME = "https://github.com/flashwatch/flashwatch"


def test_license_and_urls_metadata():
    """Current packaging standards (PEP 639): an SPDX expression and the license file; a
    table (`{ text = ... }`) is deprecated by setuptools, removal announced for 2027-02."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert (ROOT / "LICENSE").read_text().split()[:4] == ["Apache", "License", "Version", "2.0,"]
    urls = project["urls"]
    assert urls["Homepage"] == HOME and urls["Issues"] == HOME + "/issues"
    assert urls["Documentation"].startswith(HOME + "/")


def test_wheel_ships_license_metadata_and_data(installed):
    import zipfile

    with zipfile.ZipFile(installed.wheel) as whl:
        names = set(whl.namelist())
        meta = whl.read("flashwatch-0.1.0.dist-info/METADATA").decode()
    assert "flashwatch-0.1.0.dist-info/licenses/LICENSE" in names
    assert "License-Expression: Apache-2.0" in meta.splitlines()
    assert f"Project-URL: Issues, {HOME}/issues" in meta.splitlines()
    data = {p.relative_to(ROOT).as_posix() for p in (ROOT / "flashwatch" / "dashboards").rglob("*")
            if p.is_file()}
    assert data and data <= names, sorted(data - names)
    # the build itself warns about nothing deprecated (the license table did)
    assert "deprecat" not in installed.build_log.lower(), installed.build_log[-3000:]


SDIST_FOLDERS = ("tests", "docs", "dashboards", "examples", "benchmarks", "reproduction")


def test_sdist_holds_what_its_tests_read(installed, tmp_path: Path):
    """Every file of the folders the suite reads is in the sdist, and the sdist's own
    tests of the docs and the dashboards pass in the unpacked sdist (a few seconds; the
    whole suite from there is `make test`'s job)."""
    import tarfile

    from _installed import SAFE_TAR

    with tarfile.open(installed.sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
        tar.extractall(tmp_path, **SAFE_TAR)
    want = {p.relative_to(ROOT).as_posix() for d in SDIST_FOLDERS for p in (ROOT / d).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}
    want |= {"LICENSE", "README.md", "Makefile", "pyproject.toml"}
    assert not want - names, sorted(want - names)
    (src,) = tmp_path.iterdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
         "tests/test_dashboard_files.py::test_repository_dashboards_are_the_package_data",
         "tests/test_docs.py", "-k", "not python_block_runs"],
        cwd=src, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:]
    assert " passed" in done.stdout and "error" not in done.stdout.lower(), done.stdout[-3000:]
