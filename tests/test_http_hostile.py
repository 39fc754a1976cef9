"""HTTP reads against hostile servers on 127.0.0.1, and the repository's own test server held to
the rules of any server.

The hostile servers are aiohttp.web applications run by each test on its own event loop, next to
the client: a gzip bomb, bodies over the limit (with and without Content-Length), an endless
chunked body, a server that ignores Range, redirects to another origin that carries an API key,
a 408. Each counts what it sent and records the headers it received, and the tests assert on
those counts and on the errors, never on time.
"""

from __future__ import annotations

import asyncio
import collections
import http.client
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import zlib

import pytest
from aiohttp import web

import aioload
from aioload._storage import http as _http
from aioload._storage.retry import parse_retry_after
from tests.httpserver import REPO, Server

FAST = aioload.RetryPolicy(attempts=3, backoff=0.001, max_delay=0.01, timeout=30)
ONCE = aioload.RetryPolicy(attempts=1, timeout=30)
MiB = 1 << 20
ENDLESS = 128 * MiB
CHUNK = bytes(range(256)) * 256  # 64 KiB, a pattern whose slices are easy to check
KEY = {"X-Api-Key": "k-123", "Authorization": "Bearer t-456"}


def gzipped(size: int) -> bytes:
    """``size`` zero bytes, gzip-compressed (a thousandfold smaller), without holding them."""
    z = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    block = bytes(MiB)
    return b"".join([*(z.compress(block[: min(MiB, size - i)]) for i in range(0, size, MiB)), z.flush()])


class Hostile:
    """An aiohttp.web server on 127.0.0.1 (port 0) on the running loop.

    ``sent[path]`` counts the body bytes the server handed to the socket, ``requests[path]``
    the requests, ``headers[path]`` the request headers of each; ``finished[path]`` is set when
    a handler has ended (after its client went away, for the streaming ones)."""

    def __init__(self):
        self.handlers: dict = {}
        self.sent: collections.Counter[str] = collections.Counter()
        self.requests: collections.Counter[str] = collections.Counter()
        self.headers: dict[str, list] = collections.defaultdict(list)
        self.finished: dict[str, asyncio.Event] = collections.defaultdict(asyncio.Event)
        self.port = 0

    def route(self, path: str, handler) -> None:
        self.handlers[path] = handler

    async def _dispatch(self, request):
        path = request.path
        self.requests[path] += 1
        self.headers[path].append(dict(request.headers))
        try:
            return await self.handlers[path](request)
        finally:
            self.finished[path].set()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    async def stream(self, request, path: str, total: int | None, headers=None, chunked=False):
        """Send ``total`` bytes of CHUNK's pattern (None: "without end", up to ENDLESS, so that
        a client without a bound still gets to the end of a test), counting them; stop quietly
        when the client goes away."""
        total = ENDLESS if total is None else total
        resp = web.StreamResponse(headers=headers or {})
        if chunked:
            resp.enable_chunked_encoding()
        else:
            resp.content_length = total
        await resp.prepare(request)
        sock = request.transport.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)  # keep kernel buffering small
        try:
            while self.sent[path] < total:
                piece = CHUNK[: total - self.sent[path]]
                await resp.write(piece)
                self.sent[path] += len(piece)
            await resp.write_eof()
        except (ConnectionError, OSError):
            pass  # the client closed the connection: what it did not read was never sent
        return resp

    async def __aenter__(self) -> "Hostile":
        app = web.Application()
        app.router.add_get("/{path:.*}", self._dispatch)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5,
                                    handler_cancellation=True)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.port = self.runner.addresses[0][1]
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.runner.cleanup()


def run(coro_fn):
    async def bounded():
        async with asyncio.timeout(90):  # a hang guard only
            return await coro_fn()

    return asyncio.run(bounded())


async def failure(read) -> aioload.RemoteReadError:
    with pytest.raises(aioload.RemoteReadError) as info:
        await read
    return info.value


def too_large(url: str, limit: int, detail: str = "") -> str:
    return (rf"^GET {re.escape(url)} failed after 1 attempt; last status: HTTP 200 \(the body "
            rf"{detail}is larger than max_bytes={limit}.*\); not retried: pass "
            rf"Storage\(max_bytes=\.\.\.\) to read larger objects$")


