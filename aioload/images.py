"""Image datasets and decoding: image bytes to uint8 ``C, H, W`` tensors in the workers.

JPEG, PNG, WebP and GIF (and AVIF and HEIC where the decoder has them) are decoded by
torchcodec's image decoders (libjpeg-turbo, libpng, libwebp; no FFmpeg needed) where
torchcodec is installed and torch is 2.11 or newer, and by torchvision's decoding operator
otherwise (torchvision 0.29 deprecates its image decoding in favour of torchcodec's; the two
give bit-identical images at the same speed). Every other format Pillow reads (BMP, TIFF,
PPM/PGM, TGA, ICO, ...: the rest of torchvision's ``ImageFolder`` extensions) is decoded by
Pillow, converted to RGB as torchvision's ``ImageFolder`` loader does. When ``decode_size`` says the transform only
needs a much smaller image, JPEGs are decoded at 1/2, 1/4 or 1/8 scale in the DCT domain
(Pillow's ``draft``), which is several times cheaper than decoding at full size and resizing.
Images stay uint8 until the device, where :class:`aioload.transforms.Normalize` converts them.

Reads go through an :class:`aioload.Storage`, so a folder or a list of files can live on a
local disk, behind HTTP or in an object store, with retries and an optional cache.
"""

from __future__ import annotations

import functools
import io
import os
import re
import warnings
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torchvision.io
from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, has_file_allowed_extension, make_dataset

from aioload._storage import fsspec as _fsspec
from aioload._storage.cache import MemoryCache
from aioload._storage.diskcache import DiskCache
from aioload._data.dataset import NOT_READY, Dataset
from aioload._storage.mounts import is_network
from aioload._storage.storage import Storage, locate, read_bytes_blocking

__all__ = ["ImageFiles", "ImageFolder", "decode_image"]

_JPEG_MAGIC = b"\xff\xd8\xff"
_FAST_MAGIC = (_JPEG_MAGIC, b"\x89PNG\r\n\x1a\n", b"GIF87a", b"GIF89a")
"""How the formats the fast decoders take begin (WebP, AVIF and HEIC are told by
:func:`_fast_format`); every other image goes to Pillow."""


def decode_image(data: bytes | bytearray | memoryview, size: tuple[int, int] | None = None) -> torch.Tensor:
    """Decode image bytes to a uint8 RGB tensor of shape ``(3, H, W)``.

    With ``size=(h, w)``, a JPEG at least twice as large in both sides is decoded at a reduced
    scale that still covers ``size`` (never smaller than asked).
    """
    jpeg = bytes(data[:3]) == _JPEG_MAGIC
    if size is not None and jpeg:
        reduced = _decode_jpeg_reduced(data, size)
        if reduced is not None:
            return reduced
    if not jpeg and not _fast_format(data):
        return _decode_pillow(data)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return _decode_rgb(buf, jpeg)


def _fast_format(data) -> bool:
    """Whether torchcodec's (or torchvision's) decoder takes these bytes: JPEG, PNG, GIF, WebP
    (``RIFF....WEBP``), AVIF and HEIC (an ISO media ``ftyp`` box)."""
    head = bytes(data[:12])
    return (head.startswith(_FAST_MAGIC) or (head[:4] == b"RIFF" and head[8:12] == b"WEBP")
            or head[4:8] == b"ftyp")


def _decode_pillow(data) -> torch.Tensor:
    """An image in a format the fast decoders do not take (BMP, TIFF, PPM, ...), decoded by
    Pillow and converted to RGB, as torchvision's ``ImageFolder`` loader does."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as im:
            arr = np.asarray(im.convert("RGB"))
    except UnidentifiedImageError:
        raise RuntimeError(
            f"not an image format aioload decodes (it begins {bytes(data[:8])!r}): JPEG, PNG, WebP, GIF and "
            "every format Pillow reads (BMP, TIFF, PPM, ...) are; convert the file to one of them, or pass "
            "is_valid_file= to leave such files out") from None
    return torch.from_numpy(arr.copy()).permute(2, 0, 1).contiguous()


_TORCHCODEC: Any = None  # torchcodec.decoders, False where it cannot be used, None until looked for


def torchcodec_images() -> Any:
    """``torchcodec.decoders`` where it decodes images here (torchcodec installed, torch >=
    2.11, which torchcodec 0.16+ needs), else ``None``: torchvision's operator is used then."""
    global _TORCHCODEC
    if _TORCHCODEC is None:
        _TORCHCODEC = False
        version = tuple(int(part) for part in re.findall(r"\d+", torch.__version__)[:2])
        if version >= (2, 11):
            decoders: Any = None
            try:
                import torchcodec.decoders as decoders
            except (ImportError, OSError, RuntimeError):  # not installed, or built for another torch
                pass
            if decoders is not None and hasattr(decoders, "decode_jpeg") and hasattr(decoders, "decode_image"):
                _TORCHCODEC = decoders
    return _TORCHCODEC or None


