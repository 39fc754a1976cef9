"""HTTP/1.1 on asyncio for the storage layer: one connection's protocol, and the keep-alive
pools of one event loop.

What the storage layer asks of HTTP is small -- ``GET`` and ``HEAD`` with a few headers,
keep-alive, ``Range``, bodies framed by ``Content-Length``, chunked or the connection's end,
TLS -- and each request's CPU comes out of the cores that decode. aiohttp's ``ClientSession``
spent about 0.1 ms of CPU on a request whose body is tiny (its request and response objects,
header multidicts, tracing hooks, cookie jar and timers), this module about 0.012 ms; a body
of 11 MB took it 9-10 ms, this module 3-6 ms (docs/remote.md has the measurement).

:class:`Connection` is an :class:`asyncio.BufferedProtocol`: the socket's bytes land in a
64 KiB buffer of its own, where each response's head is parsed, and a body of known length
is received in place, straight into the ``bytearray`` that is returned, which grows as the
bytes arrive (:meth:`Connection.read_exact`); other bodies are taken piece by piece from the buffer
(:class:`Body`), which stops reading from the socket while it is full, so a slow consumer
bounds what is held. :class:`Pool` keeps the idle connections of one origin (scheme, host,
port), the most recently used first, and bounds those in use by a semaphore; a connection is
reused only when nothing of the last answer is left unread, in its buffer or its socket (as of
the loop's last poll of it, or polled at reuse: :meth:`Pool.connection`).

What a response may be is checked strictly: a status line ``HTTP/1.x NNN``, ``name: value``
header lines ended by CRLF (bare LF fails at once), a head of at most :data:`HEAD_LIMIT`
bytes, one ``Content-Length`` of ASCII digits (repeats must agree), ``Transfer-Encoding: chunked`` and nothing else;
anything else raises :class:`ProtocolError`. Interim ``1xx`` answers are skipped.

Not here, by design: proxies, cookies, HTTP/2, pipelining, request bodies.
"""

from __future__ import annotations

import asyncio
import re
import select
import ssl as _ssl
import time
from typing import Callable
from urllib.parse import quote, unquote, urlsplit

from aioload._storage.buffers import Buffers

HEAD_LIMIT = 64 * 1024
"""The largest response head (status line and headers) accepted, in bytes; also the
connection's receive buffer."""

LINE_LIMIT = 8 * 1024  # a chunk-size or trailer line
BODY_START = 1 << 20
"""The most bytes a body of known length is given before any of them arrives; its buffer
doubles from there as it fills."""
IDLE_S = 15.0
"""How long an idle keep-alive connection is kept for reuse."""

_DEFAULT_PORTS = {"http": 80, "https": 443}
_NO_BODY = (204, 304)
_HEX = frozenset(b"0123456789abcdefABCDEF")


class ProtocolError(Exception):
    """What the server sent is not an HTTP/1.1 response this client reads."""


class Closed(ConnectionError):
    """The connection ended before the response did. ``started``: whether any byte of the
    response had arrived (a reused connection closed before that is asked again, fresh)."""

    def __init__(self, message: str, started: bool = False):
        super().__init__(message)
        self.started = started


class Head:
    """A response's status line and headers (``headers``: lower-cased names to values, those
    of repeated names joined by ``", "``), and how its body is framed: ``length`` (bytes, or
    None), ``chunked``; neither: the body ends with the connection (``length == 0``: there is
    none). ``keep_alive``: whether the connection may carry another request."""

    __slots__ = ("status", "reason", "headers", "length", "chunked", "keep_alive")

    def __init__(self, status: int, reason: str, headers: dict[str, str], length: int | None, chunked: bool,
                 keep_alive: bool):
        self.status, self.reason, self.headers = status, reason, headers
        self.length, self.chunked, self.keep_alive = length, chunked, keep_alive


_STATUS = re.compile(r"HTTP/1\.([0-9]) ([0-9]{3})(?: ([^\r\n]*))?")
_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # a header's name: a token
_LENGTH_DIGITS = 18  # a Content-Length of more digits (an exabyte) is refused, not parsed


