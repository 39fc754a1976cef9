"""README's and docs/migration.md's tables of the keywords aioload adds to torch's DataLoader
name every one of them, and nothing else."""

from __future__ import annotations

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
