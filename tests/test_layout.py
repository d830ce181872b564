"""The package layout's rules (docs/ARCHITECTURE.md), checked on the source itself.

- the core side (core/, geometry/, repair/) never imports torch.distributed or megatron;
- the diagnostics side, the CLI entry and every subcommand's ``--help`` import no torch;
- no import cycle among the package's modules, counting every import statement (module
  level, inside functions, under ``if TYPE_CHECKING``);
- each part imports only what docs/ARCHITECTURE.md's table allows (the runtime never imports
  ``testing``);
- no module outgrows one concept (a sanity bound on its length).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "megatron_media_guard"
NAME = PKG.name
MAX_LINES = 600  # one concept per module; past this a module holds several
CORE_SIDE = ("core", "geometry", "repair")
FORBIDDEN_IN_CORE = ("torch.distributed", "megatron")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(module: str, is_pkg: bool, level: int, target: str | None) -> str:
    if level == 0:
        return target or ""
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _imports(
    path: Path, module_level_only: bool, source: str | None = None
) -> list[tuple[str, int]]:
    """(imported module, line) for every import in ``path``; with ``module_level_only``, the
    ones that run at import (not inside functions, not under ``if TYPE_CHECKING``).
    ``source``: check this text as if it were ``path``'s."""
    tree = ast.parse(path.read_text() if source is None else source, str(path))
    module, is_pkg = _module_name(path), path.name == "__init__.py"
    out: list[tuple[str, int]] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                if not module_level_only:
                    visit(child, False)
                continue
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                if not module_level_only:
                    visit(child, top)
                continue
            if isinstance(child, ast.Import):
                out.extend((a.name, child.lineno) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = _resolve(module, is_pkg, child.level, child.module)
                out.append((base, child.lineno))
                # ``from . import x`` / ``from .pkg import mod``: x may be a submodule
                for a in child.names:
                    sub = f"{base}.{a.name}"
                    path_of = PKG.parent / sub.replace(".", "/")
                    # absolute: ``from torch import distributed`` names the submodule
                    if child.level == 0 or path_of.with_suffix(".py").exists() or path_of.is_dir():
                        out.append((sub, child.lineno))
            visit(child, top)

    visit(tree, True)
    return out


SOURCES = sorted(PKG.rglob("*.py"))


def _rel(path: Path) -> str:
    return str(path.relative_to(PKG.parent))


def _forbidden(path: Path, source: str | None = None) -> list[str]:
    """Every import of torch.distributed or megatron in ``path`` (or ``source``), anywhere."""
    return [
        f"{_rel(path)}:{line} imports {mod}"
        for mod, line in _imports(path, module_level_only=False, source=source)
        if any(mod == f or mod.startswith(f + ".") for f in FORBIDDEN_IN_CORE)
    ]


@pytest.mark.parametrize("side", CORE_SIDE)
def test_core_side_never_imports_distributed_or_megatron(side):
    bad = [v for p in sorted((PKG / side).rglob("*.py")) for v in _forbidden(p)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    "source",
    [
        "import torch.distributed as dist",
        "from torch import distributed",
        "from torch.distributed import all_reduce",
        "def f():\n    from megatron.core import parallel_state",
    ],
)
def test_forbidden_import_check_can_fail(source):
    assert _forbidden(PKG / "core" / "guard.py", source), source


def _graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports, by any import statement anywhere in it (a
    function-level or ``TYPE_CHECKING`` import is an edge too: a cycle hidden there is one)."""
    modules = {_module_name(p): p for p in SOURCES}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for mod, _ in _imports(path, module_level_only=False):
            # importing a.b.c runs a/__init__, a/b/__init__ and a/b/c
            parts = mod.split(".")
            for i in range(1, len(parts) + 1):
                dep = ".".join(parts[:i])
                if dep in modules and dep != name:
                    deps.add(dep)
        graph[name] = deps
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return [*stack[stack.index(dep) :], dep]
            if dep not in state and (cycle := dfs(dep)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := dfs(node)):
            return cycle
    return None


def _without_own_package(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """A package's __init__ importing its own submodules is not a cycle through the package:
    a module's edge to a package that contains it goes."""
    return {name: {d for d in deps if not name.startswith(d + ".")} for name, deps in graph.items()}


def test_no_import_cycle():
    cycle = _find_cycle(_without_own_package(_graph()))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


@pytest.mark.parametrize(
    "graph,cycle",
    [
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
        ({"a": {"a"}}, ["a", "a"]),
        ({"a": {"b", "c"}, "b": {"c"}, "c": set()}, None),  # a diamond is no cycle
        ({"a": {"b"}, "b": set(), "c": {"d"}, "d": {"c"}}, ["c", "d", "c"]),
        ({"p.m": {"p"}, "p": {"p.m"}}, None),  # a package's __init__ importing its submodule
        ({"p.m": {"q"}, "q": {"p.m"}, "p": {"p.m"}}, ["p.m", "q", "p.m"]),
    ],
)
def test_cycle_check_can_fail(graph, cycle):
    """The checker reports a cycle when there is one, and only then."""
    assert _find_cycle(_without_own_package(graph)) == cycle


@pytest.mark.parametrize(
    "module,source,dep",
    [
        ("core/guard.py", "", "core.runs"),  # module level
        ("core/runs.py", "def f():\n    from .guard import MediaGuard", "core.guard"),
        (
            "core/runs.py",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import guard",
            "core.guard",
        ),
    ],
)
def test_cycle_graph_sees_every_import(module, source, dep):
    """The graph holds an edge for every import statement: at module level, inside a function,
    under TYPE_CHECKING (where a cycle was once hidden)."""
    path = PKG / module
    found = {m for m, _ in _imports(path, module_level_only=False, source=source or None)}
    assert f"{NAME}.{dep}" in found, found
    if source:  # the edge closes a cycle through the real graph
        graph = _graph()
        graph[_module_name(path)] |= {f"{NAME}.{dep}"}
        assert _find_cycle(_without_own_package(graph)) is not None


# docs/ARCHITECTURE.md's import table: what each part of the package may import, at module level
# and (UP_INSIDE) only inside a function, lazily (the top's loads). Anything else fails.
_BASE = {"errors", "config"}
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "config": {"errors"},
    "diagnostics": {"errors"},
    "geometry": _BASE,
    "core": _BASE | {"diagnostics", "geometry", "repair"},
    "repair": _BASE | {"diagnostics", "geometry"},
    "families": _BASE | {"core", "geometry", "diagnostics", "repair"},
    "ranks": _BASE | {"core", "diagnostics"},
    "replay": _BASE | {"core", "diagnostics", "geometry"},
    "adapters": _BASE
    | {"core", "diagnostics", "geometry", "repair", "ranks", "families", "replay"},
    "smoke": _BASE
    | {"core", "diagnostics", "geometry", "repair", "ranks", "families", "adapters", "replay"},
    "testing": _BASE
    | {"core", "diagnostics", "geometry", "repair", "ranks", "families", "adapters", "smoke"},
    "launcher": {"adapters"},
    "cli": set(),
    "__main__": {"cli"},
    "__init__": set(),
}
UP_INSIDE: dict[str, set[str]] = {
    # the CLI loads each subcommand's side only when it runs (--help imports no torch)
    "cli": {"diagnostics", "errors", "replay", "smoke"},
    # the package's public names, loaded lazily
    "__init__": {"adapters", "config", "core", "diagnostics", "errors", "families", "geometry"},
}


