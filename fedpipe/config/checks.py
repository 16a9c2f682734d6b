"""The checks every section's settings share: one line naming the setting, or nothing."""

from __future__ import annotations

from typing import Any

from fedpipe.config.codecs import check_codec

__all__ = ["check", "is_codec", "list_entries", "split_entries"]


def check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def list_entries(value: Any, key: str) -> list[Any]:
    """The entries of a list setting given as a list or tuple (a TOML array, a built config)."""
    if isinstance(value, (list, tuple)):
        return list(value)
    raise ValueError(f"{key} must be a list or a comma-separated string, got {value!r}")


def is_codec(name: str) -> bool:
    try:
        check_codec(name)
    except ValueError:
        return False
    return True


def split_entries(value: Any, key: str, what: str, sep: str = ",") -> tuple[str, ...]:
    """A list setting of strings: a ``sep``-separated string (blank entries skipped) or a
    list or tuple, each entry one ``what`` (a string, not blank, without ``sep``), stripped."""
    if isinstance(value, str):
        return tuple(e.strip() for e in value.split(sep) if e.strip())
    out = []
    for item in list_entries(value, key):
        ok = isinstance(item, str) and bool(item.strip()) and sep not in item
        check(ok, f"{key}: entry {item!r} is not one {what}")
        out.append(item.strip())
    return tuple(out)
