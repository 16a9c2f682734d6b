"""The master secret on disk: created owner-only in one step, and warned about when others can
read it (a secret or a TLS key that the group or the world can read is no secret)."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from fedpipe.auth.tokens import new_secret

__all__ = ["create_secret_file", "read_secret_file", "warn_if_readable"]

log = logging.getLogger(__name__)


def create_secret_file(path: Path) -> Path:
    """Write a new secret to ``path``, created owner-only (0600) and never over an existing file
    (``O_EXCL``: no window in which the file exists with looser permissions)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(new_secret())
    return path


def read_secret_file(path: Path) -> str:
    """The secret in ``path`` (warned about if others can read it); empty raises ValueError."""
    warn_if_readable(path, "secret file")
    secret = path.read_text().strip()
    if not secret:
        raise ValueError(f"secret file {path} is empty; delete it to get a new secret")
    return secret


def warn_if_readable(path: Path, what: str) -> bool:
    """Log a warning if the group or others may read ``path``; True when they may."""
    mode = path.stat().st_mode
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        log.warning(
            "%s %s can be read by its group or by everyone (mode %o): run chmod 600 %s",
            what,
            path,
            stat.S_IMODE(mode),
            path,
        )
        return True
    return False
