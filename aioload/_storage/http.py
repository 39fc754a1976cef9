"""One HTTP GET attempt with aiohttp, bounded and classified for the retry loop.

Each event loop gets one pooled :class:`aiohttp.ClientSession` per :class:`aioload.Storage`
(keep-alive connections, reused across reads), closed when the loop ends (see ``_scope``).
A per-host semaphore holds requests beyond ``connections_per_host`` *before* the attempt's
timeout starts, so waiting for a free connection never counts as a slow server.

What a server can make a read hold or send is bounded here:

* the body is streamed and counted: a ``Content-Length`` above ``max_bytes`` fails before the
  body is read, and a body that grows past it (no ``Content-Length``, an endless chunked body)
  fails as it passes it; neither is retried;
* bytes are kept as sent (``Accept-Encoding: identity``, aiohttp's own decompression off);
  with ``decompress=True`` gzip and deflate bodies are decoded here, in bounded steps, and
  ``max_bytes`` bounds the decoded size too;
* a range read keeps at most ``length`` bytes: when the server ignores ``Range`` (200 instead
  of 206) the body is read up to ``offset + length`` and the connection is closed;
* redirects are followed by hand, at most ``MAX_REDIRECTS``, within the URL's origin by
  default (see :func:`redirect_refusal`); the storage's ``headers`` are sent only to that
  origin.
"""

from __future__ import annotations

import asyncio
import re
import zlib
from typing import Mapping
from urllib.parse import urlsplit

from aioload._storage import scope as _scope
from aioload._storage.retry import Permanent, Transient, parse_retry_after

try:
    import aiohttp
    import yarl
except ImportError:  # pragma: no cover - exercised only where aiohttp is missing
    aiohttp = None

MISSING_AIOHTTP = "reading http:// and https:// URLs needs aiohttp: pip install 'aioload[http]'"

REDIRECTS = ("same-origin", "any", "none")
"""The values of ``Storage(redirects=...)``."""

MAX_REDIRECTS = 10
_REDIRECT_STATUSES = (301, 302, 303, 307, 308)
_DEFAULT_PORTS = {"http": 80, "https": 443}
_DECODE_STEP = 1 << 20  # the most decoded bytes one step of a decoder may produce


class Client:
    """The session and the per-host connection slots of one storage on one loop."""

    def __init__(self, connections_per_host: int, headers: Mapping[str, str] | None):
        if aiohttp is None:
            raise ImportError(MISSING_AIOHTTP)
        self.limit = connections_per_host
        self.headers = dict(headers) if headers else {}  # sent only to the URL's own origin
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=connections_per_host)
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                             timeout=aiohttp.ClientTimeout(total=None))
        self._hosts: dict[str, asyncio.Semaphore] = {}

    def slot(self, url: str) -> asyncio.Semaphore:
        host = urlsplit(url).netloc
        sem = self._hosts.get(host)
        if sem is None:
            sem = self._hosts[host] = asyncio.Semaphore(self.limit)
        return sem

    async def close(self) -> None:
        await self.session.close()


async def client(owner, connections_per_host: int, headers: Mapping[str, str] | None) -> Client:
    """``owner``'s client on the running loop."""
    return await _scope.get(("http", owner), lambda: Client(connections_per_host, headers), Client.close)


