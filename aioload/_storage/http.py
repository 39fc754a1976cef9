"""One HTTP request attempt, bounded and classified for the retry loop, over aioload's own
HTTP/1.1 client (:mod:`aioload._storage.h1`).

Each event loop gets one :class:`Client` per :class:`aioload.Storage`: a keep-alive pool of
connections per origin, closed when the loop ends (see ``_scope``). Each pool's semaphore
holds requests beyond ``connections_per_host`` *before* the attempt's clock runs, so waiting
for a free connection never counts as a slow server (for a redirect to another origin, the
clock stops while its connection is waited for).

What a server can make a read hold or send is bounded here:

* a ``Content-Length`` above ``max_bytes`` fails before the body is read, and a body that
  grows past it (no ``Content-Length``, an endless chunked body) fails as it passes it;
  neither is retried. A body of known length that is wanted whole is received in place into
  one buffer; the others are taken in pieces and counted;
* bytes are kept as sent (``Accept-Encoding: identity``); with ``decompress=True`` gzip and
  deflate bodies are decoded here, in bounded steps, and ``max_bytes`` bounds the decoded
  size too;
* a range read keeps at most ``length`` bytes: when the server ignores ``Range`` (200 instead
  of 206) the body is read up to ``offset + length`` and the connection is closed; the bytes
  that arrived before the range are added to the read's tally (``_storage.arrived``);
* redirects are followed by hand, at most ``MAX_REDIRECTS``, within the URL's origin by
  default (see :func:`redirect_refusal`); the storage's ``headers`` are sent only to that
  origin, and credentials in a URL (``user:password@``) to that URL alone.

A keep-alive connection that the server closed while it was idle is noticed when it is taken
(or when the request on it gets no byte back): the request is sent once more, on a new
connection, within the same attempt.
"""

from __future__ import annotations

import base64
import re
import ssl
import time
import zlib
from typing import Awaitable, Mapping
from urllib.parse import urljoin, urlsplit

from aioload._storage import arrived, h1
from aioload._storage import scope as _scope
from aioload._storage.retry import Permanent, Transient, parse_retry_after

REDIRECTS = ("same-origin", "any", "none")
"""The values of ``Storage(redirects=...)``."""

MAX_REDIRECTS = 10
_REDIRECT_STATUSES = (301, 302, 303, 307, 308)
_DEFAULT_PORTS = {"http": 80, "https": 443}
_DECODE_STEP = 1 << 20  # the most decoded bytes one step of a decoder may produce
_TOKEN = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
_CONTENT_RANGE = re.compile(r"^\s*bytes\s+(\d+)-")
_TARGETS_KEPT = 4096  # parsed URLs remembered per client
USER_AGENT = "aioload"


def check_headers(headers: Mapping[str, str] | None) -> None:
    """Refuse request headers that would not be sent as given (``ValueError``)."""
    for name, value in (headers or {}).items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise TypeError(f"headers must map str to str, got {name!r}: {value!r}")
        if not _TOKEN.match(name) or any(c in value for c in "\r\n\0"):
            raise ValueError(f"headers must be HTTP field names with values free of CR, LF and NUL, "
                             f"got {name!r}: {value!r}")


