"""The bench's HTTP server: files under ROOT on 127.0.0.1, each GET answered after a round trip.

Run as a script (``python _benchserver.py ROOT --latency-ms 20``), in its own process, so that
its threads share no GIL with the loaders being measured; it imports only the standard
library. Each connection has its own thread and each request sleeps the round trip before it
is answered, so concurrent requests overlap as they do against a remote store. Only the files
found under ROOT at start are served (no path outside it can be asked for). The process exits
on SIGTERM or Ctrl-C, when its parent dies (even by SIGKILL), and after ``--max-seconds``.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """End this process when ``parent`` dies, even by SIGKILL: the kernel's parent-death
    signal where there is one (Linux), and a thread that watches the parent's pid."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass
    if os.getppid() != parent:  # it died before the signal was armed
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: a client may reuse its connections
    files: dict[str, Path] = {}
    latency_s = 0.0

    def do_GET(self) -> None:  # noqa: N802 - the standard library's name
        path = self.files.get(unquote(urlsplit(self.path).path).lstrip("/"))
        time.sleep(self.latency_s)
        if path is None:
            self.send_error(404)
            return
        data = path.read_bytes()
        self.send_response(200)
        self.send_header("Content-Type", "image/jpeg")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format, *args) -> None:  # noqa: A002 - quiet: no line per request
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # connection threads end with the process
    request_queue_size = 1024  # the listen backlog: a loader may open many connections at once

    def handle_error(self, request, client_address) -> None:
        if isinstance(sys.exc_info()[1], ConnectionError):
            return  # a client that went away (a loader closed early): nothing to report
        super().handle_error(request, client_address)


def serve(root: str, latency_ms: float, max_seconds: float, parent: int) -> None:
    die_with_parent(parent)
    base = Path(root)
    files = {p.relative_to(base).as_posix(): p for p in sorted(base.rglob("*")) if p.is_file()}
    handler = type("Handler", (_Handler,), {"files": files, "latency_s": latency_ms / 1000.0})
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
    p.add_argument("--parent", type=int, default=os.getppid())
    args = p.parse_args(argv)
    serve(args.root, args.latency_ms, args.max_seconds, args.parent)


if __name__ == "__main__":
    main()