# -- size ------------------------------------------------------------------------------------
def test_a_gzip_bomb_comes_back_as_sent_and_identity_is_asked():
    bomb = gzipped(64 * MiB)

    async def main():
        async with Hostile() as srv:
            srv.route("/bomb", lambda r: _static(bomb, {"Content-Encoding": "gzip"}))
            async with aioload.Storage(retry=ONCE) as storage:
                data = await storage.read_bytes(srv.url("/bomb"))
            return data, srv.headers["/bomb"]

    data, headers = run(main)
    assert data == bomb  # the bytes as sent, not 64 MiB decoded
    assert [h["Accept-Encoding"] for h in headers] == ["identity"]


async def _static(body: bytes, headers: dict[str, str], status: int = 200):
    return web.Response(body=body, headers=headers, status=status)


def test_decompress_decodes_gzip_within_max_bytes_and_fails_a_bomb():
    small = zlib.compress(CHUNK * 4)  # the zlib format, as "deflate" is meant
    bomb = gzipped(64 * MiB)

    async def main():
        async with Hostile() as srv:
            srv.route("/bomb", lambda r: _static(bomb, {"Content-Encoding": "gzip"}))
            srv.route("/small", lambda r: _static(small, {"Content-Encoding": "deflate"}))
            async with aioload.Storage(retry=FAST, decompress=True, max_bytes=MiB) as storage:
                err = await failure(storage.read_bytes(srv.url("/bomb")))
                data = await storage.read_bytes(srv.url("/small"))
            return srv, err, data

    srv, err, data = run(main)
    assert data == CHUNK * 4
    assert re.match(too_large(srv.url("/bomb"), MiB), str(err)), str(err)
    assert str(err).endswith("once decoded); not retried: pass Storage(max_bytes=...) to read larger objects")
    assert (err.attempts, err.status) == (1, 200) and srv.requests["/bomb"] == 1
    assert srv.headers["/bomb"][0]["Accept-Encoding"] == "gzip, deflate"


def test_content_length_over_max_bytes_fails_before_the_body_even_when_encoded():
    async def main():
        async with Hostile() as srv:
            srv.route("/big", lambda r: srv.stream(r, "/big", 64 * MiB))
            srv.route("/big-gz", lambda r: srv.stream(r, "/big-gz", 64 * MiB, {"Content-Encoding": "gzip"}))
            async with aioload.Storage(retry=FAST, max_bytes=MiB) as storage:
                errors = [await failure(storage.read_bytes(srv.url(p))) for p in ("/big", "/big-gz")]
            for p in ("/big", "/big-gz"):
                await srv.finished[p].wait()
            return srv, errors

    srv, errors = run(main)
    for path, err in zip(("/big", "/big-gz"), errors):
        assert re.match(too_large(srv.url(path), MiB, rf"of {64 * MiB} bytes \(Content-Length\) "), str(err)), str(err)
        assert err.attempts == 1 and srv.requests[path] == 1  # not retried
        assert srv.sent[path] < 16 * MiB  # the connection was dropped, not read to its end


def test_a_body_without_content_length_is_cut_at_max_bytes():
    async def main():
        async with Hostile() as srv:
            srv.route("/chunked", lambda r: srv.stream(r, "/chunked", MiB + 1, chunked=True))
            srv.route("/exact", lambda r: srv.stream(r, "/exact", MiB, chunked=True))
            async with aioload.Storage(retry=FAST, max_bytes=MiB) as storage:
                err = await failure(storage.read_bytes(srv.url("/chunked")))
                exact = await storage.read_bytes(srv.url("/exact"))
            return srv, err, exact

    srv, err, exact = run(main)
    assert re.match(too_large(srv.url("/chunked"), MiB), str(err)), str(err)
    assert err.attempts == 1 and srv.requests["/chunked"] == 1
    assert exact == (CHUNK * 16)[:MiB]  # a body of exactly max_bytes is read


def test_an_endless_body_fails_at_max_bytes_not_at_the_timeout():
    async def main():
        async with Hostile() as srv:
            srv.route("/endless", lambda r: srv.stream(r, "/endless", None, chunked=True))
            async with aioload.Storage(retry=FAST, max_bytes=MiB) as storage:
                err = await failure(storage.read_bytes(srv.url("/endless")))
            await srv.finished["/endless"].wait()
            return srv, err

    srv, err = run(main)
    assert re.match(too_large(srv.url("/endless"), MiB), str(err)), str(err)
    assert err.attempts == 1 and srv.requests["/endless"] == 1
    assert srv.sent["/endless"] < 32 * MiB


