"""Robust aggregation: the StageServer's rules equal Flower's strategies of the same name, per
key over the devices that hold it, and a norm bound clips every update first."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg, FedMedian, FedTrimmedAvg, Krum, MultiKrum
from harness.close import assert_close_to_scale

from fedpipe.fl.aggregate import by_holders
from fedpipe.lora.aggregation import aggregate_held
from fedpipe.lora.robust import AggregationRule, clip_updates, combine

KEYS = ("layers.0.q.lora_A.weight", "layers.0.q.lora_B.weight")


def _states(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        {KEYS[0]: torch.randn(2, 6, generator=gen), KEYS[1]: torch.randn(5, 2, generator=gen)}
        for _ in range(n)
    ]


def _reply(state: dict[str, torch.Tensor], examples: int) -> Any:
    content = RecordDict(
        {"arrays": ArrayRecord(state), "metrics": MetricRecord({"num-examples": examples})}
    )
    return SimpleNamespace(content=content, has_error=lambda: False, metadata=SimpleNamespace())


def _flower(strategy: Any, states: list[dict[str, torch.Tensor]], weights: list[int]) -> dict:
    arrays, _ = strategy.aggregate_train(
        1, [_reply(dict(s), w) for s, w in zip(states, weights, strict=True)]
    )
    return arrays.to_torch_state_dict()


@pytest.mark.parametrize(
    ("rule", "strategy"),
    [
        (AggregationRule("median"), FedMedian()),
        (AggregationRule("trimmed", beta=0.2), FedTrimmedAvg(beta=0.2)),
        (AggregationRule("krum", malicious=1), Krum(num_malicious_nodes=1)),
        (
            AggregationRule("multikrum", malicious=1, select=3),
            MultiKrum(num_malicious_nodes=1, num_nodes_to_select=3),
        ),
    ],
    ids=["median", "trimmed", "krum", "multikrum"],
)
def test_the_servers_rule_equals_flowers_strategy(rule: AggregationRule, strategy: Any) -> None:
    states, weights = _states(6, seed=1), [3, 1, 4, 1, 5, 9]
    states[2] = {k: v * 1000 for k, v in states[2].items()}  # one hostile device
    ours = combine(states, [float(w) for w in weights], rule)
    theirs = _flower(strategy, states, weights)
    for key in KEYS:
        assert_close_to_scale(ours[key], theirs[key], rel=1e-6, atol=1e-6)
    if rule.name in ("median", "trimmed", "krum"):  # the hostile values do not get through
        assert float(ours[KEYS[0]].abs().max()) < 10


def test_the_plain_rule_is_the_weighted_mean_untouched() -> None:
    states, weights = _states(3), [1.0, 2.0, 3.0]
    plain = aggregate_held(states, weights, "separate", scale=2.0, initial={})
    ruled = aggregate_held(
        states, weights, "separate", scale=2.0, initial={}, rule=AggregationRule()
    )
    for key in KEYS:
        assert torch.equal(plain[0][key], ruled[0][key])


def test_a_rule_applies_per_key_over_the_states_that_hold_it() -> None:
    """Devices of two cuts: block 1's median is over its two holders only."""
    states = _states(3, seed=2)
    other = "layers.1.q.lora_A.weight"
    for s, value in zip(states[:2], (1.0, 3.0), strict=True):
        s[other] = torch.full((2, 6), value)
    merged, _ = aggregate_held(
        states, [1.0] * 3, "separate", scale=1.0, initial={}, rule=AggregationRule("median")
    )
    assert torch.equal(merged[other], torch.full((2, 6), 2.0))  # the median of 1 and 3
    expect = np.median(np.stack([s[KEYS[0]].numpy() for s in states]), axis=0)
    assert torch.equal(merged[KEYS[0]], torch.from_numpy(expect.astype(np.float32)))


def test_updates_are_clipped_to_the_norm_bound_and_short_ones_left_alone() -> None:
    glob = {k: torch.zeros_like(v) for k, v in _states(1)[0].items()}
    big = {k: torch.full_like(v, 10.0) for k, v in glob.items()}
    small = {k: torch.full_like(v, 1e-3) for k, v in glob.items()}
    clipped, kept = clip_updates([big, small], glob, 1.0)
    norm = float(torch.sqrt(sum(v.pow(2).sum() for v in clipped.values())))
    assert norm == pytest.approx(1.0, rel=1e-6)
    assert kept is small
    ratios = {float((clipped[k] / big[k]).unique()) for k in KEYS}
    assert len(ratios) == 1  # the direction is kept: one scale for every tensor


def test_rules_travel_as_text_and_bad_ones_are_refused() -> None:
    rule = AggregationRule("multikrum", beta=0.1, malicious=2, select=3, norm_bound=0.5)
    assert AggregationRule.parse(rule.text()) == rule
    assert AggregationRule.parse("") == AggregationRule()
    with pytest.raises(ValueError, match="unknown"):
        AggregationRule("mode")
    with pytest.raises(ValueError, match=r"beta must be in \[0, 0.5\)"):
        AggregationRule("trimmed", beta=0.5)
    with pytest.raises(ValueError, match="aggregation rule"):
        AggregationRule.parse("median;x")


def test_exact_aggregation_refuses_a_robust_rule() -> None:
    with pytest.raises(ValueError, match="applies to separate and ffa"):
        aggregate_held(
            _states(2), [1.0, 1.0], "exact", scale=1.0, initial={}, rule=AggregationRule("median")
        )


def test_the_strategy_runs_per_key_set_over_its_holders() -> None:
    """With devices of two cuts a median never takes a non-holder's value: the ServerApp runs
    the strategy once per set of keys, over the devices holding them."""
    glob = {**_states(1, seed=9)[0], "layers.1.q.lora_A.weight": torch.zeros(2, 6)}
    states = _states(3, seed=3)
    states[0]["layers.1.q.lora_A.weight"] = torch.full((2, 6), 5.0)
    states[1]["layers.1.q.lora_A.weight"] = torch.full((2, 6), 7.0)
    replies = [_reply(dict(s), 1) for s in states]
    strategy = FedMedian()
    arrays, metrics = by_holders(strategy.aggregate_train, 1, replies, glob)
    got = arrays.to_torch_state_dict()  # type: ignore[union-attr]
    assert torch.equal(got["layers.1.q.lora_A.weight"], torch.full((2, 6), 6.0))
    assert metrics is not None
    for reply, state in zip(replies, states, strict=True):  # the replies are as they came
        assert set(reply.content["arrays"].keys()) == set(state)
    one_cut = [_reply(dict(s), 1) for s in _states(2, seed=4)]
    arrays, _ = by_holders(FedAvg().aggregate_train, 1, one_cut, {})
    assert set(arrays.keys()) == set(KEYS)  # type: ignore[union-attr]
