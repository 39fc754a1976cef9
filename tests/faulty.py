"""Fault injection for tests: datasets over real files whose reads and decodes fail, crash,
hang or find corrupt data on demand.

Every sample is a small file ``sample-00007.bin`` holding a magic header and its index as
int64 values; decode checks the header and returns ``torch.tensor([index] * WIDTH)``, so a
batch says exactly which samples it contains. A fault is chosen per index:

=================  ==========================================================================
``"missing"``      the file is deleted: ``read`` raises ``FileNotFoundError`` (a real one)
``"read-error"``   ``read`` raises ``OSError`` after reading the file
``"read-hang"``    ``read`` never returns (awaits forever, cancellable)
``"corrupt"``      the file's bytes are garbage: decode raises ``ValueError`` (a real check)
``"decode-error"`` decode raises ``ValueError``
``"strict-error"`` decode raises an exception that cannot be unpickled (keyword-only argument)
``"decode-hang"``  decode never returns (the worker sleeps)
``"gil-hang"``     decode never returns, stuck in C code that holds the GIL (libc's ``sleep``)
``"kill"``         the worker kills itself with SIGKILL (what the out-of-memory killer does)
``"segv"``         the worker sends itself SIGSEGV
``"ctypes-segv"``  the worker dereferences a null pointer through ctypes
``"exit"``         the worker calls ``os._exit(3)``
=================  ==========================================================================

With ``once=path``, a fault fires only while the file ``path`` exists, and the first sample
to fire removes it: the next epoch runs clean (a crash that a fresh pool does not repeat).
"""

from __future__ import annotations

import asyncio
import ctypes
import faulthandler
import os
import signal
import struct
import time

import torch

import aioload

MAGIC = b"AIOLOADT"
WIDTH = 4
_BODY = struct.Struct(f"<{WIDTH}q")

READ_FAULTS = frozenset({"missing", "read-error", "read-hang"})
DECODE_FAULTS = frozenset({
    "corrupt", "decode-error", "strict-error", "decode-hang", "gil-hang", "kill", "segv", "ctypes-segv", "exit",
})


class StrictError(Exception):
    """Like many library exceptions, it cannot be rebuilt from its ``args`` when unpickled. Its
    ``__reduce__`` says to rebuild it so, as a library's own may: a process-wide pickling helper
    (``tblib.pickling_support.install()``, which importing Dask's ``distributed`` runs) would
    otherwise rebuild it without ``__init__``, depending on which modules were imported first."""

    def __init__(self, index: int, *, reason: str):
        super().__init__(f"sample {index} rejected: {reason}")

    def __reduce__(self):
        return type(self), self.args


def sample_path(root, index: int) -> str:
    return os.path.join(os.fspath(root), f"sample-{index:05d}.bin")


def write_samples(root, n: int, faults: dict[int, str] | None = None) -> None:
    """Write ``n`` sample files under ``root``; ``"missing"`` files are not written and
    ``"corrupt"`` ones hold garbage."""
    faults = faults or {}
    os.makedirs(root, exist_ok=True)
    for i in range(n):
        path = sample_path(root, i)
        fault = faults.get(i)
        if fault == "missing":
            if os.path.exists(path):
                os.unlink(path)
            continue
        data = b"\x00garbage" * 3 if fault == "corrupt" else MAGIC + _BODY.pack(*([i] * WIDTH))
        with open(path, "wb") as f:
            f.write(data)


def parse(data: bytes, index: int) -> torch.Tensor:
    if data[: len(MAGIC)] != MAGIC or len(data) != len(MAGIC) + _BODY.size:
        raise ValueError(f"sample {index} is corrupt: bad header or length {len(data)}")
    return torch.tensor(_BODY.unpack(data[len(MAGIC) :]), dtype=torch.int64)


def _fires(once: str | None) -> bool:
    if once is None:
        return True
    try:
        os.unlink(once)
    except FileNotFoundError:
        return False
    return True