def parse_head(block: bytes, method: str) -> Head:
    """The :class:`Head` of ``block`` (a response head without its final CRLF CRLF), for a
    request made with ``method``. Each line is taken apart with ``str`` methods, in time
    linear in its length, whatever it holds (a regular expression with two optional runs of
    blanks around a value took seconds on a line of blanks)."""
    lines = block.decode("latin-1").split("\r\n")
    status_line = _STATUS.fullmatch(lines[0])
    if status_line is None:
        raise ProtocolError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if not colon or "\n" in value or "\r" in value or _NAME.fullmatch(name) is None:
            raise ProtocolError(f"not a header line: {line[:80]!r}")
        key, value = name.lower(), value.strip(" \t")
        headers[key] = f"{headers[key]}, {value}" if key in headers else value  # a repeated name: values joined
    status, reason = int(status_line.group(2)), status_line.group(3) or ""
    connection = headers.get("connection")
    tokens = {t.strip().lower() for t in connection.split(",")} if connection else ()
    keep_alive = "keep-alive" in tokens if status_line.group(1) == "0" else "close" not in tokens
    if method == "HEAD" or status in _NO_BODY or status < 200:
        return Head(status, reason, headers, 0, False, keep_alive)
    coding = headers.get("transfer-encoding")
    if coding is not None:
        if coding.strip().lower() != "chunked":
            raise ProtocolError(f"Transfer-Encoding {coding!r} is not supported (chunked is)")
        return Head(status, reason, headers, None, True, keep_alive)
    length = content_length(headers.get("content-length"))
    return Head(status, reason, headers, length, False, keep_alive and length is not None)


def content_length(value: str | None) -> int | None:
    """The length a ``Content-Length`` value gives (``None`` for none): ASCII digits only
    (``isdigit`` alone takes ``"²"``), repeats equal; anything else raises ProtocolError."""
    if value is None:
        return None
    values = {v.strip(" \t") for v in value.split(",")}
    digits = next(iter(values))
    if len(values) != 1 or not (digits.isascii() and digits.isdigit()) or len(digits) > _LENGTH_DIGITS:
        raise ProtocolError(f"invalid Content-Length {value[:40]!r}")
    return int(digits)


