"""Parse a link from a CLI/TOML string: a profile name or an inline spec.

Inline specs are comma-separated `key=value` pairs, e.g. `up=10,down=25,rtt=50ms,jitter=2ms`:
- `up`, `down` (or `bw` for both): bandwidth; a bare number is Mbit/s, units mbps, Mbit/s, gbps,
  Gbit/s, kbps, kbit/s are accepted, and `inf` means unlimited;
- `rtt`, `jitter`, `overhead`: times with a unit, `ms`, `s` or `us` (a bare number is refused,
  because `rtt=50` could mean seconds or milliseconds);
- `name`: optional; otherwise the canonical spec string becomes the name.
"""

from __future__ import annotations

import math
import re

from fedpipe.link.profiles import LinkProfile, get_link

__all__ = ["parse_link"]

_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?|inf|unlimited)\s*([a-z/]*)\s*$")
_RATE_UNITS = {
    "": 1.0,
    "mbps": 1.0,
    "mbit/s": 1.0,
    "mbit": 1.0,
    "gbps": 1e3,
    "gbit/s": 1e3,
    "gbit": 1e3,
    "kbps": 1e-3,
    "kbit/s": 1e-3,
    "kbit": 1e-3,
}
_TIME_UNITS = {"ms": 1e-3, "s": 1.0, "us": 1e-6}
_RATE_KEYS = ("up", "down", "bw")
_TIME_KEYS = ("rtt", "jitter", "overhead")
_KEYS = (*_RATE_KEYS, *_TIME_KEYS, "name")


def parse_link(spec: str) -> LinkProfile:
    """A `LinkProfile` from a registered name (`'100mbit-100ms'`) or an inline spec (module doc)."""
    text = spec.strip()
    if "=" not in text:
        return get_link(text)
    fields = _split_pairs(text)
    if "bw" in fields and ("up" in fields or "down" in fields):
        raise ValueError(f"link spec {spec!r}: give either bw= or up=/down=, not both.")
    up_text = fields.get("up", fields.get("bw"))
    down_text = fields.get("down", fields.get("bw"))
    if up_text is None or down_text is None:
        raise ValueError(
            f"link spec {spec!r} needs both directions' bandwidth: add up=<Mbit/s> and "
            "down=<Mbit/s> (or bw=<Mbit/s> for both), e.g. 'up=10,down=25,rtt=50ms'."
        )
    up = _parse_rate(spec, "up", up_text)
    down = _parse_rate(spec, "down", down_text)
    times = {key: _parse_time(spec, key, fields[key]) for key in _TIME_KEYS if key in fields}
    name = fields.get("name") or _canonical(up, down, times)
    return LinkProfile(
        name=name,
        up_mbps=up,
        down_mbps=down,
        rtt_s=times.get("rtt", 0.0),
        jitter_s=times.get("jitter", 0.0),
        overhead_s=times.get("overhead", 0.0),
    )


def _split_pairs(spec: str) -> dict[str, str]:
    fields: dict[str, str] = {}
    for item in spec.split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        key = key.strip().lower()
        if not sep or not value.strip():
            raise ValueError(f"link spec {spec!r}: {item.strip()!r} is not key=value.")
        if key not in _KEYS:
            raise ValueError(
                f"link spec {spec!r}: unknown key {key!r}; valid keys are {', '.join(_KEYS)}."
            )
        if key in fields:
            raise ValueError(f"link spec {spec!r}: {key!r} is given twice.")
        fields[key] = value.strip()
    return fields


def _split_number(spec: str, key: str, value: str) -> tuple[float, str]:
    match = _NUMBER.match(value.lower())
    if match is None:
        raise ValueError(f"link spec {spec!r}: {key}={value!r} is not a number with a unit.")
    number, unit = match.groups()
    return (math.inf if number in ("inf", "unlimited") else float(number)), unit


def _parse_rate(spec: str, key: str, value: str) -> float:
    number, unit = _split_number(spec, key, value)
    if unit not in _RATE_UNITS:
        raise ValueError(
            f"link spec {spec!r}: {key}={value!r} has unknown unit {unit!r}; bandwidth is in bits: "
            "use a bare number (Mbit/s) or one of mbps, Mbit/s, gbps, Gbit/s, kbps, kbit/s."
        )
    return number * _RATE_UNITS[unit]


def _parse_time(spec: str, key: str, value: str) -> float:
    number, unit = _split_number(spec, key, value)
    if unit == "":
        raise ValueError(
            f"link spec {spec!r}: {key}={value!r} needs a unit; write e.g. {key}={value}ms "
            f"or {key}={value}s."
        )
    if unit not in _TIME_UNITS:
        raise ValueError(
            f"link spec {spec!r}: {key}={value!r} has unknown unit {unit!r}; use ms, s or us."
        )
    return number * _TIME_UNITS[unit]


def _canonical(up: float, down: float, times: dict[str, float]) -> str:
    parts = [f"up={up:g}", f"down={down:g}"]
    parts += [f"{key}={times[key] * 1e3:g}ms" for key in _TIME_KEYS if times.get(key)]
    return ",".join(parts)
