"""Compressed adapter rounds (``federated.adapter_codec``) through the ServerApp's own rounds
(:class:`fedpipe.fl.rounds.FedpipeStrategy`: Flower's strategy, the reply checks, the
StageServer's commit) over an in-process grid whose devices answer as the ClientApp does
(:class:`fedpipe_bench.local_devices.LocalDevices`, both of its mods) and train on a real
StageServer.

An int8 uplink round ends next to the fp32 round; int8 both ways moves under 0.3 of the
adapter bytes each way, each device keeping its residuals in its node state between rounds; a
device whose encoded update does not decode is named failed, and the aggregate is the honest
devices' alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import pytest
import torch
from fedpipe_bench.local_devices import FIRST_NODE, LocalDevices
from fedpipe_bench.local_grid import LocalGrid
from flwr.app import Array, ArrayRecord, Error, Message
from harness.close import assert_close_to_scale

from fedpipe.config import load_config
from fedpipe.fl.adapter_codec import ENCODED, FEEDBACK_KEY
from fedpipe.fl.device_work import DeviceWork, RunSettings
from fedpipe.fl.rounds import FedpipeStrategy
from fedpipe.fl.server_app import seeded_adapters
from fedpipe.server.build import build_stage_server
from fedpipe.wire.control_client import StageControlClient

HOSTILE = FIRST_NODE + 1  # device 1 of 3
SETTINGS = {
    "model.name": "tiny-llama",
    "train.batch_size": 2,
    "train.seq_len": 16,
    "train.local_steps": 2,
    "train.lr": 1e-2,
    "pipeline.microbatches": 1,
    "federated.num_devices": 3,
    "federated.profiles": "loopback",
}
INT8 = {"federated.adapter_codec": "int8", "federated.adapter_downlink_codec": "int8"}


@dataclass
class Run:
    initial: dict[str, torch.Tensor]
    device: dict[str, torch.Tensor]  # the global device adapter after the last round
    server: dict[str, torch.Tensor]
    failures: list[dict[str, Any]]
    devices: LocalDevices


class _Hostile(LocalDevices):
    """The bench's devices; device 1's encoded reply is replaced by ``tamper(reply)``."""

    def __init__(self, cfg: Any, tamper: Any) -> None:
        super().__init__(cfg)
        self.tamper = tamper

    def _answer(self, node: int, msg: Message) -> Message:
        reply = super()._answer(node, msg)
        return self.tamper(reply, msg) if node == HOSTILE else reply


def _garbage(reply: Message, _: Message) -> Message:
    """One tensor of the encoded update is bytes that are no tensor message."""
    record = cast(ArrayRecord, reply.content["arrays"])
    arrays = {k: record[k] for k in record.keys()}
    key = sorted(arrays)[0]
    assert arrays[key].stype == ENCODED
    a = arrays[key]
    arrays[key] = Array(dtype=a.dtype, shape=a.shape, stype=ENCODED, data=b"\x0a\xffnot a tensor")
    reply.content["arrays"] = ArrayRecord(arrays)
    return reply


def _error(_: Message, msg: Message) -> Message:
    return Message(Error(code=0, reason="the device failed"), reply_to=msg)


def _run(settings: dict[str, Any], rounds: int, tamper: Any = None) -> Run:
    cfg = load_config(None, {**SETTINGS, "federated.rounds": rounds, **settings})
    server = build_stage_server(cfg, port=0).start()
    control = StageControlClient(server.address, "")
    try:
        control.reset_adapter()
        run = RunSettings(stage_address=server.address, run_id="adapter-codec")
        evaluator = DeviceWork(cfg, device_id="evaluator", partition=-1, num_partitions=3)
        initial = seeded_adapters(cfg, evaluator)
        records: list[dict[str, Any]] = []
        devices = _Hostile(cfg, tamper) if tamper else LocalDevices(cfg)
        grid = LocalGrid(devices.nodes())
        state = FedpipeStrategy(cfg, control, run, grid, initial=dict(initial), log=records.append)
        result = state.run(initial, num_rounds=rounds)
        failures = [r for r in records if r["event"] == "failure"]
        device = dict(result.arrays.to_torch_state_dict())
        return Run(dict(initial), device, control.get_adapter(), failures, devices)
    finally:
        control.close()
        server.stop(grace=None)


@pytest.fixture(scope="module")
def fp32() -> Run:
    return _run({}, rounds=1)


@pytest.fixture(scope="module")
def int8_up() -> Run:
    return _run({"federated.adapter_codec": "int8"}, rounds=1)


@pytest.fixture(scope="module")
def int8() -> Run:
    return _run(INT8, rounds=2)


def test_an_int8_uplink_round_ends_within_2_percent_of_fp32s_move(fp32: Run, int8_up: Run) -> None:
    """Same data, same start (the downlink is fp32): the global adapters differ only by the
    int8 error of the devices' averaged updates."""
    assert fp32.failures == [] and int8_up.failures == []
    assert int8_up.device.keys() == fp32.device.keys()
    for key in fp32.device:
        moved = (fp32.device[key] - fp32.initial[key]).norm()
        assert moved > 0, key  # the round trained this adapter
        off = (int8_up.device[key] - fp32.device[key]).norm()
        assert off <= 0.02 * moved, (key, float(off), float(moved))
    assert int8_up.devices.traffic.adapters_down == fp32.devices.traffic.adapters_down


def test_int8_both_ways_moves_under_0_3_of_the_fp32_adapter_bytes_each_way(
    fp32: Run, int8: Run
) -> None:
    assert int8.failures == []
    for way in ("adapters_up", "adapters_down"):
        plain = getattr(fp32.devices.traffic, way)  # one round
        coded = getattr(int8.devices.traffic, way) / 2  # per round of two
        assert 0 < coded < 0.3 * plain, (way, coded, plain)


def test_each_device_keeps_its_residuals_between_rounds_in_its_node_state(int8: Run) -> None:
    for node, context in int8.devices.contexts.items():
        residuals = cast(ArrayRecord, context.state[FEEDBACK_KEY]).to_torch_state_dict()
        assert residuals.keys() == int8.device.keys(), node
        assert any(r.abs().sum() > 0 for r in residuals.values()), node


def test_an_update_that_does_not_decode_is_its_devices_failure_and_not_aggregated() -> None:
    honest = _run(INT8, rounds=1, tamper=_error)
    assert [f["node_id"] for f in honest.failures] == [HOSTILE]
    got = _run(INT8, rounds=1, tamper=_garbage)
    assert [f["node_id"] for f in got.failures] == [HOSTILE], got.failures
    assert "its adapter update does not decode" in got.failures[0]["reason"]
    for mine, expected in ((got.device, honest.device), (got.server, honest.server)):
        assert mine.keys() == expected.keys()
        for key in expected:
            assert_close_to_scale(mine[key], expected[key], rel=0, atol=1e-6)
