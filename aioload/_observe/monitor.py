"""Watching a loader run: a periodic log line (``log_every=``) and a progress bar (``progress=``).

Both are driven from the consumer's thread, once per delivered batch, and cost one clock read
per batch until a log line or a bar refresh is due.

``progress=True`` draws a tqdm bar where one can be drawn: on a terminal, or in a notebook
(whose output cells redraw tqdm's lines). Elsewhere (stderr sent to a file, a pipe, a job
scheduler's log) a bar would write every frame into the file, so progress is plain lines
instead: one every :data:`LINE_EVERY_S` seconds during an epoch and one when it ends.

Log lines go to the ``"aioload"`` logger at level INFO. A program that has not configured
logging (no handler on that logger or its ancestors: Python would drop INFO lines, or show
only warnings) still sees them: each is then written to stderr, with its time. A program that
has configured logging gets them through its own handlers and levels.
"""

from __future__ import annotations

import functools
import logging
import sys
import time
from typing import Callable

from aioload._observe.stats import LoaderStats

logger = logging.getLogger("aioload")

POSTFIX_EVERY_S = 1.0
"""How often the progress bar's throughput and waiting figures are refreshed."""

LINE_EVERY_S = 60.0
"""Away from a terminal, how often a progress line is written during an epoch."""

TQDM_MISSING = "progress=True needs tqdm, which is not installed: pip install tqdm"


def check_options(log_every, progress) -> None:
    """Validate ``log_every=`` and ``progress=``; ``progress=True`` needs tqdm importable."""
    if log_every is not None:
        if isinstance(log_every, bool) or not isinstance(log_every, (int, float)):
            raise TypeError(f"log_every must be a number of seconds > 0 or None, got {log_every!r}")
        if not log_every > 0:
            raise ValueError(f"log_every must be > 0 seconds or None, got {log_every!r}")
    if not isinstance(progress, bool):
        raise TypeError(f"progress must be True or False, got {progress!r}")
    if progress:
        tqdm_class()


def tqdm_class():
    try:
        from tqdm import tqdm
    except ImportError as exc:
        raise ImportError(TQDM_MISSING) from exc
    return _quiet_bar(tqdm)


@functools.cache
def _quiet_bar(tqdm):
    class Bar(tqdm):
        # tqdm's monitor thread would make the worker pool start with forkserver (slow)
        # instead of fork, which is only safe while no other thread runs.
        monitor_interval = 0

    return Bar


def draws_bars(stream) -> bool:
    """A live bar suits ``stream``: a terminal, or a Jupyter kernel's output stream."""
    if type(stream).__module__.startswith("ipykernel"):
        return True
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or closed
        return False


class ProgressLines:
    """Progress as plain lines, for a stream that is not a terminal: the part of tqdm's
    interface that :class:`Monitor` uses (``update``, ``set_postfix_str``, ``close``)."""

    def __init__(self, stream, total: int | None, desc: str, every_s: float = LINE_EVERY_S):
        self._stream, self._total, self._desc, self._every_s = stream, total, desc, every_s
        self.n = 0
        self._postfix = ""
        self._start = self._last = time.perf_counter()

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.perf_counter()
        if now - self._last >= self._every_s:
            self._last = now
            self._write(now, "after ")

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        self._postfix = text

    def close(self) -> None:
        self._write(time.perf_counter(), "in ")

    def _write(self, now: float, how: str) -> None:
        count = f"{self.n}/{self._total}" if self._total is not None else f"{self.n}"
        postfix = f", {self._postfix}" if self._postfix else ""
        try:
            print(f"{self._desc}: {count} batches {how}{now - self._start:.1f} s{postfix}", file=self._stream,
                  flush=True)
        except (ValueError, OSError):  # the stream was closed: progress is not worth an error
            pass


class Monitor:
    """Per-loader: logs a line every ``log_every`` seconds and keeps one bar per epoch.

    ``stats`` returns the loader's current :class:`LoaderStats` (or ``None`` once the loader
    is gone); each log line describes the interval since the previous one.
    """

    def __init__(self, stats: Callable[[], LoaderStats | None], log_every: float | None, progress: bool):
        self._stats = stats
        self._log_every = log_every
        self._progress = progress
        self._bar = None
        self._last_log = None
        self._last_stats: LoaderStats | None = None
        self._last_postfix = 0.0

    def begin_epoch(self, epoch: int, total: int | None) -> None:
        self.end_epoch()
        if self._progress:
            stream = sys.stderr
            if draws_bars(stream):
                self._bar = tqdm_class()(total=total, desc=f"epoch {epoch}", unit="batch", dynamic_ncols=True, file=stream)
            else:
                self._bar = ProgressLines(stream, total, f"epoch {epoch}")
        if self._log_every is not None and self._last_log is None:
            self._last_log = time.perf_counter()
            self._last_stats = self._stats()

    def batch(self) -> None:
        """One batch was handed over."""
        now = time.perf_counter()
        if self._bar is not None:
            self._bar.update(1)
            if now - self._last_postfix >= POSTFIX_EVERY_S:
                self._last_postfix = now
                self._postfix()
        if self._last_log is not None and now - self._last_log >= self._log_every:
            self._last_log = now
            self._log()

    def end_epoch(self) -> None:
        bar, self._bar = self._bar, None
        if bar is not None:
            self._postfix(bar)
            bar.close()

    def _postfix(self, bar=None) -> None:
        stats = self._stats()
        bar = bar or self._bar
        if stats is not None and bar is not None:
            bar.set_postfix_str(f"{stats.samples_per_s:.0f} samples/s, waiting {stats.wait_fraction:.0%}",
                                refresh=False)

    def _log(self) -> None:
        stats = self._stats()
        if stats is None:
            return
        window = stats.since(self._last_stats) if self._last_stats is not None else stats
        self._last_stats = stats
        log_line(
            "aioload: %.1f samples/s over %.1f s, read p50 %.1f ms, decode %.2f ms/sample, "
            "%d batches ready; %s",
            window.samples_per_s, window.elapsed_s, window.read_p50_ms,
            window.decode_ms_per_sample, window.queue_occupancy, window.verdict,
        )


def log_line(message: str, *args) -> None:
    """One ``log_every`` line: through the program's logging if it has any handler for the
    ``"aioload"`` logger, else straight to stderr (what ``log_every=`` asked for)."""
    if logger.hasHandlers():
        logger.info(message, *args)
        return
    record = logger.makeRecord(logger.name, logging.INFO, __file__, 0, message, args, None)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    handler.handle(record)
