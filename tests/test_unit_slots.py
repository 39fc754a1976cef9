"""The slot pool (:class:`aioload._handoff.slots.SlotPool`): reuse, the bound, growth, retirement, cleanup.

# unit tests: no worker process

A pool is built over a real :class:`~aioload._handoff.layout.Layout` and real memfd segments; the
``register`` callback (the worker pool's, which sends each new slot's fd to the workers) is a
recorder here, and pinning is off (no device), so ``fence`` must never be asked for an event.
"""

from __future__ import annotations

import os

import pytest

from aioload._handoff.layout import Layout, LeafSpec
from aioload._handoff.slots import SlotPool

pytestmark = pytest.mark.unit  # no worker process, no thread pool: `pytest -m unit` runs these in seconds

ROWS = 8
LEAF = LeafSpec("t", "torch.int64", (4,))  # 32 bytes a row


# ----------------------------------------------------------------------------- helpers
class Recorder:
    """Stands in for the worker pool's ``register`` and for the CUDA fence."""

    def __init__(self):
        self.registered: list[tuple[int, object]] = []
        self.fences = 0

    def register(self, slot_id, segment):
        self.registered.append((slot_id, segment))

    def fence(self):
        self.fences += 1
        return None


def make_pool(target=2, rows=ROWS, overflow=0):
    calls = Recorder()
    pool = SlotPool(Layout([LEAF], rows, overflow), target, calls.register, False, calls.fence)
    return pool, calls


def open_fds() -> dict[int, str]:
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass  # the directory's own fd, closed by now
    return out


def slot_files() -> set[int]:
    """The memfd files of slots this process holds open (by inode: a mapping holds its own fd)."""
    found = set()
    for fd, target in open_fds().items():
        if target.startswith("/memfd:aioload-slot"):
            try:
                found.add(os.stat(f"/proc/self/fd/{fd}").st_ino)
            except OSError:
                pass
    return found


@pytest.fixture
def no_leak():
    """Every memfd and file descriptor a test opens is closed by the time it ends, by
    reference counting alone (no garbage collection: a slot must not wait for one)."""
    before = set(open_fds())
    yield
    assert set(open_fds()) - before == set()


# ----------------------------------------------------------------------------- tests
@pytest.mark.serial  # every /dev/shm entry, before and after
def test_a_new_slot_is_a_registered_memfd_of_the_layouts_size(no_leak):
    pool, calls = make_pool()
    shm_before = set(os.listdir("/dev/shm"))
    slot = pool.acquire()
    assert slot.layout is pool.layout and slot.segment.size == pool.layout.size == 256
    assert calls.registered == [(slot.id, slot.segment)]
    assert os.readlink(f"/proc/self/fd/{slot.segment.fd}").startswith("/memfd:aioload-slot")
    assert set(os.listdir("/dev/shm")) == shm_before, "a slot must not be a /dev/shm file"
    slot.segment.map[:5] = b"batch"  # the registered fd is the memory the slot maps
    assert os.pread(calls.registered[0][1].fd, 5, 0) == b"batch"
    assert not slot.pinned and pool.live == 1 and pool.bytes_in_use == 256 and pool.peak_bytes == 256
    pool.release(slot)
    pool.close()


def test_a_released_slot_is_handed_out_again_without_a_new_segment(no_leak):
    pool, calls = make_pool(target=2)
    first, second = pool.acquire(), pool.acquire()
    assert first.id != second.id
    pool.release(first)
    again = pool.acquire()
    assert again is first and len(calls.registered) == 2 and pool.live == 2
    pool.release(again)
    pool.release(second)
    assert pool.take_retired() == []
    assert calls.fences == 0, "an unpinned slot needs no fence"
    pool.close()


