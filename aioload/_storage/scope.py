"""Resources that live exactly as long as an event loop: HTTP sessions, object-store clients.

A connection pool belongs to one loop (aiohttp and aiobotocore bind to the loop that created
them), and the loader runs one loop per epoch on its engine thread. So each loop gets its own
pool, made on first use and closed when the loop ends.

"When the loop ends" uses the loop's own protocol for async generators: every loop run by
``asyncio.run`` or by the engine calls ``loop.shutdown_asyncgens()`` before closing, which
``aclose()``-es each async generator still suspended on it. Each loop's scope is held by one
such generator, parked at its ``yield``; its ``finally`` closes what the scope holds. No hook
in the engine is needed, and a user's own ``asyncio.run(main())`` closes its sessions too.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Awaitable, Callable, Hashable

_SCOPES: dict[asyncio.AbstractEventLoop, "_Scope"] = {}
_LOCK = threading.Lock()


class _Scope:
    """What one loop holds: ``key -> (resource, close)`` in creation order."""

    def __init__(self) -> None:
        self.items: dict[Hashable, tuple[Any, Callable[[Any], Awaitable[None]]]] = {}
        self.keeper = None  # the async generator whose closing closes the scope

    async def close(self, keys=None) -> None:
        chosen = list(self.items) if keys is None else [k for k in keys if k in self.items]
        errors = []
        for key in reversed(chosen):
            resource, close = self.items.pop(key)
            try:
                await close(resource)
            except Exception as exc:  # noqa: BLE001 - close the others, then report
                errors.append(exc)
        if errors:
            raise errors[0]


async def _keep(loop: asyncio.AbstractEventLoop, scope: _Scope):
    try:
        yield
    finally:
        with _LOCK:
            if _SCOPES.get(loop) is scope:
                del _SCOPES[loop]
        await scope.close()


async def _scope() -> _Scope:
    loop = asyncio.get_running_loop()
    scope = _SCOPES.get(loop)
    if scope is not None:
        return scope
    scope = _Scope()
    with _LOCK:
        _SCOPES[loop] = scope
    scope.keeper = _keep(loop, scope)
    await scope.keeper.asend(None)  # the first step registers it with the loop, then parks
    return scope


async def get(key: Hashable, make: Callable[[], Any], close: Callable[[Any], Awaitable[None]]) -> Any:
    """The resource stored under ``key`` on the running loop, made by ``make()`` on first use.

    ``make`` is synchronous, so two tasks asking at once get the same resource; ``close`` is
    awaited when the loop shuts down (or by :func:`release`). Keys are ``(kind, owner, ...)``.
    """
    scope = await _scope()
    entry = scope.items.get(key)
    if entry is None:
        entry = scope.items[key] = (make(), close)
    return entry[0]


def peek(key: Hashable) -> Any:
    """The resource stored under ``key`` on the running loop, or None when there is none yet."""
    scope = _SCOPES.get(asyncio.get_running_loop())
    entry = scope.items.get(key) if scope is not None else None
    return entry[0] if entry is not None else None


async def release(owner: Any) -> None:
    """Close now, on the running loop, the resources whose key names ``owner`` second
    (keys are ``(kind, owner, ...)``)."""
    scope = _SCOPES.get(asyncio.get_running_loop())
    if scope is not None:
        await scope.close([k for k in scope.items if isinstance(k, tuple) and len(k) > 1 and k[1] is owner])


def open_scopes() -> int:
    """How many loops hold resources now (for tests: zero once every loop has ended)."""
    return len(_SCOPES)


def run_blocking(make_coro: Callable[[], Awaitable[Any]]) -> Any:
    """Run ``make_coro()`` to completion from synchronous code, on a fresh loop whose scope
    closes at the end; in a helper thread when this thread already runs a loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make_coro())
    result: list = []

    def target() -> None:
        try:
            result.append((True, asyncio.run(make_coro())))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            result.append((False, exc))

    thread = threading.Thread(target=target, name="aioload-blocking-read")
    thread.start()
    thread.join()
    ok, value = result[0]
    if not ok:
        raise value
    return value
