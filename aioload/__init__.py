"""aioload: a PyTorch data loader with asyncio reads, worker-process decode and zero-copy batches."""

from aioload import transforms
from aioload._dataset import Dataset
from aioload._errors import DataLoaderTimeoutError, LoaderClosedError, TooManyErrorsError, WorkerCrashedError
from aioload._loader import DataLoader
from aioload._stats import LoaderStats
from aioload._storage import read_bytes, read_range
from aioload.images import ImageFolder, decode_image

__version__ = "0.1.0"

__all__ = [
    "DataLoader",
    "DataLoaderTimeoutError",
    "Dataset",
    "ImageFolder",
    "LoaderClosedError",
    "LoaderStats",
    "TooManyErrorsError",
    "WorkerCrashedError",
    "decode_image",
    "read_bytes",
    "read_range",
    "transforms",
]
