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

from fedpipe.config import FedpipeConfig
from fedpipe.edge.trainer import DeviceTrainer
from fedpipe.fl.deadline_grid import StopRun
from fedpipe.fl.device_work import RunSettings
from fedpipe.fl.freeze import FreezeRule, FreezeState
from fedpipe.fl.replies import METRIC_KEYS, TrainReply
from fedpipe.fl.rounds import FedpipeStrategy, Resumed
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

    def round_status(self, round_: int) -> None:
        return None  # a StageServer without counts: the replies' checked claims stand


_CFG = FedpipeConfig().with_overrides({"model.name": "tiny-llama"})


@pytest.fixture(scope="module")
def initial() -> dict[str, torch.Tensor]:
    """The run's seeded device adapters (tiny-llama at the default cut)."""
    return DeviceTrainer(_CFG, device_id="evaluator").adapters()


def _reply(node: int, value: float, initial: dict[str, torch.Tensor]) -> Any:
    """What the strategy hands back: a device's reply, every adapter tensor set to ``value``."""
    metrics = dict.fromkeys(METRIC_KEYS, 0) | {"num-examples": 4, "train-loss": 1.0, "steps": 1}
    adapters = {k: torch.full_like(v, value) for k, v in initial.items()}
    return SimpleNamespace(
        content=TrainReply(metrics=metrics).write(adapters),
        metadata=SimpleNamespace(src_node_id=node),
        has_error=lambda: False,
    )


def _rounds(control: _Control, initial: dict[str, torch.Tensor]) -> tuple[FedpipeStrategy, list]:
    records: list[dict] = []
    grid = SimpleNamespace()  # Flower's grid: these tests call the hooks, not Flower's loop
    rounds = FedpipeStrategy(
        _CFG,
        control,  # type: ignore[arg-type]
        RunSettings(),
        grid,  # type: ignore[arg-type]
        initial=initial,
        log=records.append,
    )
    return rounds, records


def test_a_non_finite_device_adapter_is_not_aggregated(initial: dict[str, torch.Tensor]) -> None:
    control = _Control(dropped={})
    rounds, records = _rounds(control, initial)
    replies = [_reply(1, 0.5, initial), _reply(2, float("nan"), initial)]
    replies.append(_reply(3, float("inf"), initial))
    kept = rounds.valid_replies(replies)
    assert [r.metadata.src_node_id for r in kept] == [1]
    assert [(r["node_id"], r["event"]) for r in records] == [(2, "failure"), (3, "failure")]
    first, size = next(iter(initial)), next(iter(initial.values())).numel()
    for record in records:  # said as the reply checks say it, naming the first bad tensor
        assert record["reason"] == (
            f"device adapter not aggregated: {size} values of {first} are NaN or Inf"
        )
    rounds.commit(kept)
    assert control.commits == [{"1": 4.0}]  # the bad devices' server adapters are discarded
    assert rounds.stats["devices_trained"] == 1 and rounds.stats["devices_failed"] == 2


def test_a_server_adapter_the_stage_server_dropped_is_a_failure(
    initial: dict[str, torch.Tensor],
) -> None:
    control = _Control(dropped={"2": "1 of 512 values of lora_B are NaN or Inf"})
    rounds, records = _rounds(control, initial)
    rounds.commit([_reply(1, 0.5, initial), _reply(2, 0.5, initial)])
    failures = [r for r in records if r["event"] == "failure"]
    assert [(r["node_id"], r["reason"]) for r in failures] == [
        (2, "server adapter not merged: 1 of 512 values of lora_B are NaN or Inf")
    ]
    assert rounds.stats["devices_trained"] == 1 and rounds.stats["devices_failed"] == 1

    control = _Control(dropped={"1": "NaN"})
    rounds, _ = _rounds(control, initial)
    with pytest.raises(StopRun, match="no device trained"):
        rounds.commit([_reply(1, 0.5, initial)])


def test_the_round_is_built_complete_from_the_run_settings(
    initial: dict[str, torch.Tensor],
) -> None:
    """What server_main and the benches once set on the round afterwards is the constructor's:
    the configured Flower strategy, the reply rules, the exact-aggregation state, freezing (a
    resumed run's decision) and the round number of a resumed run."""
    cfg = _CFG.with_overrides({"pipeline.freeze": "progressive", "train.batch_size": 4})
    decision = FreezeState()
    decision.decide(FreezeRule(ratio=0.5, after=1, max_blocks=1), 1, {0: 1.0, 1: 1.0})
    decision.decide(FreezeRule(ratio=0.5, after=1, max_blocks=1), 2, {0: 0.1, 1: 0.9})
    grid = SimpleNamespace()
    hooks = FedpipeStrategy(
        cfg,
        _Control({}),  # type: ignore[arg-type]
        RunSettings(),
        grid,  # type: ignore[arg-type]
        initial=initial,
        log=lambda _: None,
        resumed=Resumed(3, decision),
    )
    assert hooks.number == 3 and hooks.number_of(1) == 4 and hooks.grid.grid is grid
    assert hooks.grid.number() == 3  # the grid's records name the strategy's round
    assert type(hooks.inner).__name__ == "FedAvg" and not hooks.stateful
    assert hooks.freeze is decision and hooks.frozen_below == 1 and hooks.freeze_rule is not None
    assert hooks.reply_rules.rows_per_step == 4
    assert hooks.reply_rules.max_examples == 4 * cfg.train.local_steps
    assert hooks.exact.device_initial is initial
    assert hooks.exact.lora_scale == cfg.model.lora_alpha / cfg.model.lora_r
    off = FedpipeStrategy(
        _CFG,
        _Control({}),  # type: ignore[arg-type]
        RunSettings(),
        grid,  # type: ignore[arg-type]
        initial=initial,
        log=lambda _: None,
        resumed=Resumed(0, decision),  # a checkpoint's decision, but pipeline.freeze = off now
    )
    assert off.freeze is None and off.freeze_rule is None and off.frozen_below == 0
    assert off.number_of(1) == 1