def _decode_rgb(buf: torch.Tensor, jpeg: bool) -> torch.Tensor:
    codec = torchcodec_images()
    if codec is not None:
        if jpeg:
            return codec.decode_jpeg(buf, mode="RGB")
        try:
            return codec.decode_image(buf, mode="RGB")
        except ValueError as exc:  # an unknown format: a RuntimeError, as torchvision's decoder raises
            raise RuntimeError(str(exc)) from exc
    # torchvision >= 0.29 warns on every call to its (deprecated) image functions; the
    # operator underneath is the same libjpeg-turbo/libpng decoder, called directly.
    op = getattr(getattr(torch.ops, "image", None), "decode_image", None)
    if op is not None:
        return op(buf, torchvision.io.ImageReadMode.RGB.value, False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return torchvision.io.decode_image(buf, mode=torchvision.io.ImageReadMode.RGB)


def _decode_jpeg_reduced(data, size: tuple[int, int]) -> torch.Tensor | None:
    from PIL import Image

    h, w = size
    with Image.open(io.BytesIO(data)) as im:
        if im.width < 2 * w or im.height < 2 * h:
            return None
        im.draft("RGB", (w, h))
        rgb = im.convert("RGB")
        arr = np.asarray(rgb)
    return torch.from_numpy(arr.copy()).permute(2, 0, 1).contiguous()


def _check_decode_device(decode_device) -> torch.device | None:
    """The device a dataset's images are decoded on, validated at the dataset's construction."""
    if decode_device is None:
        return None
    try:
        device = torch.device(decode_device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"decode_device must be None or a CUDA device such as 'cuda' or 'cuda:1', "
                         f"got {decode_device!r}") from exc
    if device.type != "cuda":
        raise ValueError(f"decode_device={decode_device!r}: only CUDA devices decode JPEGs here; leave "
                         "decode_device=None to decode on the CPU in the worker processes")
    if not torch.cuda.is_available():
        raise RuntimeError(f"decode_device={decode_device!r} needs a CUDA GPU, and torch.cuda.is_available() "
                           "is False in this process: leave decode_device=None to decode on the CPU in the "
                           "worker processes")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"decode_device={decode_device!r}: this process sees {torch.cuda.device_count()} "
                         "CUDA device(s)")
    return device


def _encoded_payload(data, decode) -> torch.Tensor:
    """In the worker: a JPEG's bytes as a 1-D uint8 tensor, any other image decoded by ``decode``."""
    if bytes(data[:3]) == _JPEG_MAGIC:
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return decode(data)


