"""Codec names, parsed without torch (settings validate them before any model loads).

A codec is named by a plain string, so that a setting, a CLI flag or a planner can choose one
per link: ``fp32``, ``bf16``, ``fp16``, ``int8``, and the low-bit codecs ``int4`` and ``int2``.
A low-bit name may end in ``g<G>`` to choose its group size (``int4g128``, ``int2g32``): each
run of ``G`` consecutive values (row-major) shares one scale and one offset. Without a suffix
``G`` is :data:`DEFAULT_GROUP`. A ``t`` after the bits (``int4t``, ``int2tg32``) groups the
values along the tokens instead: a group is ``G`` consecutive rows (tokens) of one channel (the
last dimension). A transformer's hidden states have a few channels far larger than the rest,
and along a channel the values are alike, so activations and outputs lose about half as much
with ``t``; gradients lose less with the default (row) groups.

An ``o`` after the layout (``int4to``, ``int4o2g128``, ``int2tog32``) sends the largest values
exactly: per group, the ``K`` values largest in magnitude (``o`` alone: ``K`` = 1, ``o<K>``:
``K`` in :data:`OUTLIER_COUNTS`) go as fp32 value and int16 position (6 bytes each), and the
group's scale covers only the rest, so one huge value no longer coarsens its whole group.
"""

from __future__ import annotations

import re

__all__ = [
    "CODECS",
    "DEFAULT_GROUP",
    "GROUP_SIZES",
    "LOW_BIT",
    "OUTLIER_COUNTS",
    "check_codec",
    "codec_base",
    "codec_bits",
    "codec_group",
    "codec_help",
    "codec_name",
    "codec_outliers",
    "codec_token_groups",
]

CODECS: tuple[str, ...] = ("fp32", "bf16", "fp16", "int8", "int4", "int2")
LOW_BIT: dict[str, int] = {"int4": 4, "int2": 2}  # base name -> bits per value
DEFAULT_GROUP = 64
# Powers of two: small groups follow outliers closely, large ones spend fewer bytes on scales
# (two fp32 numbers per group: 64 bits over G values, 1 bit per value at G = 64).
GROUP_SIZES: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024)
# Outliers sent exactly per group: a few; each costs 6 bytes (fp32 value, int16 position).
OUTLIER_COUNTS: tuple[int, ...] = (1, 2, 4, 8)
_NAME = re.compile(r"^(int4|int2)(t?)(?:o(\d*))?(?:g(\d+))?$")


def codec_help() -> str:
    """The allowed values, for error messages and ``--help``."""
    sizes = ", ".join(str(g) for g in GROUP_SIZES)
    counts = ", ".join(str(k) for k in OUTLIER_COUNTS)
    return (
        f"{', '.join(CODECS)}, or int4 / int2 with t (groups along tokens), o<K> (K outliers "
        f"a group sent exactly, K in {counts}, o alone: 1) and/or g<G> (G values a group, "
        f"G in {sizes}), in that order, e.g. int4t, int4g128, int2tg32, int4to, int4o2g128"
    )


def _parse(name: str) -> tuple[str, int, bool, int] | None:
    """(base codec, group size, token groups, outliers) of a valid name, or None.

    Codecs without groups have group 0 and no outliers.
    """
    if name in CODECS and name not in LOW_BIT:
        return name, 0, False, 0
    match = _NAME.match(name) if isinstance(name, str) else None
    if match is None:
        return None
    digits, count = match.group(4), match.group(3)
    group = int(digits) if digits else DEFAULT_GROUP
    if group not in GROUP_SIZES or (digits and digits[0] == "0"):
        return None
    outliers = 0 if count is None else int(count) if count else 1
    if count is not None and (outliers not in OUTLIER_COUNTS or count.startswith("0")):
        return None
    if outliers >= group:
        return None
    return match.group(1), group, bool(match.group(2)), outliers


def check_codec(name: str) -> str:
    """``name`` if it names a codec; else a ``ValueError`` listing the allowed values."""
    if _parse(name) is None:
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


def codec_token_groups(name: str) -> bool:
    """Whether a low-bit codec groups values along the tokens (one channel a group)."""
    parsed = _parse(check_codec(name))
    assert parsed is not None
    return parsed[2]


def codec_outliers(name: str) -> int:
    """Values per group a low-bit codec sends exactly (0: none, and for the other codecs)."""
    parsed = _parse(check_codec(name))
    assert parsed is not None
    return parsed[3]


def codec_bits(name: str) -> int:
    """Bits per packed value of a low-bit codec (0 for the others)."""
    return LOW_BIT.get(codec_base(name), 0)


def codec_name(base: str, group: int, token_groups: bool = False, outliers: int = 0) -> str:
    """The name of ``base`` with ``group`` (the default group gives the short name)."""
    if base not in LOW_BIT:
        return base
    layout = "t" if token_groups else ""
    if outliers:
        layout += "o" if outliers == 1 else f"o{outliers}"
    return f"{base}{layout}" if group == DEFAULT_GROUP else f"{base}{layout}g{group}"
