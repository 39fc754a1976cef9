"""A shard's version: its size and a tag that changes when it is written again.

The index cache is keyed by it, so an index is never used for a shard other than the one it
was made from. One request per shard, through the storage's own transports and retries:

* a local path: ``os.stat`` (size, ``st_mtime_ns``, inode);
* ``http(s)://``: ``HEAD`` (``Content-Length``, ``ETag`` or ``Last-Modified``), redirects
  followed as the storage's ``redirects`` rule allows; a server that refuses ``HEAD``
  (403, 405, 501) or answers it without ``Content-Length`` is asked for its first byte
  instead (``Range: bytes=0-0``: ``Content-Range`` gives the size, or ``Content-Length``
  where the server ignores ``Range``, which the version then records);
* an fsspec URL: the filesystem's ``info`` (``size``, ``ETag``, ``LastModified`` or ``mtime``).
"""

from __future__ import annotations

import asyncio
import os
import re
from dataclasses import dataclass

from aioload._storage import fsspec as _fsspec
from aioload._storage import h1
from aioload._storage import http as _http
from aioload._storage.retry import Permanent, Transient, retrying
from aioload._storage.storage import Storage, locate


@dataclass(frozen=True)
class Version:
    """``size`` in bytes, and ``tag``: whatever the store says changes with the content
    (empty where it says nothing: the size alone then tells versions apart)."""

    size: int
    tag: str
    ranges: bool | None = None
    """Whether the store answered a range request with the range (``None``: not asked)."""


async def version(storage: Storage, url: str) -> Version:
    """The version of the shard at ``url`` (a missing one raises ``FileNotFoundError``)."""
    kind, where = locate(url)
    if kind == "local":
        st = await asyncio.to_thread(os.stat, where)
        return Version(st.st_size, f"mtime_ns={st.st_mtime_ns} ino={st.st_ino}")
    if kind == "http":
        return await retrying(storage.retry, url, lambda: _head(storage, url), storage._rng, verb="HEAD")
    return await retrying(storage.retry, url, lambda: _info(storage, url), storage._rng, verb="INFO")


async def _info(storage: Storage, url: str) -> Version:
    protocol, path = _fsspec.split(url)
    fs = await _fsspec._filesystem(storage, protocol, storage.storage_options)
    try:
        async with asyncio.timeout(storage.retry.timeout):
            if getattr(fs, "async_impl", False):
                info = await fs._info(path)
            else:
                info = await asyncio.get_running_loop().run_in_executor(None, fs.info, path)
    except FileNotFoundError as exc:
        raise Permanent(f"not found: {exc}", missing=True) from exc
    except TimeoutError as exc:
        raise Transient(f"no answer within timeout={storage.retry.timeout:g} s") from exc
    except OSError as exc:
        raise Transient(f"{type(exc).__name__}: {exc}") from exc
    if info.get("type", "file") != "file":
        raise Permanent(f"{url} is a {info.get('type')}, not a shard")
    tag = next((str(info[k]) for k in ("ETag", "etag", "LastModified", "last_modified", "mtime", "created")
                if info.get(k) is not None), "")
    return Version(int(info.get("size") or 0), tag)


_NO_HEAD = (403, 405, 501)
"""Answers to HEAD that send the probe to a ranged GET: 405 and 501 (no HEAD here), 403 (a
presigned URL signs GET alone, and S3 answers its HEAD 403)."""


async def _head(storage: Storage, url: str) -> Version:
    client = await _http.client(storage, storage.connections_per_host, storage.headers)
    timeout, rule = storage.retry.timeout, storage.redirects
    resp = await _http.head(client, url, timeout, redirects=rule)
    if resp.status in _NO_HEAD or (200 <= resp.status < 300 and "content-length" not in resp.headers):
        # the first byte says the size (Content-Range), or the whole answer does (a server that ignores Range)
        resp = await _http.head(client, url, timeout, redirects=rule, first_byte=True)
        if resp.status == 206:
            return _from_headers(resp.status, resp.reason, resp.headers, resp.headers.get("content-range"), True)
        return _from_headers(resp.status, resp.reason, resp.headers, None, False if resp.status == 200 else None)
    return _from_headers(resp.status, resp.reason, resp.headers, None)


def _from_headers(status: int, reason: str | None, headers, content_range: str | None,
                  ranges: bool | None = None) -> Version:
    if status in (408, 429) or status >= 500:
        raise Transient(f"{status} {reason}", status)
    if not 200 <= status < 300:
        raise Permanent(f"{status} {reason}", status, missing=status in (404, 410))
    if status == 206 and content_range is None:
        raise Permanent("206 Partial Content without Content-Range to a request for the first byte: the size is "
                        "unknown", status, remedy="not retried: the shard's size must be known to index it")
    if content_range is not None:
        match = re.match(r"^\s*bytes\s+\d+-\d+/(\d+)", content_range)
        if match is None:
            raise Permanent(f"Content-Range {content_range!r} does not give the size", status)
        size = int(match.group(1))
    else:
        length = headers.get("content-length")
        if length is None:
            raise Permanent("no Content-Length in the answer to HEAD", status,
                            remedy="not retried: the shard's size must be known to index it")
        try:
            size = h1.content_length(length)
        except h1.ProtocolError as exc:
            raise Permanent(f"invalid response: {exc}", status,
                            remedy="not retried: the shard's size must be known to index it") from None
    tag = headers.get("etag") or headers.get("last-modified") or ""
    if ranges is None:  # what the server says of itself (S3, nginx and aiohttp say "bytes"; http.server nothing)
        accepts = {t.strip().lower() for t in (headers.get("accept-ranges") or "").split(",")}
        ranges = True if "bytes" in accepts else False if "none" in accepts else None
    return Version(size, tag, ranges)


async def ranges_ignored(storage: Storage, shards: list[tuple[str, Version]]) -> list[str]:
    """The origins (``scheme://host:port``) of these ``(url, version)`` that answer a range
    request with the whole shard, in the order met. What a shard's probe learnt decides; for
    an origin where none learnt anything, its first shard is asked for its first byte (one
    request: 206, Range honoured; 200, ignored; anything else, left undecided)."""
    known: dict[str, bool | None] = {}
    ask: dict[str, str] = {}
    for url, version in shards:
        if locate(url)[0] != "http":
            continue
        where = _http.shown_origin(url)
        if version.ranges is not None and known.get(where) is None:
            known[where] = version.ranges
            ask.pop(where, None)
        elif where not in known:
            known[where] = None
            ask[where] = url
    if not ask:
        return [where for where, ranges in known.items() if ranges is False]
    client = await _http.client(storage, storage.connections_per_host, storage.headers)
    for where, url in ask.items():
        try:
            resp = await retrying(storage.retry, url, lambda u=url: _http.head(
                client, u, storage.retry.timeout, redirects=storage.redirects, first_byte=True), storage._rng)
        except OSError:
            continue  # the reads will tell; the probe is not worth failing the dataset for
        known[where] = {206: True, 200: False}.get(resp.status)
    return [where for where, ranges in known.items() if ranges is False]


def ranges_warning(origins: list[str]) -> str:
    """What :class:`aioload.WebDataset` warns in uniform mode when ``origins`` ignore ``Range``."""
    servers = ", ".join(origins)
    return (f"the server {servers} ignores Range (it answers a range request with the whole shard): in uniform mode "
            "each sample's read downloads its shard from the start up to the sample and drops the rest. Pass "
            "WebDataset(window=k) to fetch each shard once, whole, and draw samples from k shards at a time, or serve "
            "the shards from a server that honours Range (nginx, S3, aiohttp)")
