"""The package's shape, checked from its source (docs/architecture.md, "Rules"): no class over 300
lines, no import cycle between the package's modules at import time, no module reaching into
another module's private names, nothing importing `cli/`, and the tests and the benchmarks apart
(what both use is `testbed/`)."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

pytestmark = pytest.mark.core

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "lerobot_zenoh"
MAX_CLASS_LINES = 300


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(("lerobot_zenoh", *path.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(".__init__")
        out[name] = ast.parse(path.read_text(), str(path))
    return out


MODULES = _modules()


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_no_class_is_over_300_lines():
    big = [f"{module}.{node.name}: {node.end_lineno - node.lineno + 1} lines"
           for module, tree in MODULES.items() for node in ast.walk(tree)
           if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES]
    assert not big


def test_no_module_imports_another_modules_private_names():
    found = [f"{module}: from {node.module} import {alias.name}"
             for module, tree in MODULES.items() for node in ast.walk(tree)
             if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lerobot_zenoh")
             for alias in node.names if _private(alias.name)]
    assert not found


def test_no_module_reads_a_private_attribute_only_another_module_defines():
    """`x._name` outside `self`/`cls`, where `_name` is defined (assigned on `self`, or a method)
    in some other module of the package and nowhere in this one."""
    defined: dict[str, set[str]] = defaultdict(set)
    for module, tree in MODULES.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and _private(node.name):
                defined[node.name].add(module)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _private(node.attr):
                defined[node.attr].add(module)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and _private(node.id):
                defined[node.id].add(module)
    found = []
    for module, tree in MODULES.items():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _private(node.attr)):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            owners = defined.get(node.attr, set())
            if owners and module not in owners:
                found.append(f"{module}:{node.lineno}: {ast.unparse(node)} (defined in {', '.join(sorted(owners))})")
    assert not found


def test_no_import_cycle_between_modules():
    """Imports executed at import time (module level, outside `if TYPE_CHECKING`) form no cycle."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}

    def visit(body, module):
        for node in body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lerobot_zenoh"):
                for alias in node.names:
                    target = f"{node.module}.{alias.name}"
                    graph[module].add(target if target in MODULES else node.module)
            elif isinstance(node, ast.Import):
                graph[module].update(a.name for a in node.names if a.name in MODULES)
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body, module)

    for module, tree in MODULES.items():
        visit(tree.body, module)
    state: dict[str, int] = {}
    cycles = []

    def walk(module, stack):
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if target not in graph or target == module:
                continue
            if state.get(target) == 1:
                cycles.append(" -> ".join(stack[stack.index(target):] + [target]))
            elif target not in state:
                walk(target, stack + [target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            walk(module, [module])
    assert not cycles


def _imported(tree: ast.Module) -> set[str]:
    """Every module name an import statement anywhere in `tree` names (function-level imports too), with
    `from a import b` giving both `a` and `a.b`."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _sources(folder: Path) -> dict[str, ast.Module]:
    return {str(path.relative_to(ROOT)): ast.parse(path.read_text(), str(path)) for path in sorted(folder.rglob("*.py"))}


def test_nothing_in_the_package_imports_cli():
    """`cli/` holds the console scripts' entry points; what they share with others (flag parsing:
    `command_line.py`) lives below them."""
    found = [f"{module}: {name}" for module, tree in MODULES.items() if not _under(module, "lerobot_zenoh.cli")
             for name in sorted(_imported(tree)) if _under(name, "lerobot_zenoh.cli")]
    assert not found


#: Test helpers a benchmark still imports, until they move to testbed/: the fault kit's TCP floods
#: (benchmarks/studies/openpi_door_faults.py).
BENCHMARKS_MAY_IMPORT_FROM_TESTS = {"fault_kit"}


def test_tests_and_benchmarks_import_nothing_of_each_other():
    """tests/ imports nothing from benchmarks/ (not even `python -m benchmarks.x`), benchmarks/ nothing
    from tests/' helper modules, and testbed/ (what both use) nothing from either."""
    test_helpers = {p.stem for p in (ROOT / "tests").glob("*.py")} | {
        p.name for p in (ROOT / "tests").iterdir() if p.is_dir() and any(p.glob("*.py"))}

    def runs_a_benchmark(tree):
        return [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
                and re.fullmatch(r"benchmarks(\.\w+)+", node.value)]

    found = [f"{path}: {name}" for path, tree in _sources(ROOT / "tests").items()
             for name in sorted(_imported(tree) | set(runs_a_benchmark(tree))) if _under(name, "benchmarks")]
    found += [f"{path}: {name}" for path, tree in _sources(ROOT / "benchmarks").items()
              for name in sorted(_imported(tree))
              if name.split(".")[0] in (test_helpers | {"tests"}) - BENCHMARKS_MAY_IMPORT_FROM_TESTS]
    found += [f"{path}: {name}" for path, tree in _sources(ROOT / "testbed").items()
              for name in sorted(_imported(tree)) if name.split(".")[0] in test_helpers | {"tests", "benchmarks"}]
    assert not found
