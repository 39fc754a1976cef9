"""docs/architecture.md's module map names every module of the package, and nothing else."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _mapped() -> set[str]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text.split("## Module map", 1)[1].split("\n## ", 1)[0]
    names = set()
    for line in table.splitlines():
        if line.startswith("| `"):
            first_cell = line.split("|")[1]
            names |= set(re.findall(r"`([\w/]+\.py)`", first_cell))
    return names


def _modules() -> set[str]:
    package = ROOT / "aioload"
    found = {str(p.relative_to(package)) for p in package.rglob("*.py")}
    # a subpackage's __init__.py is a docstring naming its modules (said once, under the table)
    return {name for name in found if not (name.endswith("/__init__.py"))}


def test_the_module_map_matches_the_tree():
    mapped, modules = _mapped(), _modules()
    assert sorted(modules - mapped) == [], "modules missing from docs/architecture.md's module map"
    assert sorted(mapped - modules) == [], "modules in the map that are not in the package"


def test_every_subpackage_says_what_its_modules_do():
    for init in (ROOT / "aioload").glob("*/__init__.py"):
        doc = init.read_text()
        modules = {p.stem for p in init.parent.glob("*.py") if p.name != "__init__.py"}
        if init.parent.name == "integrations":
            continue  # a public namespace: its modules document themselves
        missing = {m for m in modules if f"``{m}``" not in doc}
        assert not missing, (init.parent.name, sorted(missing))