class Connection(asyncio.BufferedProtocol):
    """One keep-alive connection: a request at a time, its response read by the coroutine
    that sent it (see the module's docstring)."""

    def __init__(self) -> None:
        self._buf = bytearray(HEAD_LIMIT)
        self._view = memoryview(self._buf)
        self._start = self._end = 0  # the unread bytes are _buf[_start:_end]
        self._sink: memoryview | None = None  # a body received in place
        self._sunk = 0
        self._waiter: asyncio.Future | None = None
        self._paused = False
        self._eof = False
        self._error: BaseException | None = None
        self._started = False  # a byte of the current response has arrived
        self._timer: asyncio.TimerHandle | None = None
        self._expired = False
        self.transport: asyncio.Transport | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.lost: asyncio.Future | None = None
        self.requests = 0  # requests sent on this connection
        self.idle_since = 0.0
        self.buffers: Buffers | None = None  # its pool's receive buffers (Pool.open sets them)
        # the request being answered (send): its method, how much of the head buffer has been
        # searched for the head's end, the head once found, what went wrong finding it, and the
        # body of known length received in place as it arrives (``want``; ``_early``: its buffer)
        self._method = ""  # "": no head is looked for in the callbacks
        self._searched = 0
        self._head: Head | None = None
        self._failed: BaseException | None = None
        self._want: Callable[[Head], int | None] | None = None
        self._early: bytearray | None = None

    # -- the protocol (the loop calls these) ------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        self._loop = asyncio.get_running_loop()
        self.lost = self._loop.create_future()

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._sink is not None:
            return self._sink[self._sunk:]
        if self._end == HEAD_LIMIT:  # only reached with unread bytes at the front: move them down
            kept = self._end - self._start
            self._buf[:kept] = bytes(self._view[self._start:self._end])  # a copy: the ranges overlap
            self._start, self._end = 0, kept
        return self._view[self._end:]

    def buffer_updated(self, nbytes: int) -> None:
        self._started = True
        if self._sink is not None:
            self._sunk += nbytes
            if self._sunk < len(self._sink):
                return
            self._sink = None
        else:
            self._end += nbytes
            if self._end == HEAD_LIMIT and self._start == 0:
                self._pause()  # full: the reader takes some before more is received
            if self._method and self._head is None and self._failed is None:
                # a response's head awaited by send(): found here, and its body (wanted whole)
                # received in place from here on, so that the coroutine wakes once
                try:
                    if not self._find_head():
                        return
                    if self._sink_early():
                        return
                except Exception as exc:  # noqa: BLE001 - send() raises it, in the coroutine
                    self._failed = exc
        self._wake()

    def eof_received(self) -> bool:
        self._eof = True
        self._wake()
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self._eof = True
        self._error = exc
        self._wake()
        if self.lost is not None and not self.lost.done():
            self.lost.set_result(None)

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _expire(self) -> None:
        self._timer = None
        self._expired = True
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(TimeoutError("the request's deadline passed"))

    def _pause(self) -> None:
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def _resume(self) -> None:
        if self._paused:
            self._paused = False
            if self.transport is not None and not self.transport.is_closing():
                self.transport.resume_reading()

    def _more(self) -> asyncio.Future:
        """A future done when bytes (or the end of the connection) arrive."""
        if self._expired:
            raise TimeoutError("the request's deadline passed")
        if self._eof:
            raise self._closed("the server closed the connection")
        self._resume()
        self._waiter = self._loop.create_future()
        return self._waiter

    def _closed(self, what: str) -> Closed:
        reason = f"{what} ({type(self._error).__name__}: {self._error})" if self._error else what
        return Closed(reason, self._started)

    # -- the coroutine's side -----------------------------------------------------------------
    @property
    def usable(self) -> bool:
        """Open, and holding no unread byte: ready for a request."""
        return (not self._eof and self.transport is not None and not self.transport.is_closing()
                and self._start == self._end)

    def quiet(self) -> bool:
        """Whether nothing waits unread in the socket either. An idle connection is quiet: a
        byte there is one the server sent beyond its last response (a body to a HEAD, more
        than its ``Content-Length``), or its close; reused, such a connection would hand the
        next request the previous one's surplus as its answer."""
        sock = self.transport.get_extra_info("socket") if self.transport is not None else None
        if sock is None:
            return False
        try:
            poller = select.poll()
            poller.register(sock.fileno(), select.POLLIN)
            return not poller.poll(0)
        except (OSError, ValueError):
            return False

    def deadline(self, seconds: float | None) -> None:
        """From now on, waiting for the server raises ``TimeoutError`` once ``seconds`` have
        passed (``None``: never)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._expired = False
        if seconds is not None:
            self._timer = self._loop.call_later(max(0.0, seconds), self._expire)

    async def send(self, request: bytes, method: str, want: Callable[[Head], int | None] | None = None) -> Head:
        """Send ``request`` (a whole request head) and return the head of its response.
        ``want(head)``: how many bytes of the body to receive in place (a body of known length
        wanted whole), or None; where it gives a number (up to :data:`BODY_START`), the bytes
        are received into a buffer of the connection's :class:`Buffers` as they arrive, in the
        protocol's callbacks, and this returns once all of them have (the coroutine wakes once
        for head and body); :meth:`read_exact` of that many bytes then returns that buffer."""
        self.requests += 1
        self._started = False
        self._start = self._end = 0
        self._method, self._searched, self._head, self._failed, self._want = method, 0, None, None, want
        self._early = None
        try:
            self.transport.write(request)
            while True:
                if self._failed is None and self._head is None:
                    if not self._find_head():
                        if self._eof and self._started:
                            raise self._closed("the server closed the connection within the response head")
                        await self._more()
                        continue
                    self._sink_early()
                if self._failed is not None:
                    raise self._failed
                if self._sink is None or self._eof:
                    return self._head
                await self._more()  # the rest of a body received in place (or the connection's end)
        finally:
            self._method = ""  # the callbacks no longer look for a head

    def _find_head(self) -> bool:
        """Look for the head of the response to the request sent: True once found (interim
        ``1xx`` answers skipped), False while it has not all arrived; ProtocolError if what came
        cannot be one."""
        while True:
            searched = self._searched
            at = self._buf.find(b"\r\n\r\n", self._start + max(0, searched - 3), self._end)
            if at < 0:
                self._bare_lf(self._start + max(0, searched - 2))
                self._searched = self._end - self._start
                if self._searched >= HEAD_LIMIT:
                    raise ProtocolError(f"the response head is longer than {HEAD_LIMIT} bytes")
                return False
            head = parse_head(bytes(self._view[self._start:at]), self._method)
            self._start, self._searched = at + 4, 0
            if head.status >= 200:
                self._head = head
                return True
            if head.status == 101:
                raise ProtocolError("101 Switching Protocols to a request that asked for no upgrade")
            # an interim 1xx answer: the real one follows

    def _sink_early(self) -> bool:
        """Start receiving the body the head just found announces in place, where ``want``
        asks for it whole: True while bytes of it are still to come."""
        want, self._want = self._want, None
        if want is None or self.buffers is None:
            return False
        n = want(self._head)
        if n is None or n > BODY_START:
            return False
        self._early = body = self.buffers.take(n)
        view = memoryview(body)
        have = self._buffered(view, 0, n)
        if have == n:
            return False
        self._sink_from(view, have)
        self._resume()  # the head buffer may have filled up and paused reading
        return True

    def _bare_lf(self, since: int) -> None:
        """Refuse a head whose lines end with a bare LF: its CRLF CRLF would never come, and
        the request would wait for its deadline instead of failing (``since``: where the
        unsearched bytes begin)."""
        for end in (b"\n\n", b"\n\r\n"):
            if self._buf.find(end, since, self._end) >= 0:
                raise ProtocolError("the response head's lines end with a bare LF, not CRLF")

    async def read_exact(self, n: int) -> bytearray:
        """The next ``n`` bytes, received in place into a ``bytearray``: up to
        :data:`BODY_START` bytes, one the connection's :class:`Buffers` give (a buffer reused
        once nobody holds it), else a new one. The buffer starts at :data:`BODY_START` bytes
        at most and doubles as it fills, so a ``Content-Length`` commits memory only as its
        bytes arrive (a server that announces 256 MiB and sends 10 bytes costs a megabyte, not
        256 MiB)."""
        early, self._early = self._early, None
        if early is not None:  # received in place as it arrived (send's want): whole, or cut short
            if len(early) != n:
                raise ValueError(f"{n} bytes asked of a body of {len(early)} received in place")
            sink, self._sink = self._sink, None
            if sink is None:
                return early
            have = n - sink.nbytes + self._sunk
            sink.release()
            raise self._closed(f"the server closed the connection after {have} of {n} bytes")
        buffers = self.buffers
        body = buffers.take(n) if buffers is not None and n <= BODY_START else bytearray(min(n, BODY_START))
        have = 0
        while True:
            # bytes already received into the head buffer come first: the loop may have read
            # more after the last sink filled and before this coroutine ran again (uvloop does)
            buffered = min(n - have, self._end - self._start)
            if have + buffered > len(body):
                body.extend(bytes(min(n, max(2 * len(body), have + buffered)) - len(body)))
            with memoryview(body) as view:
                have = self._buffered(view, have, n)
                if have == n:
                    return body
                if have < len(body):
                    have = await self._sink_into(view, have, n)
                    continue
            body.extend(bytes(min(n, 2 * len(body)) - len(body)))  # no view of it is held now

    async def read_into(self, view: memoryview) -> None:
        """The next ``len(view)`` bytes, received in place into ``view`` (a writable buffer of
        bytes the caller owns, a shared memory mapping for instance): the socket's bytes land
        there directly, with no buffer in between. ``Closed`` if the connection ends first;
        what was written by then is the caller's to discard."""
        n = view.nbytes
        have = 0
        while True:
            have = self._buffered(view, have, n)
            if have == n:
                return
            have = await self._sink_into(view, have, n)

    def _buffered(self, view: memoryview, have: int, n: int) -> int:
        """Move the bytes the head buffer holds of the next ``n - have`` into ``view[have:]``
        (as many as fit); the bytes written by then."""
        buffered = min(n - have, self._end - self._start, view.nbytes - have)
        if buffered:
            view[have:have + buffered] = self._view[self._start:self._start + buffered]
            self._start += buffered
        return have + buffered

    async def _sink_into(self, view: memoryview, have: int, n: int) -> int:
        """Receive into ``view[have:]`` until it is full (the loop writes the socket's bytes
        there: ``get_buffer``); the bytes written by then, or ``Closed``. The head buffer holds
        no byte of the body when it is called (every one was taken first)."""
        self._sink_from(view, have)
        try:
            while self._sink is not None:
                await self._more()
        except Closed:
            raise self._closed(f"the server closed the connection after {have + self._sunk} of {n} bytes") from None
        finally:
            have += self._sunk
            sink, self._sink = self._sink, None
            if sink is not None:
                sink.release()
        return have

    def _sink_from(self, view: memoryview, have: int) -> None:
        """From now on the socket's bytes land in ``view[have:]`` (the head buffer holds none of
        them: every buffered byte was taken first)."""
        self._start = self._end = 0
        self._sink, self._sunk = view[have:], 0

    async def take(self, most: int) -> bytes:
        """Up to ``most`` (> 0) of the next bytes, as soon as there are some; ``b""`` once the
        connection has ended."""
        while self._start == self._end:
            if self._eof:
                return b""
            self._start = self._end = 0
            await self._more()
        stop = min(self._end, self._start + most)
        piece = bytes(self._view[self._start:stop])
        self._start = stop
        if self._paused and self._start > 0:
            self._resume()
        return piece

    async def line(self) -> bytes:
        """The next CRLF-ended line, without its CRLF (chunk sizes and trailers)."""
        while True:
            at = self._buf.find(b"\r\n", self._start, self._end)
            if at >= 0:
                line = bytes(self._view[self._start:at])
                self._start = at + 2
                return line
            if self._end - self._start >= LINE_LIMIT:
                raise ProtocolError(f"a line of the chunked body is longer than {LINE_LIMIT} bytes")
            if self._eof:
                raise self._closed("the server closed the connection within the chunked body")
            await self._more()

    def close(self) -> None:
        self.deadline(None)
        if self.transport is not None:
            self.transport.abort()  # nothing of ours is left to send; no graceful TLS close to wait for