class Client:
    """The connection pools of one storage on one loop, and what every request sends."""

    def __init__(self, connections_per_host: int, headers: Mapping[str, str] | None):
        self.limit = connections_per_host
        self.headers = dict(headers) if headers else {}  # sent only to the URL's own origin
        self._names = {name.lower() for name in self.headers}
        self._own = "".join(f"{name}: {value}\r\n" for name, value in self.headers.items())
        self._pools: dict[tuple[str, str, int], h1.Pool] = {}
        self._targets: dict[str, h1.Target] = {}
        self._tls: ssl.SSLContext | None = None
        self.closed = False

    def target(self, url: str) -> h1.Target:
        target = self._targets.get(url)
        if target is None:
            if len(self._targets) >= _TARGETS_KEPT:
                self._targets.clear()
            target = self._targets[url] = h1.Target(url)
        return target

    def pool(self, target: h1.Target) -> h1.Pool:
        pool = self._pools.get(target.origin)
        if pool is None:
            if self.closed:  # a read still running when the storage was closed on this loop
                raise Permanent("the storage's connections on this loop were closed while the read ran",
                                remedy="not retried: read again (a new client is made)")
            tls = None
            if target.origin[0] == "https":
                if self._tls is None:
                    self._tls = h1.tls_context()
                tls = self._tls
            pool = self._pools[target.origin] = h1.Pool(target.origin, self.limit, tls)
        return pool

    def request(self, method: str, target: h1.Target, home: bool, extra: str) -> bytes:
        """The request head: the storage's headers only for its own origin (``home``), each of
        them replacing a default of the same name."""
        names = self._names if home else ()
        lines = [f"{method} {target.path} HTTP/1.1\r\n"]
        if "host" not in names:
            lines.append(f"Host: {target.host_header}\r\n")
        if "user-agent" not in names:
            lines.append(f"User-Agent: {USER_AGENT}\r\n")
        if "accept" not in names:
            lines.append("Accept: */*\r\n")
        if target.userinfo is not None and "authorization" not in names:
            token = base64.b64encode(":".join(target.userinfo).encode()).decode("ascii")
            lines.append(f"Authorization: Basic {token}\r\n")
        if home:
            lines.append(self._own)
        lines.append(extra)
        lines.append("\r\n")
        return "".join(lines).encode("latin-1")

    def open_connections(self) -> int:
        """Connections open now, in use or idle."""
        return sum(pool.open_connections for pool in self._pools.values())

    async def close(self) -> None:
        self.closed = True
        pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            await pool.close()


async def client(owner, connections_per_host: int, headers: Mapping[str, str] | None) -> Client:
    """``owner``'s client on the running loop."""
    return await _scope.get(("http", owner), lambda: Client(connections_per_host, headers), Client.close)


def existing(owner) -> Client | None:
    """``owner``'s client on the running loop, if it has one already (no await: the common
    case of every read but the first)."""
    return _scope.peek(("http", owner))


# -- redirects ---------------------------------------------------------------------------------
def origin(url: str) -> tuple[str, str, int | None]:
    """``(scheme, host, port)`` of ``url``, lower-cased, with the scheme's default port."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    try:
        port = parts.port
    except ValueError:  # not a port number: the request refuses the URL itself
        port = None
    return scheme, (parts.hostname or "").lower(), port or _DEFAULT_PORTS.get(scheme)


def shown_origin(url: str) -> str:
    """``scheme://host:port`` of ``url``, as messages name a server (no credentials)."""
    return _shown(origin(url))


def _shown(origin_: tuple[str, str, int | None]) -> str:
    scheme, host, port = origin_
    host = f"[{host}]" if ":" in host else host
    return f"{scheme}://{host}:{port}"


def redirect_refusal(source: str, target: str, first: str, redirects: str) -> str | None:
    """Why a redirect from ``source`` to ``target`` is not followed (``first`` is the URL the
    read asked for, ``redirects`` the storage's rule), or None when it is followed.

    Never followed: a redirect from https to http, one to a scheme other than http(s), any
    redirect under ``"none"``, and under ``"same-origin"`` one whose target's scheme, host or
    port differs from ``first``'s.
    """
    to = origin(target)
    if to[0] not in _DEFAULT_PORTS:
        return f"redirect to {target} refused: not an http(s) URL"
    if origin(source)[0] == "https" and to[0] == "http":
        return f"redirect to {target} refused: from https to http"
    if redirects == "none":
        return f"redirect to {target} refused: redirects='none'"
    if redirects == "same-origin" and to != origin(first):
        return f"redirect to {target} refused: it leaves the origin {_shown(origin(first))}"
    return None


def _redirect_remedy(reason: str) -> str:
    if "from https to http" in reason or "not an http(s) URL" in reason:
        return "not retried: such redirects are never followed"
    return ("not retried: pass Storage(redirects='any') to follow redirects to other origins "
            "(the storage's headers are not sent there)")


