"""Flower config values as TOML that survives Flower's ``k=v`` command-line parser."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["ConfigValue", "flat_items", "format_config_args", "toml_value"]

ConfigValue = bool | int | float | str
_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def toml_value(value: ConfigValue) -> str:
    """Render one scalar as TOML that also survives Flower's ``k=v`` command-line parser.

    Flower splits ``--run-config``/``--node-config`` with a regex that ends a quoted
    string at the next quote of the same kind, so strings use a TOML literal string
    ('...', backslashes kept as-is) unless they contain a single quote.
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        if "\n" in value or "\r" in value:
            raise ValueError(f"config strings cannot hold newlines: {value!r}")
        if "'" not in value:
            return f"'{value}'"
        if '"' not in value and "\\" not in value:
            return f'"{value}"'
        raise ValueError(
            f"config string {value!r} holds both quote kinds (or ' and a backslash); "
            "Flower's k=v parser cannot carry it: pass a path to a file instead"
        )
    raise TypeError(f"config values must be bool, int, float or str, got {type(value).__name__}")


def flat_items(config: Mapping[str, Any], prefix: str = "") -> list[tuple[str, ConfigValue]]:
    """Flatten nested dicts into dotted keys, as Flower flattens run configs."""
    items: list[tuple[str, ConfigValue]] = []
    for key, value in config.items():
        if not _BARE_KEY.match(key):
            raise ValueError(f"config key {key!r} must match [A-Za-z0-9_-]+")
        if isinstance(value, Mapping):
            items += flat_items(value, f"{prefix}{key}.")
        else:
            items.append((f"{prefix}{key}", value))
    return items


def format_config_args(config: Mapping[str, Any]) -> str:
    """Render a config as Flower's space-separated ``k=v`` string (TOML values)."""
    return " ".join(f"{key}={toml_value(value)}" for key, value in flat_items(config))
