"""A bounded walk over what an object holds: its own attributes (``__dict__`` and slots) and
the values of its containers, breadth first, each object once. The copy-on-read report walks a
dataset for its large Python containers (``aioload._observe.memory``), the cache figures for
its caches (:func:`caches_of`)."""

from __future__ import annotations

import collections
import types
from typing import Any, Callable, Iterator

CONTAINERS = (list, dict, tuple, set, frozenset)

_LEAVES = (str, bytes, bytearray, memoryview, int, float, complex, type(None), type, types.ModuleType,
           types.FunctionType, types.BuiltinFunctionType, types.MethodType)


def walk(root: Any, name: str, depth: int, limit: int, enter: Callable[[Any], bool]) -> Iterator[tuple[str, Any]]:
    """``(path, obj)`` for ``root`` (named ``name``) and each object it holds, ``depth`` levels
    down and ``limit`` objects at most; an object is looked into only where ``enter(obj)``."""
    seen: set[int] = set()
    todo: collections.deque[tuple[str, Any, int]] = collections.deque([(name, root, 0)])
    while todo and len(seen) < limit:
        path, obj, level = todo.popleft()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        yield path, obj
        if level >= depth or not enter(obj):
            continue
        if isinstance(obj, CONTAINERS):
            todo.extend((f"{path}[{key!r}]", value, level + 1) for key, value in _items(obj, limit))
        elif not isinstance(obj, type):
            todo.extend((f"{path}.{attr}", value, level + 1) for attr, value in _attributes(obj))


def _items(container, limit: int) -> list[tuple[Any, Any]]:
    """A container's values to look into, with the key or position that names each (a set's
    items are named by position too: they have no key)."""
    pairs = list(container.items()) if isinstance(container, dict) else list(enumerate(container))
    return [(key, value) for key, value in pairs[:limit] if worth(value)]


def _attributes(obj) -> list[tuple[str, Any]]:
    """An object's own attributes (its ``__dict__`` and slots) worth looking into."""
    names = dict(getattr(obj, "__dict__", None) or {})
    for cls in type(obj).__mro__:
        for slot in getattr(cls, "__slots__", ()):
            if isinstance(slot, str) and slot not in names and hasattr(obj, slot):
                names[slot] = getattr(obj, slot, None)
    return [(name, value) for name, value in names.items() if worth(value)]


def worth(value) -> bool:
    """Could ``value`` hold many Python objects? Not a number, string, bytes, module, function
    or class. (An array or a tensor is looked at, and found to hold no attributes.)"""
    return not isinstance(value, _LEAVES)


def _is_cache(obj: Any) -> bool:
    return isinstance(getattr(obj, "cache_kind", None), str) and callable(getattr(obj, "held_bytes", None))


def caches_of(dataset: Any) -> list:
    """The caches ``dataset`` holds (objects with a ``cache_kind`` and ``held_bytes()``: a
    ``Parquet``'s row groups and pages, a ``Storage``'s memory or disk cache), found by a
    bounded walk of its attributes; large containers are not looked into."""
    def enter(obj: Any) -> bool:
        return not _is_cache(obj) and not (isinstance(obj, CONTAINERS) and len(obj) > 1000)

    return [obj for _, obj in walk(dataset, "dataset", 4, 2000, enter) if _is_cache(obj)]


def held_bytes(caches: list) -> dict[str, int]:
    """The bytes ``caches`` (:func:`caches_of`) hold in this process, by kind."""
    held: dict[str, int] = {}
    for cache in caches:
        held[cache.cache_kind] = held.get(cache.cache_kind, 0) + cache.held_bytes()
    return held
