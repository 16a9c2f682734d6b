"""A hostile device's train reply plants nothing in anyone's model, through the ServerApp's own
rounds (:class:`fedpipe.fl.rounds.FedpipeStrategy`: Flower's strategy, fedpipe's reply checks,
the StageServer's commit) over an in-process grid whose devices train on a real StageServer.

Each tampered reply is refused and its device named as failed; the global device adapter and
the server's global adapter then equal those of the same round in which that device failed
outright (an error reply): the honest devices' aggregate alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import pytest
import torch
from fedpipe_bench.local_devices import FIRST_NODE, LocalDevices
from fedpipe_bench.local_grid import LocalGrid
from flwr.app import ArrayRecord, Error, Message, MetricRecord
from harness.close import assert_close_to_scale

from fedpipe.config import load_config
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
    "pipeline.microbatches": 1,
    "federated.num_devices": 3,
    "federated.rounds": 1,
    "federated.profiles": "loopback",
}
Tamper = Callable[[Message, Message], Message]  # (its honest reply, the round's message)


class _Devices(LocalDevices):
    """The bench's devices, one of which sends ``tamper(its honest reply)``."""

    def __init__(self, cfg: Any, tamper: Tamper) -> None:
        super().__init__(cfg)
        self.tamper = tamper

    def _train(self, node: int, msg: Message) -> Message:
        reply = super()._train(node, msg)
        return self.tamper(reply, msg) if node == HOSTILE else reply


def _arrays(reply: Message) -> dict[str, torch.Tensor]:
    return dict(cast(ArrayRecord, reply.content["arrays"]).to_torch_state_dict())


def _with_arrays(reply: Message, state: dict[str, torch.Tensor]) -> Message:
    reply.content["arrays"] = ArrayRecord({k: v.contiguous() for k, v in state.items()})
    return reply


def _with_metric(reply: Message, **changes: Any) -> Message:
    metrics = dict(cast(MetricRecord, reply.content["metrics"]))
    for key, value in changes.items():
        if value is None:
            metrics.pop(key.replace("_", "-"), None)
        else:
            metrics[key.replace("_", "-")] = value
    reply.content["metrics"] = MetricRecord(metrics)
    return reply


def _extra_key(reply: Message, _: Message) -> Message:
    state = _arrays(reply)
    return _with_arrays(reply, {**state, "model.norm.lora_A.weight": torch.full((4, 8), 9.0)})


def _base_delta(reply: Message, _: Message) -> Message:
    state = _arrays(reply)
    key = next(k for k in state if k.endswith(".lora_A.weight"))
    layer = key.removesuffix(".lora_A.weight")
    b = state[f"{layer}.lora_B.weight"]
    delta = torch.full((b.shape[0], state[key].shape[1]), 100.0)
    return _with_arrays(reply, {**state, f"{layer}.base_delta": delta})


def _heavy(reply: Message, _: Message) -> Message:
    """10^12 claimed examples and an adapter scaled x1000: all the weight, if trusted."""
    _with_arrays(reply, {k: v * 1000 for k, v in _arrays(reply).items()})
    return _with_metric(reply, num_examples=10**12)


def _error(_: Message, msg: Message) -> Message:
    return Message(Error(code=0, reason="the device failed"), reply_to=msg)


TAMPERS: dict[str, Tamper] = {
    "extra-key": _extra_key,
    "base-delta": _base_delta,
    "10^12-examples": _heavy,
    "nan-weight": lambda r, _: _with_metric(r, num_examples=math.nan),
    "missing-metric": lambda r, _: _with_metric(r, bytes_up=None),
}


def _round(tamper: Tamper) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list]:
    """One round of 3 devices: the global device adapter, the server's, the failure records."""
    cfg = load_config(None, SETTINGS)
    server = build_stage_server(cfg, port=0).start()
    control = StageControlClient(server.address, "")
    try:
        control.reset_adapter()
        run = RunSettings(stage_address=server.address, run_id="hostile")
        evaluator = DeviceWork(cfg, device_id="evaluator", partition=-1, num_partitions=3)
        initial = seeded_adapters(cfg, evaluator)
        records: list[dict[str, Any]] = []
        devices = _Devices(cfg, tamper)
        grid = LocalGrid(devices.nodes())
        rounds = FedpipeStrategy(cfg, control, run, grid, initial=dict(initial), log=records.append)
        result = rounds.run(initial, num_rounds=1)
        failures = [r for r in records if r["event"] == "failure"]
        return result.arrays.to_torch_state_dict(), control.get_adapter(), failures
    finally:
        control.close()
        server.stop(grace=None)


@pytest.fixture(scope="module")
def honest_alone() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The round in which the hostile device failed outright: the honest devices' aggregate."""
    device, server, failures = _round(_error)
    assert [f["node_id"] for f in failures] == [HOSTILE]
    return device, server


@pytest.mark.parametrize("name", list(TAMPERS))
def test_a_tampered_reply_is_refused_and_the_aggregate_is_the_honest_devices_alone(
    name: str, honest_alone: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]
) -> None:
    device, server, failures = _round(TAMPERS[name])
    assert [f["node_id"] for f in failures] == [HOSTILE], failures
    assert "not aggregated" in failures[0]["reason"]
    for got, expected in ((device, honest_alone[0]), (server, honest_alone[1])):
        assert got.keys() == expected.keys()  # no key of the hostile device's own
        for key in expected:
            assert_close_to_scale(got[key], expected[key], rel=0, atol=1e-6)