# -- one attempt -------------------------------------------------------------------------------
def get(client: Client, url: str, timeout: float, offset: int | None = None, length: int | None = None, *,
        max_bytes: int, decompress: bool, redirects: str) -> Awaitable[bytes | bytearray]:
    """One attempt: the body (or ``length`` bytes from ``offset``), or Transient/Permanent.
    A body received in place comes back as the ``bytearray`` it was received into."""
    return _attempt(client, url, timeout, "GET", redirects, _Read(offset, length, max_bytes, decompress))


def get_into(client: Client, url: str, timeout: float, into, *, max_bytes: int, decompress: bool,
             redirects: str) -> Awaitable[int]:
    """One attempt at the whole body, received into ``into(size)`` (a writable byte
    ``memoryview`` of ``size`` bytes, asked for once the size is known, and released once
    written): its size, or Transient/Permanent. A body of known length is received there
    directly from the socket; any other (chunked, encoded) is gathered first and copied in.
    Each attempt asks for a buffer of its own and writes it from its start."""
    return _attempt(client, url, timeout, "GET", redirects, _Into(into, max_bytes, decompress))


def head(client: Client, url: str, timeout: float, *, redirects: str, first_byte: bool = False) -> Awaitable[h1.Head]:
    """One attempt at the head of ``url``'s answer to ``HEAD`` (or, with ``first_byte``, to a
    ``GET`` of its first byte, for servers that refuse ``HEAD``), redirects followed."""
    return _attempt(client, url, timeout, "GET" if first_byte else "HEAD", redirects, _Heads(first_byte))


async def _attempt(client: Client, url: str, timeout: float, method: str, redirects: str, answer):
    try:
        return await _follow(client, url, timeout, method, redirects, answer)
    except TimeoutError as exc:
        raise Transient(f"no complete response within timeout={timeout:g} s") from exc
    except h1.Closed as exc:
        raise Transient(f"connection error: {exc}") from exc
    except ssl.SSLCertVerificationError as exc:
        raise Permanent(f"TLS: {exc.verify_message or exc}",
                        remedy="not retried: the server's certificate does not verify (SSL_CERT_FILE names "
                               "the certificates to trust)") from exc
    except OSError as exc:
        raise Transient(f"connection error: {type(exc).__name__}: {exc}") from exc
    except h1.ProtocolError as exc:
        raise Permanent(f"invalid response: {exc}",
                        remedy="not retried: the server does not answer in HTTP/1.1 as this client reads it") from exc


async def _follow(client: Client, url: str, timeout: float, method: str, redirects: str, answer):
    first = current = url
    home = None  # the URL's origin: its parsed target's (a URL parsed once per client, not per request)
    left = timeout
    for _ in range(MAX_REDIRECTS + 1):
        try:
            target = client.target(current)
        except ValueError as exc:
            raise Permanent(f"invalid URL {current!r}: {exc}", remedy="not retried: fix the URL") from exc
        if home is None:
            home = target.origin
        pool = client.pool(target)
        async with pool.slots:  # waiting for a connection: off the attempt's clock
            began = time.monotonic()
            location, result = await _hop(client, pool, target, method, target.origin == home, answer, left)
            left -= time.monotonic() - began
        if location is None:
            return result
        try:
            nxt = urljoin(current, location)
            reason = redirect_refusal(current, nxt, first, redirects)
            if reason is None:
                client.target(nxt)
        except ValueError as exc:
            raise Permanent(f"redirect to an invalid URL {location!r}: {exc}", result) from exc
        if reason is not None:
            raise Permanent(reason, result, remedy=_redirect_remedy(reason))
        current = nxt
    raise Permanent(f"more than {MAX_REDIRECTS} redirects", remedy="not retried: the server redirects in a loop")


