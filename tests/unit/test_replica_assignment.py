"""Assigning a round's devices to StageServer replicas: consistent hashing with bounded loads."""

from __future__ import annotations

import math
import random

import pytest

from fedpipe.fl.assignment import assign_devices, replica_capacity
from fedpipe.fl.replica_control import replica_run_id, stage_addresses

_RNG = random.Random(7)
DEVICES = [str(_RNG.getrandbits(63)) for _ in range(40)]  # as Flower's node ids look


def test_assignment_is_deterministic_and_ignores_the_order_devices_come_in() -> None:
    first = assign_devices(DEVICES, 4)
    shuffled = list(DEVICES)
    random.Random(1).shuffle(shuffled)
    assert assign_devices(shuffled, 4) == first
    assert set(first) == set(DEVICES) and set(first.values()) == {0, 1, 2, 3}


def test_a_device_keeps_its_replica_from_round_to_round() -> None:
    rounds = [assign_devices(DEVICES, 4) for _ in range(3)]
    assert rounds[0] == rounds[1] == rounds[2]
    # a device that joins or leaves moves only a few of the others
    fewer = assign_devices(DEVICES[1:], 4)
    moved = [d for d in DEVICES[1:] if fewer[d] != rounds[0][d]]
    assert len(moved) <= 2


@pytest.mark.parametrize(("devices", "replicas"), [(4, 2), (5, 2), (40, 4), (40, 3), (3, 4)])
def test_no_replica_takes_more_than_its_bound(devices: int, replicas: int) -> None:
    got = assign_devices(DEVICES[:devices], replicas)
    loads = [list(got.values()).count(k) for k in range(replicas)]
    bound = math.ceil(devices / replicas) + 1
    assert max(loads) <= min(bound, replica_capacity(devices, replicas))
    if devices <= replicas:
        assert max(loads) == 1  # one device each while there are enough replicas


def test_a_replica_that_is_down_gets_no_device_and_only_its_devices_move() -> None:
    all_up = assign_devices(DEVICES, 4)
    down = assign_devices(DEVICES, 4, live=[0, 1, 3])
    assert 2 not in down.values()
    # the others keep theirs, but for the few the load bound pushes on
    moved = [d for d, k in all_up.items() if k != 2 and down[d] != k]
    assert len(moved) <= 3
    loads = [list(down.values()).count(k) for k in (0, 1, 3)]
    assert max(loads) <= math.ceil(len(DEVICES) / 3) + 1


def test_no_live_replica_is_an_error() -> None:
    with pytest.raises(ValueError, match="live replicas"):
        assign_devices(DEVICES, 2, live=[])
    with pytest.raises(ValueError, match="live replicas"):
        assign_devices(DEVICES, 2, live=[2])


def test_replica_run_ids_and_addresses() -> None:
    assert replica_run_id("run.abc", 1) == "run.abc/r1"
    assert stage_addresses("10.0.0.5:50100, 10.0.0.6:50101") == ["10.0.0.5:50100", "10.0.0.6:50101"]
    assert stage_addresses("127.0.0.1:50051") == ["127.0.0.1:50051"]
