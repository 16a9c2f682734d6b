"""Loading settings: defaults, then a TOML file's tables, then ``--set`` overrides."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from fedpipe.config.fedpipe_config import FedpipeConfig

__all__ = ["load_config", "load_given", "parse_overrides", "read_settings_file"]


def parse_overrides(items: list[str]) -> dict[str, str]:
    """``["pipeline.microbatches=8"]`` -> ``{"pipeline.microbatches": "8"}``."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set expects section.key=value, got {item!r}")
        out[key.strip()] = value.strip().strip('"')
    return out


def read_settings_file(path: str | Path) -> dict[str, Any]:
    """A TOML settings file's tables as ``{"section.key": value}`` (one line if it cannot)."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"--config: settings file {path} does not exist")
    with open(path, "rb") as fh:
        try:
            data = tomllib.load(fh)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{path}: not valid TOML ({exc})") from None
    flat: dict[str, Any] = {}
    for section, table in data.items():
        if not isinstance(table, dict):
            raise ValueError(f"{path}: top-level key {section!r} must be a [table]")
        flat.update({f"{section}.{k}": v for k, v in table.items()})
    return flat


def load_given(
    path: str | Path | None = None, overrides: dict[str, Any] | None = None
) -> tuple[FedpipeConfig, set[str]]:
    """:func:`load_config`, and the settings the file and the overrides gave (the file read
    once): what a ``--resume`` takes from the command line rather than the run folder."""
    flat = read_settings_file(path) if path is not None else {}
    flat.update(overrides or {})
    return FedpipeConfig().with_overrides(flat), set(flat)


def load_config(
    path: str | Path | None = None, overrides: dict[str, Any] | None = None
) -> FedpipeConfig:
    """Defaults, then a TOML file's tables, then overrides (CLI flags win)."""
    return load_given(path, overrides)[0]
