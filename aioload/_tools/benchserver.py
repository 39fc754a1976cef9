"""The bench's HTTP server: files under ROOT on 127.0.0.1, each GET answered after a round trip.

Run as a script (``python benchserver.py ROOT --latency-ms 20``), in its own process, so that it
shares no GIL with the loaders being measured; it imports only the standard library,
:mod:`aioload._workers.parent` (which does too) and uvloop where installed. One asyncio loop serves
every connection: each request is answered a round trip after it arrived (a timer, not a
sleeping thread), so concurrent requests overlap as they do against a remote store, while the
server spends little of the CPUs the loaders share with it (a thread per connection, as
``http.server`` runs them, took about 0.12 CPUs of this 2-CPU machine). Bodies are read from the
file as they are sent, never faster than the client takes them. Only the files found under ROOT
at start are served (no path outside it can be asked for, and a symlink under ROOT that leads
outside it is not served). The process exits on SIGTERM or Ctrl-C, when its parent process dies
(even by SIGKILL; whichever of its threads started the server), and after ``--max-seconds``.

``Range: bytes=a-b`` is answered ``206`` with that part (as object stores do), ``HEAD`` with the
headers alone; ``--mb-per-s`` paces each response's body to that rate (a store's per-connection
bandwidth; 0, the default: as fast as the socket takes it): each piece of 2 ms of the pace is
written once the pace has reached its end, and a body of one piece goes right after its head,
once the round trip and the pace have both passed. Bodies go from the file to the socket by
``os.sendfile`` (no copy through this process) while the socket takes them, from a descriptor
kept open per file: a page-sized response costs the server one ``stat``, one timer callback
(no task), one write and one ``sendfile`` (40-45 µs of CPU for 139 KB with 64 requests in
flight, against 49-57 µs with a task, a sleep and an ``open`` per request, and 95 µs when its
bytes went through Python). ``GET /__requests__`` answers how
many requests for files it has had (for requests per sample), ``GET /__cpu__`` the CPU seconds
this process has used so far (every thread: the bench takes the difference over its measured
interval, the share of the CPUs the server took from the loaders it shares them with). Neither
is counted as a request.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import time
from http import HTTPStatus
from pathlib import Path
from urllib.parse import unquote, urlsplit

from aioload._workers.parent import exit_with


def die_with_parent(parent: int) -> None:
    """End this process when the process ``parent`` dies, even by SIGKILL
    (:func:`aioload._workers.parent.exit_with`)."""
    if os.getppid() != parent:  # it died before the watch began (its pid may be taken again)
        os._exit(1)
    exit_with(parent, "parent-watch")


_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")
_PIECE = 1 << 18  # bytes read from a file and written at once (unpaced)
_PACE_CHUNK = 1 << 16  # bytes written at once when paced, at least
_PACE_SLICE_S = 0.002  # ... or what the pace sends in this long: one write (and one timer) per slice
_HEAD_LIMIT = 1 << 16
COUNT_PATH = "__requests__"
CPU_PATH = "__cpu__"


def served_files(root: Path) -> dict[str, Path]:
    """The regular files under ``root``, by their path relative to it, each resolved: a symlink
    whose target lies outside ``root`` (or is not a file) is not served."""
    base = root.resolve()
    files = {}
    for path in sorted(root.rglob("*")):
        try:
            target = path.resolve(strict=True)
        except (OSError, RuntimeError):  # a dangling link, or a loop of links
            continue
        if target.is_file() and target.is_relative_to(base):
            files[path.relative_to(root).as_posix()] = target
    return files


class _Files:
    """What is served: the regular files under the root at start, by their relative path;
    ``count`` is the number of requests for files so far (GET and HEAD). A file is opened once
    and its descriptor kept while the path names the same file (its device, inode, size and
    modification time, checked by a ``stat`` per request): a file replaced or changed is opened
    again, never through a symlink put in its place."""

    def __init__(self, root: str, latency_s: float, bytes_per_s: float):
        base = Path(root)
        self.files = {name: str(path) for name, path in served_files(base).items()}
        self.latency_s = latency_s
        self.bytes_per_s = bytes_per_s
        # bytes written at once: what the pace sends in a slice (at least a chunk), or unpaced a piece
        self.piece = max(_PACE_CHUNK, int(bytes_per_s * _PACE_SLICE_S)) if bytes_per_s else _PIECE
        self.count = 0
        self._open: dict[str, tuple[tuple, int, str]] = {}  # path: (its stat's identity, descriptor, ETag)

    def open(self, path: str) -> tuple[int, int, str]:
        """``(descriptor, size, ETag)`` of the served file ``path`` (the process keeps the
        descriptor: the caller does not close it)."""
        st = os.stat(path)
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        known = self._open.get(path)
        if known is not None and known[0] == key:
            return known[1], st.st_size, known[2]
        if known is not None:
            del self._open[path]
            os.close(known[1])
        fd = _open(path)
        etag = f'"{st.st_mtime_ns:x}-{st.st_size:x}"'
        self._open[path] = (key, fd, etag)
        return fd, st.st_size, etag

    def close(self) -> None:
        for _, fd, _ in self._open.values():
            os.close(fd)
        self._open.clear()


_REASONS = {status.value: status.phrase for status in HTTPStatus}


class _Answer:
    """What a request is answered with, once its time has come: the head, and ``n`` bytes of
    the file ``fd`` from ``start`` (``n == 0``: the head alone); ``paced``: a body of more than
    one piece, sent by :meth:`_Connection._body`; ``keep``: the connection carries the next
    request after it."""

    __slots__ = ("head", "fd", "start", "n", "paced", "keep")

    def __init__(self, head: bytes, keep: bool, fd: int = -1, start: int = 0, n: int = 0, paced: bool = False):
        self.head, self.keep, self.fd, self.start, self.n, self.paced = head, keep, fd, start, n, paced


class _Connection(asyncio.Protocol):
    """One client connection: each request is answered ``latency_s`` after it arrived (a timer
    on the loop), one at a time and in order; the body is sent from the file (paced when
    asked), never faster than the client takes it."""

    def __init__(self, served: _Files):
        self.served = served
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.busy = False  # a request is being answered
        self.writable = asyncio.Event()
        self.writable.set()
        self._held: _Answer | None = None  # an answer due while the socket took no more

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if len(self.buf) > _HEAD_LIMIT and b"\r\n\r\n" not in self.buf:
            self.transport.close()
            return
        self._next()

    def connection_lost(self, exc) -> None:
        self.transport = None
        self._held = None
        self.writable.set()  # a body being sent stops at its next piece

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()
        held, self._held = self._held, None
        if held is not None:
            self._send_answer(held)

    def _next(self) -> None:
        if self.busy or self.transport is None:
            return
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head, self.buf = self.buf[:end].decode("latin-1"), self.buf[end + 4:]
        self.busy = True
        arrived = self.loop.time()
        try:
            answer, delay = self._answer(head)
        except OSError:  # the file could not be opened (a symlink put in its place)
            self.transport.close()
            return
        when = arrived + delay
        if delay <= 0 or when <= self.loop.time():
            self._send_answer(answer)
        else:
            self.loop.call_at(when, self._send_answer, answer)

    def _answer(self, head: str) -> tuple[_Answer, float]:
        """The answer to the request ``head``, and how long after its arrival it goes out."""
        lines = head.split("\r\n")
        parts = lines[0].split(" ")
        fields = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            fields[name.strip().lower()] = value.strip()
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            return _Answer(_head(400, {"Content-Length": "0", "Connection": "close"}), False), 0.0
        method, target, version = parts
        keep = "close" not in fields.get("connection", "").lower() and version == "HTTP/1.1"
        path = unquote(urlsplit(target).path).lstrip("/")
        if method == "GET" and path in (COUNT_PATH, CPU_PATH):
            data = str(self.served.count if path == COUNT_PATH else time.process_time()).encode()
            return _Answer(_head(200, {"Content-Length": str(len(data))}) + data, keep), 0.0
        if method not in ("GET", "HEAD"):
            return _Answer(_head(501, {"Content-Length": "0", "Connection": "close"}), False), 0.0
        self.served.count += 1
        latency = self.served.latency_s
        file = self.served.files.get(path)
        if file is None:
            return _Answer(_head(404, {"Content-Length": "0"}), keep), latency
        fd, size, etag = self.served.open(file)
        start, end, status = 0, size, 200
        asked = fields.get("range")
        match = _RANGE.match(asked) if asked else None
        if match is not None:
            start = int(match.group(1))
            end = min(size, int(match.group(2)) + 1) if match.group(2) else size
            if start >= size:
                return _Answer(_head(416, {"Content-Range": f"bytes */{size}", "Content-Length": "0"}), keep), latency
            status = 206
        headers = {"Content-Type": "application/octet-stream", "Content-Length": str(end - start),
                   "Accept-Ranges": "bytes", "ETag": etag}
        if status == 206:
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        if method == "HEAD" or end == start:
            return _Answer(_head(status, headers), keep), latency
        rate = self.served.bytes_per_s
        if end - start <= self.served.piece:
            # one piece: the head and the body together once the round trip and the pace have passed
            pace = (end - start) / rate if rate else 0.0
            return _Answer(_head(status, headers), keep, fd, start, end - start), latency + pace
        return _Answer(_head(status, headers), keep, fd, start, end - start, paced=True), latency

    def _send_answer(self, answer: _Answer) -> None:
        """Send ``answer`` (the socket taking more: else once it does), then take the next
        request."""
        if self.transport is None:
            return
        if not self.writable.is_set():
            self._held = answer
            return
        try:
            self.transport.write(answer.head)
            if answer.paced:
                self.loop.create_task(self._paced(answer))
                return
            if answer.n and self._write_from(answer.fd, answer.start, answer.n) != answer.n:
                answer.keep = False  # the file shrank since it was listed
        except (ConnectionError, OSError):
            answer.keep = False
        self._done(answer.keep)

    async def _paced(self, answer: _Answer) -> None:
        try:
            keep = await self._body(answer.fd, answer.start, answer.start + answer.n) and answer.keep
        except (ConnectionError, OSError):
            keep = False
        self._done(keep)

    def _done(self, keep: bool) -> None:
        if self.transport is None:
            return
        if not keep:
            self.transport.close()
            return
        self.busy = False
        self._next()

    def _write_from(self, fd: int, start: int, n: int) -> int:
        """Write ``n`` bytes of the file ``fd`` from ``start``: ``os.sendfile`` from the page cache
        to the socket while nothing waits in the transport's buffer (no copy through this
        process), what the socket does not take then through the transport. Returns the bytes
        written: fewer than ``n`` where the file ends first."""
        sock = self.transport.get_extra_info("socket")
        sent = 0
        if sock is not None and not self.transport.get_write_buffer_size():
            try:
                while sent < n:
                    got = os.sendfile(sock.fileno(), fd, start + sent, n - sent)
                    if not got:
                        return sent
                    sent += got
            except BlockingIOError:  # the socket's buffer is full: the transport takes the rest
                pass
        if sent < n:
            data = os.pread(fd, n - sent, start + sent)
            self.transport.write(data)
            sent += len(data)
        return sent

    async def _body(self, fd: int, start: int, end: int) -> bool:
        """A body of more than one piece, paced where ``--mb-per-s`` asks: each piece is written
        once the pace has reached its end (never earlier than a paced stream would have
        delivered its last byte), in pieces of what the pace sends in :data:`_PACE_SLICE_S` (at
        least :data:`_PACE_CHUNK`), each by :meth:`_write_from`. False: the connection ended, or
        the file shrank since it was listed."""
        rate, piece = self.served.bytes_per_s, self.served.piece
        began = self.loop.time()
        pos = start
        while pos < end:
            n = min(piece, end - pos)
            if rate:
                delay = began + (pos + n - start) / rate - self.loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
            await self.writable.wait()
            if self.transport is None:
                return False
            wrote = self._write_from(fd, pos, n)
            if wrote < n:
                return False
            pos += wrote
        return True


def _head(status: int, headers: dict) -> bytes:
    lines = [f"HTTP/1.1 {status} {_REASONS[status]}", *(f"{k}: {v}" for k, v in headers.items()), "", ""]
    return "\r\n".join(lines).encode("latin-1")


def _open(file: str) -> int:
    """A descriptor to read ``file``, never a symlink put in its place."""
    return os.open(file, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))


def serve(root: str, latency_ms: float, max_seconds: float, parent: int, mb_per_s: float = 0.0) -> None:
    die_with_parent(parent)
    run = asyncio.run
    try:
        import uvloop  # not needed: a faster loop where it is installed

        run = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux and macOS
        pass
    run(_serve(root, latency_ms / 1000.0, max_seconds, mb_per_s * 1e6))


async def _serve(root: str, latency_s: float, max_seconds: float, bytes_per_s: float) -> None:
    served = _Files(root, latency_s, bytes_per_s)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Connection(served), "127.0.0.1", 0, backlog=1024)
    print(f"port {server.sockets[0].getsockname()[1]}", flush=True)
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    loop.call_later(max_seconds, stop.set)
    try:
        await stop.wait()
    finally:
        server.close()
        served.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="serve ROOT's files on 127.0.0.1 after a round trip")
    p.add_argument("root")
    p.add_argument("--latency-ms", type=float, default=20.0)
    p.add_argument("--max-seconds", type=float, default=6 * 3600)
    p.add_argument("--mb-per-s", type=float, default=0.0)
    p.add_argument("--parent", type=int, default=os.getppid())
    args = p.parse_args(argv)
    serve(args.root, args.latency_ms, args.max_seconds, args.parent, args.mb_per_s)


if __name__ == "__main__":
    main()
