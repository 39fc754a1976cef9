"""The shared-memory slot lifecycle: reuse, retained batches, variable shapes, cleanup."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import aioload
from tests.conftest import child_pids
from tests.datasets import Mixed, Numbers, Squares, Varying, pad_collate

ROOT = Path(__file__).resolve().parent.parent


def memfds() -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/memfd:aioload"):
            out.append(target)
    return out


def test_slots_are_reused_across_epochs_and_bounded():
    with aioload.DataLoader(Squares(200), batch_size=8, num_workers=2) as loader:
        for _ in range(4):
            for batch in loader:
                del batch
        slots = loader._res.shared.slots
        assert slots is not None, "a fixed-shape dataset must use shared-memory slots"
        created = next(slots._ids)
        # 25 batches per epoch, 4 epochs: slots are recycled, not made per batch
        assert created <= slots.target + 2, f"{created} slots made for 100 batches"
        assert slots.live <= slots.target


def _mapping_of(address: int) -> str:
    with open("/proc/self/maps") as f:
        for line in f:
            span, *rest = line.split()
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= address < hi:
                return line
    return ""


def test_batches_view_the_slot_without_copy():
    with aioload.DataLoader(Squares(64), batch_size=8, num_workers=1) as loader:
        batches = list(loader)
        assert loader._res.shared.slots is not None
        # every batch but the first (which taught the layout) lives in a memfd slot mapping
        for images, _, _ in batches[1:]:
            assert "memfd:aioload" in _mapping_of(images.data_ptr())
        del batches, images


def test_a_batch_samplers_batches_of_any_length_view_the_slot():
    # A batch sampler has no batch_size: slots are sized by the first batch, and a longer
    # batch later makes longer slots rather than sending its tensors through the sockets.
    lengths = [4, 8, 4, 13, 3, 30, 13]
    starts = [sum(lengths[:k]) for k in range(len(lengths))]
    batches = [list(range(s, s + n)) for s, n in zip(starts, lengths)]
    dataset = Squares(sum(lengths))
    with aioload.DataLoader(dataset, batch_sampler=batches, num_workers=2) as loader:
        for _ in range(2):
            got = list(loader)
            assert [len(images) for images, _, _ in got] == lengths
            for (images, labels, names), indices in zip(got, batches):
                assert torch.equal(images[:, 0, 0], torch.tensor(indices, dtype=torch.float32))
                assert labels.tolist() == indices and list(names) == [f"s{i}" for i in indices]
            for images, _, _ in got[1:]:  # the first batch of the first epoch taught the layout
                assert "memfd:aioload" in _mapping_of(images.data_ptr()), f"a batch of {len(images)} was copied"
        assert loader._res.shared.slots.layout.rows >= max(lengths)
    del got, images


def test_retained_batches_are_never_overwritten():
    # list() keeps every batch: slots cannot be recycled under the consumer's feet.
    dataset = Squares(120)
    with aioload.DataLoader(dataset, batch_size=4, num_workers=2, queue_depth=1) as loader:
        first = list(loader)
        second = list(loader)
    for batches in (first, second):
        for b, (images, labels, names) in enumerate(batches):
            expected = torch.arange(b * 4, b * 4 + 4, dtype=torch.float32)
            assert torch.equal(images[:, 0, 0], expected)
            assert labels.tolist() == expected.long().tolist()
            assert list(names) == [f"s{i}" for i in labels.tolist()]


def test_every_collatable_kind_matches_default_collate():
    dataset = Mixed()
    reference = list(torch.utils.data.DataLoader(dataset, batch_size=6))
    with aioload.DataLoader(dataset, batch_size=6, num_workers=2) as loader:
        for _ in range(2):  # the second epoch runs entirely through slots
            got = list(loader)
            assert len(got) == len(reference)
            for ours, theirs in zip(got, reference):
                assert ours.keys() == theirs.keys()
                for key in ("image", "array", "label", "score"):
                    assert ours[key].dtype == theirs[key].dtype
                    assert torch.equal(ours[key], theirs[key])
                assert ours["name"] == theirs["name"]
                assert type(ours["pair"]) is type(theirs["pair"])
                assert torch.equal(ours["pair"][0], theirs["pair"][0])
                assert torch.equal(ours["pair"][1], theirs["pair"][1])


def test_python_numbers_of_mixed_types_collate_as_default_collate_does():
    dataset = Numbers()
    reference = list(torch.utils.data.DataLoader(dataset, batch_size=4))
    with aioload.DataLoader(dataset, batch_size=4, num_workers=2) as loader:
        for _ in range(2):
            got = list(loader)
            assert len(got) == len(reference)
            for ours, theirs in zip(got, reference):
                for a, b in zip(ours, theirs):
                    assert a.dtype == b.dtype and torch.equal(a, b), (a, b)


def test_a_number_too_large_for_int64_fails_like_default_collate():
    with pytest.raises(Exception) as theirs:
        list(torch.utils.data.DataLoader(Numbers(huge_at=13), batch_size=4))
    with aioload.DataLoader(Numbers(huge_at=13), batch_size=4, num_workers=2) as loader:
        with pytest.raises(Exception) as ours:
            list(loader)
    assert type(ours.value) is type(theirs.value)
    assert str(theirs.value) in str(ours.value)


def test_variable_shapes_fail_like_default_collate():
    with pytest.raises(RuntimeError) as theirs:
        next(iter(torch.utils.data.DataLoader(Varying(), batch_size=4)))
    with aioload.DataLoader(Varying(), batch_size=4, num_workers=2) as loader:
        with pytest.raises(RuntimeError) as ours:
            next(iter(loader))
    assert str(ours.value) == str(theirs.value)


def test_variable_shapes_with_custom_collate_go_through_the_overflow_area():
    dataset = Varying()
    reference = list(torch.utils.data.DataLoader(dataset, batch_size=4, collate_fn=pad_collate))
    with aioload.DataLoader(dataset, batch_size=4, num_workers=2, collate_fn=pad_collate) as loader:
        for _ in range(3):
            got = list(loader)
            assert len(got) == len(reference)
            for (padded, lengths), (ref_padded, ref_lengths) in zip(got, reference):
                assert torch.equal(padded, ref_padded)
                assert torch.equal(lengths, ref_lengths)
        layout = loader._res.shared.slots.layout
    assert layout.overflow > 0, "the overflow area grows to fit the batches that vary"


def dev_shm_mapped_bytes() -> int:
    """Bytes of /dev/shm files this process has mapped."""
    total = 0
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 6 and fields[5].startswith("/dev/shm/"):
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                total += hi - lo
    return total


def test_close_releases_workers_and_shared_memory():
    gc.collect()  # what earlier tests left to the garbage collector is not this test's business
    before = len(memfds())
    shm_before = dev_shm_mapped_bytes()
    loader = aioload.DataLoader(Squares(64), batch_size=8, num_workers=2)
    batches = list(loader)
    assert memfds(), "slots are memfd mappings while the loader runs"
    # batches (8 x 3 x 4 float32, in several slots) never go through /dev/shm; at most a
    # page or two of bookkeeping does
    assert dev_shm_mapped_bytes() - shm_before <= 64 * 1024
    loader.close()
    del batches
    assert not child_pids()
    # freed by reference counting alone, without waiting for the garbage collector
    assert len(memfds()) <= before


class _Copy:
    """Stands in for the CUDA event after a consumer's ``non_blocking`` copy out of a slot."""

    def __init__(self):
        self.done = False
        self.waited = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited = True
        self.done = True


