"""Grouped LoRA terms: the switch, and agreement with the per-group reference to bf16 precision.

The CPU's torch runs ``grouped_mm``'s bf16 forward, so ``force=True`` checks the numbers here;
the real path (CUDA, compute capability >= 9.0) is checked by the CUDA-only test at the end.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fedpipe.split.grouped_lora import grouped_lora, grouped_lora_supported

SIZES = [1, 16, 5, 42]  # rows per group: sizes differ, one group has a single row


def _case(
    width: int = 64, rank: int = 8, out: int = 32, device: str = "cpu"
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(sum(SIZES), width, generator=gen).to(device, torch.bfloat16)
    pairs = [
        (
            (torch.randn(rank, width, generator=gen) * 0.1).to(device),
            (torch.randn(out, rank, generator=gen) * 0.1).to(device),
        )
        for _ in SIZES
    ]
    return x, pairs


Pairs = list[tuple[torch.Tensor, torch.Tensor]]


def _per_group(
    x: torch.Tensor, pairs: Pairs, scale: float
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The reference: each group's term in float32, as the batched bank computes it."""
    lows, terms = [], []
    for rows, (a, b) in zip(x.split(SIZES), pairs, strict=True):
        low = F.linear(rows.to(a.dtype), a)
        lows.append(low)
        terms.append(F.linear(low, b) * scale)
    return torch.cat(terms), lows


def _assert_close_in_bf16(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert (got - want).abs().max() <= 2e-2 * want.abs().max()


def test_grouped_terms_match_the_per_group_reference_to_bf16_precision() -> None:
    x, pairs = _case()
    got = grouped_lora(x, SIZES, pairs, 2.0, force=True)
    assert got is not None
    term, lows = got
    want_term, want_lows = _per_group(x, pairs, 2.0)
    _assert_close_in_bf16(term, want_term)
    for low, want in zip(lows, want_lows, strict=True):
        _assert_close_in_bf16(low, want)


def test_where_the_kernel_does_not_apply_it_says_why_and_returns_none() -> None:
    x, pairs = _case()
    assert "cuda" in grouped_lora_supported(x, 8, 32).lower()
    assert grouped_lora(x, SIZES, pairs, 2.0) is None  # the caller keeps its per-group path
    assert "bfloat16" in grouped_lora_supported(x.float(), 8, 32)
    x4, pairs4 = _case(rank=4)  # 4 bf16 values = 8 bytes: under the 16-byte stride rule
    assert grouped_lora(x4, SIZES, pairs4, 2.0, force=True) is None


def test_rows_that_do_not_add_up_are_refused_with_the_counts() -> None:
    x, pairs = _case()
    with pytest.raises(ValueError, match=r"4 adapters for 3 groups"):
        grouped_lora(x, SIZES[:3], pairs, 2.0, force=True)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
    reason="needs a CUDA GPU of compute capability 9.0 or newer",
)
def test_cuda_grouped_terms_match_the_reference() -> None:
    x, pairs = _case(width=576, rank=8, out=576, device="cuda")
    assert grouped_lora_supported(x, 8, 576) == ""
    got = grouped_lora(x, SIZES, pairs, 2.0)
    assert got is not None
    want_term, _ = _per_group(x, pairs, 2.0)
    _assert_close_in_bf16(got[0], want_term)
