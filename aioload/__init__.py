"""aioload: a PyTorch data loader with asyncio reads, worker-process decode and zero-copy batches."""

import typing as _typing

__version__ = "0.1.0"

# Every name is imported on first use: ``import aioload`` itself imports nothing, so the
# ``aioload`` command answers --help and --version without importing torch (seconds), and the
# image helpers' torchvision (its models and torch._dynamo, seconds more) waits until they are used.
_EXPORTS = {
    "AudioFiles": "aioload._media.audio",
    "BlockingReadWarning": "aioload._base.errors",
    "CacheStats": "aioload._storage.cache",
    "CopyOnReadWarning": "aioload._base.errors",
    "DataLoader": "aioload._front.loader",
    "DataLoaderTimeoutError": "aioload._base.errors",
    "Dataset": "aioload._data.dataset",
    "DiskCache": "aioload._storage.diskcache",
    "ImageFiles": "aioload.images",
    "ImageFolder": "aioload.images",
    "LoaderClosedError": "aioload._base.errors",
    "LoaderStats": "aioload._observe.stats",
    "MemoryCache": "aioload._storage.cache",
    "Mix": "aioload._mix.dataset",
    "PackedTokens": "aioload._tokens.dataset",
    "Parquet": "aioload._parquet.dataset",
    "ParquetError": "aioload._parquet.footer",
    "RemoteReadError": "aioload._storage.retry",
    "RetryPolicy": "aioload._storage.retry",
    "ShardError": "aioload._shards.index",
    "ShardWriter": "aioload._shards.writer",
    "StalledWarning": "aioload._base.errors",
    "Storage": "aioload._storage.storage",
    "StringList": "aioload._data.strings",
    "TooManyErrorsError": "aioload._base.errors",
    "VideoFiles": "aioload._media.video",
    "VideoFolder": "aioload._media.video",
    "WebDataset": "aioload._shards.dataset",
    "WorkerCrashedError": "aioload._base.errors",
    "count_clips": "aioload._media.frombytes",
    "decode_audio": "aioload._media.frombytes",
    "decode_clip": "aioload._media.frombytes",
    "decode_image": "aioload.images",
    "decode_sample": "aioload._shards.dataset",
    "make_data": "aioload._data.synth",
    "make_videos": "aioload._media.synth",
    "read_bytes": "aioload._storage.storage",
    "read_range": "aioload._storage.storage",
}
_SUBMODULES = ("images", "integrations", "transforms")

if _typing.TYPE_CHECKING:  # what type checkers and editors see; at run time, __getattr__ below
    from aioload import images, integrations, transforms
    from aioload._data.dataset import Dataset
    from aioload._base.errors import (BlockingReadWarning, CopyOnReadWarning, DataLoaderTimeoutError,
                                 LoaderClosedError, StalledWarning, TooManyErrorsError, WorkerCrashedError)
    from aioload._front.loader import DataLoader
    from aioload._media.audio import AudioFiles
    from aioload._media.frombytes import count_clips, decode_audio, decode_clip
    from aioload._media.synth import make_videos
    from aioload._media.video import VideoFiles, VideoFolder
    from aioload._mix.dataset import Mix
    from aioload._observe.stats import LoaderStats
    from aioload._parquet.dataset import Parquet
    from aioload._parquet.footer import ParquetError
    from aioload._shards.dataset import WebDataset, decode_sample
    from aioload._shards.index import ShardError
    from aioload._shards.writer import ShardWriter
    from aioload._storage.cache import CacheStats, MemoryCache
    from aioload._storage.diskcache import DiskCache
    from aioload._storage.retry import RemoteReadError, RetryPolicy
    from aioload._storage.storage import Storage, read_bytes, read_range
    from aioload._data.strings import StringList
    from aioload._tokens.dataset import PackedTokens
    from aioload._data.synth import make_data
    from aioload.images import ImageFiles, ImageFolder, decode_image


def __getattr__(name: str):
    import importlib

    if name in _SUBMODULES:
        return importlib.import_module(f"aioload.{name}")
    if name not in _EXPORTS:
        raise AttributeError(f"module 'aioload' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # found directly from now on
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS, *_SUBMODULES})


__all__ = [
    "AudioFiles",
    "BlockingReadWarning",
    "CacheStats",
    "CopyOnReadWarning",
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
    "StalledWarning",
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
