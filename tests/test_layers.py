"""The package's layers import downward only: front end -> engine -> workers -> hand-off and
storage, with the statistics (``_observe``) and the base modules below the engine; and no
module takes another module's private name (``_name``). Read from the source (every import,
also those inside functions; those only for type checkers excepted)."""

from __future__ import annotations

import ast
import pathlib

import pytest

import aioload

pytestmark = pytest.mark.unit  # no worker process, no thread pool: `pytest -m unit` runs these in seconds

PACKAGE = pathlib.Path(aioload.__file__).parent

FRONT = "front end"
ENGINE = "engine"
WORKERS = "workers"
BELOW = "hand-off and storage"
OBSERVE = "statistics"
BASE = "base"

LAYERS = {
    FRONT: ("aioload", "aioload.__main__", "aioload._front.loader", "aioload._front.iterator", "aioload._front.inprocess",
            "aioload._front.epoch", "aioload._front.resources", "aioload._front.compat", "aioload.integrations", "aioload._tools"),
    ENGINE: ("aioload._engine",),
    WORKERS: ("aioload._workers",),
    BELOW: ("aioload._handoff", "aioload._storage"),
    OBSERVE: ("aioload._observe",),
    BASE: ("aioload._data.reads", "aioload._data.limiter", "aioload._base.errors", "aioload._data.dataset", "aioload._base.seeding",
           "aioload._data.strings"),
}
"""The layers, by module prefix. The datasets (``images``, ``_shards``, ``_media``, ``_mix``) and
the planner (``_plan.sampling``, ``_plan``, ``_plan.resume``) sit beside the front end and are not listed."""

FORBIDDEN = {
    ENGINE: {FRONT},
    WORKERS: {FRONT, ENGINE, OBSERVE},
    BELOW: {FRONT, ENGINE, WORKERS, OBSERVE},
    OBSERVE: {FRONT, ENGINE, WORKERS},
    BASE: {FRONT, ENGINE, WORKERS, OBSERVE},
}
"""What each layer must not import: anything above it."""


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


def test_the_layers_cover_the_engine_and_what_lies_under_it():
    """Every module of the engine, the workers, the hand-off, storage and statistics is placed."""
    for path in SOURCES:
        name = module_name(path)
        if name.split(".")[1:2] and name.split(".")[1] in ("_engine", "_workers", "_handoff", "_storage", "_observe"):
            assert layer_of(name) is not None, name


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


def test_the_check_sees_an_upward_import(tmp_path):
    """The checks above read what they must: an engine module that imports the loader, or a
    private name, is found (a file written here, read by the same functions)."""
    fake = tmp_path / "reads.py"
    fake.write_text("from aioload._front.loader import DataLoader\nfrom aioload._front.inprocess import _AllSkipped\n"
                    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from aioload._front.iterator import X\n")
    found = imports(fake)
    assert found == [("aioload._front.loader", ["DataLoader"]), ("aioload._front.inprocess", ["_AllSkipped"])]
    assert layer_of("aioload._engine.reads") == ENGINE and layer_of("aioload._front.loader") == FRONT
    assert FRONT in FORBIDDEN[layer_of("aioload._engine.reads")]
