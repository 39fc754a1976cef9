"""Anonymous shared memory segments, passed to workers as file descriptors.

On Linux a segment is a ``memfd``: it never appears in /dev/shm, is not limited by the size of
/dev/shm (a container's 64 MB default does not apply), and cannot outlive the processes that
map it, even after SIGKILL. Elsewhere an unlinked temporary file plays the same role.
"""

from __future__ import annotations

import mmap
import os
import socket
import tempfile

import numpy as np
import torch


def anonymous_fd(size: int, name: str) -> int:
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
    else:  # pragma: no cover - non-Linux
        handle = tempfile.TemporaryFile(prefix="aioload-")
        fd = os.dup(handle.fileno())
        handle.close()
    os.ftruncate(fd, size)
    return fd


class Segment:
    """One shared mapping of ``size`` bytes. The creator passes ``fd`` to other processes."""

    def __init__(self, fd: int, size: int, *, owns_fd: bool = True):
        self.fd = fd
        self.size = size
        self.map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._owns_fd = owns_fd
        self._bytes = torch.from_numpy(np.frombuffer(self.map, dtype=np.uint8))

    @classmethod
    def create(cls, size: int, name: str = "aioload-slot") -> "Segment":
        return cls(anonymous_fd(max(size, 1), name), max(size, 1))

    @property
    def address(self) -> int:
        return self._bytes.data_ptr()

    def tensor(self, offset: int, nbytes: int, dtype: torch.dtype, shape) -> torch.Tensor:
        """A view of ``nbytes`` at ``offset`` as a tensor (writes go to the shared memory)."""
        return self._bytes[offset : offset + nbytes].view(dtype).view(shape)

    def close(self) -> None:
        """Drop this process's handle; the memory is freed once no mapping or view remains."""
        if self._owns_fd and self.fd >= 0:
            os.close(self.fd)
        self.fd = -1
        self._bytes = None
        # The mmap itself is left to the garbage collector: tensors handed to the user may
        # still view it, and the kernel frees the pages when the last mapping goes away.
        self.map = None


def send_fd(sock: socket.socket, fd: int, header: bytes) -> None:
    socket.send_fds(sock, [header], [fd])


def recv_fd(sock: socket.socket, header_size: int) -> tuple[bytes, int]:
    msg, fds, _flags, _addr = socket.recv_fds(sock, header_size, 1)
    if not fds:
        raise ConnectionError("the loader closed the control channel")
    return msg, fds[0]
