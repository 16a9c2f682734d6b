"""How the ServerApp aggregates the devices' adapters of a round, beside Flower's strategy.

The strategy (FedAvg by default) combines the replies' arrays (weighted by ``num-examples``).
Three things it cannot do alone: devices of different cuts hold different blocks
(:func:`by_holders` runs the strategy once per set of keys over the devices that hold them;
:func:`pad_to_union` fills each reply instead, for the strategies whose state spans the whole
adapter), every device's update may be clipped to a norm bound first (:func:`clip_replies`),
and the ``exact`` and ``stack`` rules fold each round's product of adapters into dense base
deltas (:meth:`ExactState.fold`, state kept across rounds in :class:`ExactState`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import torch
from flwr.app import ArrayRecord, Message, MetricRecord

from fedpipe.fl.replies import TrainReply
from fedpipe.lora.aggregation import DELTA_SUFFIX, aggregate_held, split_deltas
from fedpipe.lora.robust import clip_updates

__all__ = [
    "ExactState",
    "by_holders",
    "clip_replies",
    "held",
    "non_finite",
    "pad_to_union",
]

Aggregate = Callable[[int, list[Message]], tuple[ArrayRecord | None, MetricRecord | None]]


@dataclass
class ExactState:
    """What ``exact`` and ``stack`` aggregation keep across a run's rounds."""

    mode: str = "separate"  # federated.aggregation
    lora_scale: float = 1.0  # alpha / r of the device adapters
    device_initial: dict[str, torch.Tensor] = field(default_factory=dict)  # seeded (`stack`)
    device_deltas: dict[str, torch.Tensor] = field(default_factory=dict)  # folded so far
    device_global: dict[str, torch.Tensor] = field(default_factory=dict)  # sent this round

    def begin(self, arrays: dict[str, torch.Tensor]) -> None:
        """A round starts from the global device ``arrays``: its adapters, its folded deltas."""
        self.device_global, self.device_deltas = split_deltas(arrays)

    def fold(
        self,
        held: tuple[list[dict[str, torch.Tensor]], list[float]],
        result: tuple[ArrayRecord | None, object],
    ) -> tuple[ArrayRecord | None, object]:
        """``exact`` / ``stack``: the device adapters aggregated by fedpipe, base deltas folded.

        Each layer over the devices that hold it (their cut's blocks); a layer nobody ran keeps
        its global value. The global arrays then carry the cumulative deltas (``*.base_delta``)
        down to every device each round (dense: out x in values per adapted layer) and into the
        checkpoints. Other modes: ``result`` (the strategy's) as it is.
        """
        states, weights = held
        if self.mode not in ("exact", "stack") or not states or result[0] is None:
            return result
        merged, deltas = aggregate_held(
            states, weights, self.mode, scale=self.lora_scale, initial=self.device_initial
        )
        merged = {**self.device_global, **merged}
        total = dict(self.device_deltas)
        for name, delta in deltas.items():
            total[name] = total[name] + delta if name in total else delta
        self.device_deltas = total
        arrays = {**merged, **{k + DELTA_SUFFIX: v.contiguous() for k, v in total.items()}}
        return ArrayRecord(arrays), result[1]


def held(replies: list[Message]) -> tuple[list[dict[str, torch.Tensor]], list[float]]:
    """Each finished device's adapters as it sent them (its cut's blocks) and its weight."""
    ok = [r for r in replies if not r.has_error()]
    states = [dict(cast(ArrayRecord, r.content["arrays"]).to_torch_state_dict()) for r in ok]
    return states, [float(TrainReply.read(r.content).num_examples) for r in ok]


