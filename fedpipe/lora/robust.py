"""Robust rules for aggregating adapters, the same on both sides of the split.

A hostile device can send any adapter it likes. The mean lets one device move the average as
far as it wants; these rules bound what a minority can do, per tensor element (``median``,
``trimmed``) or by choosing the updates closest to the others (``krum``, ``multikrum``), and a
norm bound clips every device's update (its adapter minus the global one) before any rule.
The ServerApp aggregates the device adapters with Flower's own strategies of the same names
(FedMedian, FedTrimmedAvg, Krum, MultiKrum); the StageServer merges the server adapters with
the functions here, which follow those strategies' definitions (a test holds them equal).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

__all__ = ["RULES", "AggregationRule", "clip_updates", "combine"]

RULES = ("mean", "median", "trimmed", "krum", "multikrum")


@dataclass(frozen=True)
class AggregationRule:
    """How one side combines its devices' adapters: the rule and its parameters."""

    name: str = "mean"
    beta: float = 0.2  # trimmed: the fraction cut from each end, per element
    malicious: int = 0  # krum, multikrum: devices assumed hostile (f)
    select: int = 1  # multikrum: updates kept and averaged (krum keeps one)
    norm_bound: float = 0.0  # > 0: each update's L2 norm is clipped to this first

    def __post_init__(self) -> None:
        if self.name not in RULES:
            raise ValueError(f"aggregation rule {self.name!r} unknown; choose one of {RULES}")
        if not 0.0 <= self.beta < 0.5:
            raise ValueError(f"trimmed mean: beta must be in [0, 0.5), got {self.beta}")
        if self.malicious < 0 or self.select < 1:
            raise ValueError(
                f"krum: malicious devices must be >= 0 and selected ones >= 1, got "
                f"{self.malicious} and {self.select}"
            )
        if not (math.isfinite(self.norm_bound) and self.norm_bound >= 0):
            raise ValueError(f"update norm bound must be finite and >= 0, got {self.norm_bound}")

    @property
    def plain(self) -> bool:
        """The weighted mean without a norm bound: what aggregation does without a rule."""
        return self.name == "mean" and self.norm_bound == 0

    def text(self) -> str:
        """A one-line form, as BeginRound carries it to the StageServer (:meth:`parse`)."""
        return f"{self.name};{self.beta!r};{self.malicious};{self.select};{self.norm_bound!r}"

    @classmethod
    def parse(cls, text: str) -> AggregationRule:
        """The rule :meth:`text` wrote ("" is the mean); raises ValueError on anything else."""
        if not text:
            return cls()
        try:
            name, beta, malicious, select, bound = text.split(";")
            return cls(name, float(beta), int(malicious), int(select), float(bound))
        except ValueError as exc:
            raise ValueError(f"aggregation rule {text!r}: {exc}") from None


def clip_updates(
    states: list[dict[str, Tensor]], global_state: dict[str, Tensor], bound: float
) -> list[dict[str, Tensor]]:
    """Each state's update (its values minus the global ones, over the keys it holds) scaled
    down to L2 norm ``bound`` where it is longer; shorter updates are left as they are."""
    out = []
    for state in states:
        updates = {k: v.float() - global_state[k].float() for k, v in state.items()}
        norm = math.sqrt(sum(float(u.pow(2).sum()) for u in updates.values()))
        if norm <= bound or norm == 0:
            out.append(state)
            continue
        scale = bound / norm
        out.append(
            {
                k: (global_state[k].float() + u * scale).to(state[k].dtype)
                for k, u in updates.items()
            }
        )
    return out


def combine(
    states: list[dict[str, Tensor]], weights: list[float], rule: AggregationRule
) -> dict[str, Tensor]:
    """States that hold the same keys, combined by ``rule`` (not the mean: see aggregate_held).

    ``median`` and ``trimmed`` work per element and ignore the weights, as Flower's FedMedian
    and FedTrimmedAvg do; ``krum``/``multikrum`` choose the state(s) with the smallest sum of
    squared distances to their ``n - f - 2`` nearest others and average the chosen by weight.
    """
    keys = list(states[0])
    if rule.name == "median":
        return {k: _per_element(states, k, lambda a: np.median(a, axis=0)) for k in keys}
    if rule.name == "trimmed":
        return {k: _per_element(states, k, lambda a: _trim_mean(a, rule.beta)) for k in keys}
    chosen = _krum(states, rule.malicious, 1 if rule.name == "krum" else rule.select)
    total = sum(weights[i] for i in chosen)
    if total <= 0:
        raise ValueError("krum chose adapters whose weights add up to 0")
    out: dict[str, Tensor] = {}
    for k in keys:
        acc = np.zeros(tuple(states[0][k].shape), dtype=np.float64)
        for i in chosen:
            acc += states[i][k].double().numpy() * (weights[i] / total)
        out[k] = torch.from_numpy(acc).to(states[0][k].dtype)
    return out


def _per_element(states: list[dict[str, Tensor]], key: str, fn) -> Tensor:  # type: ignore[no-untyped-def]
    stacked = np.stack([s[key].detach().float().numpy() for s in states])
    return torch.from_numpy(np.asarray(fn(stacked), dtype=np.float32)).to(states[0][key].dtype)


def _trim_mean(array: np.ndarray, cut: float) -> np.ndarray:
    """The mean of each element's values over axis 0, ``cut`` of them dropped at each end."""
    n = array.shape[0]
    low = int(cut * n)
    high = n - low
    part = np.partition(array, (low, high - 1), axis=0)
    return np.mean(part[low:high], axis=0)


def _krum(states: list[dict[str, Tensor]], malicious: int, select: int) -> list[int]:
    """Indices of the ``select`` states with the smallest Krum scores."""
    flat = np.stack(
        [np.concatenate([s[k].detach().float().numpy().ravel() for k in states[0]]) for s in states]
    ).astype(np.float64)
    norms = np.square(flat).sum(axis=1)
    distances = norms[:, None] + norms[None, :] - 2 * flat @ flat.T
    closest = max(1, len(states) - malicious - 2)
    scores = [float(np.sum(np.sort(row)[1 : closest + 1])) for row in distances]
    return [int(i) for i in np.argsort(scores, kind="stable")[:select]]
