"""Grouped LoRA terms: the switch, and agreement with the per-group reference to bf16 precision.

The CPU's torch runs ``grouped_mm``'s bf16 forward, so ``force=True`` checks the numbers here;
the real path (CUDA, compute capability >= 9.0) is checked by the CUDA-only test at the end.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from harness.close import assert_close_to_scale

import fedpipe.lora.batched_backward as batched_backward
import fedpipe.lora.batched_blocks as batched_blocks
from fedpipe.lora import BatchedAdapterBank, Group, LoraSettings
from fedpipe.lora.kernels import grouped_lora, grouped_lora_backward, grouped_lora_supported
from fedpipe.models import load_config, resolve_model
from fedpipe.split import build_stage, split_layout

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
    """float32, within bf16's precision of the scale (:mod:`harness.close`)."""
    assert got.dtype == torch.float32
    assert_close_to_scale(got, want, rel=2e-2)


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


def test_grouped_gradients_match_autograd_per_group_to_bf16_precision() -> None:
    """dA, dB and dx of every group's term from four grouped matmuls equal autograd through
    each group's ``(x A^T) B^T * scale`` on its own rows."""
    x, pairs = _case()
    gen = torch.Generator().manual_seed(5)
    dy = torch.randn(sum(SIZES), 32, generator=gen)
    leaves = [(a.clone().requires_grad_(True), b.clone().requires_grad_(True)) for a, b in pairs]
    xs = x.float().split(SIZES)
    rows = [r.clone().requires_grad_(True) for r in xs]
    for r, (a, b), d in zip(rows, leaves, dy.split(SIZES), strict=True):
        (F.linear(F.linear(r, a), b) * 2.0).backward(d)
    _, lows = _per_group(x, pairs, 2.0)
    got = grouped_lora_backward(
        dy, torch.cat(lows), x.float(), SIZES, pairs, 2.0, need_dx=True, force=True
    )
    assert got is not None
    grads_a, grads_b, d_x = got
    assert grads_a is not None and d_x is not None
    for i, (a, b) in enumerate(leaves):
        _assert_close_in_bf16(grads_a[i], a.grad)  # type: ignore[arg-type]
        _assert_close_in_bf16(grads_b[i], b.grad)  # type: ignore[arg-type]
    _assert_close_in_bf16(d_x, torch.cat([r.grad for r in rows]))  # type: ignore[misc]
    frozen_a = grouped_lora_backward(
        dy, torch.cat(lows), None, SIZES, pairs, 2.0, need_dx=False, force=True
    )
    assert frozen_a is not None and frozen_a[0] is None and frozen_a[2] is None
    assert grouped_lora_backward(dy, torch.cat(lows), None, SIZES, pairs, 2.0, need_dx=True) is None
    with pytest.raises(ValueError, match="dy has"):
        grouped_lora_backward(dy[1:], torch.cat(lows), None, SIZES, pairs, 2.0, need_dx=True)


# Every linear of the block trained, rank 8: every width of tiny-llama (64, 32, 128) and the
# rank fit the kernel's 16-byte stride rule in bf16.
ALL_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BANK = LoraSettings(r=8, alpha=16, seed=3, targets=ALL_LINEARS)
GROUP_SHAPES = [("a", 1, 7), ("b", 3, 12), ("c", 2, 4), ("a", 2, 12)]  # (adapter, rows, tokens)


def _bank_run(
    folder: Path, mode: str
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[list[torch.Tensor]]]:
    """Outputs, input gradients and adapter gradients of one batched call under ``mode``."""
    bank = BatchedAdapterBank(
        build_stage(folder, split_layout(load_config(folder)), "middle"), BANK, family="llama"
    )
    bank._runner.grouped = mode  # type: ignore[assignment]
    gen = torch.Generator().manual_seed(1)
    for name in "abc":  # three different adapters: a term on the wrong rows shows
        bank.add(
            name,
            init={
                k: torch.randn(v.shape, generator=gen) * 0.1 for k, v in bank.global_state().items()
            },
        )
    xs = [torch.randn(b, t, 64, generator=gen) for _, b, t in GROUP_SHAPES]
    groups = [Group(name, x) for (name, _, _), x in zip(GROUP_SHAPES, xs, strict=True)]
    taped = bank.run_taped(groups)  # as the StageServer runs it: forward now, backward later
    dys = [torch.randn(y.shape, generator=gen) for y, _ in taped]
    dxs = bank.backward([(tape, dy) for (_, tape), dy in zip(taped, dys, strict=True)])
    grads = [[p.grad.clone() for p in bank.parameters(n)] for n in "abc"]  # type: ignore[union-attr]
    return [y for y, _ in taped], dxs, grads  # type: ignore[return-value]


