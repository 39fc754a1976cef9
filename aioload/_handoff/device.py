"""Pinning and device transfer: slot memory is page-locked once; copies run on a side stream.

On a CUDA device every batch is copied with ``non_blocking=True`` on a dedicated stream and an
event is recorded after the copy. The consumer's stream waits on that event before it sees the
batch, and the slot the batch came from goes back to the pool only once the event has fired.
Without CUDA, ``pin_memory=True`` and ``device="cuda"`` degrade with a warning, as torch's
DataLoader does.
"""

from __future__ import annotations

import warnings

import torch

from aioload._handoff.tree import map_tensors

PIN_WARNING = (
    "'pin_memory' argument is set as true but no accelerator is found, "
    "then device pinned memory won't be used."
)


def resolve_device(device) -> torch.device | None:
    """The device batches are delivered on, or ``None`` for the CPU."""
    if device is None:
        return None
    device = torch.device(device)
    if device.type == "cpu":
        return None
    if device.type == "cuda" and not torch.cuda.is_available():
        warnings.warn(
            f"device={str(device)!r} was requested but CUDA is not available: "
            "batches stay on the CPU.",
            stacklevel=3,
        )
        return None
    return device


def pin_available() -> bool:
    return torch.cuda.is_available()


def pin_batch(batch):
    """Pin a batch as torch's DataLoader does: torch's own ``pin_memory`` walk, so containers
    come out as torch makes them (a plain tuple becomes a list) and a custom batch type's
    ``pin_memory()`` is called. Tensors already page-locked (slot views) are kept as they are."""
    from torch.utils.data._utils.pin_memory import pin_memory

    return pin_memory(batch)


class Transfer:
    """Copies batches to one CUDA device on a side stream (used from the engine thread)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def start(self, batch):
        """Enqueue the copy; returns ``(device_batch, event)``. Keep ``batch`` alive until the
        event has fired: its memory is being read by the copy."""
        with torch.cuda.stream(self.stream):
            out = map_tensors(lambda t: t.to(self.device, non_blocking=True), batch)
            # blocking: a thread that waits on it (the engine's, until the slot may be reused)
            # sleeps instead of spinning a CPU core for the copy's duration
            event = torch.cuda.Event(blocking=True)
            event.record(self.stream)
        return out, event

    def hand_over(self, batch, event):
        """In the consumer's thread: make its current stream wait for the copy."""
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(event)
        map_tensors(lambda t: t.record_stream(stream) or t, batch)
        return batch
