"""Shard lists: brace patterns (``train-{000000..000999}.tar``, ``{a,b}``) and lists of them.

The pattern syntax is WebDataset's (and the shell's): ``{lo..hi}`` counts from ``lo`` to
``hi`` inclusive, zero-padded to the width of ``lo`` when it starts with a 0 (or when both
ends have the same width); ``{x,y,z}`` is each alternative in turn; several braces multiply
out, leftmost slowest. A list expands each of its entries, in order.
"""

from __future__ import annotations

import os
import re
from typing import Iterable

_BRACE = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"^(\d+)\.\.(\d+)$")
MAX_SHARDS = 10_000_000


def _alternatives(inner: str, pattern: str) -> list[str]:
    match = _RANGE.match(inner)
    if match is None:
        if "," not in inner:
            raise ValueError(f"the brace {{{inner}}} in the shard pattern {pattern!r} is neither a range "
                             "{lo..hi} of numbers nor a list {a,b}")
        return inner.split(",")
    lo_text, hi_text = match.groups()
    lo, hi = int(lo_text), int(hi_text)
    if hi < lo:
        raise ValueError(f"the range {{{inner}}} in the shard pattern {pattern!r} counts down: write {{lo..hi}} "
                         "with lo <= hi")
    if hi - lo + 1 > MAX_SHARDS:
        raise ValueError(f"the range {{{inner}}} in the shard pattern {pattern!r} names more than "
                         f"{MAX_SHARDS} shards")
    width = len(lo_text) if (lo_text.startswith("0") or len(lo_text) == len(hi_text)) else 0
    return [str(i).zfill(width) for i in range(lo, hi + 1)]


def expand(pattern: str) -> list[str]:
    """Every name ``pattern`` stands for, in order."""
    match = _BRACE.search(pattern)
    if match is None:
        if "{" in pattern or "}" in pattern:
            raise ValueError(f"the shard pattern {pattern!r} has an unmatched brace")
        return [pattern]
    head, tail = pattern[:match.start()], pattern[match.end():]
    return [name for alt in _alternatives(match.group(1), pattern) for name in expand(head + alt + tail)]


def shard_urls(urls: str | os.PathLike | Iterable[str | os.PathLike]) -> list[str]:
    """The shard URLs (or paths) of a pattern, a path, or a list of them."""
    if isinstance(urls, (str, os.PathLike)):
        entries = [os.fspath(urls)]
    else:
        try:
            entries = [os.fspath(u) for u in urls]
        except TypeError:
            raise TypeError(f"urls must be a shard URL or path, a brace pattern, or a list of them, got "
                            f"{type(urls).__name__}") from None
    out = [name for entry in entries for name in expand(entry)]
    if not out:
        raise ValueError("no shards: urls is an empty list")
    return out
