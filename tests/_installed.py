"""flashwatch as a pip user has it: the sdist built from this checkout, a wheel built from
that sdist (as pip does from an index), installed into a throwaway venv, so doc blocks and
CLI commands run with nothing of the checkout importable (tests/test_docs.py,
tests/test_packaging.py; one build per test session through conftest's `installed`).

The venv reuses the running interpreter's packages (torch, lightning, ... are not
installed again): `--system-site-packages` alone would give the *base* interpreter's
site-packages when the running python is itself a venv, so a .pth line names the running
site-packages directories instead. A plain path line in a .pth does not run that
directory's own .pth files, so the editable install's finder there (it maps `flashwatch`
to a checkout) is never installed; `check_imports_installed` verifies it.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
# tarfile's "data" filter (no absolute paths, no links out) exists from 3.10.12 / 3.11.4 on
SAFE_TAR = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}


class Installed(NamedTuple):
    python: Path  # the venv's interpreter
    venv: Path
    sdist: Path
    wheel: Path
    build_log: str  # the sdist build's output (its warnings)


def _run(*cmd, cwd: Path | None = None) -> str:
    done = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True,
                          timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} exited with {done.returncode}:\n"
                           f"{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return done.stdout


# What .gitignore names: a build from the checkout itself would read a stale
# flashwatch.egg-info/SOURCES.txt and ship files MANIFEST.in no longer names.
NOT_SOURCE = shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.egg-info", "build",
                                    "dist", ".pytest_cache", ".ruff_cache", ".hypothesis",
                                    "runs")


def build_sdist(out: Path) -> tuple[Path, str]:
    """The sdist of a clean copy of the checkout, and the build's log (setuptools' own
    PEP 517 hook in this interpreter: no network, no isolated build env)."""
    src = out / "checkout"
    shutil.copytree(ROOT, src, ignore=NOT_SOURCE)
    done = subprocess.run([sys.executable, "-c", "from setuptools import build_meta; "
                           f"build_meta.build_sdist({str(out)!r})"], cwd=src,
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"building the sdist failed:\n{done.stderr[-4000:]}")
    shutil.rmtree(src)
    (sdist,) = out.glob("flashwatch-*.tar.gz")
    return sdist, done.stdout + done.stderr


def install(tmp: Path) -> Installed:
    sdist, log = build_sdist(tmp / "dist")
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp / "src", **SAFE_TAR)
    (src,) = (tmp / "src").iterdir()
    _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", tmp / "dist", src)
    (wheel,) = (tmp / "dist").glob("flashwatch-*.whl")
    venv = tmp / "venv"
    _run(sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv)
    python = venv / "bin" / "python"
    purelib = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))")
                   .strip())
    (purelib / "_outer_site_packages.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    _run(sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps",
         "--no-index", wheel)
    shutil.rmtree(tmp / "src")
    check_imports_installed(python, venv, tmp)
    return Installed(python, venv, sdist, wheel, log)


def env() -> dict:
    """The environment a block runs in: no PYTHONPATH (with `python -I` it would be
    ignored anyway), no network, no GUI."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_MODE="disabled",
               MPLBACKEND="Agg")
    return env


def check_imports_installed(python: Path, venv: Path, cwd: Path) -> None:
    """`import flashwatch` in the venv finds the installed wheel, not a checkout."""
    where = Path(_run(python, "-I", "-c", "import flashwatch; print(flashwatch.__file__)",
                      cwd=cwd).strip())
    if not where.is_relative_to(venv):
        raise RuntimeError(f"the test venv imported flashwatch from {where}, not from the "
                           f"wheel installed in {venv}: a checkout leaks onto sys.path")
