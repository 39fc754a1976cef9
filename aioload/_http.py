"""One HTTP GET attempt with aiohttp, classified for the retry loop.

Each event loop gets one pooled :class:`aiohttp.ClientSession` per :class:`aioload.Storage`
(keep-alive connections, reused across reads), closed when the loop ends (see ``_scope``).
A per-host semaphore holds requests beyond ``connections_per_host`` *before* the attempt's
timeout starts, so waiting for a free connection never counts as a slow server.
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

from aioload import _scope
from aioload._retry import Permanent, Transient, parse_retry_after

try:
    import aiohttp
except ImportError:  # pragma: no cover - exercised only where aiohttp is missing
    aiohttp = None

MISSING_AIOHTTP = "reading http:// and https:// URLs needs aiohttp: pip install 'aioload[http]'"


class Client:
    """The session and the per-host connection slots of one storage on one loop."""

    def __init__(self, connections_per_host: int, headers: dict[str, str] | None):
        if aiohttp is None:
            raise ImportError(MISSING_AIOHTTP)
        self.limit = connections_per_host
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=connections_per_host)
        self.session = aiohttp.ClientSession(connector=connector, headers=headers,
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


async def client(owner, connections_per_host: int, headers: dict[str, str] | None) -> Client:
    """``owner``'s client on the running loop."""
    return await _scope.get(("http", owner), lambda: Client(connections_per_host, headers), Client.close)


async def get(client: Client, url: str, timeout: float, offset: int | None = None,
              length: int | None = None) -> bytes:
    """One attempt: the body (or ``length`` bytes from ``offset``), or Transient/Permanent."""
    headers = None
    if offset is not None:
        headers = {"Range": f"bytes={offset}-{offset + length - 1}"}
    async with client.slot(url):
        try:
            async with asyncio.timeout(timeout):
                async with client.session.get(url, headers=headers) as resp:
                    return await _body(resp, offset, length)
        except TimeoutError as exc:
            raise Transient(f"no complete response within timeout={timeout:g} s") from exc
        except aiohttp.ClientPayloadError as exc:
            raise Transient(f"truncated body: {exc}") from exc
        except aiohttp.ClientConnectionError as exc:
            raise Transient(f"connection error: {type(exc).__name__}: {exc}") from exc
        except aiohttp.ClientError as exc:
            raise Permanent(f"{type(exc).__name__}: {exc}") from exc


async def _body(resp, offset: int | None, length: int | None) -> bytes:
    status = resp.status
    if status == 416 and offset is not None:
        return b""  # the range starts at or past the end, as a local read would return
    if status == 429 or status >= 500:
        raise Transient(f"{status} {resp.reason}", status, parse_retry_after(resp.headers.get("Retry-After")))
    if not 200 <= status < 300:
        raise Permanent(f"{status} {resp.reason}", status, missing=status in (404, 410))
    try:
        body = await resp.read()
    except aiohttp.ClientPayloadError as exc:
        raise Transient(f"truncated body: {exc}", status) from exc
    expected = resp.headers.get("Content-Length")
    if expected is not None and "Content-Encoding" not in resp.headers and len(body) != int(expected):
        raise Transient(f"truncated body: {len(body)} of {expected} bytes (Content-Length)", status)
    if offset is not None and status != 206:
        body = body[offset : offset + length]  # the server ignored Range and sent it all
    return body