class _Images(Dataset):
    """What the image datasets share: locations and targets in numpy arrays, reads through a
    :class:`Storage`, decoding to uint8 ``(3, H, W)`` tensors.

    Locations are kept in one numpy array rather than a list of Python strings, so forked
    workers do not copy the list page by page as reference counts change (copy-on-read).

    A subclass may override ``read`` (``dataset[i]`` and the loader then both go through it)
    or ``decode``, which always receives ``(bytes, target)``, also for a local file the worker
    reads itself.
    """

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        decode = getattr(cls, "decode", None)
        if callable(decode) and decode is not _Images.decode and not getattr(decode, "_reads_local_files", False):
            cls.decode = _given_bytes(decode)  # type: ignore[method-assign]

    def _setup(self, locations: Sequence[str], targets, transform, target_transform, decode_size,
               storage: Storage | None, cache, read_in: str = "auto", decode_device=None) -> None:
        if read_in not in ("auto", "loop", "worker"):
            raise ValueError(f"read_in must be 'auto', 'loop' or 'worker', got {read_in!r}")
        self.decode_device = _check_decode_device(decode_device)
        self.transform = transform
        self.target_transform = target_transform
        self.decode_size = decode_size
        self.storage = _storage(storage, cache)
        self._paths = np.array([os.fsencode(p) for p in locations], dtype=np.bytes_)
        self._targets = targets
        self.read_in = read_in
        self._read_in_worker = _reads_in_worker(read_in, locations, self.storage)
        # Look the decoder up here, in the process that builds the dataset: workers forked from
        # it inherit torchcodec, instead of each importing it (0.1-0.5 s) at its first sample of
        # every epoch, before its first batch.
        torchcodec_images()

    def __len__(self) -> int:
        return len(self._paths)

    def path(self, index: int) -> str:
        """The local path or URL of sample ``index``."""
        return os.fsdecode(self._paths[index])

    def describe(self, index: int) -> str:
        return self.path(index)

    def _target(self, index: int):
        return None if self._targets is None else self._targets[index].item()

    async def read(self, index: int) -> tuple:
        if self._read_in_worker:
            return self._raw(_LocalFile(self.path(index)), index)
        return self._raw(await self.storage.read_bytes(self.path(index)), index)

    def _raw(self, data, index: int) -> tuple:
        """The raw item: ``(data, target)``; with ``decode_device``, the index goes along too
        (the device stage seeds each sample's transform by it)."""
        if self.decode_device is not None:
            return data, self._target(index), index
        return data, self._target(index)

    def read_nowait(self, index: int) -> tuple[_LocalFile, Any] | Any:
        # only while ``read`` is this class's own: a subclass that adds work to its reads
        # (latency, a lookup) must have them awaited
        if type(self).read is not _Images.read:
            return NOT_READY
        return self._local_file(index)

    def _local_file(self, index: int) -> tuple[_LocalFile, Any] | Any:
        """The raw item of a file the worker reads itself, or ``NOT_READY``."""
        if self._read_in_worker:
            return self._raw(_LocalFile(self.path(index)), index)
        return NOT_READY

    def read_blocking(self, index: int) -> Any:
        if type(self).read is not _Images.read:
            return super().read_blocking(index)  # a subclass's own read, on an event loop of its own
        return self.storage.read_bytes_blocking(self.path(index)), self._target(index)

    def decode(self, raw: tuple) -> Any:
        if len(raw) == 3:  # decode_device: a JPEG goes to the GPU as it is (see aioload._engine.gpudecode)
            data, target, index = raw
            if isinstance(data, _LocalFile):
                data = read_bytes_blocking(data.path)
            if self._targets is not None and self.target_transform is not None:
                target = self.target_transform(target)
            return _encoded_payload(data, decode_image), target, index
        data, target = raw
        if isinstance(data, _LocalFile):
            data = read_bytes_blocking(data.path)
        image = decode_image(data, self.decode_size)
        if self.transform is not None:
            image = self.transform(image)
        if self._targets is None:
            return image
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target


def _given_bytes(decode: Callable) -> Callable:
    """A subclass's ``decode``, handed the bytes of a local file the worker reads itself (the
    built-in ``read`` passes such a file on as a :class:`_LocalFile`, not as bytes)."""

    @functools.wraps(decode)
    def decode_bytes(self, raw):
        if isinstance(raw, tuple) and len(raw) == 2 and isinstance(raw[0], _LocalFile):
            raw = (read_bytes_blocking(raw[0].path), raw[1])
        return decode(self, raw)

    decode_bytes._reads_local_files = True  # type: ignore[attr-defined]
    return decode_bytes


class _LocalFile:
    """A local file the worker reads itself, just before decoding it."""

    __slots__ = ("path",)

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (_LocalFile, (self.path,))


def _reads_in_worker(read_in: str, locations: Sequence[str], storage: Storage) -> bool:
    """Where the bytes of local files are read. A file on a local disk is read fastest by the
    worker that decodes it: the main process then spends nothing per image and no bytes cross
    a socket. Storage with latency -- network file systems, URLs -- is read on the event loop,
    many reads in flight. A cache lives in the main process, so it needs reads there too."""
    if read_in != "auto":
        return read_in == "worker" and all(locate(p)[0] == "local" for p in locations[:1])
    if not locations or storage.cache is not None:
        return False
    kind, where = locate(os.fspath(locations[0]))
    return kind == "local" and not is_network(os.path.dirname(os.path.abspath(where)) or ".")


