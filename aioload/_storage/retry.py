"""How remote reads fail and retry: the policy, the error users see, and the retry loop.

A transport (HTTP, fsspec) makes one attempt and classifies what went wrong: a
:class:`Transient` failure (connection error, timeout, truncated body, HTTP 408, 429 or 5xx)
is retried after an exponential, jittered delay, or after the server's ``Retry-After``; a
:class:`Permanent` one (any other 4xx, a missing object, a body over ``max_bytes``, a redirect
that is not followed) is not. When the attempts run out, a
:class:`RemoteReadError` names the URL (its credentials redacted), the attempts made and the
last status.
"""

from __future__ import annotations

import asyncio
import email.utils
import math
import random
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, TypeVar

from aioload._storage.redact import redact

__all__ = ["RemoteReadError", "RetryPolicy"]

T = TypeVar("T")  # what an attempt returns


@dataclass(frozen=True)
class RetryPolicy:
    """Timeouts and retries for remote reads (``http://``, ``https://``, fsspec URLs).

    * ``attempts`` -- tries per read, the first included (``1`` disables retries).
    * ``timeout`` -- seconds one attempt may take, from sending the request to the last byte
      (time spent waiting for a free connection is not counted).
    * ``backoff`` -- the delay before the second attempt; it doubles for each later one, is
      capped at ``max_delay`` and jittered (each delay is drawn from ``[d/2, d]``) so that
      many failed reads do not return in step.
    * ``max_delay`` -- the longest single wait, also the cap on a server's ``Retry-After``.

    Every number is finite; ``timeout`` is above zero, ``backoff`` and ``max_delay`` at or
    above it (a ``ValueError`` otherwise).

    Connection errors, timeouts, truncated bodies, HTTP 408, 429 and 5xx are retried; other
    4xx statuses (404, 403, ...) fail at once.
    """

    attempts: int = 5
    timeout: float = 30.0
    backoff: float = 0.2
    max_delay: float = 20.0

    def __post_init__(self):
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int):
            raise TypeError(f"attempts must be an int >= 1, got {self.attempts!r}")
        if self.attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {self.attempts}")
        for name in ("timeout", "backoff", "max_delay"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a number of seconds, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number of seconds, got {value}")
        if not self.timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {self.timeout}")
        if self.backoff < 0 or self.max_delay < 0:
            raise ValueError(f"backoff and max_delay must be >= 0, got backoff={self.backoff}, "
                             f"max_delay={self.max_delay}")

    def delay(self, failures: int, retry_after: float | None, rng: random.Random) -> float:
        """Seconds to wait after the ``failures``-th failed attempt."""
        if retry_after is not None:
            return min(max(0.0, retry_after), self.max_delay)
        ceiling = min(self.max_delay, self.backoff * 2 ** (failures - 1))
        return rng.uniform(ceiling / 2, ceiling)


class RemoteReadError(OSError):
    """A remote read failed for good. ``url``, ``attempts`` and ``status`` (the last HTTP
    status, ``None`` when no response came back) are attributes (``None``, ``0`` and ``None``
    for an error made from a message alone, as torch's ``ExceptionWrapper`` makes one).

    A missing object (HTTP 404 or 410, or the object store's "no such key") raises a
    subclass that is also a :class:`FileNotFoundError`, as a missing local file would.
    """

    def __init__(self, message: str, url: str | None = None, attempts: int = 0, status: int | None = None):
        super().__init__(message)
        self.url = url
        self.attempts = attempts
        self.status = status

    def __str__(self) -> str:
        return self.args[0]

    def __reduce__(self):
        return (type(self), (self.args[0],), self.__dict__)  # the notes too


class RemoteNotFoundError(RemoteReadError, FileNotFoundError):
    """The object does not exist (HTTP 404/410 or no such key)."""


class Transient(Exception):
    """One attempt failed in a way that may pass: retry."""

    def __init__(self, reason: str, status: int | None = None, retry_after: float | None = None):
        super().__init__(reason)
        self.reason = reason
        self.status = status
        self.retry_after = retry_after


class Permanent(Exception):
    """One attempt failed in a way that will not pass: give up now. ``remedy`` ends the final
    error's message (the default speaks of 4xx statuses)."""

    def __init__(self, reason: str, status: int | None = None, missing: bool = False,
                 remedy: str | None = None):
        super().__init__(reason)
        self.reason = reason
        self.status = status
        self.missing = missing
        self.remedy = remedy


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a ``Retry-After`` header: a number of seconds or an HTTP date."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:
        return max(0.0, seconds) if math.isfinite(seconds) else None
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


async def retrying(policy: RetryPolicy, url: str, attempt: Callable[[], Awaitable[T]],
                   rng: random.Random, verb: str = "GET") -> T:
    """``await attempt()`` until it succeeds, fails permanently or the attempts run out."""
    last: Transient | None = None
    for n in range(1, policy.attempts + 1):
        try:
            return await attempt()
        except Transient as exc:
            last = exc
        except Permanent as exc:
            raise _final(verb, url, n, exc.status, exc.reason, permanent=True, missing=exc.missing,
                         remedy=exc.remedy) from exc
        if n < policy.attempts:
            await asyncio.sleep(policy.delay(n, last.retry_after, rng))
    assert last is not None  # attempts >= 1, and every attempt that did not return was transient
    raise _final(verb, url, policy.attempts, last.status, last.reason) from last


def _final(verb: str, url: str, attempts: int, status: int | None, reason: str, permanent: bool = False,
           missing: bool = False, remedy: str | None = None) -> RemoteReadError:
    shown = "no response" if status is None else f"HTTP {status}"
    tries = f"{attempts} attempt" + ("s" if attempts != 1 else "")
    if remedy is None and permanent:
        remedy = "not retried: client errors other than 408 and 429 do not pass by retrying"
    elif remedy is None:
        remedy = "every attempt failed; raise RetryPolicy(attempts=..., timeout=...) if the storage is just slow"
    message = redact(f"{verb} {url} failed after {tries}; last status: {shown} ({reason}); {remedy}")
    cls = RemoteNotFoundError if missing else RemoteReadError
    return cls(message, redact(url), attempts, status)
