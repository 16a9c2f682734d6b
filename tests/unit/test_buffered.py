"""Buffered asynchronous rounds' parts (fedpipe.fl.buffered), without sockets.

- the staleness weights as the settings name them, and their refusals (one line, by name);
- the buffer: exactly K handed over, the rest kept in arrival order; a stale or second reply
  refused and counted;
- ``apply_updates``: the global moved by the weighted mean of each update against its own start,
  to 1e-6 of the tensors' scale; with fresh starts it is the weighted mean itself (FedAvg);
- both adapter banks merge sessions of older versions by that same formula;
- a device whose reply does not come within the round deadline fails, and its session goes.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from flwr.app import Message
from harness.close import assert_close_to_scale

from fedpipe.config import FederatedConfig, FedpipeConfig, parse_staleness
from fedpipe.fl.buffered import Buffer, BufferedRounds, Staleness
from fedpipe.fl.deadline_grid import DeadlineGrid, DeviceBook
from fedpipe.fl.replies import METRIC_KEYS, TrainReply
from fedpipe.lora import AdapterBank, LoraSettings
from fedpipe.lora.aggregation import aggregate_held, apply_updates
from fedpipe.lora.batched_bank import BatchedAdapterBank
from fedpipe.models import load_config
from fedpipe.split import build_stage, split_layout

SETTINGS = LoraSettings(r=4, alpha=8, seed=3)


def test_staleness_weights() -> None:
    assert Staleness.parse("constant").weight(7) == 1.0
    poly = Staleness.parse("poly:0.5")
    assert poly.weight(0) == 1.0 and poly.weight(3) == pytest.approx(0.5)
    hinge = Staleness.parse("hinge:2,1")
    assert [hinge.weight(s) for s in (0, 1, 2, 3)] == [1.0, 1.0, pytest.approx(1 / 3), 0.2]
    with pytest.raises(ValueError, match="count of versions"):
        poly.weight(-1)


@pytest.mark.parametrize("text", ["poly", "poly:x", "hinge:1", "linear:1", "poly:-1"])
def test_an_unknown_staleness_rule_is_one_line_naming_it(text: str) -> None:
    with pytest.raises(ValueError, match=r"federated.staleness .* unknown") as err:
        parse_staleness(text)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("settings", "said"),
    [
        ({"federated.buffer": 5}, "federated.buffer = 5 with mode = async waits for more"),
        ({"federated.buffer": 0}, "federated.buffer = 0 with mode = async"),
        ({"federated.max_staleness": -1}, "federated.max_staleness must be in 0..100"),
        ({"federated.max_staleness": 1000}, "federated.max_staleness must be in 0..100"),
        ({"federated.aggregation": "exact"}, "cannot hold federated.aggregation = exact"),
        ({"federated.strategy": "fedadam"}, "cannot hold federated.strategy = fedadam"),
        ({"federated.adapter_codec": "int8"}, "cannot hold federated.adapter_codec = int8"),
        ({"pipeline.freeze": "progressive"}, "cannot hold pipeline.freeze = progressive"),
        ({"privacy.adapter_dp": "server"}, "cannot hold privacy.adapter_dp = server"),
        ({"federated.buffer_lr": 0}, "federated.buffer_lr must be > 0"),
        ({"federated.eval_every": 0}, "federated.eval_every must be >= 1"),
    ],
)
def test_async_settings_it_cannot_hold_are_refused_by_name(
    settings: dict[str, Any], said: str
) -> None:
    with pytest.raises(ValueError, match=said.replace("(", r"\(").replace(".", r"\.")) as err:
        FedpipeConfig().with_overrides({"federated.mode": "async", **settings})
    assert "\n" not in str(err.value)


def _reply(examples: int = 4) -> Message:
    metrics = dict.fromkeys(METRIC_KEYS, 0) | {"num-examples": examples}
    return SimpleNamespace(content=TrainReply(metrics=metrics).write({}))  # type: ignore[return-value]


def test_the_buffer_hands_over_exactly_k_and_refuses_stale_and_second_replies() -> None:
    buffer = Buffer(size=2, max_staleness=1)
    assert buffer.take(_reply(), node=1, version=3, now=3) is None
    assert not buffer.full
    assert buffer.take(_reply(), node=2, version=2, now=3) is None  # 1 stale: let in
    assert buffer.take(_reply(), node=3, version=3, now=3) is None
    stale = buffer.take(_reply(), node=4, version=1, now=3)
    assert stale is not None and stale.kind == "stale" and "2 versions stale" in stale.why
    again = buffer.take(_reply(), node=1, version=3, now=3)
    assert again is not None and again.kind == "duplicate"
    assert buffer.full and [t.node for t in buffer.pop()] == [1, 2]  # exactly K, in order
    assert [t.node for t in buffer.waiting] == [3] and not buffer.full
    assert (buffer.stale, buffer.duplicates) == (1, 1)


def _states(n: int, keys: dict[str, tuple[int, ...]], seed: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [{k: torch.randn(s, generator=gen) for k, s in keys.items()} for _ in range(n)]


def test_apply_updates_moves_the_global_by_the_weighted_mean_update() -> None:
    keys = {"a": (4, 3), "b": (2, 5)}
    current = _states(1, keys, 0)[0]
    starts = _states(3, keys, 1)
    states = _states(3, keys, 2)
    del states[2]["b"]  # a device of another cut: "b" is averaged over the other two
    weights = [1.0, 3.0, 2.0]
    moved = apply_updates(current, starts, states, weights, server_lr=0.5)
    mean_a = sum(w * (s["a"] - t["a"]) for w, s, t in zip(weights, states, starts, strict=True))
    mean_a = mean_a / 6.0
    assert_close_to_scale(moved["a"], current["a"] + 0.5 * mean_a, rel=1e-6)
    mean_b = (1.0 * (states[0]["b"] - starts[0]["b"]) + 3.0 * (states[1]["b"] - starts[1]["b"])) / 4
    assert_close_to_scale(moved["b"], current["b"] + 0.5 * mean_b, rel=1e-6)


def test_apply_updates_from_fresh_starts_is_the_weighted_mean() -> None:
    keys = {"a": (4, 3), "b": (2, 5)}
    current = _states(1, keys, 0)[0]
    states = _states(3, keys, 2)
    weights = [1.0, 3.0, 2.0]
    moved = apply_updates(current, [current] * 3, states, weights)
    mean, _ = aggregate_held(states, weights, "separate", scale=1.0, initial={})
    for key in keys:
        assert_close_to_scale(moved[key], mean[key], rel=1e-6)


@pytest.mark.parametrize("bank_type", [AdapterBank, BatchedAdapterBank])
def test_both_banks_merge_older_versions_updates_by_the_same_rule(
    folder: Path, bank_type: type
) -> None:
    bank = bank_type(build_stage(folder, split_layout(load_config(folder)), "middle"), SETTINGS)
    old = {k: v.clone() for k, v in bank.global_state().items()}  # version 1's global
    gen = torch.Generator().manual_seed(5)
    bank.add("v1")  # a session of version 1, from its global
    now = {k: v + 0.01 * torch.randn(v.shape, generator=gen) for k, v in old.items()}
    bank.set_global_state(now)  # the global moved on (version 2)
    bank.add("v2")
    trained = {}
    for name in ("v1", "v2"):
        with torch.no_grad():
            for param in bank.parameters(name):
                param.add_(0.05 * torch.randn(param.shape, generator=gen))
        trained[name] = {k: v.clone() for k, v in bank.state_dict(name).items()}
    bank.apply_updates({"v1": old, "v2": now}, {"v1": 1.0, "v2": 3.0}, server_lr=0.7)
    want = apply_updates(now, [old, now], [trained["v1"], trained["v2"]], [1.0, 3.0], server_lr=0.7)
    got = bank.global_state()
    for key, value in want.items():
        assert_close_to_scale(got[key], value, rel=1e-6)
    for name in ("v1", "v2"):  # merged sessions are gone from the bank
        with pytest.raises((KeyError, ValueError)):
            bank.state_dict(name)


class _Silent:
    """Flower's grid where messages go out and no reply ever comes."""

    def __init__(self) -> None:
        self.sent: list[Message] = []

    def get_node_ids(self) -> list[int]:
        return [7]

    def create_message(self, content: Any, message_type: str, node: int, group: str) -> Any:
        return SimpleNamespace(
            content=content, metadata=SimpleNamespace(dst_node_id=node, message_type=message_type)
        )

    def push_messages(self, messages: Any) -> list[str]:
        out = []
        for i, msg in enumerate(messages):
            self.sent.append(msg)
            out.append(f"m{len(self.sent)}-{i}")
        return out

    def pull_messages(self, ids: Any) -> list[Message]:
        return []


