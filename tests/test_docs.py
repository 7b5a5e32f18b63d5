"""The docs cannot rot: every ```python block of README.md and docs/*.md runs here.

A block runs in a fresh interpreter of its own, as a pip user would run it: the python of a
throwaway venv holding the wheel built from this checkout (tests/_installed.py), in isolated
mode (`-I`: no PYTHONPATH, no script directory on sys.path), cwd a temporary directory;
nothing of the checkout (examples/, tests/) can be imported. So each block must stand alone,
as a reader would paste it, and use only what ships. Blocks that need a GPU, a network, a
long run or names from the reader's own script are fragments, marked either in the fence
(```python fragment) or by an HTML comment starting `<!-- fragment` on the line before the
fence; a fragment must still compile. A failure names the file and the line of the block's
fence.

Also checked: the README's metrics table is flashwatch/report/metrics.py's, the README links
every page of docs/ with absolute URLs (a package index renders it without the repository;
each URL's path is a file here), relative links of docs/ lead to files, numbers and paths
the docs state about the code (the demo's run directory; the alert rule count:
tests/test_dashboard_files.py), and docs/design.md's module map names every module,
benchmark, shared test file and docs page, and no module that is not there.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import NamedTuple

import pytest
from _installed import env as installed_env

from flashwatch.report.metrics import METRICS

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
BLOCK_TIMEOUT_S = 600  # a Lightning quickstart takes ≈ 10 s alone, minutes on a busy CPU

FENCE = re.compile(r"^(?P<indent>\s*)```(?P<info>.*)$")
FRAGMENT_COMMENT = re.compile(r"^\s*<!--\s*fragment\b")


class Block(NamedTuple):
    path: Path
    line: int  # 1-based line of the opening fence
    source: str
    fragment: bool

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def parse_blocks(path: Path, text: str | None = None) -> list[Block]:
    """The ```python blocks of a Markdown file, dedented by their fence's indent."""
    lines = (path.read_text() if text is None else text).split("\n")
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        words = m["info"].split()
        start, indent = i, len(m["indent"])
        i += 1
        body = []
        while i < len(lines) and lines[i].strip() != "```":
            line = lines[i]
            body.append(line[indent:] if line[:indent].strip() == "" else line.lstrip())
            i += 1
        i += 1  # the closing fence
        if not words or words[0] != "python":
            continue
        before = next((x for x in reversed(lines[:start]) if x.strip()), "")
        fragment = "fragment" in words[1:] or bool(FRAGMENT_COMMENT.match(before))
        blocks.append(Block(path, start + 1, "\n".join(body) + "\n", fragment))
    return blocks


def doc_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


ALL_BLOCKS = [b for f in doc_files() for b in parse_blocks(f)]
RUN = [b for b in ALL_BLOCKS if not b.fragment]
FRAGMENTS = [b for b in ALL_BLOCKS if b.fragment]


# The installed wheel costs once per session: sdist + wheel + venv + install + one import
# check, 4.7 s alone, 5.3 s as this test's setup on the shared 2-core dev machine. The 8
# blocks: 51.3 s wall with it vs 38.6 s with the old from-checkout runner (same machine,
# loaded by others; `pytest tests/test_docs.py -k python_block_runs`).
@pytest.mark.parametrize("block", RUN, ids=[b.name for b in RUN])
def test_python_block_runs(block: Block, tmp_path: Path, installed):
    # Blank lines in front, so a traceback's line number is the line in the Markdown file.
    script = tmp_path / (block.name.replace("/", "_").replace(":", "_L") + ".py")
    script.write_text("\n" * block.line + block.source)
    try:
        done = subprocess.run([str(installed.python), "-I", str(script)], cwd=tmp_path,
                              env=installed_env(),
                              capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{block.name}: the block ran over {BLOCK_TIMEOUT_S} s; shrink it, or "
                    f"mark it <!-- fragment --> if it is a long run by design")
    assert done.returncode == 0, (
        f"{block.name}: the ```python block exited with {done.returncode}. Fix it, or mark it "
        f"as a fragment (<!-- fragment --> before the fence) if it needs a GPU, a network, a "
        f"long run or the reader's own names.\n--- stderr (tail) ---\n{done.stderr[-4000:]}")


@pytest.mark.parametrize("block", FRAGMENTS, ids=[b.name for b in FRAGMENTS])
def test_fragment_compiles(block: Block):
    try:
        compile(block.source, block.name, "exec")
    except SyntaxError as e:
        pytest.fail(f"{block.name}: fragment does not compile: line {e.lineno} of the block: "
                    f"{e.msg}")


