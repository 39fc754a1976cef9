"""Video clips: aioload.VideoFiles against torch's DataLoader with the decoder in ``__getitem__``.

    python benchmarks/video.py                                  # local, and behind 20 ms of HTTP
    python benchmarks/video.py --videos 64 --rounds 3 --latencies 0,20 --json video.json

The data is generated once (``aioload.make_videos``, in ``$AIOLOAD_CACHE``): ``--videos`` H.264
MP4s of ``--frames`` frames at ``--size`` (a panned textured scene, moving shapes and grain; a
keyframe every 24 frames), ``--videos`` / 4 classes. Every loader makes the same samples:
``--clips-per-video`` random clips of ``--clip`` consecutive frames from each video per epoch,
through the same transform (``RandomCrop(--crop)`` + horizontal flip on the uint8
``[T, C, H, W]`` clip), in shuffled batches of ``--batch-size``, with ``--workers`` worker
processes:

* ``aioload VideoFiles``: ``aioload.DataLoader(aioload.VideoFiles(paths or URLs, labels,
  clips="random", ...), num_workers=W, io_concurrency=--io-concurrency)``: local files are
  opened by each worker's torchcodec decoder; URLs are read on the workers' event loops, many
  at once, and decoded from memory;
* ``torch DataLoader, torchcodec``: the recipe users write, ``__getitem__`` opening a
  ``torchcodec.decoders.VideoDecoder`` (the same settings: ``seek_mode="approximate"``, one
  FFmpeg thread) on the path -- or on the bytes of one blocking ``urllib`` GET behind HTTP --
  drawing the clip's start with ``torch.randint`` and decoding it with ``get_frames_at``;
* ``torch DataLoader, PyAV``: the same recipe with PyAV (FFmpeg inside its wheel): open, seek
  to the keyframe before the clip, decode forward, ``to_ndarray("rgb24")``;
* ``decode loop, torchcodec`` / ``decode loop, PyAV``: the ceiling, the same open + decode +
  transform of local files in a tight loop, one process per worker, no loader.

Behind latency, an HTTP server on 127.0.0.1 (``aioload._tools.benchserver``, the one
``aioload bench`` uses, in a process of its own, ``Range`` answered) serves the files and answers every request after L ms. Each measurement is
one epoch of a fresh loader; clips/s and main-process CPU (``time.process_time``: every thread
of the loader's process) count the batches after the first one; peak memory is the PSS of the
loader's process and its workers (the server left out). Rounds are interleaved, the order of
the rows alternates, and medians are printed. Before the rounds, every clip aioload delivers
for ``clips="uniform"`` (through its workers, locally and over HTTP by range reads) is checked
bit for bit against torchcodec's own ``VideoDecoder(path).get_frames_at`` of the same frames.
Numbers from a shared machine are noisy: compare the ratios within one run.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shlex
import sys
import urllib.request
from pathlib import Path
from typing import Callable

import torch

AIOLOAD = "aioload VideoFiles"
TORCH_TC = "torch DataLoader, torchcodec"
TORCH_AV = "torch DataLoader, PyAV"
LOOP_TC = "decode loop, torchcodec"
LOOP_AV = "decode loop, PyAV"


# -- the server: the bench's (one asyncio loop in a process of its own, ``Range`` answered;
# ``Server(root, latency_ms)``, its ``base`` URL, ``close()``)
from aioload._tools.benchhttp import Server  # noqa: E402


# -- the recipes ---------------------------------------------------------------------------------
def transform(crop: int):
    from torchvision.transforms import v2

    return v2.Compose([v2.RandomCrop(crop), v2.RandomHorizontalFlip()])


def fetch(source: str):
    """A path as it is; a URL's whole body, by one blocking GET (the classic recipe)."""
    if source.startswith("http"):
        with urllib.request.urlopen(source, timeout=120) as resp:
            return resp.read()
    return source


def torchcodec_clip(source, clip: int) -> torch.Tensor:
    from torchcodec.decoders import VideoDecoder

    decoder = VideoDecoder(source, seek_mode="approximate", num_ffmpeg_threads=1)
    start = int(torch.randint(decoder.metadata.num_frames - clip + 1, ()).item())
    return decoder.get_frames_at(list(range(start, start + clip))).data


