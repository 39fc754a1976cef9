"""aioload: a PyTorch data loader with asyncio reads, worker-process decode and zero-copy batches."""

from aioload import transforms
from aioload._cache import CacheStats, MemoryCache
from aioload._dataset import Dataset
from aioload._diskcache import DiskCache
from aioload._errors import DataLoaderTimeoutError, LoaderClosedError, TooManyErrorsError, WorkerCrashedError
from aioload._loader import DataLoader
from aioload._retry import RemoteReadError, RetryPolicy
from aioload._stats import LoaderStats
from aioload._storage import Storage, read_bytes, read_range
from aioload._strings import StringList
from aioload.images import ImageFiles, ImageFolder, decode_image

__version__ = "0.1.0"

__all__ = [
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
    "RemoteReadError",
    "RetryPolicy",
    "Storage",
    "StringList",
    "TooManyErrorsError",
    "WorkerCrashedError",
    "decode_image",
    "read_bytes",
    "read_range",
    "transforms",
]
