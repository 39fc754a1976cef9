"""The worker process: receives tasks, decodes samples, writes them into shared-memory slots.

A worker gets its copy of the dataset once, when it starts. It then serves tasks until the
loader stops it or its socket closes (the parent went away): a worker never outlives its loader.
"""

from __future__ import annotations

import os
import signal
import struct
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.utils.data._utils.worker as torch_worker

from aioload import _wire
from aioload._errors import pack_exception
from aioload._layout import Layout, SlotWriter
from aioload._seeding import derive_seed, seed_everything
from aioload._shm import Segment, recv_fd

SLOT_HEADER = struct.Struct("<qq")


@dataclass
class WorkerConfig:
    """What every worker needs, delivered once at start-up."""

    dataset: Any
    num_workers: int
    split: bool
    iterable: bool
    auto_collation: bool
    collate_fn: Callable | None
    batch_size: int | None
    drop_last: bool
    worker_init_fn: Callable | None
    base_seed: int


def _batched_fetch(ds) -> bool:
    """Whether ``ds`` really fetches in batches (``Subset`` merely forwards to its dataset)."""
    if getattr(ds, "__getitems__", None) is None:
        return False
    if isinstance(ds, torch.utils.data.Subset):
        return _batched_fetch(ds.dataset)
    return True


def _set_worker_info(worker_id: int, cfg: WorkerConfig, seed: int) -> None:
    torch_worker._worker_info = torch_worker.WorkerInfo(
        id=worker_id, num_workers=cfg.num_workers, seed=seed, dataset=cfg.dataset
    )