def test_a_range_read_from_a_server_that_ignores_range_reads_only_what_it_needs():
    async def main():
        async with Hostile() as srv:
            srv.route("/object", lambda r: srv.stream(r, "/object", 64 * MiB))
            sent = []
            async with aioload.Storage(retry=FAST) as storage:
                parts = []
                for _ in range(3):
                    parts.append(await storage.read_range(srv.url("/object"), 1000, 10))
                    await srv.finished["/object"].wait()
                    srv.finished["/object"].clear()
                    sent.append(srv.sent.pop("/object"))
            return srv, parts, sent

    srv, parts, sent = run(main)
    assert parts == [CHUNK[1000:1010]] * 3
    assert [h["Range"] for h in srv.headers["/object"]] == ["bytes=1000-1009"] * 3
    assert all(n < 16 * MiB for n in sent), sent  # not the 64 MiB object, each time


def test_a_partial_answer_is_held_to_the_range_asked():
    async def partial(request, start: int, body: bytes):
        return web.Response(status=206, body=body,
                            headers={"Content-Range": f"bytes {start}-{start + len(body) - 1}/{64 * MiB}"})

    async def main():
        async with Hostile() as srv:
            srv.route("/long", lambda r: partial(r, 1000, CHUNK))  # 64 KiB for 10 bytes asked
            srv.route("/shifted", lambda r: partial(r, 0, CHUNK[:10]))  # another range than asked
            srv.route("/unlabelled", lambda r: _static(CHUNK[:10], {}, status=206))  # which bytes? unknown
            async with aioload.Storage(retry=FAST) as storage:
                part = await storage.read_range(srv.url("/long"), 1000, 10)
                err = await failure(storage.read_range(srv.url("/shifted"), 1000, 10))
                unlabelled = await failure(storage.read_range(srv.url("/unlabelled"), 1000, 10))
            return srv, part, err, unlabelled

    srv, part, err, unlabelled = run(main)
    assert part == CHUNK[:10]
    assert "(206 Partial Content with Content-Range 'bytes 0-9/67108864' for bytes from 1000)" in str(err)
    assert err.attempts == 1 and srv.requests["/shifted"] == 1
    url = re.escape(srv.url("/unlabelled"))
    assert re.match(rf"^GET {url} failed after 1 attempt; last status: HTTP 206 \(206 Partial Content without "
                    r"Content-Range for bytes from 1000: which bytes it holds is unknown\); not retried: the server "
                    r"does not answer range requests as HTTP/1.1 says \(RFC 9110, 15.3.7\)$", str(unlabelled))
    assert srv.requests["/unlabelled"] == 1


# -- redirects -------------------------------------------------------------------------------
async def _redirect(to: str, status: int = 302):
    return web.Response(status=status, headers={"Location": to})


def test_redirects_stay_within_the_origin_and_keep_the_headers_there():
    async def main():
        async with Hostile() as home, Hostile() as other:
            other.route("/x", lambda r: _static(b"other", {}))
            home.route("/target", lambda r: _static(b"home", {}))
            home.route("/same", lambda r: _redirect("/target", 301))
            home.route("/cross", lambda r: _redirect(other.url("/x")))
            async with aioload.Storage(retry=FAST, headers=KEY) as storage:
                same = await storage.read_bytes(home.url("/same"))
                err = await failure(storage.read_bytes(home.url("/cross")))
            return home, other, same, err

    home, other, same, err = run(main)
    assert same == b"home" and home.headers["/target"][0]["X-Api-Key"] == "k-123"
    url = home.url("/cross")
    assert str(err) == (f"GET {url} failed after 1 attempt; last status: HTTP 302 (redirect to "
                        f"{other.url('/x')} refused: it leaves the origin http://127.0.0.1:{home.port}); "
                        "not retried: pass Storage(redirects='any') to follow redirects to other "
                        "origins (the storage's headers are not sent there)")
    assert other.requests["/x"] == 0  # the key never reached the other port


