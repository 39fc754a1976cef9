"""The template process: the dataset unpickled once, and every worker forked from it.

With ``spawn`` or ``forkserver`` each worker used to be a fresh interpreter that imported torch
and unpickled its own copy of the worker configuration (the dataset above all): 16 workers and
a dataset of 250 MB of Python objects took 25-30 s and 8-9 GB before the first batch, and a
1 GB dataset ran a 24 GB machine out of memory. Instead, one process is started with the
user's start method (so it is as clean as their workers would have been: no CUDA, no threads of
the training process); it receives the pickled configuration once, through a memfd, unpickles
it once, freezes what it holds out of the garbage collector's reach (``gc.freeze()``: a
collection in a worker then writes to none of those pages), and forks each worker from itself.
The workers share its pages as ``fork`` workers share the training process's.

The template is single-threaded: it waits on its socket, on the training process (a pidfd,
so it ends with it) and on each worker it forked (a pidfd each, reaped here and reported), in
one ``select``. It never forks from a process that unpickling made unsafe to fork: where that
initialised CUDA or started a thread, it says so and the pool starts its workers the old way
(:class:`Verdict`).

The conversation on its socket (a Unix stream socket; descriptors travel as ``SCM_RIGHTS``):
the pool sends the configuration's memfd, the template answers one :class:`Verdict`; then the
pool sends each worker's two socket ends, the template forks and answers :class:`Forked`, and
:class:`Exited` once that worker has ended. The pool closing its end ends the template.
"""

from __future__ import annotations

import gc
import mmap
import os
import pickle
import select
import signal
import socket
import struct
import sys
import threading
import time
import traceback
import warnings
from typing import NamedTuple

from aioload._handoff.shm import anonymous_fd
from aioload._workers import wire as _wire

_HEADER = struct.Struct("<q")
"""What travels with the descriptors: the configuration's size, or the worker's id."""

OPT_OUT = "AIOLOAD_WORKER_TEMPLATE"
"""Set to ``0`` to start every ``spawn``/``forkserver`` worker on its own, as torch does."""


class Verdict(NamedTuple):
    """The template has unpickled the configuration: ``reason`` is empty where it can fork the
    workers, else why it cannot (the pool then starts them the old way)."""

    reason: str


class Forked(NamedTuple):
    wid: int
    pid: int


class Exited(NamedTuple):
    wid: int
    exitcode: int


def unavailable(method: str) -> str:
    """Why workers of start method ``method`` are not forked from a template ('' where they are)."""
    if method == "fork":
        return ""
    if os.environ.get(OPT_OUT, "1") == "0":
        return f"{OPT_OUT}=0"
    if not sys.platform.startswith("linux") or not hasattr(os, "pidfd_open"):
        return "forking from a template needs Linux >= 5.3"
    return ""


def _unsafe_to_fork(threads_before: int) -> str:
    """Why this process, having unpickled the configuration, must not fork ('' where it may).
    ``threads_before``: its Python threads before. Native threads of the libraries it imported
    (torch's, OpenBLAS's pool when numpy is imported) are not counted: every ``fork`` worker's
    training process has them too, and those libraries make themselves safe to fork."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "unpickling the dataset initialised CUDA, and a process that has must not fork"
    started = threading.active_count() - threads_before
    if started > 0:
        return f"unpickling the dataset started {started} thread(s), which a forked worker would not have"
    return ""


def template_main(sock: socket.socket, parent: int) -> None:
    """Entry point of the template process; ``parent``: the training process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the training process's business
    threads = threading.active_count()
    try:
        parent_fd = os.pidfd_open(parent)
    except ProcessLookupError:
        os._exit(1)
    header, fds, _flags, _addr = socket.recv_fds(sock, _HEADER.size, 1)
    if not fds:
        os._exit(0)  # the pool went away before sending anything
    size = _HEADER.unpack(header)[0]
    with mmap.mmap(fds[0], size, mmap.MAP_SHARED, mmap.PROT_READ) as memory:
        cfg = pickle.loads(memory)
    os.close(fds[0])
    reason = _unsafe_to_fork(threads)
    _wire.send_blocking(sock, Verdict(reason))
    if reason:
        return
    # what the configuration holds is never collected: out of the collector's sight, its
    # objects' headers are not written by a collection in a worker (their pages stay shared)
    gc.collect()
    gc.freeze()
    _serve(sock, parent_fd, cfg, parent)


