"""One direction of an emulated link: a FIFO wire with bandwidth, latency, jitter and overhead.

`LinkDirection.schedule` is pure arithmetic on timestamps (no sleeping), so it works with any clock
and in discrete-event simulations. The model, per message of n bytes sent at t:

    start     = max(t, busy_until)               # wait for earlier messages to leave the wire
    end       = start + n / bytes_per_s           # occupancy: the wire is busy until `end`
    deliver   = end + one_way + overhead + jitter # latency: does not occupy the wire
    deliver   = max(deliver, previous deliver)    # FIFO: jitter never reorders messages
"""

from __future__ import annotations

import collections
import math
import random
import threading
from dataclasses import dataclass
from typing import NamedTuple

from fedpipe.config.profile_spec import parse_link
from fedpipe.config.profiles import Direction, LinkProfile

__all__ = ["DuplexLink", "LinkDirection", "LinkStats", "Transfer"]

DEFAULT_MAX_RECORDS = 10_000


class Transfer(NamedTuple):
    """One message's life on the link, in clock seconds (for timelines)."""

    sent_at: float
    start: float
    end: float
    deliver: float


@dataclass(frozen=True)
class LinkStats:
    """Totals for one direction since construction (or the last `reset_stats`).

    `busy_s` is wire occupancy (sum of n / bytes_per_s); `queued_s` is the total time messages
    waited behind earlier ones before their first byte went on the wire.
    """

    messages: int = 0
    bytes: int = 0
    busy_s: float = 0.0
    queued_s: float = 0.0


