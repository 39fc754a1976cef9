"""A child process that ends with the process that started it, even when that one is killed.

A loader's workers and the bench's server each call :func:`exit_with` with the pid of the
process they serve. Without it, a worker blocked in native code (a decoder that never
returns) kept running after its training process was killed with SIGKILL: its socket's
end-of-stream is noticed only by the thread that reads it, not by the one that is stuck.

Not ``prctl(PR_SET_PDEATHSIG)``: the kernel sends that signal when the *thread* that started
the child ends, so a child started from a short-lived thread would die with the thread. Nor
``os.getppid()`` alone: a worker started by the forkserver is the forkserver's child. A thread
waits on the process itself: a pidfd, which becomes readable once that process (all of its
threads) has exited (Linux >= 5.3), else a poll of whether the pid still exists.
"""

from __future__ import annotations

import os
import select
import threading
import time

_POLL = 0.2
"""Seconds between two looks at the process where no pidfd can be had."""


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process now has the pid: ours is gone
        return False
    return True


def exit_with(pid: int, name: str = "aioload-parent-watch") -> None:
    """End this process (``os._exit(1)``) as soon as process ``pid`` has ended: at once if it
    has already, else from a daemon thread that waits for it."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        os._exit(1)
    except (AttributeError, OSError):  # not Linux >= 5.3
        pidfd = None
        if not _exists(pid):
            os._exit(1)

    def watch() -> None:
        if pidfd is not None:
            select.select([pidfd], [], [])
        else:
            while _exists(pid):
                time.sleep(_POLL)
        os._exit(1)

    threading.Thread(target=watch, name=name, daemon=True).start()