class _Worker:
    def __init__(self, worker_id: int, cfg: WorkerConfig, sock, ctrl):
        self.id = worker_id
        self.cfg = cfg
        self.sock = sock
        self.ctrl = ctrl
        self.segments: dict[int, Segment] = {}
        self.base_seed = cfg.base_seed
        self.per_sample_seeds = True
        self.iterator = None

    # -- set-up -------------------------------------------------------------------------
    def start_epoch(self, base_seed: int, per_sample_seeds: bool) -> None:
        self.base_seed = base_seed
        self.per_sample_seeds = per_sample_seeds
        seed = base_seed + self.id
        seed_everything(seed)
        _set_worker_info(self.id, self.cfg, seed)
        self.iterator = None

    def segment(self, slot_id: int) -> Segment:
        seg = self.segments.get(slot_id)
        while seg is None:
            header, fd = recv_fd(self.ctrl, SLOT_HEADER.size)
            sid, size = SLOT_HEADER.unpack(header)
            self.segments[sid] = Segment(fd, size)
            seg = self.segments.get(slot_id)
        return seg

    def drop(self, slot_ids) -> None:
        for sid in slot_ids:
            seg = self.segments.pop(sid, None)
            if seg is not None:
                seg.close()

    def writer(self, slot) -> SlotWriter:
        if slot is None:
            return SlotWriter(None, None, None)
        slot_id, layout_desc, overflow = slot
        leaves, rows, ovf = layout_desc
        return SlotWriter(self.segment(slot_id), Layout(leaves, rows, ovf), overflow)

    # -- the work ------------------------------------------------------------------------
    def load(self, index, raw):
        ds = self.cfg.dataset
        if self.per_sample_seeds and index is not None:
            seed_everything(derive_seed(self.base_seed, index if isinstance(index, int) else hash(index)))
        if self.cfg.split:
            return ds.decode(raw)
        return ds[index]

    def stage(self) -> str:
        return "decode" if self.cfg.split else "__getitem__"

    def run_rows(self, task_id, slot, items, row0):
        writer = self.writer(slot)
        payloads, errors = [], []
        ds = self.cfg.dataset
        started = time.perf_counter()
        samples = None
        if not self.cfg.split and _batched_fetch(ds):
            try:
                if self.per_sample_seeds:
                    seed_everything(derive_seed(self.base_seed, items[0][0]))
                samples = ds.__getitems__([i for i, _ in items])
            except Exception as exc:  # noqa: BLE001 - reported to the consumer with its index
                errors.append((0, items[0][0], "__getitems__", pack_exception(exc)))
                return ("done", task_id, [None] * len(items), errors, None, 0, time.perf_counter() - started)
        for pos, (index, raw) in enumerate(items):
            try:
                sample = samples[pos] if samples is not None else self.load(index, raw)
                payloads.append(writer.dump(sample, row0 + pos))
            except Exception as exc:  # noqa: BLE001
                payloads.append(None)
                errors.append((pos, index, self.stage(), pack_exception(exc)))
        specs = writer.first_specs if slot is None else None
        seconds = time.perf_counter() - started
        return ("done", task_id, payloads, errors, specs, writer.overflow_wanted, seconds)

    def run_whole(self, task_id, slot, items, skip_errors: bool):
        writer = self.writer(slot)
        started = time.perf_counter()
        samples, errors = [], []
        for pos, (index, raw) in enumerate(items):
            try:
                samples.append(self.load(index, raw))
            except Exception as exc:  # noqa: BLE001
                errors.append((pos, index, self.stage(), pack_exception(exc)))
        if errors and not skip_errors:
            return ("done", task_id, [None], errors, None, 0, time.perf_counter() - started)
        return self.finish_batch(task_id, slot, writer, samples, errors, started, items[0][0] if items else None)

    def finish_batch(self, task_id, slot, writer, samples, errors, started, index):
        cfg = self.cfg
        try:
            if cfg.auto_collation:
                batch = cfg.collate_fn(samples)
            else:
                batch = cfg.collate_fn(samples[0])
            payload = writer.dump(batch, 0)
        except Exception as exc:  # noqa: BLE001
            errors.append((0, index, "collate_fn", pack_exception(exc)))
            payload = None
        specs = writer.first_specs if slot is None else None
        seconds = time.perf_counter() - started
        return ("done", task_id, [payload], errors, specs, writer.overflow_wanted, seconds)

    def run_iter(self, task_id, slot):
        cfg = self.cfg
        started = time.perf_counter()
        try:
            if self.iterator is None:
                self.iterator = iter(cfg.dataset)
            if cfg.auto_collation:
                samples = []
                for _ in range(cfg.batch_size):
                    try:
                        samples.append(next(self.iterator))
                    except StopIteration:
                        break
                if not samples or (cfg.drop_last and len(samples) < cfg.batch_size):
                    return ("stop", task_id)
            else:
                samples = [next(self.iterator)]
        except StopIteration:
            return ("stop", task_id)
        except Exception as exc:  # noqa: BLE001
            errors = [(0, None, "__iter__", pack_exception(exc))]
            return ("done", task_id, [None], errors, None, 0, time.perf_counter() - started)
        return self.finish_batch(task_id, slot, self.writer(slot), samples, [], started, None)

    def serve(self) -> None:
        while True:
            msg = _wire.recv_blocking(self.sock)
            if msg is None or msg[0] == "stop":
                return
            kind = msg[0]
            if kind == "epoch":
                self.start_epoch(msg[1], msg[2])
                continue
            if kind == "drop":
                self.drop(msg[1])
                continue
            _, task_id, slot, payload, drops = msg
            self.drop(drops)
            if kind == "rows":
                items, row0 = payload
                reply = self.run_rows(task_id, slot, items, row0)
            elif kind == "whole":
                items, skip_errors = payload
                reply = self.run_whole(task_id, slot, items, skip_errors)
            elif kind == "iter":
                reply = self.run_iter(task_id, slot)
            else:  # pragma: no cover - a bug in the engine
                raise RuntimeError(f"unknown task kind {kind!r}")
            _wire.send_blocking(self.sock, reply)


def worker_main(worker_id: int, cfg: WorkerConfig, sock, ctrl, inherited=()) -> None:
    """Entry point of a worker process."""
    # A forked worker inherits the parent's ends of its siblings' sockets: close them, so
    # that each socket reports end-of-stream as soon as its real peer is gone.
    for other in inherited:
        other.close()
    # Ctrl-C is the parent's business: it stops the workers in order.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    worker = _Worker(worker_id, cfg, sock, ctrl)
    worker.start_epoch(cfg.base_seed, per_sample_seeds=False)
    try:
        if cfg.worker_init_fn is not None:
            cfg.worker_init_fn(worker_id)
    except Exception as exc:  # noqa: BLE001
        _wire.send_blocking(sock, ("init_error", pack_exception(exc)))
        return
    _wire.send_blocking(sock, ("ready", os.getpid()))
    try:
        worker.serve()
    except (BrokenPipeError, ConnectionResetError):
        pass
    finally:
        worker.drop(list(worker.segments))
