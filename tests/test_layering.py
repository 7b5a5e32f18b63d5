"""The package's parts depend one way (docs/design.md §2): no part imports a part above it,
no import cycle between modules, and no private name crosses a part's border.

Read from the source with `ast` (no import runs), every import counted: at module top,
inside functions (a lazy import is still a dependency) and under `if TYPE_CHECKING:`
(a type named across a border is a dependency too). Each rule is also run on a small
planted tree, so the test is shown to catch what it forbids.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "flashwatch"

# A part is a subpackage of flashwatch/ or one module at its top. A part may import
# itself and the parts of a LOWER rank, never one of its own rank or above. The order
# is the data flow's: the kernel, where the heads are, the numbers, what to do about
# them, the monitored step, the watcher, the tools on top.
RANK = {
    "_checks": 0,
    "kernels": 1,
    "config": 2,  # WatchConfig reads kernels/dispatch.py's backend names
    "report": 3, "sites": 3, "signals": 3,
    "parallel": 4,
    "mitigation": 5,
    "monitor": 6,
    "watcher": 7, "sinks": 7, "nanogpt": 7, "synccount": 7,
    "diagnosis": 8,
    "__init__": 9,  # the public API: `import flashwatch`
    "integrations": 10,
    "demo": 11,
    "cli": 12,
}


class Module:
    def __init__(self, name: str, tree: ast.Module):
        self.name = name  # dotted, e.g. "flashwatch.monitor.probe"
        self.tree = tree

    @property
    def part(self) -> str:
        parts = self.name.split(".")
        return "__init__" if len(parts) == 1 else parts[1]


def load(root: Path) -> dict[str, Module]:
    mods = {}
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root.parent).with_suffix("").parts
        name = ".".join(rel[:-1] if rel[-1] == "__init__" else rel)
        mods[name] = Module(name, ast.parse(f.read_text(), str(f)))
    return mods


def resolve(mod: Module, node: ast.ImportFrom, alias: str, mods) -> tuple[str, list[str]]:
    """`from <node> import <alias>` in mod: (the module it reaches, the names it takes):
    (flashwatch.monitor.probe, []) for a submodule, (flashwatch.kernels.op, ["_x"]) for a
    name."""
    if node.level:  # relative: against this module's package
        is_pkg = "." not in mod.name or any(m.startswith(mod.name + ".") for m in mods)
        base = mod.name.split(".")
        base = base[:len(base) - node.level + (1 if is_pkg else 0)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    sub = f"{target}.{alias}"
    return (sub, []) if sub in mods else (target, [alias])


def imports(mod: Module, mods: dict[str, Module]):
    """(imported module, names taken from it, line, local binding of a module or None)
    for every import of the package."""
    top = mod.name.split(".")[0]
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == top:  # `import x.y` binds `x` only
                    yield a.name, [], node.lineno, a.asname
        elif isinstance(node, ast.ImportFrom):
            for a in node.names:
                target, names = resolve(mod, node, a.name, mods)
                if target.split(".")[0] == top:
                    yield target, names, node.lineno, None if names else a.asname or a.name


def violations(mods: dict[str, Module]) -> dict[str, list[str]]:
    found = {"upward": [], "private": [], "unknown": [], "cycle": []}
    graph = {name: set() for name in mods}
    for mod in mods.values():
        if mod.part not in RANK:
            found["unknown"].append(f"{mod.name}: a part with no rank in RANK")
            continue
        for target, names, line, _ in imports(mod, mods):
            if target not in mods:
                found["unknown"].append(f"{mod.name}:{line} imports {target}, not a module")
                continue
            dep = mods[target]
            graph[mod.name].add(target)
            if dep.part != mod.part and RANK.get(dep.part, -1) >= RANK[mod.part]:
                found["upward"].append(f"{mod.name}:{line} ({mod.part}, rank {RANK[mod.part]})"
                                       f" imports {target} ({dep.part}, rank "
                                       f"{RANK.get(dep.part)})")
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private and dep.part != mod.part:
                found["private"].append(f"{mod.name}:{line} imports {private} from {target}")
        found["private"] += private_attributes(mod, mods)
    found["cycle"] = [" -> ".join(c) for c in cycles(graph)]
    return found


def private_attributes(mod: Module, mods: dict[str, Module]) -> list[str]:
    """`probe._x` where `probe` names a module of another part (`from flashwatch.monitor
    import probe`, `import flashwatch.monitor.probe as probe`)."""
    bound = {local: target for target, _, _, local in imports(mod, mods)
             if local and target in mods and mods[target].part != mod.part}
    out = []
    for node in ast.walk(mod.tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in bound and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            out.append(f"{mod.name}:{node.lineno} reads {bound[node.value.id]}.{node.attr}")
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph[v]:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_package_keeps_its_layers():
    mods = load(PACKAGE)
    assert len(mods) > 40 and {m.part for m in mods.values()} == set(RANK), (
        sorted({m.part for m in mods.values()} ^ set(RANK)))
    found = violations(mods)
    assert found == {"upward": [], "private": [], "unknown": [], "cycle": []}, found


def _plant(tmp_path: Path, files: dict[str, str]) -> dict[str, Module]:
    root = tmp_path / "flashwatch"
    for rel, text in {"__init__.py": "", "kernels/__init__.py": "",
                      "monitor/__init__.py": "", **files}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return load(root)


@pytest.mark.parametrize("files, kind", [
    ({"kernels/op.py": "def f():\n    from flashwatch.monitor import probe\n",
      "monitor/probe.py": ""}, "upward"),
    ({"kernels/op.py": "from flashwatch.watcher import Watcher\n",
      "watcher.py": "class Watcher: ...\n"}, "upward"),
    ({"monitor/probe.py": "from flashwatch.kernels.op import _helper\n",
      "kernels/op.py": "def _helper(): ...\n"}, "private"),
    ({"monitor/probe.py": "from flashwatch.kernels import op\nop._helper()\n",
      "kernels/op.py": "def _helper(): ...\n"}, "private"),
    ({"monitor/a.py": "from flashwatch.monitor import b\n",
      "monitor/b.py": "def f():\n    from flashwatch.monitor.a import g\n"}, "cycle"),
    ({"kernels/a.py": "from . import b\n", "kernels/b.py": "from .a import x\n"}, "cycle"),
    ({"monitor/probe.py": "from flashwatch.nothere import x\n"}, "unknown"),
])
def test_each_rule_catches_a_planted_breach(tmp_path, files, kind):
    found = violations(_plant(tmp_path, files))
    assert found[kind], found
    assert all(not v for k, v in found.items() if k != kind), found


def test_a_planted_tree_that_keeps_the_rules_passes(tmp_path):
    found = violations(_plant(tmp_path, {
        "kernels/op.py": "def _own(): ...\ndef f():\n    return _own()\n",
        "monitor/probe.py": "from flashwatch.kernels import op\nfrom flashwatch.kernels.op"
                            " import f\nop.f()\n",
        "monitor/step.py": "from flashwatch.monitor.probe import op\nfrom . import probe\n"}))
    assert found == {"upward": [], "private": [], "unknown": [], "cycle": []}, found
