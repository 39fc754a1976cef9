"""A mixture's weights, and the schedule of weight changes within an epoch.

Weights are given as ``{source name: number}``, every source named, each finite and >= 0, not
all zero; only their ratios matter (:func:`normalised`). A *schedule* says which weights are in force from
which position of the epoch's order on: ``((0, w0), (p1, w1), ...)``, positions increasing.
``loader.set_weights`` adds an entry at the position of the next batch the consumer has not
yet received, so a resumed run, which loads the schedule with the state, draws exactly what
the uninterrupted run drew.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

Weights = tuple[float, ...]
Schedule = tuple[tuple[int, Weights], ...]


def check_weights(weights, names: Sequence[str]) -> Weights:
    """``weights`` (a mapping of every source name to a number) as floats in the order of
    ``names``; a clear error naming what is wrong otherwise."""
    if not isinstance(weights, Mapping):
        raise TypeError(f"weights must be a dict of source name to weight, got {type(weights).__name__}")
    unknown = [name for name in weights if name not in names]
    if unknown:
        raise ValueError(f"weights name {unknown[0]!r}, which is not a source of this mix; its sources "
                         f"are {list(names)}")
    missing = [name for name in names if name not in weights]
    if missing:
        raise ValueError(f"weights must give every source a weight (0 leaves one out); missing: {missing}")
    values = []
    for name in names:
        value = weights[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"the weight of source {name!r} must be a number, got {value!r}")
        if math.isnan(value) or math.isinf(value) or value < 0:
            raise ValueError(f"the weight of source {name!r} must be a finite number >= 0, got {value}")
        values.append(float(value))
    if math.fsum(values) <= 0:
        raise ValueError(f"weights must not all be zero: give at least one of {list(names)} a positive weight")
    return tuple(values)


def normalised(weights: Weights) -> Weights:
    """The weights as shares summing to 1. Schedules and saved states keep the weights as
    given, so that a resumed run divides the same numbers and draws bit for bit the same."""
    total = math.fsum(weights)
    return tuple(w / total for w in weights)


def as_dict(weights: Weights, names: Sequence[str]) -> dict[str, float]:
    return dict(zip(names, weights))


def at(schedule: Schedule, position: int) -> Weights:
    """The weights in force at ``position``."""
    found = schedule[0][1]
    for start, weights in schedule:
        if start > position:
            break
        found = weights
    return found


def with_change(schedule: Schedule, position: int, weights: Weights) -> Schedule:
    """``schedule`` with ``weights`` in force from ``position`` on (entries at or after it are
    replaced: a later change supersedes an earlier one that never took effect)."""
    kept = tuple(entry for entry in schedule if entry[0] < position)
    if kept and kept[-1][1] == weights:
        return kept
    return kept + ((position, weights),)
