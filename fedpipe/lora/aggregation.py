"""Aggregating LoRA adapters so that the global model is the weighted mean of the devices'.

A LoRA layer computes ``W x + s B A x`` (``s`` = alpha / r). Averaging A and B separately gives
``s mean(B) mean(A)``, which is not ``s mean(B A)``: the average of the devices' models is lost.
The strategies here (``federated.aggregation``) differ in how they keep it:

- ``separate``: mean(A), mean(B); the baseline, inexact.
- ``exact``: mean(A), mean(B), and the residual ``s (mean(BA) - mean(B) mean(A))`` folded into
  the frozen base weight ``W``: the sum is exactly ``W + s mean(BA)``.
- ``ffa``: A stays at its shared deterministic init (FFA-LoRA) and only B trains, so
  ``mean(B) A = mean(BA)`` and plain averaging is exact; nothing else moves.
- ``stack``: FLoRA-style: the devices' factors are stacked (ranks may differ), their product
  ``sum_i w_i s B_i A_i`` is folded into ``W``, and the adapter restarts from its init
  (A at the seeded init, B zero) for the next round.

Base deltas are dense ``(out, in)`` tensors keyed ``<layer>.base_delta``: the cumulative change
of that layer's frozen weight, carried in checkpoints beside the adapters so a resume restores it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import cast

import torch
from peft.tuners.lora import LoraLayer
from torch import Tensor, nn

from fedpipe.config import AGGREGATIONS
from fedpipe.lora.base import average_state_dicts, lora_layers
from fedpipe.lora.robust import AggregationRule, clip_updates, combine
from fedpipe.split.quant import storage_of

__all__ = [
    "AGGREGATIONS",
    "DELTA_SUFFIX",
    "BaseFold",
    "check_aggregation",
    "aggregate_adapters",
    "aggregate_held",
    "adapter_block",
    "apply_updates",
    "held_blocks",
    "split_deltas",
    "stack_adapters",
]

log = logging.getLogger(__name__)

DELTA_SUFFIX = ".base_delta"
# A fold that a base weight's dtype keeps less of than this is reported (bf16 keeps ~5% of
# exact's residuals on SmolLM2: they are far below its resolution at the weights' magnitude).
_KEPT_WARNING = 0.5
_A, _B = ".lora_A.weight", ".lora_B.weight"


def check_aggregation(mode: str) -> str:
    """``mode`` if it is a known strategy; else an error that lists them."""
    if mode not in AGGREGATIONS:
        raise ValueError(
            f"federated.aggregation {mode!r} unknown; choose one of {', '.join(AGGREGATIONS)}"
        )
    return mode


def split_deltas(state: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """``state`` as (adapter tensors, base deltas by layer name without the suffix)."""
    lora = {k: v for k, v in state.items() if not k.endswith(DELTA_SUFFIX)}
    deltas = {k[: -len(DELTA_SUFFIX)]: v for k, v in state.items() if k.endswith(DELTA_SUFFIX)}
    return lora, deltas


def stack_adapters(
    factors: list[tuple[Tensor, Tensor]], weights: list[float]
) -> tuple[Tensor, Tensor]:
    """FLoRA stacking: ``(A_i (r_i, in), B_i (out, r_i))`` -> ``(A (R, in), B (out, R))``.

    ``B @ A == sum_i w_i B_i A_i`` exactly (the weights go into B's blocks); ranks may differ.
    """
    if not factors or len(factors) != len(weights):
        raise ValueError(f"need one weight per adapter, got {len(factors)} and {len(weights)}")
    a = torch.cat([fa.float() for fa, _ in factors], dim=0)
    b = torch.cat([fb.float() * w for (_, fb), w in zip(factors, weights, strict=True)], dim=1)
    return a, b


def aggregate_adapters(
    states: list[dict[str, Tensor]],
    weights: list[float],
    mode: str,
    *,
    scale: float,
    initial: dict[str, Tensor],
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """The new global adapter and the base deltas to add, by strategy ``mode``.

    ``weights`` are normalised to sum 1; ``initial`` is the adapter at its seeded init (what
    ``stack`` restarts from); ``scale`` is LoRA's alpha / r. Deltas are fp32, ``(out, in)``.
    """
    check_aggregation(mode)
    total = float(sum(weights))
    if not states or len(states) != len(weights) or total <= 0 or min(weights) < 0:
        raise ValueError(f"need one weight >= 0 per adapter with a positive sum, got {weights}")
    norm = [w / total for w in weights]
    layers = sorted(k[: -len(_A)] for k in states[0] if k.endswith(_A))
    if mode == "stack":
        return _stacked(states, norm, layers, scale, initial)
    merged = average_state_dicts(states, weights)  # the baseline's own arithmetic, unchanged
    if mode != "exact":
        return merged, {}
    deltas = {}
    for name in layers:
        mean_ba = sum(
            w * (s[name + _B].float() @ s[name + _A].float())
            for s, w in zip(states, norm, strict=True)
        )
        mean_b, mean_a = merged[name + _B].float(), merged[name + _A].float()
        deltas[name] = scale * (torch.as_tensor(mean_ba) - mean_b @ mean_a)
    return merged, deltas


def adapter_block(key: str) -> int | None:
    """The global block index a state-dict key belongs to (``layers.5.…``, ``h.5.…``), if any."""
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        if part in ("layers", "h") and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def held_blocks(state: dict[str, Tensor], blocks: Sequence[int] | None) -> dict[str, Tensor]:
    """The part of ``state`` in ``blocks`` (None: all of it): what one session trained."""
    if blocks is None:
        return state
    wanted = set(blocks)
    return {k: v for k, v in state.items() if adapter_block(k) in wanted}


def aggregate_held(
    states: list[dict[str, Tensor]],
    weights: list[float],
    mode: str,
    *,
    scale: float,
    initial: dict[str, Tensor],
    rule: AggregationRule | None = None,
    global_state: dict[str, Tensor] | None = None,
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """:func:`aggregate_adapters` per layer over the states that hold it (devices or sessions
    of different cuts hold different blocks); each layer's weights are renormalised over its
    holders. Layers whose holders all weigh 0 are left out (they keep their global value).

    When every state holds every key this is :func:`aggregate_adapters` itself. A ``rule``
    other than the plain mean (:mod:`fedpipe.lora.robust`) clips each state's update against
    ``global_state`` to its norm bound first, and combines each layer's holders by its rule
    (``separate`` and ``ffa`` only: ``exact`` and ``stack`` fold a weighted mean).
    """
    if len(states) != len(weights) or min(weights, default=0.0) < 0:
        raise ValueError(f"need one weight >= 0 per adapter, got {weights}")
    if rule is not None and not rule.plain:
        if mode not in ("separate", "ffa"):
            raise ValueError(
                f"aggregation rule {rule.name!r} applies to separate and ffa aggregation, not "
                f"{mode!r} (exact and stack fold a weighted mean)"
            )
        if rule.norm_bound > 0:
            if global_state is None:
                raise ValueError("a norm bound needs the global adapter the updates are from")
            states = clip_updates(states, global_state, rule.norm_bound)
    by_holders: dict[tuple[int, ...], list[str]] = {}
    for key in dict.fromkeys(k for s in states for k in s):
        holders = tuple(i for i, s in enumerate(states) if key in s)
        by_holders.setdefault(holders, []).append(key)
    merged: dict[str, Tensor] = {}
    deltas: dict[str, Tensor] = {}
    for holders, keys in by_holders.items():
        if sum(weights[i] for i in holders) <= 0:
            continue
        group = [{k: states[i][k] for k in keys} for i in holders]
        if rule is not None and rule.name != "mean":
            merged.update(combine(group, [weights[i] for i in holders], rule))
            continue
        part, delta = aggregate_adapters(
            group,
            [weights[i] for i in holders],
            mode,
            scale=scale,
            initial={k: initial[k] for k in keys if k in initial},
        )
        merged.update(part)
        deltas.update(delta)
    return merged, deltas


def apply_updates(
    current: dict[str, Tensor],
    starts: list[dict[str, Tensor]],
    states: list[dict[str, Tensor]],
    weights: list[float],
    *,
    server_lr: float = 1.0,
) -> dict[str, Tensor]:
    """Buffered asynchronous aggregation (FedBuff): ``current`` moved by the weighted mean of
    the updates ``states[k] - starts[k]``, scaled by ``server_lr``.

    Each state's update is against the global it started from (``starts[k]``, an older one for
    a stale device); ``weights`` carry the staleness weight already. Each key is averaged over
    the states that hold it (devices or sessions of different cuts), its weights renormalised
    over them; a key no state holds, or whose holders all weigh 0, keeps its current value.
    With every start equal to ``current`` and ``server_lr`` 1 this is the weighted mean of the
    states (:func:`aggregate_held`'s ``separate``). Returns the keys that moved.
    """
    if not len(starts) == len(states) == len(weights) or min(weights, default=0.0) < 0:
        raise ValueError(f"need one start and one weight >= 0 per update, got {weights}")
    moved: dict[str, Tensor] = {}
    for key in dict.fromkeys(k for s in states for k in s):
        holders = [i for i, s in enumerate(states) if key in s]
        total = sum(weights[i] for i in holders)
        if total <= 0 or key not in current:
            continue
        missing = [i for i in holders if key not in starts[i]]
        if missing:
            raise ValueError(f"update {missing[0]} holds {key} but its start does not")
        step = torch.zeros_like(current[key], dtype=torch.float32)
        for i in holders:
            step += (weights[i] / total) * (states[i][key].float() - starts[i][key].float())
        moved[key] = (current[key].float() + server_lr * step).to(current[key].dtype)
    return moved


def _stacked(
    states: list[dict[str, Tensor]],
    norm: list[float],
    layers: list[str],
    scale: float,
    initial: dict[str, Tensor],
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    deltas = {}
    for name in layers:
        a, b = stack_adapters([(s[name + _A], s[name + _B]) for s in states], norm)
        deltas[name] = scale * (b @ a)
    return {k: v.clone() for k, v in initial.items()}, deltas


class BaseFold:
    """Sets the frozen base weights of a module's LoRA layers to ``original + delta``.

    The original weights are copied the first time a layer is changed, so setting the deltas
    again (or to nothing, on a new run) never accumulates rounding. Deltas are ``(out, in)``;
    layers that store their weight transposed (GPT-2's Conv1D) get the transpose.

    A low-precision base (bfloat16: the server's default on CUDA) cannot hold a delta much
    smaller than its weights: ``kept`` is the fraction of the last deltas that landed, over all
    layers (1 - ||landed - delta|| / ||delta||), and a fold that keeps under half is logged.
    A base stored in fewer bits (``server.weights``, fedpipe.split.quant; ``storage``) holds
    no fold at all: deltas for it are refused.
    """

    def __init__(self, *modules: nn.Module | None) -> None:
        layers: dict[str, LoraLayer] = {}
        for module in modules:
            if module is not None:
                layers.update(lora_layers(module))
        # name -> (the frozen base weight, stored transposed as GPT-2's Conv1D does)
        self._bases: dict[str, tuple[Tensor, bool]] = {
            name: (
                cast(Tensor, layer.get_base_layer().weight),
                bool(getattr(layer, "fan_in_fan_out", False)),
            )
            for name, layer in layers.items()
        }
        self.storage = _storage([layer.get_base_layer() for layer in layers.values()])
        self._original: dict[str, Tensor] = {}
        self.deltas: dict[str, Tensor] = {}
        self.kept = 1.0

    @classmethod
    def of_linears(cls, linears: dict[str, nn.Linear]) -> BaseFold:
        """A fold over plain ``nn.Linear`` base layers by global name (the batched bank's)."""
        fold = cls()
        fold._bases = {name: (linear.weight, False) for name, linear in linears.items()}
        fold.storage = _storage(list(linears.values()))
        return fold

    def check_foldable(self, mode: str) -> None:
        """Refuse ``federated.aggregation`` ``mode`` where it folds into a stored base."""
        if mode in ("exact", "stack") and self.storage != "fp32":
            raise ValueError(
                f"federated.aggregation = {mode} folds each round's base deltas into the frozen "
                f"block weights, but server.weights = {self.storage} stores them rounded, which "
                "cannot hold a fold; use aggregation separate or ffa, or server.weights = fp32"
            )

    def owns(self, name: str) -> bool:
        return name in self._bases

    @torch.no_grad()
    def set(self, deltas: dict[str, Tensor]) -> None:
        """Base weights become original + ``deltas`` (layers not named: their original)."""
        if deltas and self.storage != "fp32":
            raise ValueError(
                f"base deltas for {len(deltas)} layers (federated.aggregation exact or stack), "
                f"but these frozen weights are stored as {self.storage} (server.weights or "
                "device.weights), rounded, which cannot hold them; load them where they are "
                "stored as fp32"
            )
        unknown = sorted(set(deltas) - set(self._bases))
        if unknown:
            raise KeyError(
                f"base deltas for layers this module lacks: {unknown[:4]} ({len(unknown)}); "
                "were they saved from another split or model?"
            )
        missed, wanted = 0.0, 0.0  # squared norms: what rounding lost, what was asked
        for name in sorted(set(deltas) | set(self._original)):
            weight = self._weight(name)
            original = self._original.setdefault(name, weight.detach().clone())
            delta = deltas.get(name)
            if delta is None:
                weight.copy_(original)
                continue
            if self._transposed(name):
                delta = delta.t()
            if tuple(delta.shape) != tuple(weight.shape):
                raise ValueError(
                    f"{name}: base delta {tuple(delta.shape)} != {tuple(weight.shape)}"
                )
            target = original.float() + delta.to(weight.device).float()
            weight.copy_(target.to(weight.dtype))
            if weight.dtype != torch.float32:  # fp32 holds a fold to its own rounding
                missed += float((weight.float() - target).pow(2).sum())
                wanted += float(delta.float().pow(2).sum())
        self.deltas = {k: v.detach().float().cpu().clone() for k, v in deltas.items()}
        self._report_kept(missed, wanted)

    def _report_kept(self, missed: float, wanted: float) -> None:
        self.kept = 1.0 - (missed / wanted) ** 0.5 if wanted > 0 else 1.0
        if self.kept < _KEPT_WARNING:
            log.warning(
                "the frozen base weights kept %.0f%% of the folded base deltas (exact/stack "
                "aggregation): their dtype cannot resolve changes that small; run the stage in "
                "float32 (server.dtype = float32) or use aggregation separate or ffa",
                100 * max(self.kept, 0.0),
            )

    def add(self, deltas: dict[str, Tensor]) -> None:
        """Add ``deltas`` to the cumulative ones (a round's fold)."""
        total = dict(self.deltas)
        for name, delta in deltas.items():
            delta = delta.detach().float().cpu()
            total[name] = total[name] + delta if name in total else delta.clone()
        self.set(total)

    def state(self) -> dict[str, Tensor]:
        """The cumulative deltas under ``<layer>.base_delta`` keys (empty when none)."""
        return {k + DELTA_SUFFIX: v.clone() for k, v in self.deltas.items()}

    def _weight(self, name: str) -> Tensor:
        return self._bases[name][0]

    def _transposed(self, name: str) -> bool:
        return self._bases[name][1]


def _storage(bases: Sequence[nn.Module]) -> str:
    """How the base layers' weights are stored (fp32 when none is stored in fewer bits)."""
    kinds = {storage_of(base) for base in bases} - {"fp32"}
    return kinds.pop() if kinds else "fp32"
