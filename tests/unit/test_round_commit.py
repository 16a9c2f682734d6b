"""No adapter that is not finite is ever aggregated: the ServerApp's side of a round's commit.

A device whose reply carries NaN/Inf device adapters is left out of the strategy's average and
reported as failed; a device whose server adapter the StageServer refused to merge
(``CommitRoundReply.dropped``) is reported as failed too and does not count as trained.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from flwr.app import ArrayRecord, MetricRecord

from fedpipe.fl.device_work import RunSettings
from fedpipe.fl.round_grid import DeviceBook, RoundGrid, StopRun
from fedpipe.fl.server_app import RoundHooks
from fedpipe.wire.control_client import Committed


class _Control:
    """Stands in for the StageServer's control client: records commits, drops what it is told."""

    def __init__(self, dropped: dict[str, str]) -> None:
        self.dropped = dropped
        self.commits: list[dict[str, float]] = []

    def commit_round(self, round_: int, finished: dict[str, float]) -> Committed:
        self.commits.append(dict(finished))
        kept = [d for d in finished if d not in self.dropped]
        return Committed(len(kept), 0, {d: self.dropped[d] for d in finished if d in self.dropped})


def _reply(node: int, value: float) -> Any:
    """What the strategy hands back: a device's reply with one adapter tensor and its metrics."""
    metrics = MetricRecord({"num-examples": 4, "train-loss": 1.0, "bytes-up": 10, "bytes-down": 10})
    content = {"arrays": ArrayRecord({"lora_A": torch.full((2, 2), value)}), "metrics": metrics}
    return SimpleNamespace(
        content=content,
        metadata=SimpleNamespace(src_node_id=node),
        has_error=lambda: False,
    )


def _rounds(control: _Control) -> tuple[RoundHooks, list[dict]]:
    records: list[dict] = []
    rounds = RoundHooks(control, RunSettings(), 0, log=records.append)  # type: ignore[arg-type]
    rounds.grid = RoundGrid(
        SimpleNamespace(),  # type: ignore[arg-type]
        log=records.append,
        devices=DeviceBook(),
        deadline_s=60,
        report_every_s=30,
    )
    rounds.grid.round = 1
    return rounds, records


def test_a_non_finite_device_adapter_is_not_aggregated() -> None:
    control = _Control(dropped={})
    rounds, records = _rounds(control)
    replies = [_reply(1, 0.5), _reply(2, float("nan")), _reply(3, float("inf"))]
    kept = rounds.valid_replies(replies)
    assert [r.metadata.src_node_id for r in kept] == [1]
    assert [(r["node_id"], r["event"]) for r in records] == [(2, "failure"), (3, "failure")]
    assert (
        "device adapter not aggregated: 1 tensors hold NaN or Inf (e.g. lora_A)"
        in (records[0]["reason"])
    )
    rounds.commit(1, kept)
    assert control.commits == [{"1": 4.0}]  # the bad devices' server adapters are discarded
    assert rounds.stats["devices_trained"] == 1 and rounds.stats["devices_failed"] == 2


def test_a_server_adapter_the_stage_server_dropped_is_a_failure() -> None:
    control = _Control(dropped={"2": "1 of 512 values of lora_B are NaN or Inf"})
    rounds, records = _rounds(control)
    rounds.commit(1, [_reply(1, 0.5), _reply(2, 0.5)])
    failures = [r for r in records if r["event"] == "failure"]
    assert [(r["node_id"], r["reason"]) for r in failures] == [
        (2, "server adapter not merged: 1 of 512 values of lora_B are NaN or Inf")
    ]
    assert rounds.stats["devices_trained"] == 1 and rounds.stats["devices_failed"] == 1

    control = _Control(dropped={"1": "NaN"})
    rounds, _ = _rounds(control)
    with pytest.raises(StopRun, match="no device trained"):
        rounds.commit(1, [_reply(1, 0.5)])