def test_a_reply_past_the_round_deadline_is_a_failure_and_its_session_goes() -> None:
    records: list[dict[str, Any]] = []
    commits: list[tuple[list, list]] = []
    fed = FederatedConfig(mode="async", buffer=1, num_devices=1, round_deadline_s=0.05)
    grid = DeadlineGrid(
        _Silent(),  # type: ignore[arg-type]
        log=records.append,
        devices=DeviceBook(),
        deadline_s=1,
        report_every_s=1,
    )
    round_ = SimpleNamespace(
        policy=fed,
        grid=grid,
        number=3,
        log=records.append,
        orders=lambda messages: list(messages),
        begin_version=lambda version, arrays: None,
        commit_updates=lambda merge, discard: commits.append((merge, discard)),
    )
    loop = BufferedRounds(round_)  # type: ignore[arg-type]
    loop.globals[3] = {"a": torch.zeros(2)}
    loop._dispatch()
    assert [o.node for o in loop.out.values()] == [7]
    time.sleep(0.1)
    loop._expire()
    assert loop.out == {}
    failure = [r for r in records if r["event"] == "failure"]
    assert len(failure) == 1 and "no reply within the round deadline" in failure[0]["reason"]
    assert loop.discard == [("7", 3)]  # its session on the StageServer goes at the next commit
    loop._cancel_out()
    assert commits == [([], [("7", 3)])]
    loop._dispatch()  # it had version 3: it waits for the next one
    assert loop.out == {}
