"""The bytes that arrive for a read beyond those it returns, counted for the statistics.

A read of a byte range from a server that ignores ``Range`` gets the object from its start:
the bytes before the range arrive over the network, cost time and bandwidth, and are dropped.
``loader.stats()`` counts what arrived (``bytes_read``), not only what was kept, so that its
``bytes_per_sample`` shows what really went over the wire.

The loader's read core opens a tally around each ``dataset.read`` (:func:`tally`); the
transport adds what it dropped to the tally of the read it runs in (:func:`dropped`). The
tally is a context variable: each read runs in a task of its own, so what is counted is that
read's, however many run at once; outside a tally (a read of your own) nothing is counted.
"""

from __future__ import annotations

import contextvars

_TALLY: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("aioload_arrived", default=None)


def tally() -> tuple[list[int], contextvars.Token]:
    """Open a tally for the read about to run in this task: ``(cell, token)``; ``cell[0]``
    counts the bytes dropped; pass ``token`` to :func:`close`."""
    cell = [0]
    return cell, _TALLY.set(cell)


def close(token: contextvars.Token) -> None:
    _TALLY.reset(token)


def dropped(nbytes: int) -> None:
    """``nbytes`` arrived for the running read and were not returned."""
    cell = _TALLY.get()
    if cell is not None:
        cell[0] += nbytes
