"""Length-prefixed pickled messages over a Unix socket: blocking in workers, asyncio in the engine.

Messages are small (indices, slot offsets, pickled sample skeletons): decoded pixels travel
through shared-memory slots, never through these sockets.
"""

from __future__ import annotations

import pickle
import socket
import struct

_HEADER = struct.Struct("<Q")


def encode(message: object) -> bytes:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(payload)) + payload


def send_blocking(sock: socket.socket, message: object) -> None:
    sock.sendall(encode(message))


class Reader:
    """Messages from one socket: :meth:`read_available` from a loop's reader callback (a
    non-blocking socket), :meth:`recv_blocking` in a worker. Reads whatever has arrived into
    one buffer and parses every complete message in it: one system call per message at most,
    none for a message that is already there, where reading header and body apart would cost
    two."""

    def __init__(self, sock: socket.socket, size: int = 1 << 16):
        self.sock = sock
        self._buf = bytearray(size)
        self._start = 0  # first unparsed byte
        self._end = 0  # one past the last byte received

    def _parse(self):
        start, end = self._start, self._end
        if end - start < _HEADER.size:
            return _INCOMPLETE
        size = _HEADER.unpack_from(self._buf, start)[0]
        stop = start + _HEADER.size + size
        if stop > end:
            return _INCOMPLETE
        message = pickle.loads(memoryview(self._buf)[start + _HEADER.size : stop])
        self._start, self._end = (0, 0) if stop == end else (stop, end)
        return message

    def _room(self) -> None:
        """Move the unparsed tail to the front, or into a new, larger buffer when the message
        it starts is larger than this one."""
        start, end = self._start, self._end
        need = len(self._buf)
        if end - start >= _HEADER.size:
            need = max(need, _HEADER.size + _HEADER.unpack_from(self._buf, start)[0])
        if need > len(self._buf):
            buf = bytearray(max(need, 2 * len(self._buf)))
            buf[: end - start] = self._buf[start:end]
            self._buf = buf
        elif start:
            self._buf[: end - start] = self._buf[start:end]
        self._start, self._end = 0, end - start

    def _space(self) -> memoryview:
        """Where the next bytes go (after making room when the buffer is full)."""
        if self._start or self._end == len(self._buf):
            self._room()
        return memoryview(self._buf)[self._end :]

    def read_available(self) -> list | None:
        """Every complete message that has arrived, oldest first, after one non-blocking read
        (the engine's loop calls this when the socket is readable); ``None`` once the peer has
        gone away and no complete message is left."""
        try:
            n = self.sock.recv_into(self._space())
        except (BlockingIOError, InterruptedError):
            n = -1
        except OSError:
            n = 0
        if n > 0:
            self._end += n
        messages = []
        while (message := self._parse()) is not _INCOMPLETE:
            messages.append(message)
        return None if n == 0 and not messages else messages

    def recv_blocking(self) -> object | None:
        """The next message; ``None`` when the peer has gone away."""
        while True:
            message = self._parse()
            if message is not _INCOMPLETE:
                return message
            try:
                n = self.sock.recv_into(self._space())
            except OSError:
                return None
            if n == 0:
                return None
            self._end += n


_INCOMPLETE = object()
