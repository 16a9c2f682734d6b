"""4- and 2-bit group quantization, and the bit packing that puts it on the wire.

Values are taken row-major in groups of ``G`` (group ``k`` holds values ``kG .. kG+G-1``; the
last group may be shorter). Each group keeps an fp32 offset ``m = min`` and scale
``s = (max - min) / L`` with ``L = 2**bits - 1``; a value ``x`` becomes the integer
``q = round((x - m) / s)`` in ``[0, L]`` and the receiver decodes ``y = m + q * s``.

- Error: ``|y - x| <= s / 2`` with nearest rounding, ``< s`` with stochastic rounding, plus a
  few fp32 ulps of ``max(|m|, |max|)``. A constant group (``s = 0``) decodes exactly.
- Asymmetric (min/max) rather than symmetric (``+-max``): at 2 bits a symmetric grid has 3
  usable levels of 4, and the head's activations are far from centred on 0.
- Stochastic rounding, ``q = floor((x - m) / s + u)`` with ``u ~ U[0, 1)``, is unbiased
  (``E[y] = x``): summed over many steps its errors cancel instead of adding up. It suits
  gradients sent without error feedback; with error feedback nearest rounding is better (half
  the error, and the feedback removes the bias).
- Packing: value ``i`` of a byte sits in bits ``[i * bits, (i + 1) * bits)`` (the first value
  in the low bits): two 4-bit values or four 2-bit values per byte. Unused high bits of the
  last byte are zero on send and ignored on receipt.
- Outliers (``outliers = K > 0``): per group the ``K`` values largest in magnitude are sent
  exactly (fp32 value and position in the group) and the group's min, max and scale are taken
  over the other ``G - K``; the error bound above then holds with that smaller scale, and the
  outliers decode exactly. A group's one huge value (an attention sink's token, a massive
  channel) no longer spreads its range over the others.
- Range: finite inputs with ``max - min`` below fp32's largest value (about 3.4e38); beyond
  it the scale overflows to Inf and the receiver refuses the tensor as non-finite.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

__all__ = [
    "Outliers",
    "dequantize",
    "num_groups",
    "pack",
    "packed_nbytes",
    "quantize",
    "quantize_outliers",
    "unpack",
]


class Outliers(NamedTuple):
    """The values a low-bit codec sends exactly: ``(groups, K)`` each, group-major."""

    values: torch.Tensor  # fp32
    positions: torch.Tensor  # int16, in [0, G): the value's index in its group


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes of ``n`` packed values of ``bits`` bits."""
    return -(-n * bits // 8)


def num_groups(n: int, group: int) -> int:
    """Groups (each with one scale and one offset) of ``n`` values."""
    return -(-n // group)


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack a 1-D uint8 tensor of values in ``[0, 2**bits)`` into ``packed_nbytes`` bytes."""
    per = 8 // bits
    pad = -q.numel() % per
    if pad:
        q = torch.cat([q, q.new_zeros(pad)])
    cols = q.view(-1, per)  # (bytes, values per byte)
    out = cols[:, 0].clone()
    for i in range(1, per):
        out |= cols[:, i] << (bits * i)
    return out


def unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """The first ``n`` values of a packed uint8 tensor, as uint8 in ``[0, 2**bits)``."""
    per = 8 // bits
    mask = (1 << bits) - 1
    values = torch.empty(packed.numel(), per, dtype=torch.uint8, device=packed.device)
    for i in range(per):  # one strided column at a time: no (bytes, per) shift temporaries
        torch.bitwise_and(packed >> (bits * i), mask, out=values[:, i])
    return values.view(-1)[:n]


def quantize(
    x: torch.Tensor, bits: int, group: int, *, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed uint8, scales fp32 (groups,), offsets fp32 (groups,)) of ``x`` on its device.

    ``generator`` (on ``x``'s device) switches to stochastic rounding.
    """
    packed, scales, offsets, _ = quantize_outliers(x, bits, group, 0, generator=generator)
    return packed, scales, offsets


def quantize_outliers(
    x: torch.Tensor,
    bits: int,
    group: int,
    outliers: int,
    *,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Outliers]:
    """:func:`quantize`, with ``outliers`` (``K < group``) values per group sent exactly.

    The fourth item holds them, ``(groups, K)`` each, on ``x``'s device (``K`` = 0: empty).
    """
    if not 0 <= outliers < group:
        raise ValueError(f"outliers per group must be in [0, {group}), got {outliers}")
    flat = x.detach().reshape(-1).to(torch.float32)
    n = flat.numel()
    if n == 0:
        empty = torch.zeros(0, dtype=torch.float32, device=x.device)
        none = Outliers(empty.view(0, outliers), empty.to(torch.int16).view(0, outliers))
        return torch.zeros(0, dtype=torch.uint8, device=x.device), empty, empty.clone(), none
    groups = num_groups(n, group)
    pad = groups * group - n
    if pad:  # repeat the last value: it changes no group's min or max
        flat = torch.cat([flat, flat[-1:].expand(pad)])
    g = flat.view(groups, group)  # (groups, G)
    positions = g.new_zeros((groups, 0), dtype=torch.long)
    if outliers:  # the range of the values that are not sent exactly
        magnitude = g.abs()
        magnitude.view(-1)[n:] = -1.0  # padding is never an outlier (unless values run out)
        positions = magnitude.topk(outliers, dim=1).indices  # (groups, K)
        hidden = torch.zeros_like(g, dtype=torch.bool).scatter_(1, positions, True)
        lo = g.masked_fill(hidden, math.inf).amin(dim=1)  # (groups,)
        hi = g.masked_fill(hidden, -math.inf).amax(dim=1)
    else:
        lo, hi = g.amin(dim=1), g.amax(dim=1)  # (groups,)
    scales = (hi - lo).div_(2**bits - 1)
    # A constant group has scale 0: dividing by 1 instead sends q = 0, which decodes to lo.
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    t = (g - lo[:, None]).div_(safe[:, None])  # (groups, G) in [0, L] up to rounding
    if generator is None:
        t.round_()
    else:
        t.add_(torch.rand(t.shape, generator=generator, device=t.device)).floor_()
    exact = Outliers(g.gather(1, positions), positions.to(torch.int16))
    # outliers' own codes are clamped and overwritten on decode
    q = t.clamp_(0, 2**bits - 1).to(torch.uint8).view(-1)[:n]
    return pack(q, bits), scales, lo, exact


def dequantize(
    packed: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    bits: int,
    group: int,
    n: int,
    exact: Outliers | None = None,
) -> torch.Tensor:
    """The ``n`` fp32 values (1-D) that :func:`quantize`'s output stands for.

    ``exact``'s positions must lie in ``[0, group)`` (the decoder checks a peer's).
    """
    if n == 0:
        return torch.zeros(0, dtype=torch.float32)
    groups = num_groups(n, group)
    q = unpack(packed, bits, n).to(torch.float32)
    pad = groups * group - n
    if pad:
        q = torch.cat([q, q.new_zeros(pad)])
    y = q.view(groups, group).mul_(scales[:, None]).add_(offsets[:, None])  # (groups, G)
    if exact is not None and exact.values.numel():
        y.scatter_(1, exact.positions.long(), exact.values)  # a pad position falls off below
    return y.view(-1)[:n]
