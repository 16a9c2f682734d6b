"""Which StageServer replica serves each device of a round: consistent hashing, bounded loads.

Every replica owns points on a hash ring; a device goes to the owner of the first point at or
after its own hash, so a device keeps its replica from round to round, and when a replica is
down only that replica's devices move (to the next live owners on the ring). A replica takes
at most ``ceil(devices / live replicas) + 1`` devices of a round (one each while there are no
more devices than replicas): a device whose replica is full walks on to the next one with room
(Mirrokni, Thorup and Zadimoghaddam, "Consistent Hashing with Bounded Loads", 2018). Devices
are placed in the order of their hashes, so the answer depends only on the set of devices and
of live replicas, never on the order they are listed in.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import math
from collections.abc import Collection, Iterable

__all__ = ["POINTS_PER_REPLICA", "assign_devices", "replica_capacity"]

POINTS_PER_REPLICA = 64  # ring points per replica: loads within a few percent of even


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


@functools.cache
def _ring(replicas: int) -> tuple[tuple[int, int], ...]:
    """(position, replica) for every point of every replica, by position."""
    points = (
        (_hash(f"fedpipe-replica-{k}-{v}"), k)
        for k in range(replicas)
        for v in range(POINTS_PER_REPLICA)
    )
    return tuple(sorted(points))


def replica_capacity(devices: int, live: int) -> int:
    """The most devices one replica takes in a round of ``devices`` over ``live`` replicas."""
    if live < 1:
        raise ValueError("no live replica to assign devices to")
    return 1 if devices <= live else math.ceil(devices / live) + 1


def assign_devices(
    devices: Iterable[str], replicas: int, live: Collection[int] | None = None
) -> dict[str, int]:
    """Device id -> the index of the replica that serves it this round.

    ``live``: the replicas that may take devices (None: all ``replicas``); a replica not in it
    (down) takes none, and its devices go to the next live owners on the ring.
    """
    alive = set(range(replicas)) if live is None else set(live)
    if not alive or not alive <= set(range(replicas)):
        raise ValueError(f"live replicas {sorted(alive)} must be some of 0..{replicas - 1}")
    wanted = sorted(set(devices), key=lambda d: (_hash(d), d))
    cap = replica_capacity(len(wanted), len(alive))
    ring = [(pos, k) for pos, k in _ring(replicas) if k in alive]
    positions = [pos for pos, _ in ring]
    load = dict.fromkeys(alive, 0)
    out: dict[str, int] = {}
    for device in wanted:
        start = bisect.bisect_left(positions, _hash(device))
        for step in range(len(ring)):
            replica = ring[(start + step) % len(ring)][1]
            if load[replica] < cap:
                break
        out[device] = replica
        load[replica] += 1
    return out