def test_parser_finds_fences_markers_and_indented_blocks():
    text = "\n".join([
        "# t", "```python", "if a:", "    a = 1", "```",  # runs (line 2)
        "<!-- fragment: needs a GPU -->", "", "```python", "b(", "```",  # fragment by comment
        "```python fragment", "c = 3", "```",             # fragment by fence
        "```bash", "make test", "```",                    # not Python
        "1. item", "   ```python", "   if d:", "       d = 4", "", "   ```",  # in a list
        "```", "```python", "```"])                       # an unlabelled block holds a fence
    got = [(b.line, b.source, b.fragment) for b in parse_blocks(ROOT / "x.md", text)]
    assert got == [(2, "if a:\n    a = 1\n", False), (8, "b(\n", True), (11, "c = 3\n", True),
                   (18, "if d:\n    d = 4\n\n", False)]


def test_readme_quickstarts_are_executed_not_fragments():
    headings = [m.group(0) for m in re.finditer(r"^## Quickstart: .+$", README.read_text(), re.M)]
    assert len(headings) == 3, headings  # plain PyTorch, Lightning, Hugging Face Trainer
    text = README.read_text().split("\n")
    for heading in headings:
        at = text.index(heading) + 1
        inside = [b for b in ALL_BLOCKS if b.path == README and b.line > at]
        assert inside and not inside[0].fragment, f"{heading}: its first block is a fragment"


def metrics_table() -> list[str]:
    """The README's metrics table, rendered from the one table (flashwatch/report/metrics.py):
    every per-head metric that has a healthy range, with its Prometheus name where it is
    not flashwatch_ + the field."""
    cell = lambda text: text.replace("|", "\\|")  # noqa: E731
    rows = ["| metric | meaning | healthy |", "|---|---|---|"]
    name = lambda m: f"`{m.name}`" + (f" (`{m.prometheus_name}`)" if m.exported else "")  # noqa: E731
    rows += [f"| {name(m)} | {cell(m.help)} | {cell(m.healthy)} |"
             for m in METRICS if m.scope == "head" and m.healthy]
    return rows


def test_readme_metrics_table_is_the_metrics_table():
    lines = README.read_text().split("\n")
    at = lines.index("| metric | meaning | healthy |")
    end = next(i for i in range(at, len(lines)) if not lines[i].startswith("|"))
    want = metrics_table()
    assert len(want) >= 12  # the table must not lose its rows unnoticed
    assert lines[at:end] == want, ("README.md's metrics table differs from "
                                   "flashwatch/report/metrics.py; paste this:\n" + "\n".join(want))


HOME = "https://github.com/flashwatch/flashwatch"
BLOB = HOME + "/blob/main/"  # README links into the repository start with this
IN_REPO = re.compile(re.escape(HOME) + r"/(?:blob|tree)/main/(.+)")  # a file or a folder


def _links(page: Path) -> list[str]:
    return re.findall(r"\]\(([^)\s]+)\)", page.read_text())


def test_readme_links_every_docs_page():
    text = README.read_text()
    unlinked = [p.name for p in sorted(DOCS.glob("*.md")) if f"]({BLOB}docs/{p.name})" not in text]
    assert not unlinked, f"README.md links none of {unlinked} (add them under Documentation)"


def test_readme_links_are_absolute():
    """PyPI renders README.md without the repository: a relative link there is dead."""
    relative = [t for t in _links(README) if not t.startswith(("http://", "https://", "#"))]
    assert not relative, f"README.md: make these links {BLOB}<path>: {relative}"


def test_links_point_at_files():
    """Relative links of docs/ and the README's links into this repository ({BLOB}<path>)
    name files that exist here."""
    broken = []
    for page in doc_files():
        for target in _links(page):
            if IN_REPO.match(target):
                path = ROOT / IN_REPO.match(target).group(1)
            elif target.startswith(("http://", "https://", "mailto:", "#")):
                continue
            else:
                path = page.parent / target
            if not Path(str(path).split("#", 1)[0]).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken


def test_readme_demo_paths_are_the_demos(monkeypatch):
    """The run directories the README names: `make demo`'s (the Makefile's --out) and the
    CLI's default (`runs/demo-<time>/`, <time> the CLI's timestamp)."""
    import flashwatch.demo
    from flashwatch.cli import main

    text = " ".join(README.read_text().split())
    make_out = re.search(r"`make demo` writes `([^`]+)/`", text).group(1)
    cli_out = re.search(r"\(`flashwatch demo`: `([^`]+)/`", text).group(1)
    assert f"flashwatch demo --out {make_out}\n" in (ROOT / "Makefile").read_text()
    seen = {}
    monkeypatch.setattr(flashwatch.demo, "run_demo",
                        lambda **kw: seen.update(kw) or {"ended": "steps"})
    assert main(["demo"]) == 0
    pattern = re.escape(cli_out).replace(re.escape("<time>"), r"\d{8}-\d{6}")
    assert re.fullmatch(pattern, Path(seen["out"]).as_posix()), (cli_out, seen["out"])