def test_the_parts_table_is_acyclic():
    """No part reaches up the stack, at module level or inside a function (what UP_INSIDE
    allows is the top's lazy loads: the CLI's subcommands, the package's public names)."""
    parts = {p: set(deps) | UP_INSIDE.get(p, set()) for p, deps in ALLOWED.items()}
    cycle = _find_cycle(parts)
    assert cycle is None, "the import table has a cycle: " + " -> ".join(cycle or [])


def _part(path: Path) -> str:
    parts = _module_name(path).split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _violations(path: Path, source: str | None = None) -> list[str]:
    part = _part(path)
    bad = []
    top = {m for m, _ in _imports(path, module_level_only=True, source=source)}
    for mod, line in _imports(path, module_level_only=False, source=source):
        if not mod.startswith(NAME + "."):
            continue
        dep = mod.split(".")[1]
        if dep == part or dep in ALLOWED[part]:
            continue
        if mod not in top and dep in UP_INSIDE.get(part, set()):
            continue
        where = "at module level" if mod in top else "inside a function"
        bad.append(f"{_rel(path)}:{line} imports {mod} {where} ({part} may not)")
    return bad


def test_every_part_imports_only_what_the_table_allows():
    assert {_part(p) for p in SOURCES} <= set(ALLOWED), "a new part needs a row in ALLOWED"
    bad = [v for p in SOURCES for v in _violations(p)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    "part,source",
    [
        ("core", "from ..adapters import install_vlm"),
        ("core", "from ..replay.bundle_save import save_bundle"),  # up the stack, module level
        ("core", "def f():\n    from ..families.spec import FamilySpec"),
        ("repair", "def f():\n    from ..adapters.vlm import VLMHandle"),
        ("repair", "from ..core.plan import Plan"),  # the core imports repair
        ("families", "from ..adapters.vlm_install import install_vlm"),
        ("geometry", "import torch\nfrom ..core.items import MediaItem"),
        ("adapters", "def f():\n    from ..testing import TEST_GRAMMARS"),  # runtime -> testing
    ],
)
def test_import_table_check_can_fail(part, source):
    path = next(p for p in SOURCES if _part(p) == part and p.name != "__init__.py")
    assert _violations(path, source), source


