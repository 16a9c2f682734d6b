"""Parse a link from a CLI/TOML string: a profile name or an inline spec.

Inline specs are comma-separated `key=value` pairs, e.g. `up=10,down=25,rtt=50ms,jitter=2ms`:
- `up`, `down` (or `bw` for both): bandwidth; a bare number is Mbit/s, units mbps, Mbit/s, gbps,
  Gbit/s, kbps, kbit/s are accepted, and `inf` means unlimited;
- `rtt`, `jitter`, `overhead`: times with a unit, `ms`, `s` or `us` (a bare number is refused,
  because `rtt=50` could mean seconds or milliseconds);
- `name`: optional; otherwise the canonical spec string becomes the name.

Where a device profile is wanted, the same spec may add `slowdown=<factor>` (how many times slower
the device computes than the host, default 1), and a link name stands for a device with that link.
Lists (`--links`, `federated.profiles`) are comma-separated; an inline spec's own commas are kept
together, and a key seen again starts the next spec (`;` also separates entries):
`phone-lte,up=10,down=25,rtt=50ms,rpi-wifi` holds three entries. This module is the one parser
every command, setting and the emulator use for link and profile names.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Sequence

from fedpipe.config.profiles import (
    DeviceProfile,
    LinkProfile,
    UnknownProfileError,
    device_profile_names,
    get_device_profile,
    get_link,
    link_names,
)

__all__ = [
    "join_specs",
    "parse_device_profile",
    "parse_device_profiles",
    "parse_link",
    "parse_links",
    "split_specs",
]

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
        if text.lower() not in link_names():
            raise UnknownProfileError(
                f"unknown link {text!r}{_did_you_mean(text, link_names())}; choose one of "
                f"{', '.join(link_names())}, or give an inline spec such as "
                "'up=10,down=25,rtt=50ms'"
            )
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


def parse_device_profile(spec: str) -> DeviceProfile:
    """A `DeviceProfile` from a device profile name, a link name, or an inline spec.

    An inline spec is a link spec plus an optional `slowdown=<factor>` (module doc); a link name
    gives a device with that link that computes as fast as the host.
    """
    text = spec.strip()
    if "=" not in text:
        key = text.lower()
        if key in device_profile_names():
            return get_device_profile(key)
        if key in link_names():
            return DeviceProfile(key, get_link(key), compute_slowdown=1.0)
        choices = (*device_profile_names(), *link_names())
        raise UnknownProfileError(
            f"unknown device profile {text!r}{_did_you_mean(text, choices)}; choose a device "
            f"profile ({', '.join(device_profile_names())}), a link "
            f"({', '.join(n for n in link_names() if n not in device_profile_names())}), or an "
            "inline spec such as 'up=10,down=25,rtt=50ms,slowdown=2'"
        )
    items = [item for item in text.split(",") if item.strip()]
    slow = [i for i in items if i.partition("=")[0].strip().lower() == "slowdown"]
    if len(slow) > 1:
        raise ValueError(f"device spec {spec!r}: 'slowdown' is given twice.")
    try:
        link = parse_link(",".join(i for i in items if i not in slow))
    except UnknownProfileError:
        raise
    except ValueError as exc:
        if "unknown key" not in str(exc):
            raise
        raise ValueError(f"{str(exc).rstrip('.')}, and for a device, slowdown.") from None
    slowdown = _parse_slowdown(spec, slow[0].partition("=")[2]) if slow else 1.0
    name = link.name if slowdown == 1.0 or "name=" in text else f"{link.name},slowdown={slowdown:g}"
    return DeviceProfile(name, link, compute_slowdown=slowdown)


def split_specs(text: str) -> list[str]:
    """Entries of a comma-separated list of names and inline specs (module doc)."""
    entries: list[str] = []
    for part in text.split(";"):
        group: list[str] = []
        for item in (i.strip() for i in part.split(",")):
            if not item:
                continue
            key = item.partition("=")[0].strip().lower()
            if "=" not in item or key in {g.partition("=")[0].strip().lower() for g in group}:
                entries += [",".join(group)] if group else []
                group = []
            if "=" in item:
                group.append(item)
            else:
                entries.append(item)
        entries += [",".join(group)] if group else []
    return entries


def join_specs(entries: Sequence[str]) -> str:
    """Entries as one string that :func:`split_specs` splits back into them: joined by commas,
    as they are usually written, or by ``"; "`` where commas alone would regroup them (two
    inline specs in a row)."""
    text = ",".join(entries)
    return text if split_specs(text) == list(entries) else "; ".join(entries)


def parse_links(text: str) -> list[LinkProfile]:
    """Every link of a comma-separated list of link names and inline specs."""
    return [parse_link(entry) for entry in split_specs(text)]


def parse_device_profiles(text: str) -> list[DeviceProfile]:
    """Every device profile of a comma-separated list of names and inline specs."""
    return [parse_device_profile(entry) for entry in split_specs(text)]


def _parse_slowdown(spec: str, value: str) -> float:
    try:
        factor = float(value.strip().removesuffix("x"))
    except ValueError:
        raise ValueError(
            f"device spec {spec!r}: slowdown={value.strip()!r} is not a number; write e.g. "
            "slowdown=3 for a device that computes 3 times slower than this host."
        ) from None
    return factor


def _did_you_mean(text: str, choices: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(text.lower(), choices, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