# -- redirects ---------------------------------------------------------------------------------
def origin(url: str) -> tuple[str, str, int | None]:
    """``(scheme, host, port)`` of ``url``, lower-cased, with the scheme's default port."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    try:
        port = parts.port
    except ValueError:  # not a port number: aiohttp rejects the URL itself
        port = None
    return scheme, (parts.hostname or "").lower(), port or _DEFAULT_PORTS.get(scheme)


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
async def get(client: Client, url: str, timeout: float, offset: int | None = None,
              length: int | None = None, *, max_bytes: int, decompress: bool, redirects: str) -> bytes:
    """One attempt: the body (or ``length`` bytes from ``offset``), or Transient/Permanent."""
    async with client.slot(url):
        try:
            async with asyncio.timeout(timeout):
                return await _follow(client, url, offset, length, max_bytes, decompress, redirects)
        except TimeoutError as exc:
            raise Transient(f"no complete response within timeout={timeout:g} s") from exc
        except aiohttp.ClientPayloadError as exc:
            raise Transient(f"truncated body: {exc}") from exc
        except aiohttp.ClientConnectionError as exc:
            raise Transient(f"connection error: {type(exc).__name__}: {exc}") from exc
        except aiohttp.ClientError as exc:
            raise Permanent(f"{type(exc).__name__}: {exc}") from exc


async def _follow(client: Client, url: str, offset, length, max_bytes: int, decompress: bool,
                  redirects: str) -> bytes:
    first = current = url
    home = origin(url)
    for _ in range(MAX_REDIRECTS + 1):
        headers = _request_headers(client, current, home, offset, length, decompress)
        async with client.session.get(current, headers=headers, allow_redirects=False) as resp:
            location = resp.headers.get("Location")
            if resp.status not in _REDIRECT_STATUSES or location is None:
                return await _body(resp, offset, length, max_bytes, decompress)
            try:
                target = str(resp.url.join(yarl.URL(location)))
            except ValueError as exc:
                raise Permanent(f"redirect to an invalid URL {location!r}: {exc}", resp.status) from exc
            reason = redirect_refusal(current, target, first, redirects)
            if reason is not None:
                raise Permanent(reason, resp.status, remedy=_redirect_remedy(reason))
            current = target
    raise Permanent(f"more than {MAX_REDIRECTS} redirects", remedy="not retried: the server redirects in a loop")


def _request_headers(client: Client, url: str, home, offset, length, decompress: bool) -> dict[str, str]:
    headers = dict(client.headers) if origin(url) == home else {}
    if not any(name.lower() == "accept-encoding" for name in headers):
        # A byte range of an encoded body is not the range asked for: ranges are asked unencoded.
        encoded = decompress and offset is None
        headers["Accept-Encoding"] = "gzip, deflate" if encoded else "identity"
    if offset is not None:
        headers["Range"] = f"bytes={offset}-{offset + length - 1}"
    return headers


async def _body(resp, offset: int | None, length: int | None, max_bytes: int, decompress: bool) -> bytes:
    status = resp.status
    if status == 416 and offset is not None:
        return b""  # the range starts at or past the end, as a local read would return
    if status in (408, 429) or status >= 500:
        raise Transient(f"{status} {resp.reason}", status, parse_retry_after(resp.headers.get("Retry-After")))
    if not 200 <= status < 300:
        raise Permanent(f"{status} {resp.reason}", status, missing=status in (404, 410))
    expected = _content_length(resp)
    if expected is not None and expected > max_bytes and offset is None:
        resp.close()
        raise _too_large(f"the body of {expected} bytes (Content-Length) is larger than "
                         f"max_bytes={max_bytes}", status)
    encoding = resp.headers.get("Content-Encoding", "identity").strip().lower() or "identity"
    decoder = _decoder(encoding, status) if decompress and status == 200 and encoding != "identity" else None
    if offset is None:
        keep = _Keep(0, None, max_bytes)
    elif status == 206:
        _check_content_range(resp, offset)
        keep = _Keep(0, length, max_bytes)
    else:  # the server ignored Range and sends the whole object: read only up to the end asked
        keep = _Keep(offset, offset + length, max_bytes)
    received = 0
    try:
        async for chunk in resp.content.iter_any():
            received += len(chunk)
            if decoder is not None and received > max_bytes:
                raise _too_large(f"the body is larger than max_bytes={max_bytes} as sent", status)
            for piece in decoder.feed(chunk) if decoder is not None else (chunk,):
                keep.add(piece, status, decoded=decoder is not None)
            if keep.full:
                resp.close()  # the rest of the body is not needed: drop the connection
                return keep.data()
    except BaseException as exc:
        resp.close()  # never read on: a half-read body would stall the next request
        if isinstance(exc, aiohttp.ClientPayloadError):
            raise Transient(f"truncated body: {exc}", status) from exc
        raise
    if expected is not None and received != expected:
        raise Transient(f"truncated body: {received} of {expected} bytes (Content-Length)", status)
    if decoder is not None and not decoder.done:
        raise Transient(f"truncated body: the {encoding} stream ends early", status)
    return keep.data()


def _content_length(resp) -> int | None:
    value = resp.headers.get("Content-Length")
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise Permanent(f"invalid Content-Length {value!r}", resp.status) from None


def _check_content_range(resp, offset: int) -> None:
    value = resp.headers.get("Content-Range")
    match = re.match(r"^\s*bytes\s+(\d+)-", value or "")
    if value is not None and (match is None or int(match.group(1)) != offset):
        resp.close()
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
