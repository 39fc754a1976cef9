"""Where aioload keeps what it makes for later runs: ``$AIOLOAD_CACHE``, else ``~/.cache/aioload``.

Shard indexes (``shard-index/``), Parquet footers (``parquet-footer/``) and the generated data
of ``aioload make-data`` and ``make_videos`` live under it, each in a folder of its own.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where generated data lives: ``$AIOLOAD_CACHE``, else ``~/.cache/aioload``."""
    root = os.environ.get("AIOLOAD_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "aioload")
    return Path(root)