def crash(fault: str, index: int) -> None:
    """Make the current process fail, die or hang the way ``fault`` says.

    A deliberate segfault first turns ``faulthandler`` off in the worker: pytest enables it,
    forked workers inherit it, and it writes each crashed worker's stacks (fifty lines) to
    the terminal's stderr, past pytest's capture, in the output of a passing run. A segfault
    that nobody planned still prints them (``test_fault_edges`` checks both)."""
    if fault in ("segv", "ctypes-segv"):
        faulthandler.disable()
    if fault == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    elif fault == "ctypes-segv":
        ctypes.string_at(0)
    elif fault == "exit":
        os._exit(3)
    elif fault == "decode-hang":
        while True:
            time.sleep(3600)
    elif fault == "gil-hang":
        libc = ctypes.PyDLL(None)  # a PyDLL call keeps the GIL: no other thread of the worker runs
        while True:
            libc.sleep(3600)
    elif fault == "decode-error":
        raise ValueError(f"decode failed on purpose for index {index}")
    elif fault == "strict-error":
        raise StrictError(index, reason="strict on purpose")


class FaultyDataset(aioload.Dataset):
    """The split protocol over files written by :func:`write_samples`."""

    def __init__(self, root, n: int, faults: dict[int, str] | None = None, once: str | None = None,
                 padding: int = 0):
        self.root = os.fspath(root)
        self.n = n
        self.faults = dict(faults or {})
        self.once = once
        # An optional payload of ``padding`` Python objects: the copy-on-read soak test
        # measures how much of it each worker ends up copying.
        self.padding = list(range(padding)) if padding else None

    def __len__(self) -> int:
        return self.n

    def describe(self, index: int) -> str:
        return sample_path(self.root, index)

    async def read(self, index: int):
        fault = self.faults.get(index)
        data = await aioload.read_bytes(sample_path(self.root, index))
        if fault == "read-error" and _fires(self.once):
            raise OSError(f"injected read failure for index {index}")
        if fault == "read-hang" and _fires(self.once):
            await asyncio.Event().wait()
        return index, data

    def decode(self, raw):
        index, data = raw
        fault = self.faults.get(index)
        if fault in DECODE_FAULTS and fault != "corrupt" and _fires(self.once):
            crash(fault, index)
        return parse(data, index)


class FaultyMapDataset(torch.utils.data.Dataset):
    """A plain torch dataset (``__getitem__`` only) over the same files and faults."""

    def __init__(self, root, n: int, faults: dict[int, str] | None = None, once: str | None = None):
        self.root = os.fspath(root)
        self.n = n
        self.faults = dict(faults or {})
        self.once = once

    def __len__(self) -> int:
        return self.n

    def describe(self, index: int) -> str:
        return sample_path(self.root, index)

    def __getitem__(self, index: int) -> torch.Tensor:
        with open(sample_path(self.root, index), "rb") as f:
            data = f.read()
        fault = self.faults.get(index)
        if fault in DECODE_FAULTS and fault != "corrupt" and _fires(self.once):
            crash(fault, index)
        return parse(data, index)


class CollateFailsOn:
    """A ``collate_fn`` that raises when the batch holds sample ``index``."""

    def __init__(self, index: int):
        self.index = index

    def __call__(self, samples):
        batch = torch.stack(samples)
        if bool((batch[:, 0] == self.index).any()):
            raise KeyError(f"collate refused a batch holding sample {self.index}")
        return batch


def failing_init(worker_id: int) -> None:
    if worker_id == 1:
        raise ConnectionError(f"worker_init_fn failed in worker {worker_id} on purpose")


def hanging_init(worker_id: int) -> None:
    """A ``worker_init_fn`` that never returns (a connection that is never established)."""
    while True:
        time.sleep(3600)


class FaultyBatchedDataset(FaultyMapDataset):
    """Fetches a whole chunk in one ``__getitems__`` call, which fails if any sample does."""

    def __getitems__(self, indices: list) -> list:
        return [self[i] for i in indices]


class HeldDataset(torch.utils.data.Dataset):
    """A plain dataset whose ``__getitem__(held)`` waits until the file ``release`` exists (a
    sample stuck until the test lets it go)."""

    def __init__(self, n: int, held: int, release):
        self.n = n
        self.held = held
        self.release = os.fspath(release)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        while index == self.held and not os.path.exists(self.release):
            time.sleep(0.01)
        return index
