"""GPU check: the device path on a real GPU, and JPEG decode on the GPU.

Run on a machine with a CUDA GPU (about 5 minutes on one GPU with 16 CPU cores):

    PYTHONPATH=. python3 benchmarks/gpu_check.py [--steps 60] [--batch-size 256] [--workers N]

Prints one table of training-loop rates (ResNet-18, channels_last, bf16 autocast), each as a
share of the same loop fed by one synthetic batch kept on the device:

* aioload over in-memory uint8 images (the data path alone: hand-off, page-locked slots,
  side-stream copy), with the fraction of copy time that overlapped training steps;
* JPEG decode + RandomResizedCrop + flip in the workers: aioload with ``device="cuda"``, and
  torch's DataLoader with ``pin_memory=True`` and ``.cuda(non_blocking=True)``;
* the same JPEGs with ``decode_device="cuda"``: batched nvJPEG decode and the transforms on
  the GPU (with all workers, and with 2);
* decode throughput alone: batched nvJPEG + RandomResizedCrop on the device against the same
  decode on every CPU core (one process each, no loader).

Then the checks: ``device="cuda"`` batches equal the CPU's byte for byte, also while the
consumer's stream is busy with long kernels; with ``pin_memory=True`` the consumer's own
``non_blocking`` copies read what the batch held (no slot reused under a copy); nvJPEG
batches against the CPU decode (labels equal, pixels close). A measurement that fails prints
its error in its row; the others still run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from torchvision.transforms import v2

import aioload
from aioload._handoff import device as _device
from aioload._tools.bench import BenchImages, ceiling, environment, rrc_flip
from aioload._data.synth import make_image_folder

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


class MemoryImages(torch.utils.data.Dataset):
    """Preloaded uint8 images: a random 224 crop per sample, no decode (isolates the data path)."""

    def __init__(self, n: int = 512, size: int = 256, repeat: int = 64):
        g = torch.Generator().manual_seed(0)
        self.images = torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, generator=g)
        self.repeat = repeat

    def __len__(self) -> int:
        return len(self.images) * self.repeat

    def __getitem__(self, i):
        image = self.images[i % len(self.images)]
        y, x = torch.randint(0, image.shape[1] - 224, (2,)).tolist()
        return image[:, y:y + 224, x:x + 224].clone(), i % 1000


class TimedTransfer(_device.Transfer):
    """Records timing events around every copy (for the overlap figure)."""

    spans: list = []

    def start(self, batch):
        begin = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            begin.record(self.stream)
        out, event = super().start(batch)
        end = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            end.record(self.stream)
        TimedTransfer.spans.append((begin, end))
        return out, event


def make_model(device):
    import torchvision

    model = torchvision.models.resnet18(num_classes=1000).to(device).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, opt


def train(batches, steps: int, device, normalize, step_spans=None):
    """Run ``steps`` training steps (after 10 warm-up steps); returns steps/s."""
    model, opt = make_model(device)
    loss_fn = torch.nn.CrossEntropyLoss()
    it = iter(batches)
    done = 0
    start = None
    for images, labels in it:
        if done == 10:
            torch.cuda.synchronize()
            start = time.perf_counter()
        begin = torch.cuda.Event(enable_timing=True) if step_spans is not None else None
        if begin is not None:
            begin.record()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            x = normalize(images)
            loss = loss_fn(model(x), labels.to(device, non_blocking=True))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if begin is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            step_spans.append((begin, end))
        done += 1
        if done >= steps + 10:
            break
    torch.cuda.synchronize()
    return steps / (time.perf_counter() - start)


def overlap(copies, steps) -> float:
    """Fraction of copy time that fell inside some training step (event timestamps)."""
    if not copies or not steps:
        return float("nan")
    base = copies[0][0]
    cs = [(base.elapsed_time(a), base.elapsed_time(b)) for a, b in copies]
    ss = [(base.elapsed_time(a), base.elapsed_time(b)) for a, b in steps]
    covered = total = 0.0
    for lo, hi in cs:
        total += hi - lo
        for slo, shi in ss:
            covered += max(0.0, min(hi, shi) - max(lo, slo))
    return covered / total if total else float("nan")


def section(rows: list, name: str, work: Callable[[], tuple]) -> None:
    """Run one measurement; a failure becomes its row (the rest of the table still runs)."""
    try:
        rows.append((name, *work()))
    except Exception as exc:  # noqa: BLE001 - reported in the table
        rows.append((name, float("nan"), float("nan"), f"FAILED: {type(exc).__name__}: {exc}"[:160]))
    print(f"  {rows[-1][0]}: {rows[-1][3] or 'done'}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60, help="timed training steps per feed (default: 60)")
    parser.add_argument("--batch-size", type=int, default=256, help="images per batch (default: 256)")
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2),
                        help="worker processes for every loader (default: CPUs - 2)")
    parser.add_argument("--images", type=int, default=4096, help="generated JPEGs (default: 4096)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    torch.backends.cudnn.benchmark = True
    normalize = aioload.transforms.Normalize(MEAN, STD, channels_last=True).to(device)
    bs, w = args.batch_size, args.workers
    rows: list = []
    checks: list = []
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; {environment()}; batch {bs}, {w} workers",
          flush=True)

    # 1. synthetic: one batch already on the device
    images = torch.randint(0, 256, (bs, 3, 224, 224), dtype=torch.uint8, device=device)
    labels = torch.randint(0, 1000, (bs,), device=device)
    synthetic = train(iter(lambda: (images, labels), None), args.steps, device, normalize)
    rows.append(("synthetic (batch on device)", synthetic, 1.0, "ResNet-18, channels_last, bf16 autocast"))

    # 2. correctness: device= batches against the CPU's, byte for byte; pinned reuse
    def device_equal(busy: bool):
        intact, total = device_batches_equal(device, w, busy)
        return f"{intact} of {total} batches equal to the CPU's" + (" (consumer stream busy)" if busy else "")

    for busy in (False, True):
        section(checks, f"device='cuda' batches{' , busy stream' if busy else ''}", lambda: (0, 0, device_equal(busy)))
    section(checks, "pin_memory=True, own non_blocking copies",
            lambda: (0, 0, "{} of {} batches intact".format(*pinned_reuse(device, w))))

    # 3. aioload, in-memory images: the data path alone, with copy/compute overlap measured
    def in_memory():
        _device.Transfer = TimedTransfer
        import aioload._front.loader as loader_module
        loader_module._device.Transfer = TimedTransfer
        spans: list = []
        with aioload.DataLoader(MemoryImages(), batch_size=bs, shuffle=True, num_workers=w, device=device,
                                pin_memory=True, drop_last=True, persistent_workers=True) as loader:
            rate = train(_cycle(loader), args.steps, device, normalize, spans)
            slots = loader._res.shared.slots
            pinned = slots is not None and all(s.pinned for s in slots._free)
            wait = loader.stats().wait_fraction
        ov = overlap(TimedTransfer.spans[-len(spans):], spans)
        return rate, rate / synthetic, f"wait {wait:.0%}, copy/compute overlap {ov:.0%}, slots page-locked {pinned}"

    section(rows, "aioload, in-memory uint8", in_memory)

    # 4. JPEGs: CPU decode in the workers (aioload, torch) and nvJPEG decode (aioload)
    root = make_image_folder(images=args.images, processes=os.cpu_count() or 1)
    dataset = BenchImages(root, rrc_flip())

    def aioload_cpu():
        with aioload.DataLoader(dataset, batch_size=bs, shuffle=True, num_workers=w, device=device,
                                drop_last=True, persistent_workers=True) as loader:
            rate = train(_cycle(loader), args.steps, device, normalize)
            wait = loader.stats().wait_fraction
        return rate, rate / synthetic, f"wait {wait:.0%}"

    def torch_cpu():
        loader = torch.utils.data.DataLoader(dataset, batch_size=bs, shuffle=True, num_workers=w,
                                             pin_memory=True, drop_last=True, persistent_workers=True)
        rate = train(_cycle(_to_device(loader, device)), args.steps, device, normalize)
        return rate, rate / synthetic, "pin_memory=True, .cuda(non_blocking=True)"

    def aioload_gpu(workers: int):
        def run():
            ds = aioload.ImageFolder(root, rrc_flip(), decode_device=device)
            with aioload.DataLoader(ds, batch_size=bs, shuffle=True, num_workers=workers, drop_last=True,
                                    persistent_workers=workers > 0) as loader:
                rate = train(_cycle(loader), args.steps, device, normalize)
                wait = loader.stats().wait_fraction
            return rate, rate / synthetic, f"decode_device='cuda', {workers} workers, wait {wait:.0%}"
        return run

    section(rows, "aioload, JPEG decode+RRC on CPU", aioload_cpu)
    section(rows, "torch DataLoader, JPEG decode+RRC", torch_cpu)
    section(rows, "aioload, nvJPEG decode+RRC on GPU", aioload_gpu(w))
    section(rows, "aioload, nvJPEG, 2 workers", aioload_gpu(2))
    section(checks, "nvJPEG batches vs CPU decode", lambda: (0, 0, gpu_decode_matches(root, device, w)))

    # 5. decode throughput alone: batched nvJPEG + RRC on the device against every CPU core
    paths = sorted(str(p) for p in Path(root).rglob("*.jpg"))
    cpus = os.cpu_count() or 1
    section(rows, "decode+RRC: nvJPEG batched", lambda: _rate_row(gpu_decode_rate(paths, bs, device), "img/s"))
    section(rows, f"decode+RRC: CPU, {cpus} processes",
            lambda: _rate_row(ceiling(paths, rrc_flip(), cpus), "img/s"))

    print()
    print(f"{'feed':40} {'steps/s':>9} {'vs synthetic':>13}  notes")
    for name, r, ratio, notes in rows:
        if notes == "img/s":
            print(f"{name:40} {r:9.0f} {'img/s':>13}")
        else:
            print(f"{name:40} {r:9.2f} {ratio:12.0%}   {notes}")
    print()
    for name, _, _, notes in checks:
        print(f"{name:40} {notes}")
    return 0


def _rate_row(rate: float, unit: str) -> tuple:
    return rate, float("nan"), unit


class SeededCrops(torch.utils.data.Dataset):
    """Random 64x64 crops of fixed random images (random per sample: seed= fixes them)."""

    def __init__(self, n: int = 48 * 24):
        g = torch.Generator().manual_seed(1)
        self.images = torch.randint(0, 256, (16, 3, 96, 96), dtype=torch.uint8, generator=g)
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        image = self.images[i % 16]
        y, x = torch.randint(0, 32, (2,)).tolist()
        return image[:, y:y + 64, x:x + 64].clone(), i


def device_batches_equal(device, workers: int, busy: bool) -> tuple[int, int]:
    """``device="cuda"`` batches against the same seeded batches on the CPU, byte for byte;
    with ``busy`` the consumer's stream runs long kernels before it takes each batch (so the
    side-stream copy and the slot's reuse race the consumer, if the event discipline is wrong)."""
    with aioload.DataLoader(SeededCrops(), batch_size=48, num_workers=workers, seed=0) as loader:
        expected = [(x.clone(), y.clone()) for x, y in loader]
    work = torch.randn(4096, 4096, device=device)
    out = torch.empty_like(work)
    got = []
    with aioload.DataLoader(SeededCrops(), batch_size=48, num_workers=workers, seed=0, device=device) as loader:
        for x, y in loader:
            if busy:
                for _ in range(8):
                    torch.mm(work, work, out=out)
            got.append((x.sum(dtype=torch.int64), x.clone(), y.clone()))  # kernels queued behind the copy
    torch.cuda.synchronize()
    intact = sum(bool(torch.equal(x.cpu(), ex) and torch.equal(y.cpu(), ey))
                 for (_, x, y), (ex, ey) in zip(got, expected))
    return intact, len(expected)