class Body:
    """The body of a response taken piece by piece: :meth:`read` returns the next piece,
    ``b""`` at its end; ``complete`` tells a body read to its end from one the connection's
    end cut short (for a body framed by the connection's end, that end is its end)."""

    def __init__(self, conn: Connection, head: Head):
        if conn._early is not None:
            raise RuntimeError("a body received in place as it arrived is read with read_exact, not as a Body")
        self.conn = conn
        self.left = head.length  # bytes left of a sized body, or of the current chunk
        self.chunked = head.chunked
        self.complete = head.length == 0
        self._chunk_ended = True  # at a chunk's start: its size line comes next

    async def read(self, most: int = 1 << 20) -> bytes:
        if self.complete:
            return b""
        if self.chunked:
            return await self._chunked(most)
        if self.left is None:  # until the connection ends
            piece = await self.conn.take(most)
            self.complete = not piece
            return piece
        piece = await self.conn.take(min(most, self.left))
        if not piece:
            raise self.conn._closed("the server closed the connection within the body")
        self.left -= len(piece)
        self.complete = self.left == 0
        return piece

    async def _chunked(self, most: int) -> bytes:
        conn = self.conn
        if self._chunk_ended:
            size = _chunk_size(await conn.line())
            if size == 0:
                while await conn.line():  # trailers, ignored
                    pass
                self.complete = True
                return b""
            self.left, self._chunk_ended = size, False
        piece = await conn.take(min(most, self.left))
        if not piece:
            raise conn._closed("the server closed the connection within the chunked body")
        self.left -= len(piece)
        if self.left == 0:
            if await conn.line() != b"":
                raise ProtocolError("a chunk of the body does not end where its size says")
            self._chunk_ended = True
        return piece