class LinkDirection:
    """One direction of a link; thread-safe. `bytes_per_s=None` means unlimited bandwidth."""

    def __init__(
        self,
        bytes_per_s: float | None,
        one_way_s: float,
        jitter_s: float = 0.0,
        overhead_s: float = 0.0,
        rng: random.Random | None = None,
        *,
        max_records: int | None = DEFAULT_MAX_RECORDS,
    ) -> None:
        if bytes_per_s is not None and math.isinf(bytes_per_s):
            bytes_per_s = None
        if bytes_per_s is not None and not bytes_per_s > 0:
            raise ValueError(
                f"LinkDirection: bytes_per_s must be > 0 (got {bytes_per_s}); "
                "pass None for unlimited bandwidth."
            )
        for label, value in (
            ("one_way_s", one_way_s),
            ("jitter_s", jitter_s),
            ("overhead_s", overhead_s),
        ):
            if not math.isfinite(value) or value < 0:
                raise ValueError(
                    f"LinkDirection: {label} must be finite seconds >= 0 (got {value}); "
                    "50 ms is 0.05."
                )
        self.bytes_per_s = bytes_per_s
        self.one_way_s = float(one_way_s)
        self.jitter_s = float(jitter_s)
        self.overhead_s = float(overhead_s)
        self._rng = rng if rng is not None else random.Random()
        self._lock = threading.Lock()
        self._busy_until = -math.inf
        self._last_deliver = -math.inf
        self._stats = LinkStats()
        self._records: collections.deque[Transfer] = collections.deque(maxlen=max_records)

    @classmethod
    def from_profile(
        cls,
        profile: LinkProfile | str,
        direction: Direction,
        *,
        rng: random.Random | None = None,
        max_records: int | None = DEFAULT_MAX_RECORDS,
    ) -> LinkDirection:
        """The `direction` ('up' or 'down') half of `profile` (a link name or spec is parsed)."""
        profile = parse_link(profile) if isinstance(profile, str) else profile
        return cls(
            profile.bytes_per_s(direction),
            profile.one_way_s,
            profile.jitter_s,
            profile.overhead_s,
            rng,
            max_records=max_records,
        )

    @property
    def is_passthrough(self) -> bool:
        """True when this direction adds no delay at all (unlimited bandwidth, zero latency)."""
        return (
            self.bytes_per_s is None
            and self.one_way_s == 0.0
            and self.jitter_s == 0.0
            and self.overhead_s == 0.0
        )

    @property
    def latency_s(self) -> float:
        """Fixed one-way latency of a message, excluding jitter: one_way_s + overhead_s (L)."""
        return self.one_way_s + self.overhead_s

    def occupancy_s(self, nbytes: int) -> float:
        """Seconds `nbytes` occupy the wire (tau without the overhead, which is latency here)."""
        return 0.0 if self.bytes_per_s is None else nbytes / self.bytes_per_s

    def schedule(self, nbytes: int, sent_at: float) -> float:
        """Admit a message of `nbytes` sent at `sent_at`; return its delivery time."""
        if nbytes < 0:
            raise ValueError(f"LinkDirection.schedule: nbytes must be >= 0 (got {nbytes}).")
        with self._lock:
            start = max(sent_at, self._busy_until)
            end = start + self.occupancy_s(nbytes)
            deliver = end + self.latency_s + self._jitter_sample()
            deliver = max(deliver, self._last_deliver)
            self._busy_until = end
            self._last_deliver = deliver
            self._record(Transfer(sent_at, start, end, deliver), nbytes)
        return deliver

    def _jitter_sample(self) -> float:
        # A normal sample truncated at 0: extra delay only; mean about 0.4 * jitter_s.
        return max(0.0, self._rng.gauss(0.0, self.jitter_s)) if self.jitter_s else 0.0

    def _record(self, transfer: Transfer, nbytes: int) -> None:
        stats = self._stats
        self._stats = LinkStats(
            messages=stats.messages + 1,
            bytes=stats.bytes + nbytes,
            busy_s=stats.busy_s + (transfer.end - transfer.start),
            queued_s=stats.queued_s + (transfer.start - transfer.sent_at),
        )
        self._records.append(transfer)

    @property
    def busy_until(self) -> float:
        """When the wire is free again (-inf before the first message)."""
        with self._lock:
            return self._busy_until

    def stats(self) -> LinkStats:
        """A snapshot of the totals."""
        with self._lock:
            return self._stats

    def records(self) -> list[Transfer]:
        """The most recent transfers (at most `max_records`), oldest first."""
        with self._lock:
            return list(self._records)

    def clear_records(self) -> None:
        """Forget the timeline records (the totals stay)."""
        with self._lock:
            self._records.clear()

    def reset_stats(self) -> None:
        """Zero the totals and clear the records; the wire state (busy_until) is kept."""
        with self._lock:
            self._stats = LinkStats()
            self._records.clear()

    def __repr__(self) -> str:
        rate = "unlimited" if self.bytes_per_s is None else f"{self.bytes_per_s:g} B/s"
        return (
            f"LinkDirection({rate}, one_way_s={self.one_way_s:g}, jitter_s={self.jitter_s:g}, "
            f"overhead_s={self.overhead_s:g})"
        )


@dataclass(frozen=True)
class DuplexLink:
    """Both directions of one device's link, built from a `LinkProfile`."""

    profile: LinkProfile
    up: LinkDirection
    down: LinkDirection

    @classmethod
    def from_profile(
        cls, profile: LinkProfile | str, *, seed: int | str | None = None
    ) -> DuplexLink:
        """Each direction gets its own jitter stream; a `seed` makes both reproducible.

        ``profile`` may be a link name or an inline spec (``'up=10,down=25,rtt=50ms'``).
        """
        profile = parse_link(profile) if isinstance(profile, str) else profile
        up_rng = random.Random(f"{seed}/up") if seed is not None else None
        down_rng = random.Random(f"{seed}/down") if seed is not None else None
        return cls(
            profile,
            LinkDirection.from_profile(profile, "up", rng=up_rng),
            LinkDirection.from_profile(profile, "down", rng=down_rng),
        )

    def direction(self, direction: Direction) -> LinkDirection:
        """The `up` or `down` half."""
        if direction not in ("up", "down"):
            raise ValueError(f"direction must be 'up' or 'down' (got {direction!r}).")
        return self.up if direction == "up" else self.down
