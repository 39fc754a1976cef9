"""A server of a folder that answers as object stores and CDNs do where they differ from a
plain file server, in a child process on 127.0.0.1 (port 0): Python's ``http.server`` with
the quirks a test asks for.

* ``missing=403``: a file that does not exist is answered 403, as S3 answers a missing key
  to a client without list permission (404 otherwise);
* ``head="403"``: ``HEAD`` refused, as a presigned GET URL refuses it; ``head="no-length"``:
  ``HEAD`` answered without ``Content-Length``; ``head="ok"``: answered as usual;
* ``ranges=False``: ``Range`` ignored, the whole file sent with 200, as ``http.server``
  itself does; ``ranges=True``: a single range answered 206 with ``Content-Range``.

Each request is logged to ``log`` as ``METHOD /path RANGE`` (``-`` without one), which
:attr:`StoreServer.requests` reads. The child stops when its stdin (a pipe from the test)
closes, so it never outlives the test.
"""

from __future__ import annotations

import http.server
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class StoreServer:
    def __init__(self, root, log, *, missing: int = 404, head: str = "ok", ranges: bool = True):
        self.root, self.log = str(root), Path(log)
        self.args = [f"--missing={missing}", f"--head={head}", f"--ranges={int(ranges)}"]
        self.port = 0

    def url(self, name: str, credentials: str = "") -> str:
        return f"http://{credentials}127.0.0.1:{self.port}/{name}"

    @property
    def requests(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []

    def __enter__(self) -> "StoreServer":
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.storeserver", self.root, str(self.log), *self.args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO, text=True)
        self.port = int(self.proc.stdout.readline())
        return self

    def __exit__(self, *exc_info) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


def _handler(root: str, log, missing: int, head: str, ranges: bool):
    lock = threading.Lock()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def _file(self) -> Path | None:
            name = self.path.split("?", 1)[0].lstrip("/")
            path = Path(root, name)
            if "/" in name or name.startswith(".") or not path.is_file():
                return None
            return path

        def _log(self) -> None:
            with lock:
                log.write(f"{self.command} {self.path} {self.headers.get('Range') or '-'}\n")
                log.flush()

        def _status(self, status: int) -> None:
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_HEAD(self) -> None:
            self._log()
            path = self._file()
            if head == "403":
                return self._status(403)
            if path is None:
                return self._status(missing)
            self.send_response(200)
            if ranges:
                self.send_header("Accept-Ranges", "bytes")
            if head == "ok":
                self.send_header("Content-Length", str(path.stat().st_size))
            self.send_header("ETag", f'"{path.stat().st_mtime_ns}"')
            self.end_headers()

        def do_GET(self) -> None:
            self._log()
            path = self._file()
            if path is None:
                return self._status(missing)
            data = path.read_bytes()
            asked = re.fullmatch(r"bytes=(\d+)-(\d+)", self.headers.get("Range") or "")
            if ranges and asked:
                start, end = int(asked.group(1)), min(int(asked.group(2)), len(data) - 1)
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
                data = data[start:end + 1]
            else:
                self.send_response(200)
            if ranges:
                self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("ETag", f'"{path.stat().st_mtime_ns}"')
            self.end_headers()
            try:
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):  # a client that read what it needed and left
                self.close_connection = True

    return Handler


class _Quiet(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # a client that closed, as clients do
            super().handle_error(request, client_address)


def main() -> None:
    root, log_path, *flags = sys.argv[1:]
    options = dict(flag[2:].split("=", 1) for flag in flags)
    with open(log_path, "a") as log:
        handler = _handler(root, log, int(options["missing"]), options["head"], options["ranges"] == "1")
        server = _Quiet(("127.0.0.1", 0), handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        print(server.server_address[1], flush=True)
        sys.stdin.read()  # until the test closes the pipe (or ends)
        server.shutdown()


if __name__ == "__main__":
    main()