def _chunk_size(line: bytes) -> int:
    digits = line.split(b";", 1)[0].strip(b" \t")
    if not digits or len(digits) > 16 or not _HEX.issuperset(digits):
        raise ProtocolError(f"not a chunk size: {line[:40]!r}")
    return int(digits, 16)


# -- where requests go ---------------------------------------------------------------------------
class Target:
    """A URL as a request needs it: its origin, the ``Host`` header, the request target, and
    credentials it carries (``user:password@``)."""

    __slots__ = ("url", "origin", "host_header", "path", "userinfo")

    def __init__(self, url: str):
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in _DEFAULT_PORTS:
            raise ValueError(f"not an http(s) URL: {url}")
        host = parts.hostname
        if not host:
            raise ValueError(f"no host in the URL {url}")
        port = parts.port or _DEFAULT_PORTS[scheme]  # a port that is no number raises ValueError
        try:
            host.encode("ascii")
        except UnicodeEncodeError:
            host = host.encode("idna").decode("ascii")
        shown = f"[{host}]" if ":" in host else host
        self.url = url
        self.origin = (scheme, host, port)
        self.host_header = shown if port == _DEFAULT_PORTS[scheme] else f"{shown}:{port}"
        path = quote(parts.path or "/", safe="/%:@!$&'()*+,;=~")
        self.path = path + ("?" + quote(parts.query, safe="/%:@!$&'()*+,;=~?") if parts.query else "")
        self.userinfo = None
        if parts.username is not None:
            self.userinfo = (unquote(parts.username), unquote(parts.password or ""))


