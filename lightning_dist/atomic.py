"""Atomic writes: a reader (or a crash) never sees a half-written file or checkpoint folder.

One rule for every file the pack writes (checkpoints, exported weights, dry-run results): write under a
temporary name in the same folder, flush to disk, then rename (``os.replace`` is atomic on POSIX).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any


def atomic_write(path: str | os.PathLike, write: Callable[[IO[Any]], None], *, mode: str = "wb") -> None:
    """Call ``write(file)`` on a temporary file next to ``path``, fsync it, then rename it to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def swap_in(tmp: str | os.PathLike, path: str | os.PathLike) -> None:
    """Replace ``path`` (file or folder) by the finished ``tmp`` so that a complete one always exists on disk.

    The previous ``path`` is renamed to ``<path>.old`` first and removed last: a crash between the two
    renames leaves it there (:func:`lightning_dist.checkpoint.load` falls back to it).
    """
    tmp, path = Path(tmp), Path(path)
    old = path.with_name(path.name + ".old")
    if old.exists():
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    if old.exists():
        shutil.rmtree(old) if old.is_dir() else old.unlink()
