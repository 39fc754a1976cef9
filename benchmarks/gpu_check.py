"""GPU check: pinned slots, non-blocking copies that overlap compute, and a ResNet-18 training
loop fed by aioload against the same loop fed by a batch already on the device.

Run on a machine with a CUDA GPU:

    PYTHONPATH=. python3 benchmarks/gpu_check.py [--steps 60] [--batch-size 256] [--workers N]

Prints one table. Rows:

* slot pinning: slots were page-locked once with cudaHostRegister (no staging copy);
* pinned reuse: with ``pin_memory=True`` and no ``device=``, the consumer's own
  ``non_blocking`` copies, queued behind long kernels and the batch dropped at once, still
  read what the batch held (a slot is reused only after the copy out of it has finished);
* copy/compute overlap: fraction of the side-stream H2D copy time that ran while the training
  step ran on the main stream (CUDA event timestamps);
* steps/s for: synthetic (batch already on the GPU), aioload over in-memory uint8 images (the
  data path alone: hand-off, pinning, copy), aioload over JPEGs (decode + RandomResizedCrop +
  flip in the workers), and torch's DataLoader over the same JPEGs with pin_memory=True.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

import aioload
from aioload import _device
from aioload._bench import BenchImages, environment, rrc_flip
from aioload._synth import make_image_folder

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


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    parser.add_argument("--images", type=int, default=4096)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    torch.backends.cudnn.benchmark = True
    normalize = aioload.transforms.Normalize(MEAN, STD, channels_last=True).to(device)
    bs, w = args.batch_size, args.workers
    rows = []
    print(f"{torch.cuda.get_device_name()}; {environment()}; batch {bs}, {w} workers", flush=True)

    # 1. synthetic: one batch already on the device
    images = torch.randint(0, 256, (bs, 3, 224, 224), dtype=torch.uint8, device=device)
    labels = torch.randint(0, 1000, (bs,), device=device)
    synthetic = train(iter(lambda: (images, labels), None), args.steps, device, normalize)
    rows.append(("synthetic (batch on device)", synthetic, 1.0, ""))

    # 2. aioload, in-memory images: the data path alone, with copy/compute overlap measured
    _device.Transfer = TimedTransfer
    import aioload._loader as loader_module
    loader_module._device.Transfer = TimedTransfer
    spans: list = []
    with aioload.DataLoader(MemoryImages(), batch_size=bs, shuffle=True, num_workers=w, device=device,
                            pin_memory=True, drop_last=True, persistent_workers=True) as loader:
        rate = train(_cycle(loader), args.steps, device, normalize, spans)
        slots = loader._res.shared.slots
        pinned = slots is not None and all(s.pinned for s in slots._free)
        sample = next(iter(loader))
        on_device = sample[0].device.type == "cuda" and sample[0].dtype == torch.uint8
        wait = loader.stats().wait_fraction
    ov = overlap(TimedTransfer.spans[-len(spans):], spans)
    rows.append(("aioload, in-memory uint8", rate, rate / synthetic,
                 f"wait {wait:.0%}, copy/compute overlap {ov:.0%}"))
    print(f"slots page-locked once (cudaHostRegister): {pinned}; batches arrive on {sample[0].device} "
          f"as uint8: {on_device}", flush=True)
    del sample
    intact, total = pinned_reuse(device, w)
    print(f"pin_memory=True, consumer's own non_blocking copies: {intact} of {total} batches intact", flush=True)

    # 3. JPEGs: aioload vs torch, same dataset work
    root = make_image_folder(images=args.images, processes=os.cpu_count() or 1)
    dataset = BenchImages(root, rrc_flip())
    with aioload.DataLoader(dataset, batch_size=bs, shuffle=True, num_workers=w, device=device,
                            drop_last=True, persistent_workers=True) as loader:
        rate = train(_cycle(loader), args.steps, device, normalize)
        wait = loader.stats().wait_fraction
    rows.append(("aioload, JPEG decode+RRC", rate, rate / synthetic, f"wait {wait:.0%}"))
    torch_loader = torch.utils.data.DataLoader(dataset, batch_size=bs, shuffle=True, num_workers=w,
                                               pin_memory=True, drop_last=True, persistent_workers=True)
    rate = train(_cycle(_to_device(torch_loader, device)), args.steps, device, normalize)
    rows.append(("torch DataLoader, JPEG decode+RRC", rate, rate / synthetic, "pin_memory=True"))

    print()
    print(f"{'feed':36} {'steps/s':>9} {'vs synthetic':>13}  notes")
    for name, r, ratio, notes in rows:
        print(f"{name:36} {r:9.2f} {ratio:12.0%}   {notes}")
    return 0


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
