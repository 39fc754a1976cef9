"""The bench's HTTP scenario: the images of a folder behind :mod:`aioload._tools.benchserver` (a
threaded server on 127.0.0.1 with a round trip per request), read in both loaders' styles.

Only the standard library is used on both sides, so ``aioload bench`` needs no extra:

* aioload's read stage: :meth:`HttpImages.read` speaks HTTP/1.1 over ``asyncio`` streams, with
  keep-alive connections pooled per event loop (``io_concurrency`` requests in flight);
* torch's recipe: ``__getitem__`` does a blocking ``urllib`` GET, then decodes (one request in
  flight per worker).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

from aioload._storage import scope as _scope
from aioload._data.dataset import Dataset

SERVER = Path(__file__).resolve().parent / "benchserver.py"


class Server:
    """The server process for ``root`` with a round trip of ``latency_ms`` (each body paced to
    ``mb_per_s``; 0: unpaced); ``close()`` (or leaving the ``with`` block, by Ctrl-C too) stops
    it, and it stops by itself when this process dies or after ``max_seconds``."""

    def __init__(self, root: str | os.PathLike, latency_ms: float, max_seconds: float = 6 * 3600,
                 mb_per_s: float = 0.0):
        self.proc = subprocess.Popen(
            [sys.executable, str(SERVER), str(root), "--latency-ms", str(latency_ms),
             "--max-seconds", str(max_seconds), "--parent", str(os.getpid()), "--mb-per-s", str(mb_per_s)],
            stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line.startswith("port "):
            self.close()
            raise RuntimeError(f"the bench's HTTP server did not start: {line!r}")
        self.base = f"http://127.0.0.1:{int(line.split()[1])}/"

    def requests(self) -> int:
        """How many requests for files the server has answered so far (GET and HEAD)."""
        from aioload._tools.benchserver import COUNT_PATH

        return int(self._ask(COUNT_PATH))

    def cpu_seconds(self) -> float:
        """The CPU seconds the server's process has used so far (all of its threads)."""
        from aioload._tools.benchserver import CPU_PATH

        return float(self._ask(CPU_PATH))

    def _ask(self, path: str) -> bytes:
        import urllib.request

        with urllib.request.urlopen(self.base + path, timeout=30) as response:
            return response.read()

    def close(self) -> None:
        proc = self.proc
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:  # pragma: no cover - a wedged server
                proc.kill()
                proc.wait()
        proc.stdout.close()

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ----------------------------------------------------------------------------- the client
class _Pool:
    """Idle keep-alive connections to one server, on one event loop."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def get(self, path: str) -> bytes:
        for attempt in (0, 1):  # an idle connection the server has closed is retried once, fresh
            fresh = not self.idle
            reader, writer = self.idle.pop() if self.idle else await asyncio.open_connection(self.host, self.port)
            try:
                body = await self._exchange(reader, writer, path)
            except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
                writer.close()
                if fresh or attempt:
                    raise OSError(f"GET http://{self.host}:{self.port}/{path} failed: {exc!r}") from exc
                continue
            except BaseException:  # cancelled mid-exchange: the connection is in an unknown state
                writer.close()
                raise
            self.idle.append((reader, writer))
            return body
        raise AssertionError("unreachable")  # pragma: no cover

    async def _exchange(self, reader, writer, path: str) -> bytes:
        writer.write(f"GET /{path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n\r\n".encode("latin-1"))
        await writer.drain()
        status = (await reader.readline()).split(None, 2)
        if len(status) < 2:
            raise ValueError("the connection was closed")
        length = None
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value.strip())
        if length is None:
            raise ValueError("no Content-Length in the response")
        body = await reader.readexactly(length)
        if status[1] != b"200":
            raise OSError(f"HTTP {status[1].decode()} for /{path}")
        return body

    async def close(self) -> None:
        for _, writer in self.idle:
            writer.close()
        self.idle.clear()


class HttpImages(Dataset):
    """The images of an ImageFolder, read from :class:`Server` by URL.

    aioload runs ``read`` on its event loop (``io_concurrency`` GETs in flight) and ``decode``
    in its workers; torch's DataLoader runs ``__getitem__`` (a blocking GET, then ``decode``)
    in its workers, one request at a time each.
    """

    def __init__(self, base: str, files: list[str], labels: list[int], transform=None):
        self.base, self.files, self.labels, self.transform = base, files, labels, transform
        parts = urlsplit(base)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80

    def __len__(self) -> int:
        return len(self.files)

    async def read(self, index: int):
        pool = await _scope.get(("bench-http", id(self)), lambda: _Pool(self.host, self.port), _Pool.close)
        return await pool.get(self.files[index]), self.labels[index]

    def read_blocking(self, index: int):
        with urllib.request.urlopen(self.base + self.files[index], timeout=60) as response:
            return response.read(), self.labels[index]

    def decode(self, raw):
        from aioload.images import decode_image

        data, label = raw
        image = decode_image(data)
        return (self.transform(image) if self.transform is not None else image), label

    def describe(self, index: int) -> str:
        return self.base + self.files[index]