def _serve(sock: socket.socket, parent_fd: int, cfg, parent: int) -> None:
    """Fork a worker for each request and report how each ends, until the pool or the training
    process goes away."""
    children: dict[int, tuple[int, int]] = {}  # pidfd -> (worker id, pid)
    while True:
        ready, _, _ = select.select([sock, parent_fd, *children], [], [])
        if parent_fd in ready:
            os._exit(1)
        for pidfd in ready:
            if pidfd in children:
                wid, pid = children.pop(pidfd)
                os.close(pidfd)
                _, status = os.waitpid(pid, 0)
                if not _tell(sock, Exited(wid, os.waitstatus_to_exitcode(status))):
                    return
        if sock in ready:
            header, fds, _flags, _addr = socket.recv_fds(sock, _HEADER.size, 2)
            if not header:
                return  # the pool closed its end
            wid = _HEADER.unpack(header)[0]
            with warnings.catch_warnings():
                # Python >= 3.12 warns of any thread at a fork: here only the native ones of the
                # imported libraries (torch's), as in every fork worker's training process; a
                # Python thread started by unpickling rules the template out (_unsafe_to_fork)
                warnings.filterwarnings("ignore", r"This process .* is multi-threaded", DeprecationWarning)
                pid = os.fork()
            if pid == 0:
                _worker(wid, cfg, fds, [sock.fileno(), parent_fd, *children], parent)
            for fd in fds:
                os.close(fd)
            children[os.pidfd_open(pid)] = (wid, pid)
            if not _tell(sock, Forked(wid, pid)):
                return


def _tell(sock: socket.socket, message) -> bool:
    """Send ``message`` to the pool; ``False`` where the pool has gone away (its workers, which
    watch the training process themselves, go on or end without this process)."""
    try:
        _wire.send_blocking(sock, message)
    except OSError:
        return False
    return True


def _worker(wid: int, cfg, fds: list[int], inherited: list[int], parent: int) -> None:
    """A forked worker: the template's descriptors closed, then the worker's life; never returns."""
    import multiprocessing.util

    from aioload._workers.worker import worker_main

    code = 1
    try:
        for fd in inherited:
            os.close(fd)
        multiprocessing.util._run_after_forkers()
        sock, ctrl = (socket.socket(fileno=fd) for fd in fds)
        worker_main(wid, cfg, sock, ctrl, (), parent)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - printed as a multiprocessing child prints it
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (AttributeError, ValueError, OSError):
                pass
        os._exit(code)


