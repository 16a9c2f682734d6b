"""Link and device profiles: what an emulated device's network and CPU look like.

A `LinkProfile` describes one device's connection to the server (bandwidth each way, round-trip
time, jitter, per-message overhead); a `DeviceProfile` adds how much slower the device computes than
the machine running the simulation. Named profiles cover the reference links that published
split and edge systems report (docs: benchmarks) and a few realistic edge devices; `parse_link`
(in `fedpipe.config.profile_spec`) also accepts inline specs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "DEVICE_PROFILES",
    "REFERENCE_LINKS",
    "DeviceProfile",
    "Direction",
    "LinkProfile",
    "UnknownProfileError",
    "device_profile_names",
    "get_device_profile",
    "get_link",
    "link_names",
]

Direction = Literal["up", "down"]
"""`up`: device -> server (activations, gradient of the server output); `down`: the reverse."""

_DIRECTIONS: tuple[Direction, ...] = ("up", "down")
_BITS_PER_MBIT = 1e6


class UnknownProfileError(KeyError, ValueError):
    """A link or device profile name that is not registered; the message lists the choices.

    Both a KeyError (a failed lookup) and a ValueError (a bad setting): callers may catch either.
    """

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class LinkProfile:
    """One device's link to the server.

    Bandwidths are in Mbit/s (10**6 bits per second, as ISPs and the notes quote them); `math.inf`
    means no bandwidth limit. One-way latency is `rtt_s / 2` in each direction. `jitter_s` is the
    standard deviation of an extra one-way delay per message (a normal sample truncated at 0).
    `overhead_s` is a fixed per-message latency (framing, syscalls, serialisation on the far side):
    it delays delivery but does not occupy the wire.
    """

    name: str
    up_mbps: float
    down_mbps: float
    rtt_s: float
    jitter_s: float = 0.0
    overhead_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.name or not self.name.strip():
            raise ValueError("LinkProfile needs a non-empty name (e.g. '100mbit-5ms').")
        for field in ("up_mbps", "down_mbps"):
            value = getattr(self, field)
            if math.isnan(value) or value <= 0:
                raise ValueError(
                    f"LinkProfile {self.name!r}: {field} must be > 0 Mbit/s (got {value}); "
                    "use math.inf (or LinkProfile.unlimited()) for no bandwidth limit."
                )
        for field in ("rtt_s", "jitter_s", "overhead_s"):
            value = getattr(self, field)
            if not math.isfinite(value) or value < 0:
                raise ValueError(
                    f"LinkProfile {self.name!r}: {field} must be a finite number of seconds >= 0 "
                    f"(got {value}); note the unit is seconds, so 50 ms is 0.05."
                )

    @classmethod
    def unlimited(cls, name: str = "loopback") -> LinkProfile:
        """A link that emulates nothing: no bandwidth limit, no latency, no jitter."""
        return cls(name=name, up_mbps=math.inf, down_mbps=math.inf, rtt_s=0.0)

    @property
    def one_way_s(self) -> float:
        """One-way propagation latency, the same in both directions."""
        return self.rtt_s / 2.0

    @property
    def is_unlimited(self) -> bool:
        """True when the link adds no delay at all (a loopback)."""
        return (
            math.isinf(self.up_mbps)
            and math.isinf(self.down_mbps)
            and self.rtt_s == 0.0
            and self.jitter_s == 0.0
            and self.overhead_s == 0.0
        )

    def mbps(self, direction: Direction) -> float:
        """Bandwidth in Mbit/s for `direction` ('up' or 'down')."""
        return self.up_mbps if _check_direction(direction) == "up" else self.down_mbps

    def bytes_per_s(self, direction: Direction) -> float | None:
        """Bandwidth in bytes/s for `direction`, or None when unlimited."""
        mbps = self.mbps(direction)
        return None if math.isinf(mbps) else mbps * _BITS_PER_MBIT / 8.0

    def describe(self) -> str:
        """A one-line human summary, e.g. '10/25 Mbit/s up/down, 50 ms RTT, 2 ms jitter'."""
        if self.is_unlimited:
            return "unlimited (no emulation)"
        parts = [
            f"{_fmt_mbps(self.up_mbps)}/{_fmt_mbps(self.down_mbps)} Mbit/s up/down",
            f"{self.rtt_s * 1e3:g} ms RTT",
        ]
        if self.jitter_s:
            parts.append(f"{self.jitter_s * 1e3:g} ms jitter")
        if self.overhead_s:
            parts.append(f"{self.overhead_s * 1e3:g} ms overhead")
        return ", ".join(parts)


@dataclass(frozen=True)
class DeviceProfile:
    """An emulated device: its link and how many times slower it computes than the host.

    `compute_slowdown` 3.0 means a step that takes 10 ms on the simulation host takes 30 ms on the
    device (see `ComputeThrottle`). It must be >= 1: the emulator can slow the host down, not speed
    it up.
    """

    name: str
    link: LinkProfile
    compute_slowdown: float = 1.0

    def __post_init__(self) -> None:
        if not self.name or not self.name.strip():
            raise ValueError("DeviceProfile needs a non-empty name (e.g. 'phone-lte').")
        if not math.isfinite(self.compute_slowdown) or self.compute_slowdown < 1.0:
            raise ValueError(
                f"DeviceProfile {self.name!r}: compute_slowdown must be a finite number >= 1.0 "
                f"(got {self.compute_slowdown}); the emulator only adds delay, so a device faster "
                "than the host cannot be emulated - use 1.0."
            )


def _check_direction(direction: str) -> Direction:
    if direction not in _DIRECTIONS:
        raise ValueError(f"direction must be 'up' or 'down' (got {direction!r}).")
    return direction  # type: ignore[return-value]


def _fmt_mbps(mbps: float) -> str:
    return "inf" if math.isinf(mbps) else f"{mbps:g}"


def _ms(ms: float) -> float:
    return ms / 1e3


# The reference settings the benchmarks report (docs/reference/configuration.md): the three
# Petals reports its throughput at, and a PiPar-style edge uplink. No jitter, so benchmark runs
# are reproducible.
_REFERENCE = (
    LinkProfile("1gbit-5ms", up_mbps=1000, down_mbps=1000, rtt_s=_ms(5)),
    LinkProfile("100mbit-5ms", up_mbps=100, down_mbps=100, rtt_s=_ms(5)),
    LinkProfile("100mbit-100ms", up_mbps=100, down_mbps=100, rtt_s=_ms(100)),
    LinkProfile("10up-25down-50ms", up_mbps=10, down_mbps=25, rtt_s=_ms(50)),
)
REFERENCE_LINKS: tuple[str, ...] = tuple(link.name for link in _REFERENCE)
"""Names of the reference link settings the pipeline benchmark reports, in report order."""

# Realistic edge devices. Bandwidths are typical sustained rates, not marketing peaks; slowdowns are
# relative to a server-class CPU core running the simulation.
_DEVICES = (
    DeviceProfile(
        "phone-lte",
        LinkProfile("phone-lte", up_mbps=10, down_mbps=30, rtt_s=_ms(60), jitter_s=_ms(5)),
        compute_slowdown=3.0,
    ),
    DeviceProfile(
        "phone-5g",
        LinkProfile("phone-5g", up_mbps=50, down_mbps=200, rtt_s=_ms(25), jitter_s=_ms(3)),
        compute_slowdown=2.5,
    ),
    DeviceProfile(
        "rpi-wifi",
        LinkProfile("rpi-wifi", up_mbps=40, down_mbps=40, rtt_s=_ms(10), jitter_s=_ms(2)),
        compute_slowdown=6.0,
    ),
    DeviceProfile(
        "jetson-ethernet",
        LinkProfile("jetson-ethernet", up_mbps=1000, down_mbps=1000, rtt_s=_ms(1)),
        compute_slowdown=1.5,
    ),
    DeviceProfile(
        "laptop-wifi",
        LinkProfile("laptop-wifi", up_mbps=150, down_mbps=200, rtt_s=_ms(8), jitter_s=_ms(1)),
        compute_slowdown=1.2,
    ),
    DeviceProfile("loopback", LinkProfile.unlimited(), compute_slowdown=1.0),
)
DEVICE_PROFILES: tuple[str, ...] = tuple(device.name for device in _DEVICES)
"""Names of the built-in device profiles."""

_LINKS: dict[str, LinkProfile] = {link.name: link for link in _REFERENCE}
_LINKS.update({device.link.name: device.link for device in _DEVICES})
_DEVICE_BY_NAME: dict[str, DeviceProfile] = {device.name: device for device in _DEVICES}


def link_names() -> tuple[str, ...]:
    """Every named link: the reference settings, then each device profile's link."""
    return tuple(_LINKS)


def device_profile_names() -> tuple[str, ...]:
    """Every named device profile."""
    return DEVICE_PROFILES


def get_link(name: str) -> LinkProfile:
    """The named link (a reference setting or a device's link); unknown names list the choices."""
    key = name.strip().lower()
    if key not in _LINKS:
        raise UnknownProfileError(
            f"unknown link {name!r}; choose one of {', '.join(_LINKS)}, or give an inline spec "
            "such as 'up=10,down=25,rtt=50ms' to parse_link()."
        )
    return _LINKS[key]


def get_device_profile(name: str) -> DeviceProfile:
    """The named device profile; unknown names list the choices."""
    key = name.strip().lower()
    if key not in _DEVICE_BY_NAME:
        raise UnknownProfileError(
            f"unknown device profile {name!r}; choose one of {', '.join(_DEVICE_BY_NAME)}, "
            "or build a DeviceProfile(name, link, compute_slowdown) yourself."
        )
    return _DEVICE_BY_NAME[key]
