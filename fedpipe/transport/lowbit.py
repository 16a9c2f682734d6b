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
- Range: finite inputs with ``max - min`` below fp32's largest value (about 3.4e38); beyond
  it the scale overflows to Inf and the receiver refuses the tensor as non-finite.
"""

from __future__ import annotations

import torch

__all__ = [
    "dequantize",
    "num_groups",
    "pack",
    "packed_nbytes",
    "quantize",
    "unpack",
]


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
    flat = x.detach().reshape(-1).to(torch.float32)
    n = flat.numel()
    if n == 0:
        empty = torch.zeros(0, dtype=torch.float32, device=x.device)
        return torch.zeros(0, dtype=torch.uint8, device=x.device), empty, empty.clone()
    groups = num_groups(n, group)
    pad = groups * group - n
    if pad:  # repeat the last value: it changes no group's min or max
        flat = torch.cat([flat, flat[-1:].expand(pad)])
    g = flat.view(groups, group)  # (groups, G)
    lo, hi = g.amin(dim=1), g.amax(dim=1)  # (groups,)
    scales = (hi - lo).div_(2**bits - 1)
    # A constant group has scale 0: dividing by 1 instead sends q = 0, which decodes to lo.
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    t = (g - lo[:, None]).div_(safe[:, None])  # (groups, G) in [0, L] up to rounding
    if generator is None:
        t.round_()
    else:
        t.add_(torch.rand(t.shape, generator=generator, device=t.device)).floor_()
    q = t.clamp_(0, 2**bits - 1).to(torch.uint8).view(-1)[:n]
    return pack(q, bits), scales, lo


def dequantize(
    packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, bits: int, group: int, n: int
) -> torch.Tensor:
    """The ``n`` fp32 values (1-D) that :func:`quantize`'s output stands for."""
    if n == 0:
        return torch.zeros(0, dtype=torch.float32)
    groups = num_groups(n, group)
    q = unpack(packed, bits, n).to(torch.float32)
    pad = groups * group - n
    if pad:
        q = torch.cat([q, q.new_zeros(pad)])
    y = q.view(groups, group).mul_(scales[:, None]).add_(offsets[:, None])  # (groups, G)
    return y.view(-1)[:n]
