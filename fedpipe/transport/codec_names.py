"""Codec names, parsed without torch (settings validate them before any model loads).

A codec is named by a plain string, so that a setting, a CLI flag or a planner can choose one
per link: ``fp32``, ``bf16``, ``fp16``, ``int8``, and the low-bit codecs ``int4`` and ``int2``.
A low-bit name may end in ``g<G>`` to choose its group size (``int4g128``, ``int2g32``): each
run of ``G`` consecutive values (row-major) shares one scale and one offset. Without a suffix
``G`` is :data:`DEFAULT_GROUP`.
"""

from __future__ import annotations

import re

__all__ = [
    "CODECS",
    "DEFAULT_GROUP",
    "GROUP_SIZES",
    "LOW_BIT",
    "check_codec",
    "codec_base",
    "codec_bits",
    "codec_group",
    "codec_help",
    "codec_name",
]

CODECS: tuple[str, ...] = ("fp32", "bf16", "fp16", "int8", "int4", "int2")
LOW_BIT: dict[str, int] = {"int4": 4, "int2": 2}  # base name -> bits per value
DEFAULT_GROUP = 64
# Powers of two: small groups follow outliers closely, large ones spend fewer bytes on scales
# (two fp32 numbers per group: 64 bits over G values, 1 bit per value at G = 64).
GROUP_SIZES: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024)
_NAME = re.compile(r"^(int4|int2)g(\d+)$")


def codec_help() -> str:
    """The allowed values, for error messages and ``--help``."""
    sizes = ", ".join(str(g) for g in GROUP_SIZES)
    return f"{', '.join(CODECS)}, or int4g<G> / int2g<G> with G in {sizes}"


def _parse(name: str) -> tuple[str, int] | None:
    """(base codec, group size) of a valid name, or None; group 0 for codecs without groups."""
    if name in CODECS:
        return name, DEFAULT_GROUP if name in LOW_BIT else 0
    match = _NAME.match(name)
    if match and int(match.group(2)) in GROUP_SIZES and match.group(2)[0] != "0":
        return match.group(1), int(match.group(2))
    return None


def check_codec(name: str) -> str:
    """``name`` if it names a codec; else a ``ValueError`` listing the allowed values."""
    if not isinstance(name, str) or _parse(name) is None:
        raise ValueError(f"unknown codec {name!r}; choose one of {codec_help()}")
    return name


def codec_base(name: str) -> str:
    """The codec a name selects on the wire: ``int4g128`` -> ``int4``."""
    parsed = _parse(check_codec(name))
    assert parsed is not None
    return parsed[0]


def codec_group(name: str) -> int:
    """Values per scale of a low-bit codec (0 for the others)."""
    parsed = _parse(check_codec(name))
    assert parsed is not None
    return parsed[1]


def codec_bits(name: str) -> int:
    """Bits per packed value of a low-bit codec (0 for the others)."""
    return LOW_BIT.get(codec_base(name), 0)


def codec_name(base: str, group: int) -> str:
    """The name of ``base`` with ``group`` (the default group gives the short name)."""
    if base not in LOW_BIT or group == DEFAULT_GROUP:
        return base
    return f"{base}g{group}"