def pyav_clip(source, clip: int) -> torch.Tensor:
    import av

    with av.open(io.BytesIO(source) if isinstance(source, bytes) else source) as container:
        stream = container.streams.video[0]
        stream.codec_context.thread_count = 1
        fps, base = float(stream.average_rate), stream.time_base
        first_pts = stream.start_time or 0
        start = int(torch.randint(stream.frames - clip + 1, ()).item())
        container.seek(first_pts + int(round(start / fps / base)), stream=stream, backward=True)
        frames = []
        for frame in container.decode(stream):
            index = int(round(float((frame.pts - first_pts) * base) * fps))
            if index >= start:
                frames.append(torch.from_numpy(frame.to_ndarray(format="rgb24")))
                if len(frames) == clip:
                    break
    return torch.stack(frames).permute(0, 3, 1, 2)


DECODERS = {"torchcodec": torchcodec_clip, "pyav": pyav_clip}


class RecipeClips(torch.utils.data.Dataset):
    """``__getitem__`` opens the video (or GETs it), draws a clip, decodes it, transforms it."""

    def __init__(self, sources: list[str], labels: list[int], clip: int, clips_per_video: int, crop: int,
                 decoder: str):
        self.sources, self.labels, self.clip, self.per_video = sources, labels, clip, clips_per_video
        self.transform, self.decode = transform(crop), DECODERS[decoder]

    def __len__(self) -> int:
        return len(self.sources) * self.per_video

    def __getitem__(self, index: int):
        video = index // self.per_video
        return self.transform(self.decode(fetch(self.sources[video]), self.clip)), self.labels[video]


# -- one run -------------------------------------------------------------------------------------
def factories(sources: list[str], labels: list[int], args) -> dict[str, Callable]:
    import aioload

    common = dict(batch_size=args.batch_size, shuffle=True, num_workers=args.workers, drop_last=True)

    def ours():
        ds = aioload.VideoFiles(sources, labels, frames_per_clip=args.clip, clips="random",
                                clips_per_video=args.clips_per_video, transform=transform(args.crop))
        return aioload.DataLoader(ds, io_concurrency=args.io_concurrency, **common)

    def recipe(decoder: str):
        ds = RecipeClips(sources, labels, args.clip, args.clips_per_video, args.crop, decoder)
        return lambda: torch.utils.data.DataLoader(ds, **common)

    return {AIOLOAD: ours, TORCH_TC: recipe("torchcodec"), TORCH_AV: recipe("pyav")}


def _decode_loop(share) -> int:
    sources, clip, crop, decoder = share
    tf, decode = transform(crop), DECODERS[decoder]
    for source in sources:
        tf(decode(source, clip))
    return len(sources)


def ceilings(paths: list[str], args) -> dict[str, float]:
    from aioload._tools.bench import ceiling_of

    work = paths * args.clips_per_video
    return {name: ceiling_of(_decode_loop, [(work[w::args.workers], args.clip, args.crop, decoder)
                                            for w in range(args.workers)])
            for name, decoder in ((LOOP_TC, "torchcodec"), (LOOP_AV, "pyav"))}


def check_frames(sources: list[str], paths: list[str], args) -> int:
    """Every clip of ``clips="uniform"`` through aioload's workers equals torchcodec's own
    decode of the same frames (the default, exact seek mode); returns the clips checked."""
    import aioload
    from torchcodec.decoders import VideoDecoder

    per_video = 3
    ds = aioload.VideoFiles(sources, frames_per_clip=args.clip, clips="uniform", clips_per_video=per_video)
    checked = 0
    with aioload.DataLoader(ds, batch_size=args.batch_size, num_workers=args.workers) as loader:
        for batch_no, clips in enumerate(loader):
            for row, clip in enumerate(clips):
                video, k = divmod(batch_no * args.batch_size + row, per_video)
                decoder = VideoDecoder(paths[video])
                count = len(decoder) - args.clip + 1
                start = round(k * (count - 1) / (per_video - 1))
                if not torch.equal(clip, decoder.get_frames_at(list(range(start, start + args.clip))).data):
                    raise SystemExit(f"clip {k} of {paths[video]} differs from torchcodec's own decode")
                checked += 1
    return checked


