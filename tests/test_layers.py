"""The package's layers import downward only, from the command line to storage (see
docs/architecture.md's module map): every module is placed, none imports a layer above its
own, no modules import each other in a circle, and the house stands on at most ten floors.
No module takes another module's private name (``_name``). Read from the source (every
import, also those inside functions; those only for type checkers excepted)."""

from __future__ import annotations

import ast
import pathlib

import pytest

import aioload

pytestmark = pytest.mark.unit  # no worker process, no thread pool: `pytest -m unit` runs these in seconds

PACKAGE = pathlib.Path(aioload.__file__).parent

COMMAND = "command line"
FACE = "public face"
FRONT = "front end"
DATASETS = "datasets"
PLAN = "plan"
ENGINE = "engine"
WORKERS = "workers"
OBSERVE = "statistics"
SOURCES_BELOW = "images and mixes"
DATA = "reads and datasets"
BASE = "base"
BELOW = "hand-off and storage"

LAYERS = {
    COMMAND: ("aioload.__main__", "aioload._tools"),
    FACE: ("aioload", "aioload.integrations"),
    FRONT: ("aioload._front",),
    DATASETS: ("aioload._tokens", "aioload._parquet", "aioload._shards", "aioload._media"),
    PLAN: ("aioload._plan",),
    ENGINE: ("aioload._engine",),
    WORKERS: ("aioload._workers",),
    OBSERVE: ("aioload._observe",),
    SOURCES_BELOW: ("aioload.images", "aioload._mix"),
    DATA: ("aioload._data",),
    BASE: ("aioload._base",),
    BELOW: ("aioload._handoff", "aioload._storage", "aioload.transforms"),
}
"""The layers, by module prefix, from the top down: a module imports its own layer and those
below it, never one above."""

APART = {(WORKERS, OBSERVE), (OBSERVE, WORKERS)}
"""Layers side by side, neither importing the other: the workers report nothing to the
statistics, which only read what the engine hands them."""

ORDER = list(LAYERS)
FORBIDDEN = {layer: set(ORDER[:i]) | {other for mine, other in APART if mine == layer} for i, layer in enumerate(ORDER)}
"""What each layer must not import: anything above it, and the layer it stands apart from."""

MAX_FLOORS = 10
"""The longest chain of imports between the package's rooms (a subpackage, or a module at its
root, is one room), counted in rooms."""


def layer_of(module: str) -> str | None:
    best = None
    for layer, prefixes in LAYERS.items():
        for prefix in prefixes:
            within = module == prefix or (prefix != "aioload" and module.startswith(prefix + "."))
            if within and (best is None or len(prefix) > len(best[1])):
                best = (layer, prefix)
    return best[0] if best else None


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking_only(node: ast.AST, parents: dict) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def imports(path: pathlib.Path) -> list[tuple[str, list[str]]]:
    """``(module, names)`` for every ``aioload`` import of the file at ``path``."""
    tree = ast.parse(path.read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        if _type_checking_only(node, parents):
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.split(".")[0] == "aioload":
            found.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names if a.name.split(".")[0] == "aioload"]
    return found


SOURCES = sorted(PACKAGE.rglob("*.py"))


def _is_module(parent: str, name: str) -> bool:
    base = PACKAGE.parent.joinpath(*parent.split("."), name)
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def test_every_module_is_placed_on_a_layer():
    assert [module_name(path) for path in SOURCES if layer_of(module_name(path)) is None] == []


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down(path):
    here = module_name(path)
    layer = layer_of(here)
    upward = []
    for target, _ in imports(path):
        there = layer_of(target)
        if layer in FORBIDDEN and there in FORBIDDEN[layer]:
            upward.append(f"{target} ({there})")
    assert not upward, f"{here} ({layer}) imports upward: {upward}"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_takes_another_modules_private_names(path):
    here = module_name(path)
    taken = [f"{target}.{name}" for target, names in imports(path) for name in names
             if name.startswith("_") and not name.startswith("__") and target != here and not _is_module(target, name)]
    assert not taken, f"{here} imports private names: {taken}"


def resolved(path: pathlib.Path) -> set[str]:
    """The package's modules that the file at ``path`` imports (relative imports resolved; a
    name imported from a package, where it is a module, counts as that module)."""
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = set()
    for node in ast.walk(tree):
        if _type_checking_only(node, parents):
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "aioload"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.split(".")[0] != "aioload":
                continue
            for alias in node.names:
                found.add(f"{module}.{alias.name}" if _is_module(module, alias.name) else module)
    return found - {here}


def _graph(room=lambda name: name) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in SOURCES:
        here = room(module_name(path))
        graph.setdefault(here, set()).update(room(t) for t in resolved(path) if room(t) != here)
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                top = stack.pop()
                group.append(top)
                if top == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def room_of(module: str) -> str:
    """A subpackage of the package's root, or a module at its root, is one room."""
    return ".".join(module.split(".")[:2])


def floors(graph: dict[str, set[str]]) -> int:
    """How many rooms the longest chain of imports passes (the graph has no circle)."""
    height: dict[str, int] = {}

    def of(node: str) -> int:
        if node not in height:
            height[node] = 1 + max((of(other) for other in graph.get(node, ())), default=0)
        return height[node]

    return max(of(node) for node in graph)


def test_no_modules_import_each_other_in_a_circle():
    assert _circles(_graph()) == []


def test_no_rooms_import_each_other_in_a_circle_and_the_house_has_at_most_ten_floors():
    rooms = _graph(room_of)
    assert _circles(rooms) == []
    assert floors(rooms) <= MAX_FLOORS


def test_the_check_sees_an_upward_import(tmp_path):
    """The checks above read what they must: an engine module that imports the loader, or a
    private name, is found (a file written here, read by the same functions); a circle and the
    floors of a chain are counted."""
    fake = tmp_path / "reads.py"
    fake.write_text("from aioload._front.loader import DataLoader\nfrom aioload._front.inprocess import _AllSkipped\n"
                    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from aioload._front.iterator import X\n")
    found = imports(fake)
    assert found == [("aioload._front.loader", ["DataLoader"]), ("aioload._front.inprocess", ["_AllSkipped"])]
    assert layer_of("aioload._engine.reads") == ENGINE and layer_of("aioload._front.loader") == FRONT
    assert FRONT in FORBIDDEN[layer_of("aioload._engine.reads")]
    assert OBSERVE in FORBIDDEN[WORKERS] and DATA not in FORBIDDEN[WORKERS]
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert floors({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == 3