def gpu_decode_matches(root, device, workers: int) -> str:
    """nvJPEG's batches against the workers' CPU decode with the same seed (nvJPEG's IDCT is
    not libjpeg's: equal labels and crops, pixels close)."""
    center = v2.CenterCrop(192)
    diffs, labels_equal, n = [], True, 0
    with aioload.DataLoader(aioload.ImageFolder(root, center), batch_size=64, num_workers=workers) as cpu, \
            aioload.DataLoader(aioload.ImageFolder(root, center, decode_device=device), batch_size=64,
                               num_workers=workers) as gpu:
        for (x, y), (gx, gy) in zip(cpu, gpu):
            labels_equal &= torch.equal(y, gy.cpu())
            diffs.append((gx.cpu().int() - x.int()).abs().float().mean().item())
            n += 1
            if n == 8:
                break
    return f"{n} batches, labels equal {labels_equal}, mean |pixel difference| {max(diffs):.2f} (worst batch)"


def gpu_decode_rate(paths: list[str], batch: int, device, seconds: float = 10.0) -> float:
    """img/s of batched nvJPEG decode + RandomResizedCrop(224) + flip on the device."""
    from aioload._engine.gpudecode import decode_batch

    data = [torch.frombuffer(bytearray(Path(p).read_bytes()), dtype=torch.uint8) for p in paths]
    transform = rrc_flip()
    done, started = 0, None
    while True:
        for i in range(0, len(data) - batch + 1, batch):
            images = decode_batch(data[i:i + batch], device)
            torch.stack([transform(image) for image in images])
            done += batch
            if started is None:  # the first batch warms nvJPEG up
                torch.cuda.synchronize()
                started, done = time.perf_counter(), 0
            elif time.perf_counter() - started > seconds:
                torch.cuda.synchronize()
                return done / (time.perf_counter() - started)


