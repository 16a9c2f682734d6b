"""Link and device emulation for local simulation: profiles, clocks, a FIFO link model, a delay line
that delivers items when the emulated link would, and a compute throttle for slower devices.

Pure Python (no gRPC, no torch), so any layer can use it.
"""

from fedpipe.config.profile_spec import (
    parse_device_profile,
    parse_device_profiles,
    parse_link,
    parse_links,
    split_specs,
)
from fedpipe.config.profiles import (
    DEVICE_PROFILES,
    REFERENCE_LINKS,
    DeviceProfile,
    Direction,
    LinkProfile,
    UnknownProfileError,
    device_profile_names,
    get_device_profile,
    get_link,
    link_names,
)
from fedpipe.emulation.clock import Clock, FakeClock, RealClock
from fedpipe.emulation.delay_line import DelayLine, DelayLineClosed, DelayLineStats
from fedpipe.emulation.direction import DuplexLink, LinkDirection, LinkStats, Transfer
from fedpipe.emulation.throttle import ComputeThrottle, ThrottleStats

__all__ = [
    "DEVICE_PROFILES",
    "REFERENCE_LINKS",
    "Clock",
    "ComputeThrottle",
    "DelayLine",
    "DelayLineClosed",
    "DelayLineStats",
    "DeviceProfile",
    "Direction",
    "DuplexLink",
    "FakeClock",
    "LinkDirection",
    "LinkProfile",
    "LinkStats",
    "RealClock",
    "ThrottleStats",
    "Transfer",
    "UnknownProfileError",
    "device_profile_names",
    "get_device_profile",
    "get_link",
    "link_names",
    "parse_device_profile",
    "parse_device_profiles",
    "parse_link",
    "parse_links",
    "split_specs",
]
