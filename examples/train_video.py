"""Train a video classifier on a folder of clips: random 16-frame clips, decoded in the workers.

    python examples/train_video.py                 # generated H.264 videos, 20 steps
    python examples/train_video.py --data DIR --steps 0 --epochs 5 --clips-per-video 4

``--data DIR`` is a folder laid out as ``DIR/<class>/<video>.mp4`` (any FFmpeg container);
without it, ``aioload.make_videos`` generates 64 videos once, in ``$AIOLOAD_CACHE`` (default
``~/.cache/aioload``). ``--steps N`` trains N steps over as many epochs as that takes;
``--steps 0`` trains ``--epochs`` whole epochs.

What it shows: ``aioload.VideoFolder`` picks a random clip per video per epoch in the workers
(seeded from ``(seed, epoch, index)`` with ``seed=``, so a run repeats and resumes exactly),
torchcodec decodes only that clip, the transform crops and flips every frame of the clip alike,
batches of uint8 ``[B, T, C, H, W]`` clips arrive on the device, and normalisation runs there.
Needs ``pip install 'aioload[video]'`` and FFmpeg's libraries (README's set-up does both).
"""

from __future__ import annotations

import argparse
import time

import torch
from torchvision.transforms import v2

import aioload

MEAN, STD = [0.43, 0.39, 0.38], [0.23, 0.22, 0.22]  # Kinetics-400's, the usual choice


def small_3d_cnn(classes: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv3d(3, 16, (3, 5, 5), stride=(1, 4, 4), padding=(1, 2, 2)), torch.nn.ReLU(),
        torch.nn.Conv3d(16, 32, 3, stride=2, padding=1), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool3d(1), torch.nn.Flatten(), torch.nn.Linear(32, classes),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", help="VideoFolder-style directory (default: 64 generated videos)")
    parser.add_argument("--steps", type=int, default=20,
                        help="train this many steps, over as many epochs as needed; 0: --epochs epochs (default: 20)")
    parser.add_argument("--epochs", type=int, default=1, help="epochs to train with --steps 0 (default: 1)")
    parser.add_argument("--batch-size", type=int, default=8, help="(default: 8)")
    parser.add_argument("--workers", type=int, default=2, help="decode processes (default: 2)")
    parser.add_argument("--frames", type=int, default=16, help="frames per clip (default: 16)")
    parser.add_argument("--frame-step", type=int, default=2, help="take every n-th frame (default: 2)")
    parser.add_argument("--clips-per-video", type=int, default=1, help="random clips per video per epoch (default: 1)")
    parser.add_argument("--size", type=int, default=96, help="training crop size (default: 96)")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    root = args.data or aioload.make_videos(n=64, classes=4, frames_per_video=64, size=(112, 144))
    train_tf = v2.Compose([v2.RandomResizedCrop(args.size, scale=(0.5, 1.0), antialias=True),
                           v2.RandomHorizontalFlip()])  # one crop and one flip for the whole clip
    dataset = aioload.VideoFolder(root, args.frames, clips="random", clips_per_video=args.clips_per_video,
                                  frame_step=args.frame_step, transform=train_tf)
    model = small_3d_cnn(len(dataset.classes)).to(device)
    normalize = aioload.transforms.Normalize(MEAN, STD).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()

    with aioload.DataLoader(dataset, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                            drop_last=True, device=device, seed=0) as loader:
        if len(loader) == 0:
            raise SystemExit(f"{root} has fewer clips than one batch (--batch-size {args.batch_size})")
        step = epoch = 0
        while (step < args.steps) if args.steps else (epoch < args.epochs):
            started = time.perf_counter()
            for clips, labels in loader:  # clips: uint8 [B, T, C, H, W], already on the device
                b, t = clips.shape[:2]
                x = normalize(clips.flatten(0, 1)).view(b, t, *clips.shape[2:]).transpose(1, 2)  # [B, C, T, H, W]
                loss = loss_fn(model(x), labels)
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