class Filled(torch.utils.data.Dataset):
    """Sample i: 65,536 int32 values equal to i (a batch overwritten too early shows)."""

    def __len__(self) -> int:
        return 64 * 48

    def __getitem__(self, i):
        return torch.full((1 << 16,), i, dtype=torch.int32), i


def pinned_reuse(device, workers: int) -> tuple[int, int]:
    """Copy every batch with the consumer's own non_blocking copy, each queued behind long
    kernels, and drop the batch at once; ``(intact batches, batches)``."""
    work = torch.randn(4096, 4096, device=device)
    out = torch.empty_like(work)
    seen = []
    with aioload.DataLoader(Filled(), batch_size=64, num_workers=workers, pin_memory=True) as loader:
        for values, index in loader:
            for _ in range(8):
                torch.mm(work, work, out=out)  # the copy below waits behind these
            copied = values.to(device, non_blocking=True)
            seen.append((copied.amin(1), copied.amax(1), index.clone()))
            del values, copied
    torch.cuda.synchronize()
    intact = sum(bool((lo.cpu() == index).all() and (hi.cpu() == index).all()) for lo, hi, index in seen)
    return intact, len(seen)


def _cycle(loader):
    while True:
        yield from loader


def _to_device(loader, device):
    for images, labels in loader:
        yield images.to(device, non_blocking=True), labels.to(device, non_blocking=True)


if __name__ == "__main__":
    sys.exit(main())
