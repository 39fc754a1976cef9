"""Length-prefixed pickled messages over a Unix socket: blocking in workers, asyncio in the engine.

Messages are mostly small (indices, slot offsets, pickled sample skeletons): decoded pixels
travel through shared-memory slots, never through these sockets. What ``Dataset.read`` returned
(a remote file's bytes) does travel here, to the worker that decodes it.
"""

from __future__ import annotations

import pickle
import socket
import struct

_HEADER = struct.Struct("<Q")

SHRINK_AFTER = 8
"""Smaller messages in a row after which a reader's grown buffer goes back to its first size."""


def encode(message: object) -> bytes:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(payload)) + payload


def send_blocking(sock: socket.socket, message: object) -> None:
    sock.sendall(encode(message))


def unsendable(error: Exception, indices) -> TypeError:
    """The error of a task that could not be pickled (``error``) for dataset ``indices``."""
    exc = TypeError(f"the task for dataset indices {list(indices)} cannot be pickled to reach a "
                    f"worker process ({type(error).__name__}: {error}); a sampler's indices and "
                    "what read() returns must pickle")
    exc.__cause__ = error
    return exc


class Reader:
    """Messages from one socket: :meth:`read_available` from a loop's reader callback (a
    non-blocking socket), :meth:`recv_blocking` in a worker. Reads whatever has arrived into
    one buffer and parses every complete message in it: one system call per message at most,
    none for a message that is already there, where reading header and body apart would cost
    two."""

    def __init__(self, sock: socket.socket, size: int = 1 << 16):
        self.sock = sock
        self._size = size  # the capacity a grown buffer returns to
        self._buf = bytearray(size)
        self._start = 0  # first unparsed byte
        self._end = 0  # one past the last byte received
        self._small = 0  # messages in a row that needed at most half of a grown buffer

    @property
    def capacity(self) -> int:
        """Bytes the buffer holds now: the initial size, or more while large messages come."""
        return len(self._buf)

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
        self._fit(stop - start)
        return message

    def _fit(self, size: int) -> None:
        """Give a buffer grown for a large message back once ``SHRINK_AFTER`` messages in a
        row have needed at most half of it: a worker that was sent one large task must not
        hold that much memory for the rest of its life, and a stream of large tasks must not
        reallocate the buffer for each."""
        if len(self._buf) == self._size:
            return
        self._small = self._small + 1 if 2 * size <= len(self._buf) else 0
        if self._small >= SHRINK_AFTER and self._start == self._end:
            self._buf = bytearray(self._size)
            self._small = 0

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