def _module_map() -> str:
    design = (DOCS / "design.md").read_text()
    return design.split("## 2.", 1)[1].split("\n## 3.", 1)[0]


def _names(name: str, text: str) -> bool:
    """Whether `text` names the file `name` as a whole word: "sites.py" is not named by
    "explicit_sites.py", nor "ops.py" by "smallops.py"."""
    return re.search(rf"(?<!\w){re.escape(name)}(?!\w)", text) is not None


PACKAGE = ROOT / "flashwatch"
PARTS = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))  # kernels, monitor, ...


def _package_block(section: str) -> str:
    start = section.index("flashwatch/    the package")
    return section[start:section.index("\ndashboards/", start)]


def _folder_blocks(section: str) -> dict[str, str]:
    """The map's flashwatch/ block cut at each `  <part>/` line: {"": the package's own
    modules, "kernels": kernels/'s entry, ...}."""
    blocks, name = {"": ""}, ""
    for line in _package_block(section).split("\n"):
        m = re.match(r"^  (\w+)/\s", line)
        if m:
            name = m.group(1)
            blocks[name] = ""
        blocks[name] += line + "\n"
    return blocks


def test_design_module_map_names_every_module():
    """docs/design.md §2 names every module of flashwatch/ in the block of its own folder
    (every subpackage has a block), every benchmark script, every test file that is not a
    test_*.py, and every page of docs/."""
    section = _module_map()
    blocks = _folder_blocks(section)
    assert sorted(set(blocks) - {""}) == PARTS, "the map's folders are not the package's"
    missing = [f"flashwatch/{part + '/' if part else ''}{p.name}"
               for part in ("", *PARTS) for p in sorted((PACKAGE / part).glob("*.py"))
               if p.name != "__init__.py" or part == ""
               if not _names(p.name, blocks[part])]
    files = sorted((ROOT / "benchmarks").glob("*.py"))
    files += [p for p in sorted((ROOT / "tests").glob("*.py"))
              if not p.name.startswith("test_") and p.name != "__init__.py"]
    files += [p for p in sorted(DOCS.glob("*.md")) if p.name != "design.md"]
    missing += [str(p.relative_to(ROOT)) for p in files if not _names(p.name, section)]
    assert not missing, f"docs/design.md §2 (module map) does not name {missing}"


def test_design_module_map_names_no_module_that_does_not_exist():
    """Every *.py a folder's block of the map names is a module of that folder."""
    wrong = []
    for part, text in _folder_blocks(_module_map()).items():
        named = set(re.findall(r"(?<![\w/])(\w+\.py)\b", text))
        wrong += [f"{part}/{n}" for n in named if not (PACKAGE / part / n).exists()]
        assert named, f"the map's {part or 'flashwatch'}/ block names no module"
    assert not wrong, sorted(wrong)


def test_tests_mirror_the_package():
    """tests/<part>/ exists only for a part of the package (and tests/trainers, the real
    trainers' models in .venv-trainers), and a test of a part's module sits in that part's
    folder (tests/monitor/test_probe.py for flashwatch/monitor/probe.py)."""
    test_dirs = sorted(p.name for p in (ROOT / "tests").iterdir()
                       if p.is_dir() and p.name != "__pycache__")
    assert set(test_dirs) <= set(PARTS) | {"trainers"}, test_dirs
    misplaced = [f"{t.relative_to(ROOT)} (flashwatch/{part}/{t.name[5:]})"
                 for part in PARTS for t in sorted((ROOT / "tests").rglob("test_*.py"))
                 if (PACKAGE / part / t.name[5:]).exists() and t.parent.name != part
                 and not (PACKAGE / t.name[5:]).exists() and t.parent.name != "trainers"]
    assert not misplaced, misplaced


def test_readme_stays_a_ten_minute_read():
    """≤ 250 lines: what it is, the two commands, three quickstarts, the metrics, what to
    do, results, links; everything else lives in docs/."""
    n = len(README.read_text().splitlines())
    assert n <= 250, f"README.md has {n} lines; move detail to docs/ and link it"
