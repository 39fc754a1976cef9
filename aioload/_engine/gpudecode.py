"""JPEG decode on the GPU: ``ImageFolder(..., decode_device="cuda")`` and ``ImageFiles`` alike.

When a node's CPUs cannot decode as fast as its GPUs train, the decode moves to the GPU:

* **worker** (or the read stage with ``num_workers=0``): reads the file. A JPEG travels as its
  encoded bytes, a 1-D uint8 tensor of a few tens of kB instead of 400 kB of pixels; any other
  image (PNG, WebP, ...) is decoded on the CPU there, since nvJPEG reads JPEG only.
* **engine thread, side stream**: one batched ``decode_jpegs_cuda`` call (nvJPEG) decodes the
  batch's JPEGs; the CPU-decoded images and the labels are copied with ``non_blocking=True``;
  an event is recorded. A batch whose call fails (nvJPEG rejects a file, or raises anything
  else) is decoded again one image at a time, and each image nvJPEG fails on is decoded on the
  CPU (libjpeg accepts more, CMYK included); an image no decoder takes fails its sample alone,
  named by its index. The CPU batch -- and so its slot -- is kept until the event has fired, as for any
  copy.
* **consumer thread**: its stream waits on the event; the dataset's ``transform`` runs on each
  device image, and the images are stacked into one batch.

The transforms run in the consumer's thread because their random parameters come from torch's
global CPU generator. Drawn on the engine's thread they would interleave with the training
loop's own draws from that generator (two threads, one generator), and neither would be
reproducible. In the consumer's thread each sample's draws are seeded from ``(epoch seed,
index)`` as a worker seeds them -- torch's CPU generator, ``random``'s, numpy's, and the decode
device's CUDA generator, which a transform of a CUDA image draws from -- inside a block that
gives back the training loop's own state of each of them afterwards.

``sample_seed(base_seed, index)`` seeds every sample, with or without ``seed=``: with ``seed=S``
the batches are a function of ``(S, epoch, index)`` as on the CPU path; without, the epoch's base
seed is drawn from torch's generator as usual.
"""

from __future__ import annotations

import contextlib
import random
import warnings

import torch
from torch.utils.data._utils.collate import default_collate

from aioload._engine.budget import AllSkipped, ErrorBudget
from aioload._base.seeding import sample_seed, seed_everything
from aioload._handoff.tree import map_tensors

def decode_device_of(dataset) -> torch.device | None:
    """The decode device a dataset asks for (``None``: decode in the workers)."""
    device = getattr(dataset, "decode_device", None)
    return None if device is None else torch.device(device)


def check_loader_device(decode_on: torch.device, device: torch.device | None) -> None:
    """``device=`` and the dataset's ``decode_device`` must agree: the batch is made there."""
    if device is not None and device != decode_on:
        raise ValueError(f"the dataset decodes on {decode_on} (decode_device=) but device={str(device)!r}: "
                         "batches are made where they are decoded; pass the same device, or leave device=None")


def collate_encoded(samples):
    """In the worker: ``(payloads, targets, indices)`` from samples ``(payload, target, index)``.

    Payloads differ in length, so they stay a list (each one lives in the batch slot's
    overflow area); targets are collated as torch collates them, or ``None`` without labels."""
    payloads = [payload for payload, _, _ in samples]
    targets = [target for _, target, _ in samples]
    indices = torch.tensor([index for _, _, index in samples], dtype=torch.int64)
    collated = None if all(t is None for t in targets) else default_collate(targets)
    return payloads, collated, indices


class _Done:
    """The event of work that ran synchronously (CPU tensors): already complete."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class DecodeFailure:
    """In a decoded batch, an image that neither nvJPEG nor the CPU could decode."""

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException):
        self.exc = exc


def _decode_many(payloads: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    from aioload.images import torchcodec_images

    codec = torchcodec_images()  # torchcodec's nvJPEG batch where installed; torchvision's op otherwise
    if codec is not None:
        return codec.decode_jpeg(payloads, mode="RGB", device=device)
    op = getattr(getattr(torch.ops, "image", None), "decode_jpegs_cuda", None)
    from torchvision.io import ImageReadMode

    if device.type == "cuda" and op is not None:
        return op(payloads, ImageReadMode.RGB.value, device)
    return [_decode_one(p, device) for p in payloads]


def _decode_one(payload: torch.Tensor, device: torch.device) -> torch.Tensor:
    import torchvision
    from torchvision.io import ImageReadMode

    from aioload.images import torchcodec_images

    codec = torchcodec_images()
    if codec is not None:
        return codec.decode_jpeg(payload, mode="RGB", device=device)

    if device.type == "cuda":
        op = getattr(getattr(torch.ops, "image", None), "decode_jpegs_cuda", None)
        if op is not None:
            return op([payload], ImageReadMode.RGB.value, device)[0]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return torchvision.io.decode_jpeg(payload, mode=ImageReadMode.RGB, device=device)
    op = getattr(getattr(torch.ops, "image", None), "decode_jpeg", None)
    if op is not None:
        return op(payload, ImageReadMode.RGB.value, False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return torchvision.io.decode_jpeg(payload, mode=ImageReadMode.RGB)


def decode_batch(payloads: list[torch.Tensor], device: torch.device) -> list:
    """Every payload as an image on ``device``: JPEGs in one batched call, with the fallbacks
    described in the module docstring; an image no decoder takes is a :class:`DecodeFailure`."""
    from aioload.images import decode_image

    out: list = [None] * len(payloads)
    jpegs = [i for i, p in enumerate(payloads) if p.dim() == 1]
    for i, p in enumerate(payloads):
        if p.dim() != 1:  # decoded on the CPU in the worker
            out[i] = p.to(device, non_blocking=True)
    if jpegs:
        try:
            for i, image in zip(jpegs, _decode_many([payloads[i] for i in jpegs], device)):
                out[i] = image
        except Exception:  # noqa: BLE001 - one file nvJPEG rejects fails the whole call: one at a time
            # Whatever the batched call raised (a RuntimeError for a file it rejects, but also
            # a TypeError from another torchvision's signature, an out-of-memory error...), each
            # image gets its own chance, and each failure is its sample's.
            for i in jpegs:
                try:
                    out[i] = _decode_one(payloads[i], device)
                except Exception:  # noqa: BLE001 - libjpeg takes more than nvJPEG (CMYK, some progressive files)
                    try:
                        out[i] = decode_image(payloads[i].numpy().tobytes()).to(device, non_blocking=True)
                    except Exception as exc:  # noqa: BLE001 - reported with the sample's index
                        out[i] = DecodeFailure(exc)
    return out


def device_generators(device: torch.device) -> list[torch.Generator]:
    """The generators a transform of an image on ``device`` may draw from besides torch's CPU
    one: that CUDA device's own (``v2.GaussianNoise`` on a CUDA image draws there, as any
    ``torch.randn(..., device=image.device)`` does); none on the CPU."""
    if device.type != "cuda":
        return []
    index = device.index if device.index is not None else torch.cuda.current_device()
    return [torch.cuda.default_generators[index]]


@contextlib.contextmanager
def own_rngs(device: torch.device):
    """Seed and draw freely inside; torch's CPU generator, ``device``'s generator, ``random``'s
    and numpy's are given back as they were (they belong to the training loop of this thread)."""
    import numpy as np

    generators = [torch.default_generator, *device_generators(device)]
    states = [generator.get_state() for generator in generators]
    py_state = random.getstate()
    np_state = np.random.get_state()
    try:
        yield
    finally:
        for generator, state in zip(generators, states):
            generator.set_state(state)
        random.setstate(py_state)
        np.random.set_state(np_state)