class Pool:
    """The connections of one origin on one loop: at most ``limit`` in use at once
    (``slots``), the idle ones kept for :data:`IDLE_S`, the most recently used first."""

    def __init__(self, origin: tuple[str, str, int], limit: int, tls: _ssl.SSLContext | None):
        self.origin = origin
        self.slots = asyncio.Semaphore(limit)
        self.buffers = Buffers()  # shared by its connections
        self._tls = tls
        self._idle: list[Connection] = []  # the most recently used last
        self._fresh: list[Connection] = []  # released since the loop last polled its sockets
        self._all: set[Connection] = set()

    async def connection(self, timeout: float) -> tuple[Connection, bool]:
        """An idle connection (``True``: reused) or a new one (``False``), made within
        ``timeout`` seconds.

        A connection released before the loop's last poll of its sockets is taken when
        :attr:`~Connection.usable`: whatever the server sent beyond its last answer by that
        poll, or its close, has reached the connection (and made it unusable). One released
        since, in this same turn of the loop, is taken only when :meth:`~Connection.quiet`
        besides: a poll of its socket, a system call that lets the thread that decodes take the
        interpreter (about 5 µs a request with a thread decoding beside the loop), which the
        first kind saves."""
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if conn.usable and now - conn.idle_since < IDLE_S:
                return conn, True
            self.discard(conn)
        while self._fresh:
            conn = self._fresh.pop()
            if conn.usable and conn.quiet():
                return conn, True
            self.discard(conn)
        return await self.open(timeout), False

    async def open(self, timeout: float) -> Connection:
        """A new connection (TCP, and TLS for https), made within ``timeout`` seconds."""
        scheme, host, port = self.origin
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(timeout):
            _, conn = await loop.create_connection(Connection, host, port, ssl=self._tls,
                                                   server_hostname=host if self._tls is not None else None)
        conn.buffers = self.buffers
        self._all.add(conn)
        return conn

    def release(self, conn: Connection) -> None:
        """Keep ``conn`` for the next request (its response was read to the end)."""
        conn.deadline(None)
        if not conn.usable:
            self.discard(conn)
            return
        conn.idle_since = time.monotonic()
        if not self._fresh:
            # run once the loop has polled its sockets: callbacks scheduled while the loop runs
            # its ready ones wait for its next turn, which polls first (asyncio's and uvloop's)
            asyncio.get_running_loop().call_soon(self._polled)
        self._fresh.append(conn)

    def _polled(self) -> None:
        """The connections released before the loop's last poll join the idle ones."""
        fresh, self._fresh = self._fresh, []
        self._idle.extend(fresh)
        newest = self._idle[-1].idle_since if self._idle else 0.0
        while self._idle and newest - self._idle[0].idle_since >= IDLE_S:
            self.discard(self._idle.pop(0))

    def discard(self, conn: Connection) -> None:
        conn.close()
        self._all.discard(conn)

    async def close(self) -> None:
        """Close every connection, and wait (briefly) until the loop has let go of each."""
        conns, self._all, self._idle, self._fresh = list(self._all), set(), [], []
        for conn in conns:
            conn.close()
        lost = [c.lost for c in conns if c.lost is not None and not c.lost.done()]
        if lost:
            await asyncio.wait(lost, timeout=1.0)

    @property
    def open_connections(self) -> int:
        return sum(1 for c in self._all if c.transport is not None and not c.transport.is_closing())


def tls_context() -> _ssl.SSLContext:
    """The TLS settings of https requests: the system's trusted certificates (``SSL_CERT_FILE``
    and ``SSL_CERT_DIR`` name others), host names checked."""
    return _ssl.create_default_context()