def test_the_pool_keeps_at_most_target_free_slots(no_leak):
    before = slot_files()  # slots of loaders from earlier tests that are not yet collected
    pool, calls = make_pool(target=2)
    slots = [pool.acquire() for _ in range(5)]
    assert pool.live == 5 and pool.peak_bytes == 5 * pool.layout.size
    for slot in slots:
        pool.release(slot)
    assert pool.live == 2 and pool.bytes_in_use == 2 * pool.layout.size
    assert pool.peak_bytes == 5 * pool.layout.size, "the peak is the most ever held at once"
    retired = pool.take_retired()
    assert sorted(retired) == [s.id for s in slots[2:]], "the slots released beyond the target are freed"
    assert all(s.segment.fd == -1 for s in slots[2:]) and all(s.segment.fd >= 0 for s in slots[:2])
    assert pool.take_retired() == [], "take_retired hands each id over once"
    assert len(slot_files() - before) == 2
    reused = [pool.acquire() for _ in range(2)]
    assert {s.id for s in reused} == {slots[0].id, slots[1].id} and len(calls.registered) == 5
    fresh = pool.acquire()
    assert fresh.id not in {s.id for s in slots}, "ids are never reused: workers key slots by id"
    assert pool.live == 3 and pool.peak_bytes == 5 * pool.layout.size
    for slot in reused + [fresh]:
        pool.release(slot)
    pool.close()


def test_grow_rows_makes_later_slots_longer_and_retires_the_old_ones(no_leak):
    pool, _ = make_pool(target=4)
    old_layout = pool.layout
    out, idle = pool.acquire(), pool.acquire()
    pool.release(idle)
    pool.grow_rows(ROWS - 1)
    pool.grow_rows(ROWS)
    assert pool.layout is old_layout, "a batch that fits changes nothing"
    pool.grow_rows(ROWS + 1)
    assert pool.layout.rows == ROWS + ROWS // 4, "a quarter to spare"
    pool.grow_rows(40)
    assert pool.layout.rows == 40 and pool.layout.size == 40 * 32
    slot = pool.acquire()
    assert slot.layout is pool.layout and slot.segment.size == pool.layout.size
    assert slot.id not in (out.id, idle.id), "a free slot of the old layout is not handed out"
    assert pool.take_retired() == [idle.id]
    pool.release(out)
    assert pool.take_retired() == [out.id], "a slot of the old layout is freed when it comes back"
    pool.release(slot)
    assert pool.live == 1 and pool.take_retired() == []
    pool.close()


def test_grow_overflow_fits_the_wanted_bytes_at_least_doubling(no_leak):
    pool, _ = make_pool(overflow=0)
    fixed = pool.layout.fixed_bytes
    pool.grow_overflow(0)
    assert pool.layout.overflow == 0
    pool.grow_overflow(100)
    assert pool.layout.overflow == 128 and pool.layout.size == fixed + 128  # 64-byte aligned
    pool.grow_overflow(129)
    assert pool.layout.overflow == 256, "grown at least twofold"
    pool.grow_overflow(1000)
    assert pool.layout.overflow == 1024
    before = pool.layout
    pool.grow_overflow(1024)
    assert pool.layout is before
    slot = pool.acquire()
    assert slot.segment.size == fixed + 1024
    pool.release(slot)
    pool.close()


def test_grown_rows_keep_the_overflow_per_row():
    pool, _ = make_pool(overflow=8 * 64)
    pool.grow_rows(16)
    assert pool.layout.rows == 16 and pool.layout.overflow == 16 * 64
    pool.close()


def test_close_frees_every_free_slot_and_every_slot_released_later(no_leak):
    pool, _ = make_pool(target=3)
    before = slot_files()
    slots = [pool.acquire() for _ in range(3)]
    pool.release(slots[0])
    assert len(slot_files() - before) == 3
    pool.close()
    assert pool.closed and pool.take_retired() == [slots[0].id]
    assert len(slot_files() - before) == 2, "the slots still out stay open for their batches"
    for slot in slots[1:]:
        pool.release(slot)
    assert slot_files() == before and pool.live == 0
    assert sorted(pool.take_retired()) == [slots[1].id, slots[2].id]


def test_a_slots_memory_outlives_the_pool_while_a_view_holds_it(no_leak):
    pool, _ = make_pool(target=1)
    slot = pool.acquire()
    view = slot.segment.tensor(0, 32, LEAF.torch_dtype, (4,))
    view[:] = 7
    pool.release(slot)
    pool.close()
    assert slot.segment.fd == -1
    assert view.tolist() == [7, 7, 7, 7], "closing the pool must not unmap memory a batch still views"
    del view
