"""The package's shape, checked from its source (docs/architecture.md, "Rules"): no class over 300
lines, no import cycle between the package's modules (type-hint imports included), the server's
rooms importing one way only, no module reaching into another module's private names, nothing
importing `cli/`, and the tests and the benchmarks apart (what both use is `testbed/`)."""

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


def _import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports, from every import statement: at module level, under
    `if TYPE_CHECKING:` (type hints are imports too: they name the module, and a reader follows them),
    and inside functions. Importing `a.b.c` runs `a/__init__` and `a/b/__init__` first, so each
    package `__init__` on the way is imported too (except the importer's own packages, already running)."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}

    def packages(name: str) -> set[str]:
        parts = name.split(".")
        return {".".join(parts[:i]) for i in range(1, len(parts))}

    for module, tree in MODULES.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lerobot_zenoh"):
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module
                           for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("lerobot_zenoh")]
            else:
                continue
            for target in targets:
                graph[module].update(t for t in {target} | packages(target)
                                     if t in MODULES and t != module and t not in packages(module))
    return graph


GRAPH = _import_graph()


def test_no_import_cycle_between_modules():
    """No cycle among the package's modules, type-hint and function-level imports included: an
    interface or a shared record lives in a leaf module that its users import (e.g.
    `server/engine/interface.py`), never in the module of one of its users."""
    state: dict[str, int] = {}
    cycles = []

    def walk(module, stack):
        state[module] = 1
        for target in sorted(GRAPH[module]):
            if state.get(target) == 1:
                cycles.append(" -> ".join(stack[stack.index(target):] + [target]))
            elif target not in state:
                walk(target, stack + [target])
        state[module] = 2

    for module in sorted(GRAPH):
        if module not in state:
            walk(module, [module])
    assert not cycles


SERVER = "lerobot_zenoh.server"


def _server_rooms() -> dict[str, set[str]]:
    """Each sub-package of `server/` -> the sub-packages its `__init__` docstring says it may import
    (its line `May import (server/): a, b, c.`, or `nothing.`)."""
    rooms = {}
    for module, tree in MODULES.items():
        if module.count(".") != 2 or not module.startswith(SERVER + ".") or not (PACKAGE / "server" / module.split(".")[2]).is_dir():
            continue
        found = re.search(r"^May import \(server/\): ([^.]*)\.", ast.get_docstring(tree) or "", re.M)
        assert found, f"{module}: its __init__ docstring has no 'May import (server/): ...' line"
        rooms[module.split(".")[2]] = {n.strip() for n in found.group(1).split(",")} - {"nothing"}
    return rooms


def test_the_server_is_rooms_whose_imports_point_one_way():
    """`server/` holds sub-packages only; each imports only the rooms its `__init__` names, and what
    they name is an order (no two rooms may import each other, even through a third)."""
    flat = [p.name for p in (PACKAGE / "server").glob("*.py") if p.name != "__init__.py"]
    assert not flat, f"modules outside the rooms of server/: {flat}"
    rooms = _server_rooms()
    # A room's __init__ is its map and imports nothing, so importing one module of a room loads no
    # other (runners/ excepted: its __init__ is the registry plugins import).
    loud = [room for room in rooms if room != "runners" and GRAPH[f"{SERVER}.{room}"]]
    assert not loud, f"rooms whose __init__ imports modules: {loud}"
    assert set().union(*rooms.values()) <= set(rooms), "a room names a room that does not exist"

    def below(room, seen=()):
        assert room not in seen, f"rooms that may import each other: {' -> '.join((*seen, room))}"
        return set().union(*(below(r, (*seen, room)) | {r} for r in rooms[room])) if rooms[room] else set()

    for room in rooms:
        below(room)

    def room_of(module):
        parts = module.split(".")
        return parts[2] if len(parts) > 2 and parts[:2] == SERVER.split(".") and parts[2] in rooms else None

    found = [f"{module} -> {target}" for module, targets in GRAPH.items() if room_of(module)
             for target in sorted(targets) if room_of(target) not in (None, room_of(module))
             and room_of(target) not in rooms[room_of(module)]]
    assert not found


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


def _run_in_children(tree: ast.Module) -> set[str]:
    """Modules a file runs in another process: `python -m a.b` names, and what a `python -c` code
    string imports (a string that parses as Python holding an import)."""
    names = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
            continue
        if re.fullmatch(r"\w+(\.\w+)+", node.value) and not node.value.endswith(".py"):
            names.add(node.value)
        elif "import" in node.value:
            try:
                names |= _imported(ast.parse(node.value))
            except SyntaxError:
                pass
    return names


def test_tests_and_benchmarks_import_nothing_of_each_other():
    """tests/ imports nothing from benchmarks/, benchmarks/ nothing from tests/' helper modules, and
    testbed/ (what both use) nothing from either; not even in a child process (`python -m x`, or a
    `python -c` string's imports)."""
    test_helpers = {p.stem for p in (ROOT / "tests").glob("*.py")} | {
        p.name for p in (ROOT / "tests").iterdir() if p.is_dir() and any(p.glob("*.py"))}

    def reached(tree):
        return _imported(tree) | _run_in_children(tree)

    found = [f"{path}: {name}" for path, tree in _sources(ROOT / "tests").items()
             for name in sorted(reached(tree)) if _under(name, "benchmarks")]
    found += [f"{path}: {name}" for path, tree in _sources(ROOT / "benchmarks").items()
              for name in sorted(reached(tree)) if name.split(".")[0] in test_helpers | {"tests"}]
    found += [f"{path}: {name}" for path, tree in _sources(ROOT / "testbed").items()
              for name in sorted(reached(tree)) if name.split(".")[0] in test_helpers | {"tests", "benchmarks"}]
    assert not found