class Template:
    """The training process's side of one template process: started with ``context``, sent
    ``payload`` (the pickled configuration), then asked for workers with :meth:`fork`."""

    def __init__(self, payload: bytes, context):
        ours, theirs = socket.socketpair()
        self.sock = ours
        self.reader = _wire.Reader(ours)
        self.lock = threading.Lock()
        self.pids: dict[int, int] = {}
        self.pidfds: dict[int, int] = {}
        self.exits: dict[int, int] = {}
        self.ended = False  # the template's end of the socket is closed
        self.proc = context.Process(target=template_main, args=(theirs, os.getpid()), name="aioload-template")
        try:
            self.proc.start()
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        fd = anonymous_fd(max(1, len(payload)), "aioload-worker-config")
        try:
            with mmap.mmap(fd, max(1, len(payload))) as memory:
                memory[: len(payload)] = payload
            socket.send_fds(ours, [_HEADER.pack(len(payload))], [fd])
        except OSError:
            pass  # it died before it could take it: its workers report how
        finally:
            os.close(fd)

    def verdict(self) -> str | None:
        """Wait until the template has unpickled the configuration: ``''`` where it forks the
        workers, the reason where it cannot, ``None`` where it died first."""
        message = self.reader.recv_blocking()
        self.sock.setblocking(False)
        if message is None:
            self.ended = True
            return None
        return message.reason

    def fork(self, wid: int, child: socket.socket, cchild: socket.socket) -> None:
        """Ask for worker ``wid``, to serve on ``child`` (tasks) and ``cchild`` (memory)."""
        try:
            self.sock.setblocking(True)
            socket.send_fds(self.sock, [_HEADER.pack(wid)], [child.fileno(), cchild.fileno()])
        except OSError:
            pass  # the template is gone: the worker's sockets report it
        finally:
            self.sock.setblocking(False)

    def pump(self, timeout: float = 0.0) -> None:
        """Take in what the template has reported, waiting up to ``timeout`` for the first of it."""
        with self.lock:
            if self.ended:
                return
            ready, _, _ = select.select([self.sock], [], [], max(0.0, timeout))
            if not ready:
                return
            messages = self.reader.read_available()
            if messages is None:
                self.ended = True
                return
            for message in messages:
                if isinstance(message, Forked):
                    self.pids[message.wid] = message.pid
                    try:
                        self.pidfds[message.wid] = os.pidfd_open(message.pid)
                    except ProcessLookupError:
                        pass
                elif isinstance(message, Exited):
                    self.exits[message.wid] = message.exitcode
                    pidfd = self.pidfds.pop(message.wid, None)
                    if pidfd is not None:
                        os.close(pidfd)

    def close(self, timeout: float = 1.0) -> None:
        """End the template (its workers are stopped first, by the pool) and wait for it."""
        self.sock.close()
        self.proc.join(timeout)
        if self.proc.exitcode is None:
            self.proc.kill()
            self.proc.join(timeout)
        if self.proc.exitcode is not None:
            self.proc.close()
        with self.lock:
            self.ended = True
            for pidfd in self.pidfds.values():
                os.close(pidfd)
            self.pidfds.clear()


class ForkedWorker:
    """A worker forked by a template, seen from the training process as a
    ``multiprocessing.Process`` is (``pid``, ``exitcode``, ``join``, ``terminate``, ``kill``): the
    template, its parent, reaps it and reports how it ended. A worker the template never forked
    (it died first) answers with the template's pid and exit code."""

    def __init__(self, template: Template, wid: int):
        self.template = template
        self.wid = wid
        self.name = f"aioload-worker-{wid}"

    @property
    def pid(self) -> int | None:
        template = self.template
        deadline = time.monotonic() + 1.0
        while self.wid not in template.pids and not template.ended and time.monotonic() < deadline:
            template.pump(0.05)
        return template.pids.get(self.wid, template.proc.pid if template.ended else None)

    @property
    def exitcode(self) -> int | None:
        template = self.template
        template.pump()
        if self.wid in template.exits:
            return template.exits[self.wid]
        if template.ended and self.wid not in template.pids:
            template.proc.join(1.0)
            return template.proc.exitcode
        return None

    def is_alive(self) -> bool:
        if self.exitcode is not None:
            return False
        pidfd = self.template.pidfds.get(self.wid)
        return not (self.template.ended and (pidfd is None or select.select([pidfd], [], [], 0)[0]))

    def join(self, timeout: float | None = None) -> None:
        deadline = time.monotonic() + (3600.0 if timeout is None else timeout)
        while self.is_alive():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            if self.template.ended:
                pidfd = self.template.pidfds.get(self.wid)
                select.select([pidfd] if pidfd is not None else [], [], [], min(left, 0.05))
            else:
                self.template.pump(min(left, 0.05))

    def _signal(self, signum: int) -> None:
        pidfd = self.template.pidfds.get(self.wid)
        if pidfd is None or self.exitcode is not None:
            return
        try:
            signal.pidfd_send_signal(pidfd, signum)
        except ProcessLookupError:
            pass

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def close(self) -> None:
        pass