def _pinned_pool(target: int, copies: list, monkeypatch):
    from aioload._handoff import slots as _slots
    from aioload._handoff.layout import Layout, LeafSpec
    from aioload._handoff.slots import SlotPool

    monkeypatch.setattr(_slots, "_cuda_unregister", lambda segment: None)  # no device here

    def fence():
        copies.append(_Copy())
        return copies[-1]

    pool = SlotPool(Layout([LeafSpec("t", "torch.int64", (4,))], 8, 0), target, lambda *a: None, False, fence)

    def acquire():
        slot = pool.acquire()
        slot.pinned = True  # as cudaHostRegister would have made it
        return slot

    return pool, acquire


def test_no_fence_is_made_while_cuda_is_not_in_use():
    # A process that never touched CUDA (none visible here, whatever the machine) has no copy
    # that could be reading a slot: releasing one must not initialise CUDA to make an event.
    code = ("import torch; from aioload._handoff.slots import cuda_fence; "
            "assert cuda_fence() is None; assert not torch.cuda.is_initialized(); print('ok')")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_a_pinned_slot_is_reused_only_after_the_copy_out_of_it_finished(monkeypatch):
    copies: list = []
    pool, acquire = _pinned_pool(4, copies, monkeypatch)
    first = acquire()
    pool.release(first)  # the consumer dropped the batch; its copy is still queued
    second = acquire()
    assert second.id != first.id, "a slot whose copy is pending was handed out again"
    copies[0].done = True
    pool.release(second)  # its own copy is still queued: it cools in turn
    third = acquire()
    assert third.id == first.id, "the slot whose copy finished is the one handed out again"
    fourth = acquire()
    assert fourth.id not in (first.id, second.id), "a slot whose copy is pending was handed out"
    assert not copies[0].waited and not copies[1].waited, "a pool with room must not wait for the device"
    pool.close()
    for slot in (third, fourth):  # the consumer's, released after the close: unmapped then
        pool.release(slot)
    assert pool.live == 0


def test_a_pool_with_every_slot_cooling_waits_for_the_oldest_copy(monkeypatch):
    copies: list = []
    pool, acquire = _pinned_pool(2, copies, monkeypatch)
    slots = [acquire(), acquire()]
    for slot in slots:
        pool.release(slot)
    again = acquire()
    assert copies[0].waited and again.id == slots[0].id
    assert pool.live == 2, "no slot may be made while the device is a whole queue behind"
    pool.close()
    assert copies[1].waited, "close() unmapped a slot a copy was still reading"
    assert pool.live == 1  # the slot still out is the consumer's until it is released
    pool.release(again)
    assert pool.live == 0
