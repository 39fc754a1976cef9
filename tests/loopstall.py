"""How long something held the running event loop, for tests of a client that must never
block it (a long header, a slow parse)."""

from __future__ import annotations

import asyncio


async def longest_stall(until: asyncio.Event) -> float:
    """The longest time the running loop went without running this coroutine, until
    ``until`` is set: how long something held the loop (a few ms when nothing did)."""
    longest, last = 0.0, asyncio.get_running_loop().time()
    while not until.is_set():
        await asyncio.sleep(0.005)
        now = asyncio.get_running_loop().time()
        longest, last = max(longest, now - last), now
    return longest
