"""aioload's own HTTP/1.1 client (``_storage/h1.py`` under ``_storage/http.py``) against real
servers on 127.0.0.1: keep-alive reuse, chunked and close-delimited bodies, a server that
closes mid-body or while a connection is idle, interim answers, invalid answers, a deadline
hit between two pieces of a body, credentials in a URL, and TLS.

Two kinds of servers run on each test's own loop, beside the client: an aiohttp.web
application (a server as deployed) and raw asyncio servers that write exactly the bytes a test
gives them (what a broken or unusual server sends). Each counts what it received; the tests
assert on those counts and on the errors, never on time.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
import gc
import ipaddress
import re
import ssl
import tracemalloc

import pytest
import uvloop
from aiohttp import web

import aioload
from aioload._shards import probe
from aioload._storage import h1
from aioload._storage import scope as _scope
from tests.loopstall import longest_stall

ONCE = aioload.RetryPolicy(attempts=1, timeout=30)
THRICE = aioload.RetryPolicy(attempts=3, backoff=0.001, max_delay=0.01, timeout=30)
BODY = bytes(range(256)) * 40  # 10 KiB
BIG = BODY * 20  # 200 KiB: more than a connection's receive buffer


def run(coro_fn, loop: str = "asyncio"):
    """``coro_fn()`` on a new loop: asyncio's own, or uvloop's (the workers' loop)."""
    async def bounded():
        async with asyncio.timeout(90):  # a hang guard only
            return await coro_fn()

    return uvloop.run(bounded()) if loop == "uvloop" else asyncio.run(bounded())


LOOPS = pytest.mark.parametrize("loop", ["asyncio", "uvloop"])


def open_connections() -> list:
    gc.collect()
    return [o for o in gc.get_objects() if type(o) is h1.Connection and o.transport is not None
            and not o.transport.is_closing()]


class Web:
    """An aiohttp.web server whose ``/{name}`` routes are the test's handlers; ``peers``
    lists the client address of each request (one per connection when they are reused)."""

    def __init__(self, ssl_context: ssl.SSLContext | None = None):
        self.routes: dict = {}
        self.peers: list = []
        self.headers: list[dict] = []
        self.ssl_context = ssl_context
        self.port = 0

    async def _dispatch(self, request):
        self.peers.append(request.transport.get_extra_info("peername"))
        self.headers.append(dict(request.headers))
        return await self.routes[request.match_info["name"]](request)

    def url(self, name: str, host: str = "127.0.0.1") -> str:
        scheme = "https" if self.ssl_context is not None else "http"
        return f"{scheme}://{host}:{self.port}/{name}"

    async def __aenter__(self) -> "Web":
        app = web.Application()
        app.router.add_get("/{name}", self._dispatch)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5, handler_cancellation=True)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0, ssl_context=self.ssl_context).start()
        self.port = self.runner.addresses[0][1]
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.runner.cleanup()


class Raw:
    """A server that reads each request head and answers with ``answer(n)`` (the n-th request
    overall, from 0): bytes to write, or a tuple ``(bytes, "close")`` to write and then close,
    ``(bytes, "hang")`` to write and then send nothing more. ``requests`` counts the heads
    received, ``connections`` the connections accepted."""

    def __init__(self, answer):
        self.answer = answer
        self.requests = 0
        self.connections = 0
        self.port = 0
        self._tasks: set = set()

    def url(self, name: str = "x") -> str:
        return f"http://127.0.0.1:{self.port}/{name}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._tasks.add(asyncio.current_task())
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if not head:
                    return
                n, self.requests = self.requests, self.requests + 1
                out = self.answer(n)
                then = None
                if isinstance(out, tuple):
                    out, then = out
                writer.write(out)
                await writer.drain()
                if then == "close":
                    return
                if then == "hang":
                    await asyncio.Event().wait()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except asyncio.CancelledError:
            pass  # the test is over (__aexit__): end quietly, as start_server's callback expects
        finally:
            writer.close()

    async def __aenter__(self) -> "Raw":
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc_info) -> None:
        self.server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.server.wait_closed()