def test_cross_origin_redirects_when_allowed_drop_the_headers():
    async def main():
        async with Hostile() as home, Hostile() as other:
            other.route("/x", lambda r: _static(b"other", {}))
            home.route("/cross", lambda r: _redirect(other.url("/x"), 307))
            async with aioload.Storage(retry=FAST, headers=KEY, redirects="any") as storage:
                data = await storage.read_bytes(home.url("/cross"))
            return home, other, data

    home, other, data = run(main)
    assert data == b"other"
    assert home.headers["/cross"][0]["X-Api-Key"] == "k-123"
    (received,) = other.headers["/x"]
    assert "X-Api-Key" not in received and "Authorization" not in received


def test_redirect_none_and_redirect_loops_fail_at_once():
    async def main():
        async with Hostile() as srv:
            srv.route("/a", lambda r: _redirect("/b"))
            srv.route("/b", lambda r: _static(b"b", {}))
            srv.route("/loop", lambda r: _redirect("/loop"))
            async with aioload.Storage(retry=FAST, redirects="none") as storage:
                refused = await failure(storage.read_bytes(srv.url("/a")))
            async with aioload.Storage(retry=FAST) as storage:
                looped = await failure(storage.read_bytes(srv.url("/loop")))
            return srv, refused, looped

    srv, refused, looped = run(main)
    assert "(redirect to " + srv.url("/b") + " refused: redirects='none')" in str(refused)
    assert srv.requests["/b"] == 0
    assert "(more than 10 redirects); not retried: the server redirects in a loop" in str(looped)
    assert looped.attempts == 1 and srv.requests["/loop"] == 11


@pytest.mark.parametrize("source, target, rule, refused", [
    ("http://h/a", "http://H:80/b", "same-origin", None),
    ("https://h/a", "https://h:443/b", "same-origin", None),
    ("http://h:8080/a", "http://h:8081/a", "same-origin", "it leaves the origin http://h:8080"),
    ("http://h/a", "https://h/a", "same-origin", "it leaves the origin http://h:80"),
    ("http://h/a", "http://g/a", "same-origin", "it leaves the origin http://h:80"),
    ("http://h/a", "http://g/a", "any", None),
    ("http://[::1]:9/a", "http://[::1]:9/b", "same-origin", None),
    ("https://h/a", "http://h/a", "any", "from https to http"),
    ("https://h/a", "http://h/a", "same-origin", "from https to http"),
    ("http://h/a", "ftp://h/a", "any", "not an http(s) URL"),
    ("http://h/a", "http://h/b", "none", "redirects='none'"),
])
def test_the_redirect_rule(source, target, rule, refused):
    reason = _http.redirect_refusal(source, target, source, rule)
    assert reason == (None if refused is None else f"redirect to {target} refused: {refused}")


def test_a_later_hop_is_judged_against_the_first_url():
    # under "any", a hop from https elsewhere down to http is still refused
    assert _http.redirect_refusal("https://g/x", "http://h/a", "http://h/a", "any") == \
        "redirect to http://h/a refused: from https to http"
    assert _http.redirect_refusal("http://h/x", "http://h/y", "http://g/a", "same-origin") == \
        "redirect to http://h/y refused: it leaves the origin http://g:80"


# -- retries ---------------------------------------------------------------------------------
def test_408_is_retried():
    async def main():
        async with Hostile() as srv:
            async def flaky(request):
                return web.Response(status=408) if srv.requests["/f"] == 1 else web.Response(body=b"ok")

            srv.route("/f", flaky)
            async with aioload.Storage(retry=FAST) as storage:
                return srv, await storage.read_bytes(srv.url("/f"))

    srv, data = run(main)
    assert data == b"ok" and srv.requests["/f"] == 2


