"""Every group's LoRA term of one linear in two grouped matmuls (``F.grouped_mm``), where it runs.

A batched call adds each group's low-rank term ``x_g @ A_g^T @ B_g^T * scale`` to the frozen
linear's output on its own rows. Per group that is two small matmuls (plus a scale and an add):
4 kernels per group and linear, which on a GPU costs launches, not math (a SmolLM2 microbatch
is launch-bound). ``torch.nn.functional.grouped_mm`` computes all groups' products in one
kernel over the joined rows, with each group's adapter picked by row offsets.

This is a forward without autograd: the batched backward computes the adapters' gradients from
the saved low-rank activations, which :func:`grouped_lora` returns, with
:func:`grouped_lora_backward` (four grouped matmuls per linear for every session's dA, dB and
LoRA part of dx, instead of four small matmuls per session). Both are wired into
:class:`~fedpipe.lora.batched_blocks.BlockRunner` (``grouped = "auto"``). It runs only where the
kernel is supported and fast: CUDA, bfloat16 activations, compute capability 9.0 or newer, and
widths the kernel's 16-byte stride rule accepts; everywhere else :func:`grouped_lora` returns
None and the caller keeps its per-group path, which stays the exact reference. The grouped path
rounds A, B, the low-rank activation and the term to bfloat16 (the kernel accumulates in
float32), so it matches the per-group float32 LoRA term to bfloat16 precision, not bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "group_offsets",
    "grouped_lora",
    "grouped_lora_backward",
    "grouped_lora_input_grad",
    "grouped_lora_supported",
    "grouped_lora_weight_grads",
]

_MIN_CAPABILITY = (9, 0)
_STRIDE_BYTES = 16  # the grouped kernels' stride rule: every row a multiple of 16 bytes


def grouped_lora_supported(x: Tensor, rank: int, out_features: int) -> str:
    """Why the grouped kernel cannot serve this linear ("" when it can)."""
    if not hasattr(F, "grouped_mm"):
        return "this torch has no torch.nn.functional.grouped_mm"
    if x.dtype != torch.bfloat16:
        return f"activations in {x.dtype}, the grouped kernel takes bfloat16"
    if x.device.type != "cuda":
        return f"activations on {x.device.type}, the grouped kernel is CUDA-only here"
    if torch.cuda.get_device_capability(x.device) < _MIN_CAPABILITY:
        return f"compute capability {torch.cuda.get_device_capability(x.device)} < 9.0"
    return _widths_fit(x.shape[-1], rank, out_features)


def _widths_fit(*widths: int) -> str:
    step = _STRIDE_BYTES // 2  # bf16: 2 bytes per value
    bad = [w for w in widths if w % step]
    return f"widths {bad} are not multiples of {step} (16-byte strides)" if bad else ""


def group_offsets(sizes: Sequence[int], device: torch.device) -> Tensor:
    """The end row of each group, int32 on ``device``: ``grouped_mm``'s ``offs``."""
    ends = torch.tensor(sizes, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return ends.to(device, non_blocking=True)


def grouped_lora(
    x: Tensor,
    sizes: Sequence[int],
    pairs: Sequence[tuple[Tensor, Tensor]],
    scale: float,
    *,
    force: bool = False,
    offs: Tensor | None = None,
) -> tuple[Tensor, list[Tensor]] | None:
    """(every group's LoRA term joined (N, out), each group's low-rank activation (n_g, r)).

    ``x``: (N, in), the groups' rows joined in order, ``sizes[g]`` rows each; ``pairs[g]`` is
    group g's (A (r, in), B (out, r)). None when the grouped kernel does not apply here (the
    caller runs its per-group path). ``force`` skips the device check (tests on a CPU, whose
    torch runs the bf16 forward): the widths must still fit. ``offs``: the groups' end rows as
    int32 on ``x``'s device (:func:`group_offsets`), to reuse across the linears of a call
    instead of copying them to the device per linear.
    """
    if not pairs or len(pairs) != len(sizes) or sum(sizes) != x.shape[0]:
        raise ValueError(
            f"{len(pairs)} adapters for {len(sizes)} groups of {sum(sizes)} rows, x has "
            f"{x.shape[0]}: give one (A, B) and one row count per group"
        )
    rank, out_features = pairs[0][1].shape[1], pairs[0][1].shape[0]
    why = _widths_fit(x.shape[-1], rank, out_features) if force else ""
    if not force:
        why = grouped_lora_supported(x, rank, out_features)
    if why:
        return None
    with torch.no_grad():
        a_t = torch.stack([a for a, _ in pairs]).to(torch.bfloat16).transpose(1, 2)  # (G, in, r)
        b_t = torch.stack([b for _, b in pairs]).to(torch.bfloat16).transpose(1, 2)  # (G, r, out)
        if offs is None:
            offs = group_offsets(sizes, x.device)
        # bf16 out (float32 accumulation inside the kernel): out_dtype=float32 is not on
        # every backend (the CPU's refuses it), and the sum lands in a bf16 output anyway.
        low = F.grouped_mm(x.to(torch.bfloat16), a_t, offs=offs)  # (N, r)
        term = F.grouped_mm(low, b_t, offs=offs)  # (N, out)
    return term.float() * scale, list(low.float().split(list(sizes)))


def grouped_lora_backward(
    dy: Tensor,
    lows: Tensor,
    x: Tensor | None,
    sizes: Sequence[int],
    pairs: Sequence[tuple[Tensor, Tensor]],
    scale: float,
    *,
    need_dx: bool,
    force: bool = False,
    offs: Tensor | None = None,
) -> tuple[list[Tensor] | None, list[Tensor], Tensor | None] | None:
    """The backward of :func:`grouped_lora`'s terms: (each group's dL/dA or None, each group's
    dL/dB, every group's LoRA part of dL/dx joined or None), in four grouped matmuls.

    ``dy``: (N, out) dL/d(linear output), groups' rows joined; ``lows``: (N, r) the forward's
    low-rank activations joined; ``x``: (N, in) the linear's input, or None when no A trains.
    Per group g (rows n_g), as autograd through ``(x A^T) B^T * scale``: with
    ``d = dy_g * scale``, dB = d^T low_g, d_low = d B, dA = d_low^T x_g, dx_g = d_low A. The
    weight gradients group along the rows (the 2-D x 2-D form of ``grouped_mm``, MoE's
    weight-gradient case). None where the kernel does not apply, as for :func:`grouped_lora`.
    """
    if not pairs or len(pairs) != len(sizes) or not sum(sizes) == dy.shape[0] == lows.shape[0]:
        raise ValueError(
            f"{len(pairs)} adapters for {len(sizes)} groups of {sum(sizes)} rows, dy has "
            f"{dy.shape[0]} and the low-rank activations {lows.shape[0]}"
        )
    got = grouped_lora_input_grad(dy, sizes, pairs, scale, need_dx=need_dx, force=force, offs=offs)
    if got is None:
        return None
    d, d_low, d_x = got
    if offs is None:
        offs = group_offsets(sizes, dy.device)
    grad_a, grad_b = grouped_lora_weight_grads(d, d_low, lows, x, offs)
    return grad_a, grad_b, d_x


def grouped_lora_input_grad(
    dy: Tensor,
    sizes: Sequence[int],
    pairs: Sequence[tuple[Tensor, Tensor]],
    scale: float,
    *,
    need_dx: bool,
    force: bool = False,
    offs: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor | None] | None:
    """The part of :func:`grouped_lora_backward` the input gradient needs (B/W split):
    (``d`` = dy * scale in bf16 (N, out), ``d_low`` (N, r), the LoRA part of dL/dx or None).

    :func:`grouped_lora_weight_grads` takes ``d`` and ``d_low`` for dA and dB, then or later.
    None where the kernel does not apply.
    """
    rank, out_features = pairs[0][1].shape[1], pairs[0][1].shape[0]
    in_features = pairs[0][0].shape[1]
    if force:
        why = _widths_fit(in_features, rank, out_features)
    else:
        why = grouped_lora_supported(dy, rank, out_features) or _widths_fit(in_features)
    if why:
        return None
    if offs is None:
        offs = group_offsets(sizes, dy.device)
    bf16 = torch.bfloat16
    with torch.no_grad():
        d = (dy * scale).to(bf16)  # (N, out)
        b_stack = torch.stack([b for _, b in pairs]).to(bf16)  # (G, out, r)
        d_low = F.grouped_mm(d, b_stack, offs=offs)  # (N, r)
        d_x = None
        if need_dx:
            a_stack = torch.stack([a for a, _ in pairs]).to(bf16)  # (G, r, in)
            d_x = F.grouped_mm(d_low, a_stack, offs=offs).float()  # (N, in)
    return d, d_low, d_x


def grouped_lora_weight_grads(
    d: Tensor, d_low: Tensor, lows: Tensor, x: Tensor | None, offs: Tensor | None
) -> tuple[list[Tensor] | None, list[Tensor]]:
    """Each group's dL/dA (None without ``x``) and dL/dB from :func:`grouped_lora_input_grad`'s
    ``d`` and ``d_low``, the forward's low-rank activations ``lows`` (N, r) and the input ``x``."""
    bf16 = torch.bfloat16
    with torch.no_grad():
        grad_b = F.grouped_mm(d.t(), lows.to(bf16), offs=offs)  # (G, out, r)
        grad_a = None
        if x is not None:
            grad_a = list(F.grouped_mm(d_low.t(), x.to(bf16), offs=offs).float().unbind(0))
    return grad_a, list(grad_b.float().unbind(0))