def response(body: bytes, status: str = "200 OK", headers: str = "") -> bytes:
    return f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\n{headers}\r\n".encode() + body


def chunked(pieces: list[bytes], trailers: str = "") -> bytes:
    out = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    for piece in pieces:
        out += f"{len(piece):x};ext=1\r\n".encode() + piece + b"\r\n"
    return out + b"0\r\n" + trailers.encode() + b"\r\n"


# -- keep-alive ----------------------------------------------------------------------------------
@LOOPS
def test_reads_on_one_loop_reuse_one_keep_alive_connection_and_close_it_with_the_loop(loop):
    async def body(request):
        return web.Response(body=BODY)

    async def main():
        async with Web() as srv:
            srv.routes["a"] = body
            storage = aioload.Storage(retry=ONCE)
            got = [await storage.read_bytes(srv.url("a")) for _ in range(20)]
            kept = len(open_connections())
            # aiohttp's Response ignores Range: the client reads what it needs and drops the connection
            got.append(await storage.read_range(srv.url("a"), 100, 50))
            return got, list(srv.peers), kept, len(open_connections())

    got, peers, kept, after_range = run(main, loop)
    assert got[:20] == [BODY] * 20 and got[20] == BODY[100:150]
    assert all(type(g) is bytes for g in got)
    assert len(peers) == 21 and len(set(peers)) == 1  # every request on the same connection
    assert (kept, after_range) == (1, 0)
    assert open_connections() == [] and _scope.open_scopes() == 0


def test_concurrent_reads_open_at_most_connections_per_host():
    async def slow(request):
        await asyncio.sleep(0.02)
        return web.Response(body=BODY)

    async def main():
        async with Web() as srv:
            srv.routes["a"] = slow
            storage = aioload.Storage(retry=ONCE, connections_per_host=3)
            got = await asyncio.gather(*(storage.read_bytes(srv.url("a")) for _ in range(30)))
            return got, list(srv.peers)

    got, peers = run(main)
    assert got == [BODY] * 30
    assert len(set(peers)) == 3  # three connections, each reused


def test_waiting_for_a_connection_is_not_counted_against_the_timeout():
    # One connection, four reads at once, each answered after 0.3 s: the last waits about
    # 0.9 s for the connection, longer than the timeout, yet no attempt times out.
    async def slow(request):
        await asyncio.sleep(0.3)
        return web.Response(body=BODY)

    async def main():
        async with Web() as srv:
            srv.routes["a"] = slow
            storage = aioload.Storage(retry=aioload.RetryPolicy(attempts=1, timeout=0.6), connections_per_host=1)
            got = await asyncio.gather(*(storage.read_bytes(srv.url("a")) for _ in range(4)))
            return got, srv.peers

    got, peers = run(main)
    assert got == [BODY] * 4
    assert len(peers) == 4 and len(set(peers)) == 1


def test_an_idle_connection_the_server_closed_is_replaced_without_spending_an_attempt():
    # The server answers once per connection and closes it, saying nothing (no "Connection:
    # close"): the client learns it only when it uses the connection again.
    async def main():
        async with Raw(lambda n: (response(BODY[:n + 1]), "close")) as srv:
            storage = aioload.Storage(retry=ONCE)  # one attempt: a second request would fail it
            got = []
            for _ in range(5):
                got.append(await storage.read_bytes(srv.url()))
                await asyncio.sleep(0.01)  # the server's close arrives while the connection is idle
            return got, srv.requests, srv.connections

    got, requests, connections = run(main)
    assert got == [BODY[:n + 1] for n in range(5)]
    assert requests == 5 and connections == 5


@LOOPS
def test_a_reused_connection_closed_before_its_answer_is_asked_again_on_a_new_one(loop):
    # Every second request on a connection is met by a close (the server timed the connection
    # out just as the request came): the request goes again, fresh, within the same attempt.
    async def main():
        async with Raw(lambda n: response(b"%d" % n) if n % 2 == 0 else (b"", "close")) as srv:
            storage = aioload.Storage(retry=ONCE)
            got = [await storage.read_bytes(srv.url()) for _ in range(4)]
            return got, srv.requests, srv.connections

    got, requests, connections = run(main, loop)
    assert got == [b"0", b"2", b"4", b"6"]
    assert requests == 7 and connections == 4


