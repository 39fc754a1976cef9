"""The bench's HTTP server: files under ROOT on 127.0.0.1, each GET answered after a round trip.

Run as a script (``python _benchserver.py ROOT --latency-ms 20``), in its own process, so that
its threads share no GIL with the loaders being measured; it imports only the standard
library. Each connection has its own thread and each request sleeps the round trip before it
is answered, so concurrent requests overlap as they do against a remote store. Only the files
found under ROOT at start are served (no path outside it can be asked for, and a symlink under
ROOT that leads outside it is not served). The process exits on SIGTERM or Ctrl-C, when its
parent process dies (even by SIGKILL; whichever of its threads started the server), and after
``--max-seconds``.

``Range: bytes=a-b`` is answered ``206`` with that part (as object stores do), ``HEAD`` with
the headers alone; ``--mb-per-s`` paces each response's body to that rate (a store's
per-connection bandwidth; 0, the default: as fast as the socket takes it). ``GET
/__requests__`` answers how many requests for files it has had (for requests per sample).
"""

from __future__ import annotations

import argparse
import os
import re
import select
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

def die_with_parent(parent: int) -> None:
    """End this process when the process ``parent`` dies, even by SIGKILL.

    Not ``prctl(PR_SET_PDEATHSIG)``: the kernel sends that signal when the *thread* that
    started this process ends, so a server started from a short-lived thread died with the
    thread. A thread here waits on the parent process itself instead: a pidfd, which becomes
    readable when that process (all of its threads) has exited (Linux >= 5.3), else a poll of
    ``os.getppid()``, which changes only when the parent process is gone."""
    try:
        pidfd = os.pidfd_open(parent)
    except (AttributeError, OSError):  # not Linux >= 5.3, or the parent is already gone
        pidfd = None
    if os.getppid() != parent:  # it died before the watch began
        os._exit(1)

    def watch() -> None:
        if pidfd is not None:
            select.select([pidfd], [], [])
        else:
            while os.getppid() == parent:
                time.sleep(0.2)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


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


_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")
_PACE_CHUNK = 1 << 16
COUNT_PATH = "__requests__"


class _Count:
    def __init__(self):
        self.value = 0
        self.lock = threading.Lock()

    def add(self) -> None:
        with self.lock:
            self.value += 1


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: a client may reuse its connections
    files: dict[str, Path] = {}
    latency_s = 0.0
    bytes_per_s = 0.0  # 0: unpaced
    count = _Count()

    def do_GET(self) -> None:  # noqa: N802 - the standard library's name
        if urlsplit(self.path).path == "/" + COUNT_PATH:
            data = str(self.count.value).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        self._answer(body=True)

    def do_HEAD(self) -> None:  # noqa: N802
        self._answer(body=False)

    def _answer(self, body: bool) -> None:
        self.count.add()
        path = self.files.get(unquote(urlsplit(self.path).path).lstrip("/"))
        time.sleep(self.latency_s)
        if path is None:
            self.send_error(404)
            return
        try:  # the resolved file itself, never a symlink put in its place since
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            self.send_error(404)
            return
        with open(fd, "rb") as f:
            self._answer_from(f, body)

    def _answer_from(self, f, body: bool) -> None:
        size = os.fstat(f.fileno()).st_size
        start, end, status = 0, size, 200
        asked = self.headers.get("Range")
        match = _RANGE.match(asked.strip()) if asked else None
        if match is not None:
            start = int(match.group(1))
            end = min(size, int(match.group(2)) + 1) if match.group(2) else size
            if start >= size:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            status = 206
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(end - start))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", f'"{os.fstat(f.fileno()).st_mtime_ns:x}-{size:x}"')
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.end_headers()
        if body:
            f.seek(start)
            self._send(f.read(end - start))

    def _send(self, data: bytes) -> None:
        if not self.bytes_per_s:
            self.wfile.write(data)
            return
        began = time.perf_counter()
        view = memoryview(data)
        for pos in range(0, len(view), _PACE_CHUNK):
            self.wfile.write(view[pos:pos + _PACE_CHUNK])
            due = began + (pos + _PACE_CHUNK) / self.bytes_per_s
            delay = due - time.perf_counter()
            if delay > 0:
                time.sleep(delay)

    def log_message(self, format, *args) -> None:  # noqa: A002 - quiet: no line per request
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # connection threads end with the process
    request_queue_size = 1024  # the listen backlog: a loader may open many connections at once

    def handle_error(self, request, client_address) -> None:
        if isinstance(sys.exc_info()[1], ConnectionError):
            return  # a client that went away (a loader closed early): nothing to report
        super().handle_error(request, client_address)


def serve(root: str, latency_ms: float, max_seconds: float, parent: int, mb_per_s: float = 0.0) -> None:
    die_with_parent(parent)
    files = served_files(Path(root))
    handler = type("Handler", (_Handler,), {"files": files, "latency_s": latency_ms / 1000.0,
                                            "bytes_per_s": mb_per_s * 1e6, "count": _Count()})
    server = _Server(("127.0.0.1", 0), handler)
    print(f"port {server.server_address[1]}", flush=True)
    timer = threading.Timer(max_seconds, server.shutdown)
    timer.daemon = True
    timer.start()
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


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