def pad_to_union(
    replies: list[Message],
    held: tuple[list[dict[str, torch.Tensor]], list[float]],
    global_state: dict[str, torch.Tensor],
) -> None:
    """Devices of different cuts hold different blocks: fill each reply's missing keys.

    A key a device lacks gets the weighted mean over the devices that hold it (a key nobody
    holds: its global value). Any strategy that averages the replies by ``num-examples``
    then gets, per key, the mean over its holders with their weights renormalised, and a
    block no device ran keeps its global value. Replies of one cut are left as they are.
    """
    states, weights = held
    union = dict.fromkeys([*global_state, *(k for s in states for k in s)])
    if all(set(s) == set(union) for s in states):
        return
    merged, _ = aggregate_held(states, weights, "separate", scale=1.0, initial={})
    fill = {**global_state, **merged}
    ok = [r for r in replies if not r.has_error()]
    for reply, state in zip(ok, states, strict=True):
        full = {k: state[k] if k in state else fill[k] for k in union}
        reply.content["arrays"] = ArrayRecord({k: v.contiguous() for k, v in full.items()})


def by_holders(
    aggregate: Aggregate,
    server_round: int,
    replies: list[Message],
    global_state: dict[str, torch.Tensor],
) -> tuple[ArrayRecord | None, MetricRecord | None]:
    """The strategy's ``aggregate`` per set of keys, over the devices that hold those keys.

    Devices of one cut hold the same keys: that is one call, as if nothing were in between. A
    key no device held keeps its global value. With several cuts, each set of keys is
    aggregated over its holders alone, so no device's value stands in for another's (a median
    or a Krum choice over holders only), and the metrics over every reply.
    """
    ok = [r for r in replies if not r.has_error()]
    states = [dict(cast(ArrayRecord, r.content["arrays"]).to_torch_state_dict()) for r in ok]
    groups: dict[tuple[int, ...], list[str]] = {}
    for key in dict.fromkeys(k for s in states for k in s):
        holders = tuple(i for i, s in enumerate(states) if key in s)
        groups.setdefault(holders, []).append(key)
    if len(groups) <= 1:
        arrays, metrics = aggregate(server_round, replies)
        return _with_global(arrays, global_state), metrics
    originals = [r.content["arrays"] for r in ok]
    merged: dict[str, torch.Tensor] = {}
    try:
        for holders, keys in groups.items():
            for i in holders:
                ok[i].content["arrays"] = ArrayRecord({k: states[i][k] for k in keys})
            arrays, _ = aggregate(server_round, [ok[i] for i in holders])
            if arrays is not None:
                merged.update(arrays.to_torch_state_dict())
    finally:
        for reply, record in zip(ok, originals, strict=True):
            reply.content["arrays"] = record
    strategy = aggregate.__self__  # type: ignore[attr-defined]  # the bound strategy method
    metrics = strategy.train_metrics_aggr_fn([r.content for r in ok], strategy.weighted_by_key)
    return _with_global(ArrayRecord(merged) if merged else None, global_state), metrics


def _with_global(
    arrays: ArrayRecord | None, global_state: dict[str, torch.Tensor]
) -> ArrayRecord | None:
    """``arrays`` plus the global values of the keys no device held (none: as it is)."""
    if arrays is None:
        return None
    missing = {k: v for k, v in global_state.items() if k not in arrays}
    if not missing:
        return arrays
    state = {**missing, **arrays.to_torch_state_dict()}
    return ArrayRecord({k: v.contiguous() for k, v in state.items()})


def clip_replies(
    replies: list[Message], global_state: dict[str, torch.Tensor], bound: float
) -> None:
    """Each reply's update (its adapter minus the global one) clipped to L2 norm ``bound``."""
    for reply in replies:
        if reply.has_error():
            continue
        state = cast(ArrayRecord, reply.content["arrays"]).to_torch_state_dict()
        (clipped,) = clip_updates([dict(state)], global_state, bound)
        if clipped is not state:
            reply.content["arrays"] = ArrayRecord({k: v.contiguous() for k, v in clipped.items()})


def non_finite(reply: Message) -> list[str]:
    """Names of the reply's adapter tensors holding NaN or Inf."""
    arrays = cast(ArrayRecord, reply.content["arrays"]).to_torch_state_dict()
    return [name for name, tensor in arrays.items() if not bool(torch.isfinite(tensor).all())]