@pytest.mark.parametrize("path", SOURCES, ids=_rel)
def test_modules_hold_one_concept(path):
    n = len(path.read_text().splitlines())
    assert n <= MAX_LINES, f"{_rel(path)} has {n} lines: it holds more than one concept, split it"


#: the only modules that write a guard's counters: the guard, and the end of every fault path
COUNTER_WRITERS = ("core/guard.py", "core/fault_path.py")


def _counter_writes(source: str) -> list[int]:
    """Lines that write a ``counters`` attribute: assigned, item-assigned (``+=`` too) or
    changed by a dict method."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            changes = node.func.attr in ("update", "clear", "pop", "setdefault", "__setitem__")
            targets = [node.func.value] if changes else []
        else:
            continue
        for t in targets:
            t = t.value if isinstance(t, ast.Subscript) else t
            if isinstance(t, ast.Attribute) and t.attr == "counters":
                out.append(node.lineno)
    return out


def test_only_the_guard_and_its_conclusion_write_the_counters():
    """Adapters return findings and a plan; ``MediaGuard`` counts (docs/ARCHITECTURE.md)."""
    bad = [
        f"{_rel(p)}:{line}"
        for p in SOURCES
        if p.relative_to(PKG).as_posix() not in COUNTER_WRITERS
        for line in _counter_writes(p.read_text())
    ]
    assert not bad, f"guard counters written outside {COUNTER_WRITERS}: {bad}"


@pytest.mark.parametrize(
    "source",
    [
        'guard.counters["dropped"] += 1',
        'self.guard.counters["merges"] = 0',
        "guard.counters.update(dropped=2)",
        "handle.guard.counters = {}",
    ],
)
def test_counter_write_check_can_fail(source):
    assert _counter_writes(source) == [1]
    assert _counter_writes("n = guard.counters['dropped']") == []


TORCH_FREE = """
import sys
import {name}, {name}.cli, {name}.errors, {name}.config
import {name}.diagnostics, {name}.diagnostics.report, {name}.diagnostics.report_format
from {name} import GuardConfig, MediaAlignmentError, MediaGuardError
from {name}.diagnostics import GuardRecord
for argv in (["--help"], ["report", "--help"], ["replay", "--help"], ["smoke", "--help"]):
    try:
        {name}.cli.main(argv)
    except SystemExit:
        pass
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
print("TORCH:" + ",".join(loaded[:5]))
"""


@pytest.mark.timeout(120)
def test_diagnostics_side_and_every_help_import_no_torch():
    out = subprocess.run(
        [sys.executable, "-c", TORCH_FREE.format(name=NAME)],
        capture_output=True,
        text=True,
        timeout=100,
        check=True,
    ).stdout
    line = next(x for x in out.splitlines() if x.startswith("TORCH:"))
    assert line == "TORCH:", f"torch imported by the torch-free side: {line}"
    assert all(f"usage: media-guard {cmd}" in out for cmd in ("report", "replay", "smoke")), out
