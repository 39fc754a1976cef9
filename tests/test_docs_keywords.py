"""README's and docs/migration.md's tables of the keywords aioload adds to torch's DataLoader
name every one of them, and nothing else."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest
import torch

import aioload

ROOT = Path(__file__).resolve().parent.parent

TORCH_SINCE = {"in_order"}  # torch's own since torch 2.6: absent from older torch's signature


def added_keywords() -> set[str]:
    ours = set(inspect.signature(aioload.DataLoader.__init__).parameters)
    torch_own = set(inspect.signature(torch.utils.data.DataLoader.__init__).parameters)
    return ours - torch_own - TORCH_SINCE


def table_keywords(text: str) -> set[str]:
    """The names in backticks in the first column of a markdown table (`name` or `name=...`)."""
    names = set()
    for line in text.splitlines():
        if line.startswith("| `"):
            first = line.split("|")[1]
            names |= {re.match(r"\w+", cell).group() for cell in re.findall(r"`([^`]+)`", first)}
    return names


def section(path: str, heading: str) -> str:
    text = (ROOT / path).read_text()
    body = text.split(heading + "\n", 1)[1]
    return re.split(r"\n#+ ", body, maxsplit=1)[0]


@pytest.mark.parametrize(("path", "heading"), [
    ("docs/migration.md", "## What aioload adds (keyword-only)"),
    ("README.md", "## The one-line change"),
])
def test_the_tables_of_added_keywords_are_complete(path, heading):
    assert table_keywords(section(path, heading)) == added_keywords()


def test_the_added_keywords_are_keyword_only():
    parameters = inspect.signature(aioload.DataLoader.__init__).parameters
    assert all(parameters[name].kind is inspect.Parameter.KEYWORD_ONLY for name in added_keywords())


def signature_defaults() -> dict[str, object]:
    parameters = inspect.signature(aioload.DataLoader.__init__).parameters
    return {name: parameters[name].default for name in added_keywords()}


def _value(text: str):
    """A default as the docs write it: a Python literal, or (not a literal) a sentence saying what
    ``None`` stands for, such as ``max(2, prefetch_factor × num_workers / 2)``."""
    try:
        return ast.literal_eval(text.strip())
    except (ValueError, SyntaxError):
        return DESCRIBED


DESCRIBED = object()


def readme_defaults() -> dict[str, object]:
    """README's table: `name`, `name` | `default`, `default` | what it does."""
    defaults = {}
    for line in section("README.md", "## The one-line change").splitlines():
        if line.startswith("| `"):
            names_cell, default_cell = line.split("|")[1:3]
            names = re.findall(r"`(\w+)`", names_cell)
            values = re.findall(r"`([^`]+)`", default_cell) or [default_cell]
            assert len(values) == len(names), f"README.md: one default per keyword in the row {line[:60]!r}"
            defaults.update(zip(names, map(_value, values)))
    return defaults


def migration_defaults() -> dict[str, object]:
    """docs/migration.md's table: `name=default`, ... | meaning."""
    defaults = {}
    for line in section("docs/migration.md", "## What aioload adds (keyword-only)").splitlines():
        if line.startswith("| `"):
            for cell in re.findall(r"`([^`]+)`", line.split("|")[1]):
                name, _, value = cell.partition("=")
                assert value, f"docs/migration.md: {name} is listed without its default"
                defaults[name] = _value(value)
    return defaults


@pytest.mark.parametrize("documented", [readme_defaults, migration_defaults], ids=["README", "migration"])
def test_the_tables_show_the_defaults_of_the_signature(documented):
    wrong = {}
    for name, default in signature_defaults().items():
        shown = documented()[name]
        # a description stands for None only (what the loader then picks); anything else is the value
        if (shown is DESCRIBED and default is not None) or (shown is not DESCRIBED and (type(shown), shown) != (type(default), default)):
            wrong[name] = (shown if shown is not DESCRIBED else "a description", default)
    assert not wrong, f"documented default vs the signature's: {wrong}"