@pytest.mark.parametrize("name", ["timeout", "backoff", "max_delay"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_retry_policy_refuses_numbers_that_are_not_finite(name, value):
    with pytest.raises(ValueError, match=rf"^{name} must be a finite number of seconds, got {value}$"):
        aioload.RetryPolicy(**{name: value})


def test_a_retry_after_that_is_not_finite_is_ignored():
    assert parse_retry_after("nan") is None and parse_retry_after("inf") is None
    assert parse_retry_after("1.5") == 1.5


def test_storage_validates_the_http_limits():
    with pytest.raises(ValueError, match=r"^max_bytes must be >= 1, got 0$"):
        aioload.Storage(max_bytes=0)
    with pytest.raises(TypeError, match=r"^max_bytes must be an int >= 1, got 1.5$"):
        aioload.Storage(max_bytes=1.5)
    with pytest.raises(TypeError, match=r"^decompress must be True or False, got 'yes'$"):
        aioload.Storage(decompress="yes")
    with pytest.raises(ValueError, match=r"^redirects must be 'same-origin', 'any' or 'none', got 'all'$"):
        aioload.Storage(redirects="all")
    storage = aioload.Storage()
    assert (storage.max_bytes, storage.decompress, storage.redirects) == (1 << 30, False, "same-origin")


# -- the repository's test server ------------------------------------------------------------
@pytest.fixture
def served(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    (root / "ok.bin").write_bytes(b"inside")
    (tmp_path / "secret.txt").write_bytes(b"SECRET")
    os.symlink(tmp_path / "secret.txt", root / "link")
    with Server(root) as srv:
        yield srv, tmp_path / "secret.txt"


def raw_request(port: int, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, path, body=body)  # the path goes out byte for byte, unnormalised
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_the_test_server_serves_nothing_outside_its_folder(served):
    srv, secret = served
    assert raw_request(srv.port, "GET", "/ok.bin") == (200, b"inside")
    for path in ["/../secret.txt", "/%2e%2e/secret.txt", "/..%2fsecret.txt", "/..%2Fsecret.txt",
                 f"/{secret}", f"/%2f{str(secret)[1:]}", "/ok.bin/../../secret.txt", "/..\\secret.txt",
                 "/./ok.bin", "/"]:
        assert raw_request(srv.port, "GET", path) == (400, b"bad path"), path
    assert raw_request(srv.port, "GET", "/link") == (404, b"not found")  # a symlink out of the folder


def test_the_test_server_takes_only_the_control_requests_it_knows(served):
    srv, _ = served
    bad = [("script", b"not json"), ("script", b'{"name": 5, "faults": []}'),
           ("script", b'{"name": "ok.bin", "faults": "abc"}'), ("script", b'{"name": "ok.bin", "faults": [999]}'),
           ("script", b'{"name": "ok.bin", "faults": ["explode"]}'),
           ("script", b'{"name": "ok.bin", "faults": [{"status": "500", "retry_after": null}]}'),
           ("script", b'{"name": "ok.bin", "faults": [503], "extra": 1}'),
           ("latency", b"NaN"), ("latency", b'"0.1"'), ("latency", b"-1"), ("latency", b"true"),
           ("latency", b"3600"), ("state", b"{}"), ("reboot", b"null")]
    for op, body in bad:
        status, _ = raw_request(srv.port, "POST", f"/_control/{op}", body)
        assert status == 400, (op, body)
    state = json.loads(raw_request(srv.port, "POST", "/_control/state", b"null")[1])
    assert state["latency"] == 0.0
    assert raw_request(srv.port, "GET", "/ok.bin") == (200, b"inside")  # no fault was queued
    srv.script("ok.bin", 503)  # what Server sends is still taken
    assert raw_request(srv.port, "GET", "/ok.bin")[0] == 503


def test_the_test_server_ends_when_its_parent_is_killed(tmp_path):
    code = ("import sys, time\nfrom tests.httpserver import Server\n"
            "srv = Server(sys.argv[1]).start()\nprint(srv._proc.pid, srv.port, flush=True)\ntime.sleep(600)\n")
    env = {**os.environ, "PYTHONPATH": REPO}
    parent = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, text=True)
    pidfd = None
    try:
        pid, port = map(int, parent.stdout.readline().split())
        pidfd = os.pidfd_open(pid)  # readable once the server process has exited
        assert select.select([pidfd], [], [], 0)[0] == []
        parent.kill()  # SIGKILL: no cleanup runs in the parent
        parent.wait(30)
        exited = select.select([pidfd], [], [], 60)[0] == [pidfd]  # 60 s: a hang guard only
        if not exited:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        assert exited, "the server outlived its parent"
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
    finally:
        parent.stdout.close()
        if pidfd is not None:
            os.close(pidfd)