def seed_sample(seed: int, device: torch.device) -> None:
    """Seed one sample's transform: every generator :func:`own_rngs` gives back."""
    seed_everything(seed)
    for generator in device_generators(device):
        generator.manual_seed(seed)


class DecodeTransfer:
    """The device stage of one epoch for a dataset with ``decode_device``: ``start`` in the
    engine thread, ``hand_over`` in the consumer's (the interface of :class:`_device.Transfer`)."""

    def __init__(self, device: torch.device, dataset, base_seed: int):
        self.device = device
        self.dataset = dataset
        self.base_seed = base_seed
        self.budget: ErrorBudget | None = None  # the epoch's, set once the engine exists
        self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None

    def start(self, batch):
        """Enqueue the decode and the copies; returns ``(device_batch, event)``."""
        payloads, targets, indices = batch
        indices = indices.tolist()  # the slot is reused once the event fires
        context = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        with context:
            images = decode_batch(payloads, self.device)
            if targets is not None:
                targets = _to(targets, self.device)
            if self.stream is None:
                return (images, targets, indices), _Done()
            event = torch.cuda.Event(blocking=True)  # its waiter sleeps rather than spins (see Transfer)
            event.record(self.stream)
        return (images, targets, indices), event

    def hand_over(self, batch, event):
        """In the consumer's thread: wait for the decode, transform every image, stack."""
        images, targets, indices = batch
        if self.stream is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(event)
            for image in images:
                if isinstance(image, torch.Tensor):
                    image.record_stream(stream)
        keep = self._failed(images, indices)
        transform = getattr(self.dataset, "transform", None)
        out = []
        with own_rngs(self.device):
            for pos in keep:
                seed_sample(sample_seed(self.base_seed, indices[pos]), self.device)
                image = images[pos]
                out.append(transform(image) if transform is not None else image)
        if not out:
            raise AllSkipped
        stacked = self._stack(out, [indices[p] for p in keep])
        if targets is None:
            return stacked
        if len(keep) != len(indices):
            targets = _select(targets, keep)
        return stacked, targets

    def finish(self, batch):
        """A batch made in the consumer's thread (``num_workers=0``): both halves at once."""
        out, event = self.start(batch)
        return self.hand_over(out, event)

    def _failed(self, images: list, indices: list) -> list[int]:
        """Positions of the images that decoded; a failure is raised, or skipped by the budget."""
        from aioload._engine.budget import where

        keep = []
        for pos, image in enumerate(images):
            if not isinstance(image, DecodeFailure):
                keep.append(pos)
                continue
            exc = image.exc
            describe = getattr(self.dataset, "describe", None)
            exc.add_note(f"while decoding dataset index {indices[pos]}{where(describe, indices[pos])} on "
                         f"{self.device} (decode_device=): neither nvJPEG nor the CPU decoder could read it")
            if self.budget is None:
                raise exc
            self.budget.failed([indices[pos]], exc)
        return keep

    def _stack(self, images: list[torch.Tensor], indices: list[int]) -> torch.Tensor:
        shapes = {tuple(image.shape) for image in images}
        if len(shapes) > 1:
            sizes = ", ".join(f"{i}: {tuple(im.shape)}" for i, im in list(zip(indices, images))[:4])
            raise ValueError(f"decode_device= stacks a batch's images, and these differ in size after the "
                             f"transform (dataset index: shape; {sizes}, ...): give the dataset a transform that "
                             "makes every image one size, such as v2.RandomResizedCrop(224) or v2.Resize((h, w))")
        return torch.stack(images)


def _to(value, device: torch.device):
    return map_tensors(lambda t: t.to(device, non_blocking=True), value)


def _select(targets, keep: list[int]):
    index = torch.tensor(keep, dtype=torch.int64)
    return map_tensors(lambda t: t.index_select(0, index.to(t.device)), targets)