def test_connection_close_and_http_1_0_are_not_reused():
    answers = [response(b"one", headers="Connection: close\r\n"),
               b"HTTP/1.0 200 OK\r\nContent-Length: 3\r\n\r\ntwo",
               response(b"six")]

    async def main():
        async with Raw(lambda n: answers[min(n, 2)]) as srv:
            storage = aioload.Storage(retry=ONCE)
            got = [await storage.read_bytes(srv.url()) for _ in range(4)]
            return got, srv.connections

    got, connections = run(main)
    assert got == [b"one", b"two", b"six", b"six"]
    assert connections == 3  # a new one after each of the first two; the third is kept


# -- bodies ------------------------------------------------------------------------------------------
def test_chunked_bodies_with_extensions_and_trailers_and_keep_alive_after_them():
    pieces = [BODY[:1], BODY[1:5000], BODY[5000:]]

    async def main():
        async with Raw(lambda n: chunked(pieces, "X-Checksum: 1\r\n")) as srv:
            storage = aioload.Storage(retry=ONCE)
            got = [await storage.read_bytes(srv.url()) for _ in range(3)]
            got.append(await storage.read_range(srv.url(), 4000, 2000))  # 200 to a range: cut here
            got.append(await storage.read_bytes(srv.url()))
            return got, srv.connections

    got, connections = run(main)
    assert got[:3] == [BODY] * 3
    assert got[3] == BODY[4000:6000]
    assert got[4] == BODY
    assert connections == 2  # one until the cut read dropped it, then another


@LOOPS
def test_a_large_chunked_body_from_aiohttp_passes_through_the_bounded_buffer(loop):
    data = bytes(range(251)) * (24 * 1024)  # 6 MiB, more than the receive buffer many times over

    async def stream(request):
        resp = web.StreamResponse()
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        for i in range(0, len(data), 100_000):
            await resp.write(data[i:i + 100_000])
        await resp.write_eof()
        return resp

    async def main():
        async with Web() as srv:
            srv.routes["big"] = stream
            storage = aioload.Storage(retry=ONCE)
            return await storage.read_bytes(srv.url("big")), await storage.read_bytes(srv.url("big")), srv.peers

    first, second, peers = run(main, loop)
    assert first == data and second == data
    assert len(set(peers)) == 1


def test_many_tiny_chunks_cross_the_receive_buffer_many_times():
    # 3 x 1,463 chunks of 7 bytes and their size lines: about 210 KB of framing, written at
    # once, so lines and chunks straddle the 64 KiB buffer as it fills, pauses and moves down.
    pieces = [BODY[i:i + 7] for i in range(0, len(BODY), 7)] * 3

    async def main():
        async with Raw(lambda n: chunked(pieces)) as srv:
            storage = aioload.Storage(retry=ONCE)
            return [await storage.read_bytes(srv.url()) for _ in range(2)], srv.connections

    got, connections = run(main)
    assert got == [BODY * 3] * 2 and connections == 1


def test_a_body_that_ends_with_the_connection():
    async def main():
        async with Raw(lambda n: (b"HTTP/1.1 200 OK\r\n\r\n" + BODY, "close")) as srv:
            return await aioload.Storage(retry=ONCE).read_bytes(srv.url())

    assert run(main) == BODY


@pytest.mark.parametrize("cut", ["sized", "chunked"])
def test_a_server_that_closes_mid_body_is_retried_and_named(cut):
    whole = response(BODY) if cut == "sized" else chunked([BODY[:6000], BODY[6000:]])
    broken = whole[:-3000]

    async def main():
        async with Raw(lambda n: (broken, "close") if n < 2 else whole) as srv:
            good = await aioload.Storage(retry=THRICE).read_bytes(srv.url())
            storage = aioload.Storage(retry=aioload.RetryPolicy(attempts=2, backoff=0.001))
        async with Raw(lambda n: (broken, "close")) as srv:
            with pytest.raises(aioload.RemoteReadError) as info:
                await storage.read_bytes(srv.url())
            return good, info.value, srv.requests

    good, err, requests = run(main)
    assert good == BODY
    assert re.match(r"^GET \S+ failed after 2 attempts; last status: HTTP 200 \(truncated body: the server "
                    r"closed the connection", str(err))
    assert (err.attempts, err.status, requests) == (2, 200, 2)


