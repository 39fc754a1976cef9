"""One walker over nested samples and batches: which containers are looked into, and how they
are rebuilt.

The rule, as torch's ``default_collate`` walks a sample:

* a **mapping** (any ``collections.abc.Mapping``) is walked in its own key order and rebuilt
  as ``type(m)({key: value, ...})``, or as a plain ``dict`` when that type's constructor
  refuses a dict (``TypeError``);
* a **namedtuple** (a tuple with ``_fields``) is rebuilt as ``type(t)(*values)``;
* a **list** or **tuple**, or a subclass of either, is rebuilt as ``type(s)(values)``, or as a
  plain ``list`` when that constructor refuses a list;
* anything else is a **leaf**, handed to the function as it is: tensors, arrays, numbers,
  strings, ``None``, objects of any other type.

Two hooks, for the walks that must see a sample differently:

* ``exact=True`` walks only the built-in ``dict``, ``list`` and ``tuple`` (exactly those
  types) and namedtuples; a subclass (an ``OrderedDict``, a tokenizer's ``BatchEncoding``) is
  a leaf. A row's skeleton is walked so: a container of another type reaches torch's
  ``collate`` in the parent whole, as the sample held it, and ``collate`` copies it with
  whatever else it carries.
* ``is_leaf(obj)`` makes a node a leaf even though the rule would walk it.

The walk recurses once per level of nesting; samples are nested a few levels deep.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Callable, Iterator

import torch


def map_leaves(fn: Callable, tree, *others, exact: bool = False, is_leaf: Callable[[Any], bool] | None = None):
    """``tree`` with every leaf replaced by ``fn(leaf)``, containers rebuilt (see the module
    docstring). With ``others`` (trees of the same structure) ``fn`` gets the leaves found at
    the same place in each, ``fn(leaf, other_leaf, ...)``, and the structure is the first
    tree's: a mapping's keys are the first's (a key another lacks raises ``KeyError``), and a
    sequence of another length raises ``ValueError``."""
    if others:
        return _map_many(fn, [tree, *others], exact, is_leaf)
    if is_leaf is not None:
        return _map_hooked(fn, tree, exact, is_leaf)
    return (_map_exact if exact else _map)(fn, tree)


def leaves(tree, *, exact: bool = False, is_leaf: Callable[[Any], bool] | None = None) -> Iterator:
    """The leaves of ``tree``, in the order :func:`map_leaves` visits them (a mapping's values
    in its key order, a sequence's items in order)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if is_leaf is not None and is_leaf(node):
            yield node
        elif _is_mapping(node, exact):
            stack.extend(reversed(list(node.values())))
        elif _is_sequence(node, exact):
            stack.extend(reversed(node))
        else:
            yield node


def _is_mapping(node, exact: bool) -> bool:
    return type(node) is dict if exact else isinstance(node, Mapping)


def _is_sequence(node, exact: bool) -> bool:
    kind = type(node)
    if kind is list or kind is tuple:
        return True
    if exact:
        return isinstance(node, tuple) and hasattr(kind, "_fields")
    return isinstance(node, (list, tuple))


def _rebuild(node, values: list):
    """``values`` in a container of ``node``'s type (see the module docstring)."""
    kind = type(node)
    if isinstance(node, tuple) and hasattr(kind, "_fields"):
        return kind(*values)
    try:
        return kind(values)
    except TypeError:
        return values


def _rebuild_mapping(node, items: dict):
    try:
        return type(node)(items)
    except TypeError:
        return items


def _map(fn, node):
    # the built-in types first, by identity: the common case costs no isinstance call
    kind = type(node)
    if kind is tuple:
        return tuple([_map(fn, v) for v in node])
    if kind is list:
        return [_map(fn, v) for v in node]
    if kind is dict:
        return {key: _map(fn, v) for key, v in node.items()}
    if isinstance(node, Mapping):
        return _rebuild_mapping(node, {key: _map(fn, v) for key, v in node.items()})
    if isinstance(node, (list, tuple)):
        return _rebuild(node, [_map(fn, v) for v in node])
    return fn(node)


def _map_exact(fn, node):
    kind = type(node)
    if kind is tuple:
        return tuple([_map_exact(fn, v) for v in node])
    if kind is list:
        return [_map_exact(fn, v) for v in node]
    if kind is dict:
        return {key: _map_exact(fn, v) for key, v in node.items()}
    if isinstance(node, tuple) and hasattr(kind, "_fields"):
        return kind(*[_map_exact(fn, v) for v in node])
    return fn(node)


def _map_hooked(fn, node, exact: bool, is_leaf):
    if is_leaf(node):
        return fn(node)
    if _is_mapping(node, exact):
        return _rebuild_mapping(node, {key: _map_hooked(fn, v, exact, is_leaf) for key, v in node.items()})
    if _is_sequence(node, exact):
        return _rebuild(node, [_map_hooked(fn, v, exact, is_leaf) for v in node])
    return fn(node)


def _map_many(fn, nodes: list, exact: bool, is_leaf):
    first = nodes[0]
    if is_leaf is not None and is_leaf(first):
        return fn(*nodes)
    if _is_mapping(first, exact):
        return _rebuild_mapping(first, {key: _map_many(fn, [n[key] for n in nodes], exact, is_leaf) for key in first})
    if _is_sequence(first, exact):
        if any(len(n) != len(first) for n in nodes):
            raise ValueError(f"the trees hold sequences of different lengths ({[len(n) for n in nodes]})")
        return _rebuild(first, [_map_many(fn, list(column), exact, is_leaf) for column in zip(*nodes)])
    return fn(*nodes)


def map_tensors(fn: Callable, tree):
    """``tree`` with ``fn(t)`` in place of every tensor ``t`` (a ``torch.Tensor`` or a
    subclass); every other leaf is kept as it is."""
    return _map(functools.partial(_on_tensor, fn), tree)


def _on_tensor(fn, leaf):
    return fn(leaf) if isinstance(leaf, torch.Tensor) else leaf