async def _hop(client: Client, pool: h1.Pool, target: h1.Target, method: str, home: bool, answer,
               timeout: float):
    """One request and its answer within ``timeout`` seconds: ``(None, result)``, or
    ``(Location, status)`` for a redirect."""
    began = time.monotonic()
    request = client.request(method, target, home, answer.headers(client, home))
    conn, reused = await pool.connection(timeout)
    try:
        conn.deadline(timeout - (time.monotonic() - began))
        try:
            resp = await conn.send(request, method, answer.wanted)
        except h1.Closed as exc:
            if not reused or exc.started:
                raise
            pool.discard(conn)  # closed by the server while idle: once more, on a new connection
            conn = await pool.open(timeout - (time.monotonic() - began))
            conn.deadline(timeout - (time.monotonic() - began))
            resp = await conn.send(request, method, answer.wanted)
        location = resp.headers.get("location")
        if resp.status in _REDIRECT_STATUSES and location is not None:
            pool.discard(conn)  # its body is of no use
            return location, resp.status
        result = await answer.take(conn, resp)
    except BaseException:
        pool.discard(conn)  # half-read, or in an unknown state: never reused
        raise
    if resp.keep_alive and answer.complete:
        pool.release(conn)
    else:
        pool.discard(conn)
    return None, result


def _status_error(resp: h1.Head) -> Exception | None:
    status = resp.status
    if status in (408, 429) or status >= 500:
        return Transient(f"{status} {resp.reason}", status, parse_retry_after(resp.headers.get("retry-after")))
    if not 200 <= status < 300:
        return Permanent(f"{status} {resp.reason}", status, missing=status in (404, 410))
    return None


class _Heads:
    """What a HEAD (or first-byte GET) attempt keeps: the head."""

    wanted = None  # no body received in place as it arrives (h1.Connection.send)

    def __init__(self, first_byte: bool):
        self.first_byte = first_byte
        self.complete = False

    def headers(self, client: Client, home: bool) -> str:
        names = client._names if home else ()
        extra = "" if "accept-encoding" in names else "Accept-Encoding: identity\r\n"
        return extra + ("Range: bytes=0-0\r\n" if self.first_byte else "")

    async def take(self, conn: h1.Connection, resp: h1.Head) -> h1.Head:
        # After a HEAD the connection is closed: a server that sends a body to a HEAD anyway may
        # send it after the next request has gone out on it, where no check could tell it from
        # that request's answer (a probe per shard, made once, so reuse saves little).
        if self.first_byte and resp.status == 206 and resp.length is not None and resp.length <= 1:
            await conn.read_exact(resp.length)
            self.complete = True
        return resp  # any other body is not read: the connection is closed instead