def test_a_deadline_between_two_pieces_of_a_body_times_out():
    async def main():
        async with Raw(lambda n: (response(BODY)[:-100], "hang")) as srv:
            storage = aioload.Storage(retry=aioload.RetryPolicy(attempts=2, timeout=0.3, backoff=0.001))
            with pytest.raises(aioload.RemoteReadError) as info:
                await storage.read_bytes(srv.url())
            return info.value, srv.requests

    err, requests = run(main)
    assert "no complete response within timeout=0.3 s" in str(err)
    assert (err.attempts, requests) == (2, 2)


def test_interim_answers_are_skipped():
    early = b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\n"

    async def main():
        async with Raw(lambda n: early + b"HTTP/1.1 100 Continue\r\n\r\n" + response(BODY)) as srv:
            storage = aioload.Storage(retry=ONCE)
            return [await storage.read_bytes(srv.url()) for _ in range(2)], srv.connections

    got, connections = run(main)
    assert got == [BODY, BODY] and connections == 1


# -- what is refused ---------------------------------------------------------------------------------
@pytest.mark.parametrize("answer, reason", [
    (b"SSH-2.0-OpenSSH_9.2\r\n\r\n", "invalid response: not an HTTP/1.x status line: 'SSH-2.0-OpenSSH_9.2'"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n folded\r\n\r\nabc", "invalid response: not a header line: ' folded'"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd",
     "invalid response: invalid Content-Length '3, 4'"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n", "invalid response: Transfer-Encoding 'gzip' is not "
                                                            "supported (chunked is)"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "invalid response: not a chunk size: b'zz'"),
    (b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * (70 * 1024), "invalid response: the response head is longer than "
                                                          "65536 bytes"),
    ("HTTP/1.1 200 OK\r\nContent-Length: \u00b2\r\n\r\nab".encode("latin-1"),
     "invalid response: invalid Content-Length '\u00b2'"),  # a digit to str.isdigit, not to HTTP
    (b"HTTP/1.1 200 OK\r\nContent-Length: " + b"9" * 5000 + b"\r\n\r\n",
     "invalid response: invalid Content-Length '" + "9" * 40 + "'"),
    (b"HTTP/1.1 200 OK\nContent-Length: 3\n\nabc", "invalid response: the response head's lines end with a bare "
                                                   "LF, not CRLF"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 3\n\r\nabc", "invalid response: the response head's lines end with "
                                                       "a bare LF, not CRLF"),
])
def test_invalid_answers_fail_at_once_and_say_why(answer, reason):
    async def main():
        async with Raw(lambda n: (answer, "hang")) as srv:
            with pytest.raises(aioload.RemoteReadError) as info:
                await aioload.Storage(retry=THRICE).read_bytes(srv.url())
            return info.value, srv.requests

    err, requests = run(main)
    assert f"({reason})" in str(err)
    assert str(err).endswith("not retried: the server does not answer in HTTP/1.1 as this client reads it")
    assert (err.attempts, requests) == (1, 1)


def test_a_head_line_of_blanks_is_parsed_without_holding_the_loop():
    # A value with 20,000 blanks inside took a backtracking expression 12 s (60,000: 25 s and
    # more), the loop held meanwhile;
    # the rule is that nothing holds the loop for as long as the request's timeout.
    padded = b"HTTP/1.1 200 OK\r\nX-Pad: a" + b" " * 20_000 + b"b\r\nX-Tail:" + b"\t " * 2000 + b"\r\n"

    async def main():
        async with Raw(lambda n: padded + b"Content-Length: 3\r\n\r\nabc") as srv:
            done = asyncio.Event()
            watch = asyncio.ensure_future(longest_stall(done))
            storage = aioload.Storage(retry=aioload.RetryPolicy(attempts=1, timeout=2))
            got = [await storage.read_bytes(srv.url()) for _ in range(3)]
            done.set()
            return got, await watch

    got, stall = run(main)
    assert got == [b"abc"] * 3
    assert stall < 2.0, f"the loop was held {stall:.1f} s, past the request's timeout of 2 s"
    head = h1.parse_head(padded[:-2], "GET")
    assert head.headers == {"x-pad": "a" + " " * 20_000 + "b", "x-tail": ""}


