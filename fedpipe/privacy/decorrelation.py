"""A head that learns to hide which token it read: a distance-correlation penalty (NoPeek).

``privacy.decorrelation = w`` adds ``w * dCor(tokens, activations)`` to the device's loss,
per microbatch, where the samples are the microbatch's token positions: the distance between
two positions' inputs is 1 when they hold different tokens and 0 when the same, the distance
between their activations the L2 distance of the unit-norm vectors the head sends up (unit
norm, as the server's inversion reads them, and because the first token's vector is orders of
magnitude larger than the others). Distance correlation (Szekely et al., 2007) is 0 exactly
when the two are independent; NoPeek (Vepakomma et al., 2020) trains a split model's first part
to lower it alongside the task loss. Its gradient reaches the head's adapters only: the
penalty is computed on the device, from the head's output before any link noise.

A penalty is not a guarantee: the server sees the device's adapters every round and can fit
its inversion to the head they make. ``fedpipe bench privacy`` measures exactly that attacker.
"""

from __future__ import annotations

import secrets

import torch
from torch import Tensor

__all__ = ["Decorrelation", "distance_correlation"]

_EPS = 1e-12
MAX_POSITIONS = 512  # positions sampled per microbatch: the penalty's matrices are (n, n)


def _centred(distances: Tensor) -> Tensor:
    """Double centring of an (n, n) distance matrix."""
    return (
        distances
        - distances.mean(dim=0, keepdim=True)
        - distances.mean(dim=1, keepdim=True)
        + distances.mean()
    )


def distance_correlation(ids: Tensor, hidden: Tensor) -> Tensor:
    """dCor between token identity and unit-norm hidden states, over positions; a scalar in
    [0, 1] with a gradient to ``hidden``.

    ``ids`` (n,) token ids, ``hidden`` (n, C). 0 when every position holds the same token.
    """
    if ids.shape[0] != hidden.shape[0]:
        raise ValueError(f"{ids.shape[0]} token ids for {hidden.shape[0]} hidden states")
    a = _centred((ids[:, None] != ids[None, :]).to(torch.float32))
    unit = hidden.float() / (hidden.float().norm(dim=-1, keepdim=True) + _EPS)
    gram = unit @ unit.T
    # |u_i - u_j| = sqrt(2 - 2 u_i.u_j) for unit vectors; the floor keeps the gradient finite
    b = _centred(torch.sqrt(torch.clamp(2.0 - 2.0 * gram, min=_EPS)))
    var_a, var_b = (a * a).mean(), (b * b).mean()
    if float(var_a.detach()) <= _EPS or float(var_b.detach()) <= _EPS:
        return hidden.sum() * 0.0  # no spread to correlate: zero, still in the graph
    cov = torch.clamp((a * b).mean(), min=_EPS)
    return torch.sqrt(cov / torch.sqrt(var_a * var_b))


class Decorrelation:
    """The device runtime's ``head_penalty``: ``weight * dCor`` of one microbatch.

    ``scale`` divides it over a step's microbatches (the runtime passes 1/m), so a step's
    penalty is ``weight`` times the mean dCor of its microbatches, beside the task loss
    (a mean over the step's tokens). ``values`` keeps each microbatch's dCor for the report.
    """

    def __init__(self, weight: float, *, seed: int | None = None) -> None:
        if weight <= 0:
            raise ValueError(f"need weight > 0, got {weight}")
        self.weight = weight
        self.generator = torch.Generator().manual_seed(
            secrets.randbits(63) if seed is None else seed
        )
        self.values: list[float] = []

    def __call__(self, ids: Tensor, hidden: Tensor, scale: float) -> Tensor:
        flat_ids = ids.reshape(-1)
        flat = hidden.reshape(-1, hidden.shape[-1])
        if flat_ids.shape[0] > MAX_POSITIONS:  # a random subset bounds the (n, n) cost
            pick = torch.randperm(flat_ids.shape[0], generator=self.generator)[:MAX_POSITIONS]
            flat_ids, flat = flat_ids[pick.to(flat_ids.device)], flat[pick.to(flat.device)]
        dcor = distance_correlation(flat_ids, flat)
        self.values.append(float(dcor.detach()))
        return dcor * (self.weight * scale)

    def take_mean(self) -> float | None:
        """The mean dCor since the last call (None when nothing was penalised), and reset."""
        values, self.values = self.values, []
        return sum(values) / len(values) if values else None
