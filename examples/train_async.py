"""The same training loop as ``train_folder.py``, driven from async code with ``async for``.

    python examples/train_async.py

The loader never blocks the event loop: a heartbeat coroutine keeps ticking beside training
(in a real program: a metrics server, a checkpoint uploader, a control channel).
"""

from __future__ import annotations

import argparse
import asyncio

import torch
from torchvision.transforms import v2

import aioload

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


async def heartbeat(period: float, ticks: list) -> None:
    while True:
        await asyncio.sleep(period)
        ticks.append(asyncio.get_running_loop().time())


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
    ticks: list = []
    beat = asyncio.create_task(heartbeat(0.01, ticks))
    step = epoch = 0
    loss = torch.tensor(float("nan"))
    try:
        async with aioload.DataLoader(dataset, batch_size=32, shuffle=True, num_workers=args.workers,
                                      drop_last=True, device=device) as loader:
            if len(loader) == 0:
                raise SystemExit(f"{root} has fewer images than one batch (32)")
            while step < args.steps:  # as many epochs as the steps take
                async for images, labels in loader:
                    loss = torch.nn.functional.cross_entropy(model(normalize(images)), labels)
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    optimizer.step()
                    step += 1
                    await asyncio.sleep(0)  # let other coroutines run between steps
                    if step >= args.steps:
                        break
                epoch += 1
    finally:
        beat.cancel()
    print(f"done: {step} steps in {epoch} epoch{'' if epoch == 1 else 's'}, loss {loss.item():.3f}, "
          f"heartbeat ticked {len(ticks)} times")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", help="ImageFolder-style directory (default: 256 generated JPEGs)")
    parser.add_argument("--steps", type=int, default=10,
                        help="training steps, over as many epochs as that takes (default: 10)")
    parser.add_argument("--workers", type=int, default=2, help="decode processes (default: 2)")
    asyncio.run(train(parser.parse_args()))


if __name__ == "__main__":
    main()