class _Read:
    """What a GET attempt keeps: the body, or ``length`` bytes of it from ``offset``."""

    def __init__(self, offset: int | None, length: int | None, max_bytes: int, decompress: bool):
        self.offset, self.length, self.max_bytes, self.decompress = offset, length, max_bytes, decompress
        self.complete = False  # the body was read to its end (the connection may be reused)

    def headers(self, client: Client, home: bool) -> str:
        names = client._names if home else ()
        extra = ""
        if "accept-encoding" not in names:
            # A byte range of an encoded body is not the range asked for: ranges are asked unencoded.
            encoded = self.decompress and self.offset is None
            extra = "Accept-Encoding: gzip, deflate\r\n" if encoded else "Accept-Encoding: identity\r\n"
        if self.offset is not None:
            extra += f"Range: bytes={self.offset}-{self.offset + self.length - 1}\r\n"
        return extra

    def _whole(self, resp: h1.Head) -> int | None:
        """The length of ``resp``'s body where :meth:`take` reads it whole into one buffer
        (``read_exact``: a known length, not decoded here, every byte of it wanted), else None."""
        expected = resp.length
        if expected is None:
            return None
        if self.offset is None:
            return None if self.decompress and resp.status == 200 and _encoding(resp) != "identity" else expected
        return expected if resp.status == 206 and expected <= self.length else None

    def wanted(self, resp: h1.Head) -> int | None:
        """The bytes of a successful ``resp``'s body that :meth:`take` reads whole, within
        ``max_bytes`` (the connection then receives them in place as they arrive, with the head)."""
        n = self._whole(resp)
        return n if n is not None and 200 <= resp.status < 300 and n <= self.max_bytes else None

    async def take(self, conn: h1.Connection, resp: h1.Head) -> bytes | bytearray:
        status, offset, length, max_bytes = resp.status, self.offset, self.length, self.max_bytes
        if status == 416 and offset is not None:
            self.complete = resp.length == 0
            return b""  # the range starts at or past the end, as a local read would return
        error = _status_error(resp)
        if error is not None:
            self.complete = resp.length == 0
            raise error
        expected = resp.length
        if expected is not None and expected > max_bytes and offset is None:
            raise _too_large(f"the body of {expected} bytes (Content-Length) is larger than "
                             f"max_bytes={max_bytes}", status)
        if status == 206 and offset is not None:
            _check_content_range(resp, offset)
        encoding = _encoding(resp)
        decoder = _decoder(encoding, status) if self.decompress and status == 200 and encoding != "identity" else None
        if self._whole(resp) is not None:  # decoder is None here: _whole leaves such bodies out
            if expected > max_bytes:
                raise _too_large(f"the body is larger than max_bytes={max_bytes}", status)
            try:
                data = await conn.read_exact(expected)
            except h1.Closed as exc:
                raise Transient(f"truncated body: {exc} (Content-Length)", status) from exc
            self.complete = True
            return data
        if offset is None:
            keep = _Keep(0, None, max_bytes)
        elif status == 206:
            keep = _Keep(0, length, max_bytes)
        else:  # the server ignored Range and sends the whole object: read only up to the end asked
            keep = _Keep(offset, offset + length, max_bytes)
        return await self._pieces(h1.Body(conn, resp), keep, decoder, encoding, status)

    async def _pieces(self, body: h1.Body, keep: _Keep, decoder, encoding: str, status: int) -> bytes:
        received = 0
        try:
            while chunk := await body.read():
                received += len(chunk)
                if decoder is not None and received > self.max_bytes:
                    raise _too_large(f"the body is larger than max_bytes={self.max_bytes} as sent", status)
                for piece in decoder.feed(chunk) if decoder is not None else (chunk,):
                    keep.add(piece, status, decoded=decoder is not None)
                if keep.full:
                    return self._kept(keep)  # the rest of the body is not needed: the connection is dropped
        except h1.Closed as exc:
            raise Transient(f"truncated body: {exc}", status) from exc
        self.complete = body.complete
        if decoder is not None and not decoder.done:
            raise Transient(f"truncated body: the {encoding} stream ends early", status)
        return self._kept(keep)

    def _kept(self, keep: _Keep) -> bytes:
        data = keep.data()
        if self.offset is not None and keep.seen > len(data):  # a range read answered with more than the range
            arrived.dropped(keep.seen - len(data))  # (the whole body, Range ignored): what arrived is counted
        return data


class _Into(_Read):
    """What a GET attempt of a whole body received into a caller's buffer keeps: its size."""

    wanted = None  # received into the caller's buffer instead (read_into)

    def __init__(self, into, max_bytes: int, decompress: bool):
        super().__init__(None, None, max_bytes, decompress)
        self.into = into

    async def take(self, conn: h1.Connection, resp: h1.Head) -> int:
        expected = resp.length
        encoding = _encoding(resp)
        if resp.status != 200 or expected is None or (self.decompress and encoding != "identity"):
            data = await super().take(conn, resp)  # gathered (or refused) as any read is, then copied in
            _write(self.into(len(data)), data)
            return len(data)
        if expected > self.max_bytes:
            raise _too_large(f"the body of {expected} bytes (Content-Length) is larger than "
                             f"max_bytes={self.max_bytes}", 200)
        view = self.into(expected)
        try:
            if view.nbytes != expected:
                raise ValueError(f"a buffer of {view.nbytes} bytes was given for a body of {expected}")
            try:
                await conn.read_into(view)
            except h1.Closed as exc:
                raise Transient(f"truncated body: {exc} (Content-Length)", 200) from exc
        finally:
            view.release()
        self.complete = True
        return expected


