"""The same training loop as ``train_folder.py``, driven from async code with ``async for``.

    python examples/train_async.py

The loader never blocks the event loop, and the training step runs in a thread
(``asyncio.to_thread``: a synchronous step on the loop would hold it for the whole step), so a
heartbeat coroutine keeps ticking beside training (in a real program: a metrics server, a
checkpoint uploader, a control channel). At the end it prints how often the heartbeat ticked
and the longest gap between two ticks while the loop awaited a batch and while a step ran.
"""

from __future__ import annotations

import argparse
import asyncio

import torch
from torchvision.transforms import v2

import aioload

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


class Heartbeat:
    """Ticks every ``period`` seconds; keeps the longest gap between two ticks for each phase of
    the training loop (``"batch"``: awaiting the loader, ``"step"``: a training step)."""

    def __init__(self, period: float):
        self.period, self.ticks, self.phase = period, 0, "batch"
        self.longest = {"batch": 0.0, "step": 0.0}

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        last = loop.time()
        while True:
            phase = self.phase
            await asyncio.sleep(self.period)
            now = loop.time()
            self.ticks += 1
            self.longest[phase] = max(self.longest[phase], now - last - self.period)
            last = now


async def train(args) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    root = args.data or aioload.make_data(n=256, classes=4)
    dataset = aioload.ImageFolder(root, v2.Compose([v2.RandomResizedCrop(128, antialias=True),
                                                    v2.RandomHorizontalFlip()]))
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 5, stride=4, padding=2), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(16, len(dataset.classes)),
    ).to(device)
    normalize = aioload.transforms.Normalize(MEAN, STD).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    heart = Heartbeat(0.01)
    beat = asyncio.create_task(heart.run())

    def train_step(images, labels):
        loss = torch.nn.functional.cross_entropy(model(normalize(images)), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss.detach()
    step = epoch = 0
    loss = torch.tensor(float("nan"))
    try:
        # persistent_workers: the break below keeps the workers (stopping them would hold the
        # loop); leaving the async with block stops them, in a thread
        async with aioload.DataLoader(dataset, batch_size=32, shuffle=True, num_workers=args.workers,
                                      drop_last=True, device=device, persistent_workers=True) as loader:
            if len(loader) == 0:
                raise SystemExit(f"{root} has fewer images than one batch (32)")
            while step < args.steps:  # as many epochs as the steps take
                async for images, labels in loader:
                    heart.phase = "step"
                    loss = await asyncio.to_thread(train_step, images, labels)  # the loop stays free
                    heart.phase = "batch"
                    step += 1
                    if step >= args.steps:
                        break
                epoch += 1
    finally:
        beat.cancel()
    print(f"done: {step} steps in {epoch} epoch{'' if epoch == 1 else 's'}, loss {loss.item():.3f}, "
          f"heartbeat ticked {heart.ticks} times; its longest gap: {heart.longest['batch'] * 1e3:.1f} ms "
          f"while awaiting a batch, {heart.longest['step'] * 1e3:.1f} ms during a training step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", help="ImageFolder-style directory (default: 256 generated JPEGs)")
    parser.add_argument("--steps", type=int, default=10,
                        help="training steps, over as many epochs as that takes (default: 10)")
    parser.add_argument("--workers", type=int, default=2, help="decode processes (default: 2)")
    asyncio.run(train(parser.parse_args()))


if __name__ == "__main__":
    main()
