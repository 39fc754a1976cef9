"""Distributed data-parallel training under torchrun, resumable in the middle of an epoch.

    torchrun --nproc-per-node 2 examples/ddp_train.py                       # a few steps
    torchrun --nproc-per-node 2 examples/ddp_train.py --steps 3 --checkpoint ckpt.pt
    torchrun --nproc-per-node 2 examples/ddp_train.py --steps 6 --resume ckpt.pt
    python examples/ddp_train.py                                            # one process: a world of 1

Launch it with ``torchrun``, which starts one process per rank and tells each its ``RANK``,
``WORLD_SIZE`` and where rank 0 listens. Started with plain ``python`` (no ``RANK`` in the
environment), it says so and runs as a world of one rank on 127.0.0.1, the same code path.

Once ``torch.distributed`` is initialised, aioload gives each rank its own shard of the
dataset (disjoint, equal lengths, reshuffled every epoch); ``seed=`` makes the order and every
random crop a function of (seed, epoch, rank, index). The checkpoint holds the model, the
optimiser and every rank's ``loader.state_dict()``, so a resumed run trains on exactly the
batches the interrupted one had not reached yet. Uses NCCL with one GPU per rank where CUDA
has enough GPUs, else gloo on the CPU. The data is the embedded synthetic image folder.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torchvision.transforms import v2

import aioload

CLASSES = 4


def say(line: str) -> None:
    """Print ``line`` in one write: the ranks share the terminal, and print() writes a line and
    its newline apart, which unbuffered (python -u, PYTHONUNBUFFERED) glues two ranks' lines."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", help="an image folder (default: generate the synthetic one)")
    p.add_argument("--images", type=int, default=64, help="synthetic images to generate (default: %(default)s)")
    p.add_argument("--steps", type=int, default=6,
                   help="train until this many steps in all, a resumed run's included (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=8, help="images per batch, per rank (default: %(default)s)")
    p.add_argument("--image-size", type=int, default=64, help="training crop size, px (default: %(default)s)")
    p.add_argument("--workers", type=int, default=2, help="decode processes per rank (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="order and augmentation seed (default: %(default)s)")
    p.add_argument("--checkpoint", help="save model, optimiser and loader state here at the end (default: no checkpoint)")
    p.add_argument("--resume", help="continue from this checkpoint (default: start afresh)")
    return p.parse_args()


def single_process_defaults() -> None:
    """Without torchrun: the environment of a world of one rank, rank 0 listening on a free
    port of 127.0.0.1."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    say("not started by torchrun (no RANK in the environment): running as a single process, a world "
        "of 1; for more ranks: torchrun --nproc-per-node N examples/ddp_train.py")


def setup() -> tuple[int, int, torch.device]:
    if "RANK" not in os.environ:
        single_process_defaults()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world:
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl")
        device = torch.device("cuda", local_rank)
    else:
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


def dataset(args) -> aioload.ImageFolder:
    if args.data is not None:
        root = args.data
    else:
        if dist.get_rank() == 0:  # one rank generates, the others wait
            aioload.make_data(n=args.images, classes=CLASSES)
        dist.barrier()
        root = aioload.make_data(n=args.images, classes=CLASSES)
    size = args.image_size
    crop = v2.Compose([v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip()])
    return aioload.ImageFolder(root, transform=crop, decode_size=(size, size))


def model_for(classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, classes),
    )


def digest(images: torch.Tensor, labels: torch.Tensor) -> str:
    """A fingerprint of a batch's pixels and labels: equal runs print equal digests."""
    data = images.cpu().numpy().tobytes() + labels.cpu().numpy().tobytes()
    return hashlib.sha1(data).hexdigest()[:12]


def save(path: str, model, optimizer, loader, step: int, epoch: int) -> None:
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, loader.state_dict())  # every rank's own position
    if dist.get_rank() == 0:
        torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "loaders": states, "step": step, "epoch": epoch}, path)
    dist.barrier()


def main() -> None:
    args = arguments()
    rank, world, device = setup()
    ds = dataset(args)
    torch.manual_seed(args.seed)  # the same initial weights on every run (DDP copies rank 0's)
    model = DistributedDataParallel(model_for(CLASSES).to(device), device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    normalize = aioload.transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]).to(device)
    on_gpu = device.type == "cuda"
    step = epoch = 0
    with aioload.DataLoader(ds, batch_size=args.batch_size, shuffle=True, drop_last=True, seed=args.seed,
                            num_workers=args.workers, device=device if on_gpu else None) as loader:
        if args.resume:
            ckpt = torch.load(args.resume, map_location="cpu", weights_only=True)
            model.module.load_state_dict(ckpt["model"])
            optimizer.load_state_dict(ckpt["optimizer"])
            loader.load_state_dict(ckpt["loaders"][rank])
            step, epoch = ckpt["step"], ckpt["epoch"]
            if rank == 0:
                say(f"resumed from {args.resume}: step {step}, epoch {epoch}")
        if rank == 0:
            say(f"{world} rank{'' if world == 1 else 's'} on {device.type}, {len(ds)} images, "
                f"{len(loader)} batches per rank and epoch")
        while step < args.steps:
            loader.set_epoch(epoch)  # keeps a loaded mid-epoch state for this epoch
            for images, labels in loader:
                logits = model(normalize(images.to(device, non_blocking=True)))
                loss = F.cross_entropy(logits, labels.to(device, non_blocking=True))
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                step += 1
                say(f"rank {rank} epoch {epoch} step {step} batch {digest(images, labels)} "
                    f"loss {loss.item():.4f}")
                if step == args.steps:
                    break
            else:
                epoch += 1
        if args.checkpoint:
            save(args.checkpoint, model, optimizer, loader, step, epoch)
            if rank == 0:
                say(f"saved step {step}, epoch {epoch} to {args.checkpoint}: --resume {args.checkpoint} "
                    f"goes on from there")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
