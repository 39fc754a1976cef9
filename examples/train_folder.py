"""Train an image classifier on a folder of JPEGs: the classic recipe, done the aioload way.

    python examples/train_folder.py                 # generated ImageNet-like data, 20 steps
    python examples/train_folder.py --data DIR --steps 0 --epochs 10 --model resnet18

``--steps N`` trains N steps, over as many epochs as that takes; ``--steps 0`` trains
``--epochs`` whole epochs instead. The generated data is ``aioload.make_data``'s (made once, in
``$AIOLOAD_CACHE``, default ``~/.cache/aioload``).

What changes against torchvision's tutorial: ``aioload.ImageFolder`` decodes to uint8 tensors
in the workers, ``transforms.v2`` augments them as uint8, batches arrive already on the device
(``device=``), and normalisation runs there, on the whole batch (``aioload.transforms.Normalize``).
"""

from __future__ import annotations

import argparse
import time

import torch
from torchvision.transforms import v2

import aioload

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def small_cnn(classes: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 5, stride=4, padding=2), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, stride=2, padding=1), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, classes),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", help="ImageFolder-style directory (default: 256 generated JPEGs)")
    parser.add_argument("--steps", type=int, default=20,
                        help="train this many steps, over as many epochs as needed; 0: --epochs epochs (default: 20)")
    parser.add_argument("--epochs", type=int, default=1, help="epochs to train with --steps 0 (default: 1)")
    parser.add_argument("--batch-size", type=int, default=32, help="(default: 32)")
    parser.add_argument("--workers", type=int, default=2, help="decode processes (default: 2)")
    parser.add_argument("--size", type=int, default=160, help="training crop size (default: 160)")
    parser.add_argument("--model", choices=["small", "resnet18"], default="small", help="(default: small)")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    root = args.data or aioload.make_data(n=256, classes=4)
    train_tf = v2.Compose([v2.RandomResizedCrop(args.size, antialias=True), v2.RandomHorizontalFlip()])
    dataset = aioload.ImageFolder(root, train_tf)
    classes = len(dataset.classes)
    if args.model == "resnet18":
        import torchvision

        model = torchvision.models.resnet18(num_classes=classes)
    else:
        model = small_cnn(classes)
    model = model.to(device)
    normalize = aioload.transforms.Normalize(MEAN, STD).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()

    with aioload.DataLoader(dataset, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                            drop_last=True, device=device, seed=0) as loader:
        if len(loader) == 0:
            raise SystemExit(f"{root} has fewer images than one batch (--batch-size {args.batch_size})")
        step = epoch = 0
        while (step < args.steps) if args.steps else (epoch < args.epochs):
            started = time.perf_counter()
            for images, labels in loader:
                logits = model(normalize(images))  # uint8 batch -> normalised float, on the device
                loss = loss_fn(logits, labels)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                step += 1
                if step % 10 == 0:
                    print(f"epoch {epoch} step {step} loss {loss.item():.3f}", flush=True)
                if args.steps and step >= args.steps:
                    break
            print(f"epoch {epoch}: {time.perf_counter() - started:.1f} s; {loader.stats().verdict}")
            epoch += 1
    print(f"done: {step} steps in {epoch} epoch{'' if epoch == 1 else 's'}")


if __name__ == "__main__":
    main()