def _encoding(resp: h1.Head) -> str:
    """The response's ``Content-Encoding``, lower-cased (``"identity"`` for none)."""
    return (resp.headers.get("content-encoding") or "identity").strip().lower() or "identity"


def _write(view: memoryview, data) -> None:
    with view:
        if view.nbytes != len(data):
            raise ValueError(f"a buffer of {view.nbytes} bytes was given for a body of {len(data)}")
        view[:] = data


def _check_content_range(resp: h1.Head, offset: int) -> None:
    value = resp.headers.get("content-range")
    if value is None:
        raise Permanent(f"206 Partial Content without Content-Range for bytes from {offset}: which bytes it holds "
                        "is unknown", 206, remedy="not retried: the server does not answer range requests as "
                        "HTTP/1.1 says (RFC 9110, 15.3.7)")
    match = _CONTENT_RANGE.match(value)
    if match is None or int(match.group(1)) != offset:
        raise Permanent(f"206 Partial Content with Content-Range {value!r} for bytes from {offset}", 206)


def _too_large(reason: str, status: int) -> Permanent:
    return Permanent(reason, status, remedy="not retried: pass Storage(max_bytes=...) to read larger objects")


class _Keep:
    """The part ``[start, stop)`` of a body that arrives in pieces (``stop=None``: to its end),
    failing once more than ``max_bytes`` of it have arrived."""

    def __init__(self, start: int, stop: int | None, max_bytes: int):
        self.start, self.stop, self.max_bytes = start, stop, max_bytes
        self.seen = 0
        self.parts: list[bytes] = []
        self.full = stop is not None and stop <= start

    def add(self, piece: bytes, status: int, decoded: bool) -> None:
        begin, self.seen = self.seen, self.seen + len(piece)
        if min(self.seen, self.stop if self.stop is not None else self.seen) > self.max_bytes:
            what = " once decoded" if decoded else ""
            raise _too_large(f"the body is larger than max_bytes={self.max_bytes}{what}", status)
        lo = max(self.start - begin, 0)
        hi = len(piece) if self.stop is None else min(self.stop - begin, len(piece))
        if lo < hi:
            self.parts.append(piece[lo:hi])
        if self.stop is not None and self.seen >= self.stop:
            self.full = True

    def data(self) -> bytes:
        return b"".join(self.parts)


class _Decoder:
    """A gzip or deflate body decoded in steps of at most ``_DECODE_STEP`` bytes."""

    def __init__(self, encoding: str):
        self.encoding = encoding
        self._z = None

    def feed(self, chunk: bytes):
        if self._z is None:
            if self.encoding in ("gzip", "x-gzip"):
                wbits = 16 + zlib.MAX_WBITS
            else:  # deflate: the zlib format, or (from some servers) a raw deflate stream
                wbits = zlib.MAX_WBITS if chunk[:1] and chunk[0] & 0x0F == 8 else -zlib.MAX_WBITS
            self._z = zlib.decompressobj(wbits)
        data = chunk
        while data and not self._z.eof:
            try:
                out = self._z.decompress(data, _DECODE_STEP)
            except zlib.error as exc:
                raise Permanent(f"the {self.encoding} body does not decode: {exc}") from exc
            if out:
                yield out
            data = self._z.unconsumed_tail

    @property
    def done(self) -> bool:
        return self._z is not None and self._z.eof


def _decoder(encoding: str, status: int) -> _Decoder:
    if encoding not in ("gzip", "x-gzip", "deflate"):
        raise Permanent(f"Content-Encoding {encoding!r} cannot be decoded (gzip and deflate can)", status,
                        remedy="not retried: pass Storage(decompress=False) to keep the bytes as sent")
    return _Decoder(encoding)