def _storage(storage: Storage | None, cache) -> Storage:
    if storage is not None and cache is not None:
        raise TypeError("pass either storage= or cache=, not both: give the cache to the storage, "
                        "Storage(cache=..., retry=...)")
    if storage is None:
        return Storage(cache=cache)
    if not isinstance(storage, Storage):
        raise TypeError(f"storage must be an aioload.Storage, got {type(storage).__name__}")
    return storage


class ImageFolder(_Images):
    """``torchvision.datasets.ImageFolder``, read by the event loop and decoded in the workers.

    Same ``classes``, ``class_to_idx``, ``samples``, ``targets`` and order as torchvision's.
    A sample is ``(image, target)`` where ``image`` is a uint8 ``(3, H, W)`` tensor (RGB), so
    ``torchvision.transforms.v2`` pipelines apply directly. ``decode_size=(h, w)``: the
    smallest image the transform needs, which lets large JPEGs decode at reduced scale.
    Every file listed is decoded: JPEG, PNG, WebP and GIF by torchcodec's (or torchvision's)
    decoder, every other format Pillow reads (BMP, TIFF, PPM, PGM, ...) by Pillow, converted
    to RGB as torchvision's loader does.

    ``root`` may also be an fsspec URL whose filesystem can list (``s3://bucket/train``,
    ``gs://...``, ``memory://...``; options in ``storage=Storage(storage_options=...)``).
    ``cache=`` (a :class:`aioload.MemoryCache` or :class:`aioload.DiskCache`) keeps raw
    bytes for later epochs; ``storage=`` sets retries, timeouts and connections instead.

    ``read_in``: where a local file's bytes are read. ``"auto"`` (default) reads files on a
    local disk in the worker that decodes them (the cheapest place: no main-process CPU, no
    bytes through a socket) and files on a network file system on the event loop, many in
    flight; ``"loop"`` or ``"worker"`` force one or the other.

    ``decode_device="cuda"``: decode JPEGs on the GPU, for nodes whose CPUs cannot keep up.
    Workers (or, with ``num_workers=0``, the read stage) deliver each batch's encoded JPEGs;
    the loader decodes them in one batched nvJPEG call on a side stream, runs ``transform`` on
    the device (it must give every image one size) and delivers ``(images, targets)`` on the
    device. Other formats, and files nvJPEG rejects, are decoded on the CPU; ``decode_size``
    does not apply. ``dataset[i]`` still decodes on the CPU. See ``docs/gpu.md``.
    """

    def __init__(self, root: str | os.PathLike, transform: Callable | None = None,
                 target_transform: Callable | None = None, *, is_valid_file: Callable[[str], bool] | None = None,
                 allow_empty: bool = False, decode_size: tuple[int, int] | None = None,
                 cache: MemoryCache | DiskCache | None = None, storage: Storage | None = None,
                 read_in: str = "auto", decode_device: str | torch.device | None = None):
        self.root = os.fspath(root)
        extensions = IMG_EXTENSIONS if is_valid_file is None else None
        self.classes, self.class_to_idx, samples = class_folder(self.root, storage, extensions, is_valid_file,
                                                                allow_empty, "ImageFolder", "aioload.ImageFiles")
        self.extensions = extensions
        targets = np.array([t for _, t in samples], dtype=np.int64)
        self._setup([p for p, _ in samples], targets, transform, target_transform, decode_size, storage, cache,
                    read_in, decode_device)

    @property
    def samples(self) -> list[tuple[str, int]]:
        return [(os.fsdecode(p), int(t)) for p, t in zip(self._paths, self._targets)]

    imgs = samples

    @property
    def targets(self) -> list[int]:
        return self._targets.tolist()

    def __repr__(self) -> str:
        return f"ImageFolder(root={self.root!r}, samples={len(self)}, classes={len(self.classes)})"