@LOOPS
def test_a_body_received_in_place_after_a_head_that_fills_the_receive_buffer_arrives_whole(loop):
    # The head (60 KB of padding) and the first bytes of the body fill the connection's 64 KiB
    # receive buffer, which stops reading from the socket; the body, received in place from
    # then on as its bytes arrive, starts it again: each body whole, on the one connection.
    pad = "x" * 60_000

    async def main():
        async with Raw(lambda n: response(BIG + b"%d" % n, headers=f"X-Pad: {pad}\r\n")) as srv:
            storage = aioload.Storage(retry=aioload.RetryPolicy(attempts=1, timeout=5))
            got = [await storage.read_bytes(srv.url()) for _ in range(3)]
            return got, srv.requests, srv.connections

    got, requests, connections = run(main, loop)
    assert got == [BIG + b"%d" % n for n in range(3)]
    assert requests == 3 and connections == 1


@LOOPS
def test_a_server_that_sends_more_than_its_content_length_never_answers_the_next_request_with_it(loop):
    # Each answer is followed by a whole second response: the surplus of one request must not
    # become the next one's answer on a reused connection. The body is larger than the receive
    # buffer, so it is received in place and the surplus is still in the socket when it ends.
    async def main():
        async with Raw(lambda n: response(BIG + b"%d" % n) + response(b"stale")) as srv:
            storage = aioload.Storage(retry=ONCE)
            got = []
            for _ in range(5):
                got.append(await storage.read_bytes(srv.url()))
            return got, srv.requests, srv.connections, len(open_connections())

    got, requests, connections, left = run(main, loop)
    assert got == [BIG + b"%d" % n for n in range(5)]
    assert requests == connections == 5 and left <= 1


@contextlib.asynccontextmanager
async def serving(serve):
    """A server on 127.0.0.1 whose every connection ``serve(reader, writer)`` answers (a client
    that leaves ends it quietly, and the connection is closed after it); yields a URL of it."""
    async def answer(reader, writer):
        try:
            await serve(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    async with server:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/x"


@LOOPS
def test_bytes_a_server_sends_to_an_idle_connection_never_answer_the_next_request(loop):
    # Each answer is followed, 50 ms later, by a whole second response that nobody asked for,
    # while the connection waits idle in its pool: the loop receives it there, and the
    # connection is not used again (no poll at reuse is needed to see it).
    connections = []

    async def serve(reader, writer):
        connections.append(writer)
        n = 0
        while await reader.readuntil(b"\r\n\r\n"):
            writer.write(response(b"answer%d-%d" % (len(connections), n)))
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.write(response(b"stale"))
            await writer.drain()
            n += 1

    async def main():
        async with serving(serve) as url:
            storage = aioload.Storage(retry=ONCE)
            got = []
            for _ in range(3):
                got.append(await storage.read_bytes(url))
                await asyncio.sleep(0.3)  # the stale answer arrives meanwhile
            await storage.aclose()
            return got

    got = run(main, loop)
    assert got == [b"answer1-0", b"answer2-0", b"answer3-0"]
    assert len(connections) == 3


@LOOPS
def test_a_body_sent_to_a_head_does_not_answer_the_next_get(loop):
    # A server that answers HEAD with its body, sent late: the body reaches the connection
    # only after the next request on it. No check at reuse can see it coming, so a connection
    # that carried a HEAD is not reused.
    sent = []

    async def serve(reader, writer):
        late = b""
        while head := await reader.readuntil(b"\r\n\r\n"):
            n = len(sent)
            sent.append(head.split(b" ", 1)[0])
            if head.startswith(b"HEAD "):
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(BIG))
                late = BIG
            else:
                writer.write(late + response(b"get%d" % n))
                late = b""
            await writer.drain()

    async def main():
        async with serving(serve) as url:
            storage = aioload.Storage(retry=ONCE)
            version = await probe.version(storage, url)
            got = [await storage.read_bytes(url) for _ in range(2)]
            await storage.aclose()
            return version, got

    version, got = run(main, loop)
    assert version.size == len(BIG)
    assert got == [b"get1", b"get2"] and sent == [b"HEAD", b"GET", b"GET"]


