"""Length-prefixed pickled messages over a Unix socket: blocking in workers, asyncio in the engine.

Messages are small (indices, slot offsets, pickled sample skeletons): decoded pixels travel
through shared-memory slots, never through these sockets.
"""

from __future__ import annotations

import asyncio
import pickle
import socket
import struct

_HEADER = struct.Struct("<Q")


def encode(message: object) -> bytes:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(payload)) + payload


def _recv_exact_blocking(sock: socket.socket, size: int) -> bytearray | None:
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            return None
        got += n
    return buf


def recv_blocking(sock: socket.socket) -> object | None:
    """Receive one message; ``None`` when the peer has gone away."""
    try:
        head = _recv_exact_blocking(sock, _HEADER.size)
        if head is None:
            return None
        body = _recv_exact_blocking(sock, _HEADER.unpack(head)[0])
    except (ConnectionResetError, BrokenPipeError, OSError):
        return None
    if body is None:
        return None
    return pickle.loads(body)


def send_blocking(sock: socket.socket, message: object) -> None:
    sock.sendall(encode(message))


async def _recv_exact(loop: asyncio.AbstractEventLoop, sock: socket.socket, size: int):
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        n = await loop.sock_recv_into(sock, view[got:])
        if n == 0:
            return None
        got += n
    return buf


async def recv(sock: socket.socket) -> object | None:
    """Receive one message on the running loop; ``None`` at end of stream."""
    loop = asyncio.get_running_loop()
    try:
        head = await _recv_exact(loop, sock, _HEADER.size)
        if head is None:
            return None
        body = await _recv_exact(loop, sock, _HEADER.unpack(head)[0])
    except (ConnectionResetError, BrokenPipeError):
        return None
    return None if body is None else pickle.loads(body)


async def send(sock: socket.socket, message: object) -> None:
    await asyncio.get_running_loop().sock_sendall(sock, encode(message))
