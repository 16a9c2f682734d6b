"""The suite's one rule for comparing two float computations: close relative to the scale.

Two computations of the same numbers in another summation order (another CPU's kernels: AMD
vs Intel, AVX2 vs AVX-512; batched vs one at a time) differ by a few float roundings *of the
tensor's largest values*, wherever the element is. A per-element relative tolerance
(``rtol * |want[i]|``) fails on the small elements of a large-scale tensor: an element near 0
of a gradient whose largest value is 155 moves by 2e-5 (1e-7 of the scale) and is "off by
100%". So every comparison here is against one tolerance for the whole tensor::

    tolerance = atol + rel * max(max |want|, max |got|)

and the largest difference must be within it. A test converted from
``assert_close(got, want, rtol=R, atol=A)`` uses ``rel=R, atol=A``. Exact comparisons stay
``torch.equal``.

Non-finite values: a NaN in one tensor and not in the other fails; infinities must be equal
(same place, same sign); they take no part in the scale or the difference.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["FLOAT32_ATOL", "FLOAT32_REL", "assert_close_to_scale", "assert_states_close_to_scale"]

# torch.testing.assert_close's float32 defaults (rtol, atol), for the comparisons that used them
FLOAT32_REL = 1.3e-6
FLOAT32_ATOL = 1e-5


def _index(flat: int, shape: torch.Size) -> tuple[int, ...]:
    """The multi-dimensional index of a flat position."""
    index = []
    for size in reversed(shape):
        index.append(flat % size)
        flat //= size
    return tuple(reversed(index))


def assert_close_to_scale(
    got: torch.Tensor,
    want: torch.Tensor,
    *,
    rel: float,
    atol: float = 0.0,
    msg: str | None = None,
) -> None:
    """Fail unless ``got`` and ``want`` have the same shape and dtype and their largest
    difference is within ``atol + rel * scale`` (the scale: the largest magnitude in either).

    The failure names ``msg`` (the key), the largest difference, its index, the scale and the
    tolerance."""
    name = msg or "tensor"
    if not isinstance(got, torch.Tensor) or not isinstance(want, torch.Tensor):
        raise AssertionError(f"{name}: not tensors: got {type(got)}, want {type(want)}")
    if got.shape != want.shape or got.dtype != want.dtype:
        raise AssertionError(
            f"{name}: got shape {tuple(got.shape)} dtype {got.dtype}, "
            f"want shape {tuple(want.shape)} dtype {want.dtype}"
        )
    if got.numel() == 0:
        return
    g = got.detach().to("cpu", torch.float64).reshape(-1)
    w = want.detach().to("cpu", torch.float64).reshape(-1)
    nan_g, nan_w = torch.isnan(g), torch.isnan(w)
    if not torch.equal(nan_g, nan_w):
        at = int(torch.nonzero(nan_g != nan_w)[0])
        raise AssertionError(
            f"{name}: NaN in one and not the other at index {_index(at, got.shape)}: "
            f"got {g[at].item()}, want {w[at].item()}"
        )
    inf = torch.isinf(g) | torch.isinf(w)
    unequal_inf = inf & (g != w)
    if bool(unequal_inf.any()):
        at = int(torch.nonzero(unequal_inf)[0])
        raise AssertionError(
            f"{name}: infinities differ at index {_index(at, got.shape)}: "
            f"got {g[at].item()}, want {w[at].item()}"
        )
    finite = ~(nan_g | inf)
    if not bool(finite.any()):
        return
    scale = max(float(w[finite].abs().max()), float(g[finite].abs().max()))
    tolerance = atol + rel * scale
    diff = torch.where(finite, (g - w).abs(), torch.zeros_like(g))
    at = int(diff.argmax())
    largest = float(diff[at])
    if largest > tolerance:
        raise AssertionError(
            f"{name}: largest difference {largest:.3g} at index {_index(at, got.shape)} "
            f"(got {g[at].item():.9g}, want {w[at].item():.9g}) exceeds the tolerance "
            f"{tolerance:.3g} = atol {atol:g} + rel {rel:g} x scale {scale:.3g}"
        )


def assert_states_close_to_scale(
    got: Mapping[str, torch.Tensor],
    want: Mapping[str, torch.Tensor],
    *,
    rel: float,
    atol: float = 0.0,
    msg: str | None = None,
) -> None:
    """:func:`assert_close_to_scale` for each tensor of two state dicts with the same keys,
    each against its own scale; a failure names the key (after ``msg``, if given)."""
    prefix = f"{msg} " if msg else ""
    if set(got) != set(want):
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        raise AssertionError(f"{prefix}keys differ: missing {missing}, extra {extra}")
    for key, value in want.items():
        assert_close_to_scale(got[key], value, rel=rel, atol=atol, msg=f"{prefix}{key}")