def test_the_batched_forward_takes_the_grouped_kernel_and_keeps_each_sessions_numbers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Wired into the batched bank: every group's LoRA term of every linear in one grouped
    call, outputs and every gradient (through the tape's low-rank activations) equal to the
    per-group path to bf16 precision; where the kernel does not apply ("auto" on a CPU), the
    per-group path runs and the numbers are exactly those of "off"."""
    folder = resolve_model("tiny-llama", cache_dir=tmp_path)
    calls: list[tuple[int, ...]] = []
    back: list[tuple[int, ...]] = []
    real, real_back = batched_blocks.grouped_lora, batched_backward.grouped_lora_backward

    def counting(x: torch.Tensor, sizes: tuple[int, ...], *args: object, **kw: object) -> object:
        calls.append(tuple(sizes))
        return real(x, sizes, *args, **kw)  # type: ignore[arg-type]

    def counting_back(*args: object, **kw: object) -> object:
        back.append(tuple(args[3]))  # type: ignore[arg-type]
        return real_back(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(batched_blocks, "grouped_lora", counting)
    monkeypatch.setattr(batched_backward, "grouped_lora_backward", counting_back)
    want = _bank_run(folder, "off")
    assert calls == [] and back == []
    got = _bank_run(folder, "force")
    blocks = load_config(folder).num_hidden_layers - 2  # head 1, tail 1: the middle
    assert len(calls) == blocks * len(ALL_LINEARS)
    assert set(calls) == {(7, 36, 8, 24)}  # each group's b*T rows, one kernel for all four
    assert len(back) == blocks * len(ALL_LINEARS)  # one joined backward over all four tapes
    assert set(back) == {(7, 36, 8, 24)}
    for g, w in zip(got[0] + got[1], want[0] + want[1], strict=True):
        assert_close_to_scale(g, w, atol=2e-2, rel=2e-2)
    for gs, ws in zip(got[2], want[2], strict=True):
        for g, w in zip(gs, ws, strict=True):
            assert_close_to_scale(g, w, rel=3e-2)
    calls.clear()
    back.clear()
    auto = _bank_run(folder, "auto")  # a CPU: the kernel does not apply, per-group path
    assert calls == [] and back == []  # not even asked: no cost on a CPU
    for g, w in zip(auto[0] + auto[1], want[0] + want[1], strict=True):
        assert torch.equal(g, w)


def test_a_kernel_that_fails_where_its_checks_let_it_run_falls_back_once_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A grouped kernel that raises on a GPU (a layout or driver its checks do not know)
    costs no call: that call and every later one loop over the sessions, with one warning."""
    folder = resolve_model("tiny-llama", cache_dir=tmp_path)
    raised: list[str] = []

    def broken(*args: object, **kw: object) -> object:
        raised.append("forward")
        raise RuntimeError("grouped_mm: unsupported layout\nmore detail")

    want = _bank_run(folder, "off")
    # As on a GPU: "auto" tries the kernel (on a CPU it would not even ask).
    monkeypatch.setattr(
        batched_blocks.BlockRunner,
        "may_group",
        lambda self, x, groups: self.grouped != "off" and groups > 1,
    )
    monkeypatch.setattr(batched_blocks, "grouped_lora", broken)
    with caplog.at_level("WARNING", logger="fedpipe.lora.batched_blocks"):
        got = _bank_run(folder, "auto")
    assert raised == ["forward"]  # tried once, then off for the rest of the bank's life
    for g, w in zip(got[0] + got[1], want[0] + want[1], strict=True):
        assert torch.equal(g, w)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "unsupported layout" in warnings[0]
    assert "more detail" not in warnings[0]  # one line
    with pytest.raises(RuntimeError, match="unsupported layout"):
        _bank_run(folder, "force")  # tests see the error

    def broken_back(*args: object, **kw: object) -> object:
        raised.append("backward")
        raise RuntimeError("grouped_mm: unsupported layout")

    monkeypatch.setattr(batched_blocks, "grouped_lora", lambda *a, **k: None)  # declines
    monkeypatch.setattr(batched_backward, "grouped_lora_backward", broken_back)
    raised.clear()
    got = _bank_run(folder, "auto")
    assert raised == ["backward"]
    for g, w in zip(got[0] + got[1], want[0] + want[1], strict=True):
        assert torch.equal(g, w)


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
    dy = torch.randn(sum(SIZES), 576, device="cuda", dtype=torch.bfloat16)
    back = grouped_lora_backward(
        dy,
        torch.cat(got[1]),
        x,
        SIZES,
        pairs,
        2.0,
        need_dx=True,  # the real kernel, no force
    )
    assert back is not None and back[0] is not None and back[2] is not None
    split = zip(pairs, x.split(SIZES), dy.split(SIZES), strict=True)
    for i, ((a, b), rows, d) in enumerate(split):
        d_low = (d.float() * 2.0) @ b
        _assert_close_in_bf16(back[1][i], (d.float() * 2.0).t() @ (rows.float() @ a.t()))
        _assert_close_in_bf16(back[0][i], d_low.t() @ rows.float())
    ref_dx = torch.cat(
        [((d.float() * 2.0) @ b) @ a for (a, b), d in zip(pairs, dy.split(SIZES), strict=True)]
    )
    _assert_close_in_bf16(back[2], ref_dx)
