"""fedpipe's cache folder, and the one way files are written there: whole or not at all."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["cache_root", "fsync_path", "write_atomic"]


def cache_root(cache_dir: Path | None = None) -> Path:
    """The cache folder: ``cache_dir``, else $FEDPIPE_CACHE, else ~/.cache/fedpipe."""
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("FEDPIPE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "fedpipe"


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path``, fsync it, rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{path.stem}-", suffix=path.suffix, dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_path(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def fsync_path(path: Path) -> None:
    """fsync a file or a folder (a folder's fsync makes renames and new entries durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