def test_a_content_length_commits_memory_only_as_its_bytes_arrive():
    # Four reads announce 256 MiB each and send 10 bytes: the buffers must not be made at the
    # announced size up front (1 GiB) but grow with what arrives.
    head = b"HTTP/1.1 200 OK\r\nContent-Length: 268435456\r\n\r\n0123456789"

    async def main():
        async with Raw(lambda n: (head, "hang")) as srv:
            storage = aioload.Storage(retry=aioload.RetryPolicy(attempts=1, timeout=0.5))
            tracemalloc.start()
            try:
                errors = await asyncio.gather(*(storage.read_bytes(srv.url()) for _ in range(4)),
                                              return_exceptions=True)
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            return errors, peak

    errors, peak = run(main)
    assert all(isinstance(e, aioload.RemoteReadError) and "timeout=0.5 s" in str(e) for e in errors), errors
    assert peak < 32 << 20, f"{peak >> 20} MiB held for 40 bytes received"


@LOOPS
@pytest.mark.parametrize("size", [(1 << 20) + 1, 5 * (1 << 20) + 3 * 256])
def test_a_large_body_grows_its_buffer_in_place_to_the_right_bytes(loop, size):
    # past BODY_START the buffer doubles: the bytes the loop receives between the moment one
    # buffer fills and the moment it is grown (uvloop reads on at once) must not be lost
    data = (bytes(range(256)) * (size // 256 + 1))[:size]

    async def main():
        async with Raw(lambda n: response(data)) as srv:
            storage = aioload.Storage(retry=ONCE)
            return [await storage.read_bytes(srv.url()) for _ in range(2)], srv.connections

    got, connections = run(main, loop)
    assert got == [data, data] and connections == 1


def test_headers_that_would_not_be_sent_as_given_are_refused_at_construction():
    with pytest.raises(ValueError, match=r"^headers must be HTTP field names with values free of CR, LF and NUL, "
                                         r"got 'X-A': 'b\\r\\nHost: evil'$"):
        aioload.Storage(headers={"X-A": "b\r\nHost: evil"})
    with pytest.raises(ValueError, match=r"^headers must be HTTP field names .*got 'Bad Name': 'v'$"):
        aioload.Storage(headers={"Bad Name": "v"})


# -- what is sent --------------------------------------------------------------------------------------
def redirect(location: str):
    async def handler(request):
        raise web.HTTPFound(location)

    return handler


def test_credentials_in_the_url_go_to_that_url_alone_and_headers_replace_defaults():
    async def answer(request):
        return web.Response(body=b"ok")

    async def main():
        async with Web() as other, Web() as home:
            other.routes["b"] = answer
            home.routes["a"] = redirect(other.url("b"))
            storage = aioload.Storage(retry=ONCE, redirects="any", headers={"User-Agent": "trainer/1"})
            url = home.url("a").replace("http://", "http://ann:s%20cret@")
            return await storage.read_bytes(url), home.headers, other.headers

    got, at_home, elsewhere = run(main)
    assert got == b"ok"
    token = base64.b64encode(b"ann:s cret").decode()
    assert at_home[0]["Authorization"] == f"Basic {token}" and at_home[0]["User-Agent"] == "trainer/1"
    assert "Authorization" not in elsewhere[0] and elsewhere[0]["User-Agent"] == "aioload"


def test_credentials_in_a_url_are_never_shown_in_errors():
    async def missing(request):
        return web.Response(status=404)

    async def failing(request):
        return web.Response(status=503)

    async def main():
        async with Web() as other, Web() as home:
            home.routes["gone"] = missing
            home.routes["busy"] = failing
            home.routes["away"] = redirect(other.url("x").replace("http://", "http://eve:t0ken@"))
            storage = aioload.Storage(retry=THRICE)
            errors = []
            for name in ("gone", "busy", "away"):
                with pytest.raises(aioload.RemoteReadError) as info:
                    await storage.read_bytes(home.url(name).replace("http://", "http://ann:s3cret@"))
                errors.append(info.value)
            with pytest.raises(aioload.RemoteReadError) as info:
                await storage.read_bytes(f"http://ann:s3cret@127.0.0.1:{home.port}:x/bad-port")
            errors.append(info.value)
            return errors, home.headers

    errors, sent = run(main)
    shown = [(str(e), e.url) for e in errors]
    assert not any("s3cret" in text or "ann" in text or "t0ken" in text for pair in shown for text in pair), shown
    assert shown[0][0].startswith("GET http://***@127.0.0.1:") and shown[0][1].startswith("http://***@127.0.0.1:")
    assert "redirect to http://***@127.0.0.1:" in shown[2][0]
    assert sent[0]["Authorization"] == "Basic " + base64.b64encode(b"ann:s3cret").decode()  # sent, not shown


def test_paths_are_sent_percent_encoded_and_queries_kept():
    seen = []

    async def answer(request):
        seen.append(request.rel_url.raw_path_qs)
        return web.Response(body=b"ok")

    async def main():
        async with Web() as srv:
            srv.routes["a b é.jpg"] = answer
            storage = aioload.Storage(retry=ONCE)
            await storage.read_bytes(srv.url("a b é.jpg") + "?sig=x%2By&t=1")
            await storage.read_bytes(srv.url("a%20b%20%C3%A9.jpg"))

    run(main)
    assert seen == ["/a%20b%20%C3%A9.jpg?sig=x%2By&t=1", "/a%20b%20%C3%A9.jpg"]


# -- TLS ------------------------------------------------------------------------------------------------
@pytest.fixture
def certificate(tmp_path):
    """A self-signed certificate for 127.0.0.1 and its key, as PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "aioload test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert_file, key_file)
    return cert_file, context


@LOOPS
def test_https_reads_verify_the_server_and_reuse_the_connection(certificate, monkeypatch, loop):
    cert_file, server_context = certificate
    monkeypatch.setenv("SSL_CERT_FILE", str(cert_file))  # trust the test's certificate alone

    async def answer(request):
        return web.Response(body=BODY)

    async def main():
        async with Web(server_context) as srv:
            srv.routes["a"] = answer
            storage = aioload.Storage(retry=ONCE)
            got = [await storage.read_bytes(srv.url("a")) for _ in range(3)]
            got.append(await storage.read_range(srv.url("a"), 10, 20))
            return got, srv.peers

    got, peers = run(main, loop)
    assert got == [BODY] * 3 + [BODY[10:30]]
    assert len(set(peers)) == 1
    assert open_connections() == []


def test_an_https_server_whose_certificate_does_not_verify_fails_at_once(certificate, tmp_path, monkeypatch):
    _, server_context = certificate
    monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "none.pem"))  # trust nothing
    monkeypatch.setenv("SSL_CERT_DIR", str(tmp_path))

    async def answer(request):
        return web.Response(body=b"x")

    async def main():
        async with Web(server_context) as srv:
            srv.routes["a"] = answer
            with pytest.raises(aioload.RemoteReadError) as info:
                await aioload.Storage(retry=THRICE).read_bytes(srv.url("a"))
            return info.value, srv.peers

    err, peers = run(main)
    assert err.attempts == 1 and err.status is None and peers == []
    assert re.search(r"\(TLS: .*certificate.*\); not retried: the server's certificate does not verify "
                     r"\(SSL_CERT_FILE names the certificates to trust\)$", str(err))
    assert not isinstance(err, FileNotFoundError)