def class_folder(root: str, storage: Storage | None, extensions, is_valid_file, allow_empty: bool, name: str,
                 files_class: str) -> tuple[list[str], dict[str, int], list[tuple[str, int]]]:
    """``(classes, class_to_idx, samples)`` of a class-per-folder tree, as torchvision's
    ``ImageFolder`` finds them: a local folder, or an fsspec URL listed through ``storage``'s
    options. ``name`` and ``files_class`` word the error for a root that cannot be listed."""
    kind, where = locate(root)
    if kind == "local":
        classes, class_to_idx = find_classes(where)
        return classes, class_to_idx, make_dataset(where, class_to_idx, extensions, is_valid_file, allow_empty)
    if kind == "fsspec":
        options = storage.storage_options if storage is not None else {}
        return _listed_folder(root, options, extensions, is_valid_file, allow_empty)
    raise ValueError(f"{name} needs a root it can list, got {root!r}: HTTP servers cannot list folders; pass "
                     f"the URLs to {files_class} instead")


def _listed_folder(root: str, options, extensions, is_valid_file, allow_empty):
    """torchvision's ``find_classes`` + ``make_dataset`` over an fsspec listing: same classes,
    same order (directories sorted, then file names within each), same errors."""
    if (extensions is None) == (is_valid_file is None):
        raise ValueError("Both extensions and is_valid_file cannot be None or not None at the same time")
    entries = _fsspec.find(root, options)
    classes = sorted(rel for rel, kind in entries.items() if kind == "directory" and "/" not in rel)
    if not classes:
        raise FileNotFoundError(f"Couldn't find any class folder in {root}.")
    class_to_idx = {name: i for i, name in enumerate(classes)}
    valid = is_valid_file or (lambda p: has_file_allowed_extension(p, extensions))
    base = root.rstrip("/") + "/"
    files = sorted(rel.rpartition("/")[::2] for rel, kind in entries.items() if kind != "directory")
    samples, found = [], set()
    for name in classes:
        for folder, fname in files:
            if folder == name or folder.startswith(name + "/"):
                url = f"{base}{folder}/{fname}"
                if valid(url):
                    samples.append((url, class_to_idx[name]))
                    found.add(name)
    empty = set(classes) - found
    if empty and not allow_empty:
        msg = f"Found no valid file for the classes {', '.join(sorted(empty))}. "
        if extensions is not None:
            msg += f"Supported extensions are: {extensions if isinstance(extensions, str) else ', '.join(extensions)}"
        raise FileNotFoundError(msg)
    return classes, class_to_idx, samples


class ImageFiles(_Images):
    """Images at a list of local paths or URLs (``http(s)://``, ``s3://``, any fsspec URL).

    A sample is ``(image, label)`` with ``labels`` (one number per path), or the image alone
    without; ``image`` is a uint8 ``(3, H, W)`` RGB tensor as in :class:`ImageFolder`.
    ``decode_size``, ``transform`` and ``target_transform`` work as there. ``cache=`` keeps
    raw bytes for later epochs; ``storage=`` (an :class:`aioload.Storage`) sets retries,
    timeouts, connections and headers instead. ``decode_device="cuda"`` decodes JPEGs on the
    GPU, as in :class:`ImageFolder`.
    """

    def __init__(self, paths_or_urls: Sequence[str | os.PathLike], labels: Sequence[Any] | None = None,
                 transform: Callable | None = None, target_transform: Callable | None = None,
                 decode_size: tuple[int, int] | None = None, *, cache: MemoryCache | DiskCache | None = None,
                 storage: Storage | None = None, read_in: str = "auto",
                 decode_device: str | torch.device | None = None):
        if isinstance(paths_or_urls, (str, bytes, os.PathLike)):
            raise TypeError("paths_or_urls must be a sequence of paths or URLs, not a single one: "
                            "wrap it in a list, or use aioload.ImageFolder for a folder")
        locations = [os.fspath(p) for p in paths_or_urls]
        targets = None
        if labels is not None:
            targets = np.asarray(labels)
            if targets.ndim != 1 or len(targets) != len(locations):
                raise ValueError(f"labels must hold one label per path: got {targets.shape} labels "
                                 f"for {len(locations)} paths")
            if targets.dtype.kind not in "biuf":
                raise TypeError(f"labels must be numbers (class indices), got dtype {targets.dtype}")
        self._setup(locations, targets, transform, target_transform, decode_size, storage, cache, read_in,
                    decode_device)

    @property
    def targets(self) -> list | None:
        return None if self._targets is None else self._targets.tolist()

    def __repr__(self) -> str:
        return f"ImageFiles(samples={len(self)}, labels={self._targets is not None})"
