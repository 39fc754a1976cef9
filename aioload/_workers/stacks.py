"""A worker's Python stacks, every thread's, taken from outside it: what the person on call
needs when a sample never comes back (the ``timeout=`` error, the stall warning).

A worker stuck in a decode cannot answer a message, and one stuck in C code holding the GIL
runs no Python thread at all; ``faulthandler`` can still write every thread's stack from a
signal handler, without the GIL. So each worker registers :data:`SIGNAL` with
``faulthandler`` at start-up, writing into a memfd of its own (:func:`install`), and the
training process (:func:`take`) opens that memfd through ``/proc/<pid>/fd``, empties it, sends
the signal and reads what the handler wrote. Nothing is sent on the worker's sockets, and a
worker that is never asked pays one descriptor.
"""

from __future__ import annotations

import faulthandler
import fcntl
import os
import signal
import time

SIGNAL = signal.SIGUSR2
"""The signal a worker dumps its stacks on (``faulthandler``'s handler, registered in the worker)."""

NAME = "aioload-stacks"
"""The memfd's name, by which :func:`take` finds it among the worker's descriptors."""

SETTLE_S = 0.05
"""The dump is whole once its size has not changed for this long (the handler writes it in
well under a millisecond, and leaves no end mark)."""

_dump = None  # the worker's memfd, as a file kept open for the handler


def install() -> None:
    """In a worker: dump every thread's stack into this process's memfd on :data:`SIGNAL`."""
    global _dump
    try:
        fd = os.memfd_create(NAME, os.MFD_CLOEXEC)
    except (AttributeError, OSError):  # not Linux: no stacks, nothing else changes
        return
    # append: each dump starts where the training process emptied the file, not at this
    # descriptor's offset after the last dump
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_APPEND)
    _dump = os.fdopen(fd, "wb", buffering=0)
    faulthandler.register(SIGNAL, file=_dump, all_threads=True, chain=False)


def _find(pid: int) -> str | None:
    """The ``/proc`` path of worker ``pid``'s stack memfd, else ``None``."""
    folder = f"/proc/{pid}/fd"
    for name in os.listdir(folder):
        try:
            target = os.readlink(f"{folder}/{name}")
        except OSError:
            continue
        if target.startswith(f"/memfd:{NAME} "):
            return f"{folder}/{name}"
    return None


def take(pid: int, timeout: float = 2.0) -> str:
    """Every thread's Python stack in worker ``pid`` (``faulthandler``'s text, most recent call
    first), or a sentence saying why it could not be had. From any thread of the training
    process; at most ``timeout`` seconds."""
    try:
        path = _find(pid)
        if path is None:
            return "(its stack could not be taken: the worker registered no stack dump)"
        with open(path, "r+b", buffering=0) as dump:
            dump.truncate(0)
            os.kill(pid, SIGNAL)
            text = _settled(dump, timeout)
    except OSError as exc:
        return f"(its stack could not be taken: {exc})"
    return text.rstrip("\n") if text else f"(its stack could not be taken: no answer within {timeout} s)"


def _settled(dump, timeout: float) -> str:
    """What the handler wrote into ``dump``, once it has stopped growing (at most ``timeout`` s)."""
    deadline = time.monotonic() + timeout
    size, since = 0, time.monotonic()
    while time.monotonic() < deadline:
        now = os.fstat(dump.fileno()).st_size
        if now != size:
            size, since = now, time.monotonic()
        elif size and time.monotonic() - since >= SETTLE_S:
            break
        time.sleep(0.005)
    dump.seek(0)
    return dump.read(size).decode("utf-8", "replace")
