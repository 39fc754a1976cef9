"""A real HTTP server for tests: aiohttp on 127.0.0.1 (port 0) in a child process, serving
the files of a folder, with faults injected on demand.

The server runs in its own process so that the test process keeps a single thread (the
loader then starts its workers with ``fork``, as in most training scripts). The test drives
it through :class:`Server`, which talks to control endpoints under ``/_control/``.

``server.script(name, *faults)`` queues faults for the next requests of ``/name`` (one per
request, in order; afterwards the file is served normally). ``server.script_any(*faults)``
queues faults taken by whatever request comes next. A fault is:

================  ============================================================================
``503`` (an int)  that status, with an empty body
``Status(s, r)``  status ``s`` with header ``Retry-After: r``
``"reset"``       the connection is dropped before any response (the client sees a reset)
``"truncate"``    headers promise the whole file (Content-Length), half the body is sent, then
                  the connection is dropped
``"hang"``        no answer until the client gives up (then the connection is dropped)
================  ============================================================================

``server.latency = s`` delays every answer by ``s`` seconds. ``server.requests[name]``
counts requests per file, ``server.ranges`` lists the Range headers received, and
``server.peak`` is the most requests held at once by latency or a hang.

The server is test code that listens on a port, so it holds to what any server should:

* it serves regular files strictly inside its folder: a path with ``.`` or ``..`` segments,
  empty segments (``//tmp/...``), encoded slashes (``%2f``), backslashes or NUL is answered
  400, and a file outside the folder (through a symlink, say) 404;
* ``/_control/`` takes only the operations and the JSON shapes :class:`Server` sends
  (``{"name": str | null, "faults": [fault, ...]}``, a latency in ``[0, 60]``), 400 otherwise;
* it stops when the process that started it ends, even by SIGKILL: its stdin is a pipe from
  that process, whose end of file stops it, and a watchdog stops it when its parent process
  changes (a forked child of the test may hold the pipe open).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import urllib.parse
import urllib.request
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Status:
    status: int
    retry_after: str | None = None


# -- the test's side ---------------------------------------------------------------------------
class Server:
    def __init__(self, root: str | os.PathLike):
        self.root = os.fspath(root)
        self.port = 0
        self._proc: subprocess.Popen | None = None

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/{name}"

    def start(self) -> "Server":
        self._proc = subprocess.Popen([sys.executable, "-m", "tests.httpserver", self.root, str(os.getpid())],
                                      cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self._proc.stdout.readline()
        if not line.startswith("port "):
            self.stop()
            raise RuntimeError(f"the HTTP test server did not start: {line!r}")
        self.port = int(line.split()[1])
        return self

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.stdin.close()  # end of file: the server stops
            proc.terminate()
            proc.wait(30)
            proc.stdout.close()

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def _control(self, op: str, payload=None):
        data = json.dumps(payload).encode()
        req = urllib.request.Request(self.url(f"_control/{op}"), data=data, method="POST")
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read())

    def script(self, name: str, *faults) -> None:
        self._control("script", {"name": name, "faults": [_encode(f) for f in faults]})

    def script_any(self, *faults) -> None:
        self._control("script", {"name": None, "faults": [_encode(f) for f in faults]})

    @property
    def latency(self) -> float:
        return self._control("state")["latency"]

    @latency.setter
    def latency(self, seconds: float) -> None:
        self._control("latency", seconds)

    @property
    def requests(self) -> collections.Counter:
        return collections.Counter(self._control("state")["requests"])

    @property
    def ranges(self) -> list[str]:
        return self._control("state")["ranges"]

    @property
    def peak(self) -> int:
        return self._control("state")["peak"]


@contextlib.contextmanager
def serving_copy(folder: str | os.PathLike, tmp_path: pathlib.Path):
    """A :class:`Server` of a copy of ``folder`` in ``tmp_path / "www"`` (its ``root_path``),
    so that a test may cut or change the files it serves."""
    copy = tmp_path / "www"
    shutil.copytree(folder, copy)
    with Server(copy) as s:
        s.root_path = copy
        yield s


def _encode(fault):
    if isinstance(fault, Status):
        return {"status": fault.status, "retry_after": fault.retry_after}
    return fault


# -- the server process ------------------------------------------------------------------------
_NAMED_FAULTS = ("reset", "truncate", "hang")
_MAX_FAULTS = 10_000  # per control request
_MAX_LATENCY = 60.0


class _State:
    def __init__(self, root: str):
        self.root = os.path.realpath(root)
        self.latency = 0.0
        self.requests: collections.Counter[str] = collections.Counter()
        self.ranges: list[str] = []
        self.waiting = 0
        self.peak = 0
        self.scripts: dict = collections.defaultdict(collections.deque)

    def next_fault(self, name: str):
        self.requests[name] += 1
        for key in (name, None):
            if self.scripts.get(key):
                return self.scripts[key].popleft()
        return None

    def file(self, name: str) -> str | None:
        """The regular file ``name`` names strictly inside the root (symlinks resolved), or None."""
        path = os.path.realpath(os.path.join(self.root, name))
        if os.path.commonpath([path, self.root]) != self.root or not os.path.isfile(path):
            return None
        return path


def file_name(raw_path: str) -> str | None:
    """The file name a request path asks for (``a/b.jpg`` from ``/a/b.jpg``), or None for a
    path that is not plainly inside the served folder: ``.`` or ``..`` segments, empty ones
    (``//x``, ``a//b``, a trailing ``/``), encoded slashes or backslashes, NUL."""
    if not raw_path.startswith("/") or re.search(r"%(2f|5c)", raw_path, re.IGNORECASE):
        return None
    segments = [urllib.parse.unquote(s) for s in raw_path[1:].split("/")]
    for segment in segments:
        if segment in ("", ".", "..") or "\\" in segment or "\0" in segment or "/" in segment:
            return None
    return "/".join(segments)


def _is_status(value) -> bool:
    return type(value) is int and 100 <= value <= 599


def _valid_fault(fault) -> bool:
    if isinstance(fault, str):
        return fault in _NAMED_FAULTS
    if isinstance(fault, dict):
        return (set(fault) == {"status", "retry_after"} and _is_status(fault["status"])
                and (fault["retry_after"] is None or isinstance(fault["retry_after"], str)))
    return _is_status(fault)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a number")


def control_error(op: str, payload) -> str | None:
    """Why a control request is refused, or None for one :class:`Server` could have sent."""
    if op == "script":
        if not isinstance(payload, dict) or set(payload) != {"name", "faults"}:
            return 'script takes {"name": ..., "faults": [...]}'
        if payload["name"] is not None and not isinstance(payload["name"], str):
            return "name must be a string or null"
        faults = payload["faults"]
        if not isinstance(faults, list) or len(faults) > _MAX_FAULTS:
            return f"faults must be a list of at most {_MAX_FAULTS} faults"
        bad = [f for f in faults if not _valid_fault(f)]
        return f"unknown faults {bad[:3]!r}" if bad else None
    if op == "latency":
        if isinstance(payload, bool) or not isinstance(payload, (int, float)) or \
                not 0 <= payload <= _MAX_LATENCY:
            return f"latency must be a number of seconds in [0, {_MAX_LATENCY:g}]"
        return None
    if op == "state":
        return None if payload is None else "state takes no payload"
    return f"unknown control {op!r}"


async def _control(state: _State, request):
    from aiohttp import web

    op = request.match_info["op"]
    try:
        payload = json.loads(await request.text(), parse_constant=_reject_constant)
    except ValueError as exc:
        return web.Response(status=400, text=f"the body is not JSON: {exc}")
    error = control_error(op, payload)
    if error is not None:
        return web.Response(status=400, text=error)
    if op == "script":
        state.scripts[payload["name"]].extend(payload["faults"])
    elif op == "latency":
        state.latency = float(payload)
    return web.json_response({"latency": state.latency, "requests": state.requests,
                              "ranges": state.ranges, "peak": state.peak})


async def _handle(state: _State, request):
    from aiohttp import web

    name = file_name(request.rel_url.raw_path)
    if name is None:
        return web.Response(status=400, text="bad path")
    fault = state.next_fault(name)
    if "Range" in request.headers:
        state.ranges.append(request.headers["Range"])
    if state.latency or fault == "hang":
        state.waiting += 1
        state.peak = max(state.peak, state.waiting)
        try:
            if fault == "hang":
                await asyncio.Event().wait()  # until the client disconnects (handler cancelled)
            await asyncio.sleep(state.latency)
        finally:
            state.waiting -= 1
    if isinstance(fault, int):
        return web.Response(status=fault)
    if isinstance(fault, dict):
        headers = {"Retry-After": fault["retry_after"]} if fault["retry_after"] is not None else None
        return web.Response(status=fault["status"], headers=headers)
    if fault == "reset":
        _drop(request)
        return web.Response(status=500)
    path = state.file(name)
    if path is None:
        return web.Response(status=404, text="not found")
    if fault == "truncate":
        with open(path, "rb") as f:
            data = f.read()
        resp = web.StreamResponse(headers={"Content-Length": str(len(data))})
        await resp.prepare(request)
        await resp.write(data[: len(data) // 2])
        _drop(request)
        return resp
    return web.FileResponse(path)


def _drop(request) -> None:
    """Close the connection at once (RST, not a graceful FIN), as a crashed server would."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


def _stop_with_parent(loop: asyncio.AbstractEventLoop, stop: asyncio.Event, parent: int) -> None:
    """Set ``stop`` at end of file on stdin (the parent's end of the pipe closed) or once the
    parent process is gone (this process is then re-parented)."""

    def readable() -> None:
        if not os.read(0, 4096):
            loop.remove_reader(0)
            stop.set()

    def watch() -> None:
        if os.getppid() != parent:
            stop.set()
        else:
            loop.call_later(0.5, watch)

    loop.add_reader(0, readable)
    watch()


async def _serve(root: str, parent: int) -> None:
    from aiohttp import web

    state = _State(root)
    app = web.Application()
    app.router.add_post("/_control/{op}", lambda r: _control(state, r))
    app.router.add_get("/{name:.*}", lambda r: _handle(state, r))
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5, handler_cancellation=True)
    await runner.setup()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    await web.SockSite(runner, sock).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    _stop_with_parent(loop, stop, parent)
    print(f"port {sock.getsockname()[1]}", flush=True)
    try:
        await stop.wait()
    finally:
        loop.remove_reader(0)
        await runner.cleanup()


if __name__ == "__main__":
    asyncio.run(_serve(sys.argv[1], int(sys.argv[2])))
