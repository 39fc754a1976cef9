"""aioload: a PyTorch data loader with asyncio reads, worker-process decode and zero-copy batches."""

from aioload import transforms
from aioload._storage.cache import CacheStats, MemoryCache
from aioload._dataset import Dataset
from aioload._storage.diskcache import DiskCache
from aioload._errors import (BlockingReadWarning, DataLoaderTimeoutError, LoaderClosedError, TooManyErrorsError,
                             WorkerCrashedError)
from aioload._loader import DataLoader
from aioload._media.audio import AudioFiles
from aioload._media.frombytes import count_clips, decode_audio, decode_clip
from aioload._media.synth import make_videos
from aioload._media.video import VideoFiles, VideoFolder
from aioload._mix.dataset import Mix
from aioload._storage.retry import RemoteReadError, RetryPolicy
from aioload._observe.stats import LoaderStats
from aioload._parquet.dataset import Parquet
from aioload._parquet.footer import ParquetError
from aioload._shards.dataset import WebDataset
from aioload._shards.decoders import decode_sample
from aioload._shards.index import ShardError
from aioload._shards.writer import ShardWriter
from aioload._storage.storage import Storage, read_bytes, read_range
from aioload._strings import StringList
from aioload._tokens.dataset import PackedTokens
from aioload._tools.synth import make_data

__version__ = "0.1.0"

_IMAGES = ("ImageFiles", "ImageFolder", "decode_image")


def __getattr__(name: str):
    # The image helpers need torchvision, whose import takes seconds (it pulls in its models
    # and torch._dynamo): it happens on first use, not at ``import aioload``.
    if name in _IMAGES or name == "images":
        import importlib

        images = importlib.import_module("aioload.images")
        return images if name == "images" else getattr(images, name)
    raise AttributeError(f"module 'aioload' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_IMAGES])

__all__ = [
    "AudioFiles",
    "BlockingReadWarning",
    "CacheStats",
    "DataLoader",
    "DataLoaderTimeoutError",
    "Dataset",
    "DiskCache",
    "ImageFiles",
    "ImageFolder",
    "LoaderClosedError",
    "LoaderStats",
    "MemoryCache",
    "Mix",
    "PackedTokens",
    "Parquet",
    "ParquetError",
    "RemoteReadError",
    "RetryPolicy",
    "ShardError",
    "ShardWriter",
    "Storage",
    "StringList",
    "TooManyErrorsError",
    "VideoFiles",
    "VideoFolder",
    "WebDataset",
    "WorkerCrashedError",
    "count_clips",
    "decode_audio",
    "decode_clip",
    "decode_image",
    "decode_sample",
    "make_data",
    "make_videos",
    "read_bytes",
    "read_range",
    "transforms",
]