def scenario(latency: float | None, paths: list[str], labels: list[int], root: Path, args) -> dict:
    from aioload._tools import bench

    server = Server(root, latency) if latency is not None else None
    try:
        if server is not None:
            bench.EXCLUDED_PIDS.add(server.proc.pid)
            sources = [server.base + Path(p).relative_to(root).as_posix() for p in paths]
        else:
            sources = paths
        checked = check_frames(sources, paths, args)
        comparison = bench.Comparison(factories(sources, labels, args))
        extra = comparison.run(args.rounds, progress=lambda m: print(f"  {m}", file=sys.stderr, flush=True),
                               each_round=(lambda: ceilings(paths, args)) if server is None else None,
                               label="local " if server is None else f"{latency:g} ms ")
    finally:
        if server is not None:
            bench.EXCLUDED_PIDS.discard(server.proc.pid)
            server.close()
    rows = []
    ours = comparison.med(AIOLOAD, "rate")
    for name, runs in comparison.runs.items():
        rate = comparison.med(name, "rate")
        rows.append({"row": name, "clips_s": rate, "aioload_over_row": ours / rate if rate else None,
                     "cpu_ms_per_clip": comparison.med(name, "cpu_ms_per_image"),
                     "peak_mb": max(r.memory_mb for r in runs), "first_batch_s": comparison.med(name, "first_batch_s"),
                     "rounds_clips_s": [r.rate for r in runs]})
    for name in (LOOP_TC, LOOP_AV) if extra else ():
        rate = bench.median(e[name] for e in extra)
        rows.append({"row": name, "clips_s": rate, "aioload_over_row": ours / rate, "cpu_ms_per_clip": None,
                     "peak_mb": None, "first_batch_s": None, "rounds_clips_s": [e[name] for e in extra]})
    return {"latency_ms": latency or 0.0, "checked_clips": checked, "rows": rows}


def print_scenario(result: dict, args) -> None:
    where = "Local files" if not result["latency_ms"] else f"Behind {result['latency_ms']:g} ms of HTTP latency"
    print(f"\n## {where}\n")
    print(f"{'':34} {'clips/s':>9} {'aioload/row':>12} {'main CPU ms/clip':>17} {'peak MB':>8} {'first batch s':>14}")
    for row in result["rows"]:
        cpu = f"{row['cpu_ms_per_clip']:.3f}" if row["cpu_ms_per_clip"] is not None else "-"
        peak = f"{row['peak_mb']:.0f}" if row["peak_mb"] is not None else "-"
        first = f"{row['first_batch_s']:.2f}" if row["first_batch_s"] is not None else "-"
        print(f"{row['row']:34} {row['clips_s']:9.1f} {row['aioload_over_row']:11.2f}x {cpu:>17} {peak:>8} "
              f"{first:>14}")
    print(f"\nframes equal to torchcodec's own decode, bit for bit: {result['checked_clips']} clips "
          f"(clips='uniform', through the workers{', by range reads' if result['latency_ms'] else ''})")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--videos", type=int, default=64)
    parser.add_argument("--frames", type=int, default=96, help="frames per video (default: 96, 3.8 s at 25 fps)")
    parser.add_argument("--size", default="128x170", help="video height x width (default: 128x170)")
    parser.add_argument("--clip", type=int, default=16, help="frames per clip (default: 16)")
    parser.add_argument("--crop", type=int, default=112, help="RandomCrop size (default: 112)")
    parser.add_argument("--clips-per-video", type=int, default=4, help="random clips per video per epoch")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--io-concurrency", type=int, default=32)
    parser.add_argument("--latencies", default="0,20", help="comma-separated ms; 0 is the local files")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="also write the rows and the settings to this file")
    args = parser.parse_args(argv)

    import aioload
    from aioload._tools.bench import environment

    height, width = (int(x) for x in args.size.split("x"))
    root = aioload.make_videos(n=args.videos, classes=max(1, args.videos // 16), frames_per_video=args.frames,
                               size=(height, width), quiet=False)
    folder = aioload.VideoFolder(root, args.clip)
    paths, labels = [p for p, _ in folder.samples], [t for _, t in folder.samples]
    size_kb = sum(os.path.getsize(p) for p in paths) / len(paths) / 1024
    command = "python benchmarks/video.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    load_before = os.getloadavg()
    results = [scenario(float(l) if float(l) else None, paths, labels, root, args) for l in args.latencies.split(",")]
    load_after = os.getloadavg()
    import av
    import torchcodec

    run = (f"{environment()}, torchcodec {torchcodec.__version__}, PyAV {av.__version__}, FFmpeg "
           f"{torchcodec.ffmpeg_major_version}.x (torchcodec's); load average {load_before[0]:.2f} before, "
           f"{load_after[0]:.2f} after")
    print(f"\n# {len(paths)} videos of {args.frames} frames at {height}x{width} (H.264, {size_kb:.0f} kB each), "
          f"{args.clips_per_video} random {args.clip}-frame clips per video per epoch, RandomCrop {args.crop} + flip, "
          f"batch {args.batch_size}, {args.workers} workers")
    for result in results:
        print_scenario(result, args)
    print(f"\n{command}\n{run}")
    if args.json:
        Path(args.json).write_text(json.dumps({"command": command, "run": run, "settings": vars(args),
                                               "scenarios": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
