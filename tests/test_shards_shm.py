"""Window mode's shards in shared memory (``aioload._handoff.shared``): a remote shard is
received into a memfd that the workers map, and a read hands over only where its sample lies
in it. What arrives is what the shards hold, the batches are those of the same dataset read
from local files, a shard's memory goes once its last sample is decoded, and nothing is left
mapped or open after an epoch, ``break``, ``close()``, an error or Ctrl-C, in the training
process or in its workers."""

from __future__ import annotations

import asyncio
import gc
import os
import pickle
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import aioload
from aioload._handoff import shared as _shared
from tests.httpserver import Server
from tests.resources import gone, shm_entries, wait_until
from tests.shards_data import fingerprint, image_samples, webdataset_reads, write_webdataset

SHARD = "memfd:aioload-shard"


def shard_memory(pid: int | str = "self") -> tuple[int, int]:
    """``(descriptors, mappings)`` of window mode's shard memory in process ``pid``."""
    fds = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            fds += SHARD in os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue
    with open(f"/proc/{pid}/maps") as f:
        maps = sum(1 for line in f if SHARD in line)
    return fds, maps


def none_left(pids) -> bool:
    gc.collect()
    return all(shard_memory(pid) == (0, 0) for pid in pids)


@pytest.fixture(scope="module")
def folder(image_root, tmp_path_factory):
    root = tmp_path_factory.mktemp("shm-shards")
    write_webdataset(image_samples(image_root), root, 10)  # 48 images: 5 shards
    return root


@pytest.fixture(scope="module")
def server(folder):
    with Server(folder) as s:
        yield s


pytestmark = pytest.mark.usefixtures("private_cache")  # indexes kept in the test's own folder


def remote(server, **kwargs) -> aioload.WebDataset:
    return aioload.WebDataset(server.url("wds-{000000..000004}.tar"), decode=fingerprint, window=2, **kwargs)


def loader_of(ds, workers: int, **kwargs) -> aioload.DataLoader:
    return aioload.DataLoader(ds, shuffle=True, seed=3, batch_size=4, num_workers=workers, **kwargs)


def test_a_read_hands_over_where_the_sample_lies_not_its_bytes(server, folder):
    ds = remote(server)

    async def read(index):
        return await ds.read(index)

    raw, index = asyncio.run(read(7))
    assert isinstance(raw, _shared.SharedRange) and index == 7
    assert len(raw) == ds._ends[7] - ds._starts[7] > 1000
    with _shared.collecting() as segments:
        message = pickle.dumps((raw, index), protocol=pickle.HIGHEST_PROTOCOL)
    assert len(message) < 200 and [s.id for s in segments] == [raw.owner.id]  # the segment's id, offset, length
    # anywhere else a range pickles as its bytes (what the sample's range holds in the shard)
    with open(folder / "wds-000000.tar", "rb") as f:
        f.seek(int(ds._starts[7]))
        assert pickle.loads(pickle.dumps(raw)) == f.read(len(raw))
    del raw, segments
    assert none_left(["self"])  # the loop of asyncio.run ended: its shards went with it


@pytest.mark.parametrize("workers", [0, 2])
def test_samples_arrive_intact_and_batches_are_those_of_local_reads(server, folder, workers):
    reference = webdataset_reads(str(folder / "wds-{000000..000004}.tar"))
    local = aioload.WebDataset(str(folder / "wds-{000000..000004}.tar"), decode=fingerprint, window=2)
    with loader_of(local, workers) as loader:
        expected = [[tuple(x) for x in zip(k, d, c.tolist())] for k, d, c in loader]
    ds = remote(server)
    with loader_of(ds, workers) as loader:
        for epoch in range(2):  # the second epoch on the workers that mapped the first's shards
            got = [[tuple(x) for x in zip(k, d, c.tolist())] for k, d, c in loader]
            if epoch == 0:
                assert got == expected  # the same batches, in the same order
                stats = loader.stats()
        pids = [p.pid for p in loader._res.pool.procs] if workers else []
        assert {k: (d, c) for batch in got for k, d, c in batch} == reference
        # between epochs nothing is held: not in this process, not in the workers still running
        assert stats.shard_fetches == 5 and stats.shard_window_bytes == 0
        wait_until(lambda: none_left(["self", *pids]), 10, "every shard's memory to go")


def test_a_shards_memory_goes_when_its_last_sample_is_decoded():
    released = []
    pool = _shared.SharedPool(spare=1, name="aioload-shard", on_release=released.append)
    data = bytes(range(256)) * 40
    held = pool.take(len(data))
    _shared.SharedPool.fill(held, data)
    first, last = held.range(0, 100), held.range(len(data) - 100, 100)
    assert bytes(first.view()) == data[:100] and bytes(last.view()) == data[-100:]
    del held  # the window let go after its last read was served: the samples are still on their way
    assert released == [] and shard_memory() != (0, 0)
    del first
    assert released == []
    del last  # the last one decoded
    assert released == [len(data)]
    kept = shard_memory()
    assert kept != (0, 0)  # kept for the next shard, its pages already made
    again = pool.take(len(data) + 4096)  # grows the memfd kept
    assert shard_memory() == kept
    del again
    pool.close()
    assert shard_memory() == (0, 0) and released == [len(data), len(data) + 4096]


def test_the_window_counts_a_shard_until_its_last_sample_is_decoded(server):
    ds = remote(server, fetch_ahead=0)
    sizes = ds.shard_sizes.tolist()
    with aioload.DataLoader(ds, shuffle=True, seed=3, batch_size=2, num_workers=2, prefetch_factor=1,
                            io_concurrency=2) as loader:
        list(loader)
        stats = loader.stats()
    # shards are let go during the epoch, not all kept to its end
    assert 0 < stats.shard_window_peak_bytes < sum(sizes)
    assert stats.shard_window_bytes == 0 and none_left(["self"])


@pytest.mark.parametrize("workers", [0, 2])
def test_nothing_is_left_after_break_or_close(server, workers):
    shm_before = shm_entries()
    ds = remote(server)
    loader = loader_of(ds, workers, persistent_workers=workers > 0)  # workers kept: are they left holding shards?
    for i, _ in enumerate(loader):
        if i == 2:
            pids = [p.pid for p in loader._res.pool.procs] if workers else []
            break
    # persistent workers are kept past the break, unless their tasks in flight did not drain
    # within the engine's drain timeout (a loaded machine): then the pool goes, as designed
    if loader._res.pool is not None:
        assert all(not gone(pid) for pid in pids)
    else:
        wait_until(lambda: all(gone(pid) for pid in pids), 10, "the workers of a pool that did not drain to go")
    wait_until(lambda: none_left(["self", *pids]), 10, "the shards of the epoch left by break to go")
    assert ds._window.held_bytes == 0
    for i, _ in enumerate(loader):  # the next epoch runs as usual
        if i == 1:
            break
    loader.close()
    wait_until(lambda: none_left(["self"]), 10, "the shards to go with close()")
    assert all(gone(pid) for pid in pids) and shm_entries() <= shm_before


class Broken(Exception):
    pass


def explode(sample):
    if sample["__key__"].endswith("3"):
        raise Broken(sample["__key__"])
    return fingerprint(sample)


@pytest.mark.parametrize("raised", ["decode", "keyboard"])
def test_nothing_is_left_after_an_error_or_ctrl_c_in_the_loop(server, raised):
    ds = aioload.WebDataset(server.url("wds-{000000..000004}.tar"), window=2,
                            decode=explode if raised == "decode" else fingerprint)
    with loader_of(ds, 2, persistent_workers=True) as loader:
        pids = []
        with pytest.raises(Broken if raised == "decode" else KeyboardInterrupt):
            for i, _ in enumerate(loader):
                pids = [p.pid for p in loader._res.pool.procs]
                assert not raised == "decode"  # the broken sample is in the first batch
                if raised == "keyboard" and i == 1:
                    raise KeyboardInterrupt  # what Ctrl-C raises in the training loop
        wait_until(lambda: none_left(["self", *pids]), 10, "the shards to go after the epoch failed")
    assert all(gone(pid) for pid in pids)


def crash(sample):
    if sample["__key__"].endswith("5"):
        os._exit(3)  # a worker dies in native code, or is killed
    return fingerprint(sample)


def test_nothing_is_left_after_a_worker_crashes(server):
    ds = aioload.WebDataset(server.url("wds-{000000..000004}.tar"), window=2, decode=crash)
    with loader_of(ds, 2) as loader:
        with pytest.raises(aioload.WorkerCrashedError):
            for _ in loader:
                pass
        wait_until(lambda: none_left(["self"]), 10, "the shards to go after a worker crashed")
    assert ds._window.held_bytes == 0


CHILD = textwrap.dedent("""
    import os, signal, sys, time
    # Ctrl-C raises KeyboardInterrupt here even where the suite runs as a background job, whose
    # children start with SIGINT ignored (and Python then leaves it ignored)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.path.insert(0, {root!r})
    import aioload
    from tests.shards_data import fingerprint
    from tests.test_shards_shm import none_left

    ds = aioload.WebDataset({pattern!r}, decode=fingerprint, window=2)
    loader = aioload.DataLoader(ds, shuffle=True, seed=3, batch_size=4, num_workers=2, persistent_workers=True)
    try:
        for i, batch in enumerate(loader):
            if i == 1:
                pids = [p.pid for p in loader._res.pool.procs]
                print(" ".join(map(str, pids)), flush=True)
            time.sleep(0.5)  # the training step, where Ctrl-C lands
    except KeyboardInterrupt:
        del batch
        deadline = time.monotonic() + 10
        while not none_left(["self", *pids]) and time.monotonic() < deadline:
            time.sleep(0.05)
        print("clean" if none_left(["self", *pids]) else "left", flush=True)
        loader.close()
""")


def test_ctrl_c_leaves_no_shard_memory_in_the_process_nor_its_workers(server, tmp_path):
    shm_before = shm_entries()
    script = tmp_path / "child.py"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script.write_text(CHILD.format(root=root, pattern=server.url("wds-{000000..000004}.tar")))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal does: the whole process group
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert (out.strip(), err, proc.returncode) == ("clean", "", 0)
    wait_until(lambda: all(gone(pid) for pid in pids), 10, "the workers to exit")
    assert shm_entries() <= shm_before


def test_tasks_carry_no_sample_bytes(server, monkeypatch):
    """What the training process sends the workers: task messages of a few bytes per sample,
    each shard's descriptor beside them."""
    from aioload._workers import wire

    sizes = []
    encode = wire.encode

    def counted(message):
        data = encode(message)
        if type(message).__name__ == "Task":
            sizes.append((len(data), len(message.work.items)))
        return data

    monkeypatch.setattr(wire, "encode", counted)
    ds = remote(server)
    with loader_of(ds, 2) as loader:
        rows = [k for keys, _, _ in loader for k in keys]
    assert sorted(rows) == sorted(ds.key(i) for i in range(len(ds)))
    smallest = int(min(ds._ends - ds._starts))
    assert sizes and all(size < 200 + 100 * items < smallest * items for size, items in sizes if items)
    assert torch.tensor([items for _, items in sizes]).sum().item() == len(ds)
