"""The backward of the batched blocks over any set of sessions' tapes, block by block.

Each item is one group's :class:`~fedpipe.lora.batched_blocks.Tape` (from any forward call) and
the gradient of its output. The walk goes from the stage's last block to its first; at each block
the rows of every item that ran it are joined, so the frozen input gradients (``dy @ W``), the
norms, the SiLU gate and the residuals are one op over all items; each item's LoRA gradients use
its own rows and its own adapter, and attention runs once per sequence length. A group that
skipped a block in the forward (``Group.blocks``) skips it here too.

The result equals autograd through the HF layers (the same formulas, fp32 tolerance). Gradients
of the adapters come back as a mapping Parameter -> gradient (summed over an adapter's items);
the caller adds them to ``.grad`` (:meth:`BatchedAdapterBank.backward`) or hands them to autograd
(:class:`TapedBlocks`), so a call that fails leaves every ``.grad`` as it was.

The input gradient does not need the adapters' weight gradients (zero-bubble's B/W split): with
``defer_weights`` the walk computes every block's input gradient and only records each weight
gradient's matmuls (their operands are kept); :meth:`WeightGrads.compute` runs them later, in the
order the walk met them, so each adapter's gradient is summed in the same order, to the bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from fedpipe.lora.batched_blocks import (
    BlockRunner,
    BlockTape,
    Slices,
    Tape,
    by_length,
    eager_attention,
    float_mask,
    join,
    row_slices,
)
from fedpipe.lora.kernels import (
    group_offsets,
    grouped_lora_backward,
    grouped_lora_input_grad,
    grouped_lora_weight_grads,
)
from fedpipe.split.quant import linear_product_t

__all__ = ["Grads", "TapedBlocks", "WeightGrads", "backward_blocks"]

Grads = dict[nn.Parameter, Tensor]  # an adapter tensor -> its gradient from this backward
WeightOp = Callable[[Grads], None]  # adds one weight gradient to a Grads


class WeightGrads:
    """The adapters' weight gradients of one backward: computed at once, or recorded for later.

    Recorded (``deferred``), each is a matmul whose operands the walk kept; :meth:`compute` runs
    them in the walk's order. Computed, :meth:`compute` returns what the walk summed.
    """

    def __init__(self, *, deferred: bool) -> None:
        self.deferred = deferred
        self._grads: Grads = {}
        self._ops: list[WeightOp] = []

    def add(self, op: WeightOp) -> None:
        """Run ``op`` now, or keep it for :meth:`compute`."""
        if self.deferred:
            self._ops.append(op)
        else:
            op(self._grads)

    def put(self, param: nn.Parameter, grad: Tensor) -> None:
        """Add a gradient computed now (not deferred)."""
        _add(self._grads, param, grad)

    def compute(self) -> Grads:
        """Parameter -> gradient summed over this backward's items (runs what was recorded)."""
        ops, self._ops = self._ops, []  # the operands go with them
        for op in ops:
            op(self._grads)
        return self._grads


def backward_blocks(
    runner: BlockRunner, items: Sequence[tuple[Tape, Tensor]], *, defer_weights: bool = False
) -> tuple[list[Tensor | None], WeightGrads]:
    """Input gradients (None where not needed) and adapter gradients of ``items``.

    Each item is (tape, dy) with dy of the tape's shape (b, T, C). ``defer_weights``: the adapter
    gradients are only recorded; :meth:`WeightGrads.compute` computes them.
    """
    grads = WeightGrads(deferred=defer_weights)
    dys = [dy.reshape(-1, dy.shape[-1]) for _, dy in items]
    # Below an item's lowest block that trains (pipeline.freeze leaves the lowest ones frozen)
    # nothing of it is needed unless its sender wants the input gradient.
    lowest = [_lowest_trained(tape) for tape, _ in items]
    for index in reversed(runner.block_indices):
        active = [
            i
            for i, (tape, _) in enumerate(items)
            if index in tape.blocks and (tape.need_input_grad or lowest[i] <= index)
        ]
        if not active:
            continue
        # The input gradient of this block is needed by an item with an earlier block that
        # trains or one whose sender wants it; the others stop at their LoRA gradients.
        rows = runner.chunk_rows(dys[active[0]].device)
        for chunk in _chunks(active, [items[i][0] for i in active], rows):
            need_dx = any(_needs_below(items[i][0], index, lowest[i]) for i in chunk)
            tapes = [items[i][0] for i in chunk]
            dxs = _Block(runner, index, tapes, grads).backward([dys[i] for i in chunk], need_dx)
            for i, dx in zip(chunk, dxs, strict=True):
                dys[i] = dx
    out: list[Tensor | None] = []
    for (tape, _), dy in zip(items, dys, strict=True):
        out.append(dy.view(tape.shape) if tape.need_input_grad else None)
    return out, grads


def _chunks(positions: list[int], tapes: list[Tape], rows: int | None) -> list[list[int]]:
    """``positions`` cut into runs of at most ``rows`` rows (a larger tape alone; None: one run).

    On a CPU the joined matmul gains nothing while the row-wise ops of many rows fall out of
    the cache; on a GPU one run is fastest (fewer, larger kernels).
    """
    if rows is None:
        return [positions]
    out: list[list[int]] = []
    total = 0
    for position, tape in zip(positions, tapes, strict=True):
        size = tape.shape[0] * tape.shape[1]
        if not out or total + size > rows:
            out.append([])
            total = 0
        out[-1].append(position)
        total += size
    return out


def _needs_below(tape: Tape, index: int, lowest: float) -> bool:
    return tape.need_input_grad or lowest < index


def _lowest_trained(tape: Tape) -> float:
    """The lowest of the tape's blocks whose adapter has a tensor that trains (inf: none)."""
    trained = {
        int(key.split(".")[1])
        for key, (a, b) in tape.adapter.items()
        if a.requires_grad or b.requires_grad
    }
    return min((b for b in tape.blocks if b in trained), default=math.inf)


class _Block:
    """The backward of one decoder layer over the joined rows of several tapes."""

    def __init__(
        self, runner: BlockRunner, index: int, tapes: list[Tape], grads: WeightGrads
    ) -> None:
        self.runner = runner
        self.index = index
        self.layer: Any = runner.stage.layers[str(index)]
        self.prefix = f"layers.{index}"
        self.records: list[BlockTape] = [t.blocks[index] for t in tapes]
        self.adapters = [t.adapter for t in tapes]
        self.shapes = [t.shape for t in tapes]
        self.segments = [t.segments for t in tapes]  # packed rows' segment ids, or None
        self.slices: Slices = row_slices([r.h0.shape[0] for r in self.records])
        self.grads = grads
        self._offs: Tensor | None = None  # grouped_mm's group ends, made once per block

    def backward(self, dys: list[Tensor], need_dx: bool) -> list[Tensor]:
        """dL/d(block input) per tape from dL/d(block output); adapter gradients on the side."""
        attn, mlp = self.layer.self_attn, self.layer.mlp
        shape = self.runner.layout
        recs = self.records
        dh2 = join(dys)  # (N, C)
        # MLP: h2 = h1 + down(act(gate) * up) (post-normed, scaled where the layout says)
        d_out = self._branch(shape.mlp_post_norm, "mlp", dh2)
        gate, up = join([r.gate for r in recs]), join([r.up for r in recs])
        act = self.runner.activation(gate)
        d_inner = self._linear("mlp.down_proj", mlp.down_proj, d_out, lambda: act * up)
        assert d_inner is not None
        d_gate = self.runner.activation_backward(d_inner * up, gate)
        d_up = d_inner * act
        h1 = join([r.h1 for r in recs])
        normed = self._normed(shape.mlp_norm, h1)
        d_normed = self._gate_up(mlp, d_gate, d_up, normed, _start(shape.mlp_norm, dh2))
        assert d_normed is not None
        dh1 = self._residual(shape.mlp_norm, h1, d_normed, dh2)
        # Attention: h1 = h0 + o_proj(attention(rope(q), rope(k), v))
        d_out = self._branch(shape.attn_post_norm, "attn", dh1)
        heads = join([r.heads for r in recs])
        d_heads = self._linear("self_attn.o_proj", attn.o_proj, d_out, lambda: heads)
        assert d_heads is not None
        dq, dk, dv = self._attention(attn, d_heads)
        if shape.qk_norm != "none":
            dq = self._norm_heads(attn.q_norm, "q", dq)
            dk = self._norm_heads(attn.k_norm, "k", dk)
        h0 = join([r.h0 for r in recs])
        normed = self._normed(shape.attn_norm, h0)
        d_normed = self._qkv(attn, dq, dk, dv, normed, need_dx, _start(shape.attn_norm, dh1))
        if d_normed is None:  # nobody needs what lies below this block
            return dys
        dh0 = self._residual(shape.attn_norm, h0, d_normed, dh1)
        return [dh0[rows] for rows in self.slices]

    def _branch(self, post_norm: str | None, key: str, d: Tensor) -> Tensor:
        """dL/d(branch output before its post-norm) from dL/d(residual sum): through the
        residual multiplier and the post-norm where the layout has them (else ``d`` itself)."""
        if self.runner.residual_multiplier is not None:
            d = d * self.runner.residual_multiplier
        if post_norm is None:
            return d
        x = join([r.extra[key] for r in self.records])
        return _rms_backward(getattr(self.layer, post_norm), x, d, None, self._offset)

    def _normed(self, norm: str | None, x: Tensor) -> Callable[[], Tensor]:
        """The branch's input, the norm of ``x`` made on first use (``x`` without a norm)."""
        if norm is None:
            return lambda: x
        module = getattr(self.layer, norm)
        return _Lazy(lambda: module(x))

    def _residual(self, norm: str | None, x: Tensor, d_normed: Tensor, residual: Tensor) -> Tensor:
        """dL/dx of ``x + f(norm(x))`` from dL/d(norm(x)) and the residual's gradient (without
        a norm, ``d_normed`` has the residual's gradient already: see :func:`_start`)."""
        if norm is None:
            return d_normed
        return _rms_backward(getattr(self.layer, norm), x, d_normed, residual, self._offset)

    @property
    def _offset(self) -> float:
        return self.runner.layout.norm_offset

    def _norm_heads(self, norm: Any, key: str, d: Tensor) -> Tensor:
        """dL/d(q or k before its norm), (N, width), from dL/d(its norm's output)."""
        x = join([r.extra[key] for r in self.records])
        if self.runner.layout.qk_norm == "projection":
            return _rms_backward(norm, x, d, None, self._offset)
        dim = self.layer.self_attn.head_dim
        flat = _rms_backward(norm, x.reshape(-1, dim), d.reshape(-1, dim), None, self._offset)
        return flat.view(d.shape)

    def _gate_up(
        self,
        mlp: Any,
        d_gate: Tensor,
        d_up: Tensor,
        normed: Callable[[], Tensor],
        into: Tensor | None,
    ) -> Tensor | None:
        """dL/d(MLP input) through gate and up, two linears or one fused (gate first), added
        to ``into`` where given."""
        names = self.runner.layout.gate_up
        if len(names) == 1:
            fused = torch.cat((d_gate, d_up), dim=-1)
            return self._linear(f"mlp.{names[0]}", getattr(mlp, names[0]), fused, normed, into)
        # The input's gradient sums its linears' terms in autograd's order (the linear made
        # last first, its LoRA before its base), so that it equals the solo run to the bit.
        gate, up = names
        d_normed = self._linear(f"mlp.{up}", getattr(mlp, up), d_up, normed, into)
        return self._linear(f"mlp.{gate}", getattr(mlp, gate), d_gate, normed, d_normed)

    def _qkv(
        self,
        attn: Any,
        dq: Tensor,
        dk: Tensor,
        dv: Tensor,
        normed: Callable[[], Tensor],
        need_dx: bool,
        into: Tensor | None,
    ) -> Tensor | None:
        """dL/d(attention input) through q, k and v, three linears or one fused, added to
        ``into`` where given."""
        names = self.runner.layout.qkv
        if len(names) == 1:
            fused = torch.cat((dq, dk, dv), dim=-1)
            linear = getattr(attn, names[0])
            return self._linear(
                f"self_attn.{names[0]}", linear, fused, normed, into, need_dx=need_dx
            )
        d_normed = into
        for name, d in reversed(list(zip(names, (dq, dk, dv), strict=True))):
            d_normed = self._linear(
                f"self_attn.{name}", getattr(attn, name), d, normed, d_normed, need_dx=need_dx
            )
        return d_normed

    def _linear(
        self,
        name: str,
        linear: nn.Linear,
        dy: Tensor,
        x: Callable[[], Tensor],
        into: Tensor | None = None,
        *,
        need_dx: bool = True,
    ) -> Tensor | None:
        """dL/dx of frozen ``linear`` plus each tape's LoRA term (added to ``into`` if given).

        The frozen part is one matmul over every tape's rows; each tape's A and B gradients
        are computed on its own rows, as autograd would through ``(x A^T) B^T * scale``.
        ``x`` (the joined input) is made only when some tape's A needs it.
        """
        key = f"{self.prefix}.{name}"
        applied, lora_dx = self._grouped(key, dy, x, need_dx)
        if applied:  # every tape's LoRA gradients in grouped matmuls (a GPU)
            if lora_dx is None:
                return None
            base = (
                linear_product_t(linear, dy)
                if into is None
                else into + linear_product_t(linear, dy)
            )
            return base + lora_dx.to(base.dtype)
        # dx = (into + LoRA terms) + dy W, autograd's order; without ``into``: dy W + LoRA.
        dx = None if not need_dx else linear_product_t(linear, dy) if into is None else into
        for rows, adapter, rec in zip(self.slices, self.adapters, self.records, strict=True):
            pair = adapter.get(key)
            if pair is None:
                continue
            a, b = pair
            g = dy[rows].to(b.dtype) * self.runner.scale  # (n, out)
            if b.requires_grad:
                self.grads.add(_grad_b(b, g, rec.lows[key]))
            d_low = g @ b  # (n, r)
            if a.requires_grad:
                self.grads.add(_grad_a(a, d_low, x, rows))
            if dx is not None:
                dx[rows] += (d_low @ a).to(dx.dtype)
        if dx is not None and into is not None:
            dx = dx + linear_product_t(linear, dy)
        return dx

    def _grouped(
        self, key: str, dy: Tensor, x: Callable[[], Tensor], need_dx: bool
    ) -> tuple[bool, Tensor | None]:
        """Every tape's LoRA gradients of one linear by ``grouped_mm``, added to the grads:
        (True, their part of dL/dx or None when not needed). (False, None) where the grouped
        kernel does not apply (grouping off, one tape, a tape without this adapter, the kernel
        refuses): the caller then loops over the tapes, the exact reference."""
        if not self.runner.may_group(dy, len(self.slices)):
            return False, None
        pairs = [pair for adapter in self.adapters if (pair := adapter.get(key)) is not None]
        if len(pairs) < len(self.adapters):
            return False, None
        sizes = [rows.stop - rows.start for rows in self.slices]
        if self._offs is None:
            self._offs = group_offsets(sizes, dy.device)
        need_a = any(a.requires_grad for a, _ in pairs)
        if self.grads.deferred:
            return self._grouped_input_grad(key, dy, x if need_a else None, pairs, need_dx)
        try:
            got = grouped_lora_backward(
                dy,
                join([rec.lows[key] for rec in self.records]),
                x() if need_a else None,
                sizes,
                pairs,
                self.runner.scale,
                need_dx=need_dx,
                force=self.runner.grouped == "force",
                offs=self._offs,
            )
        except RuntimeError as exc:
            self.runner.grouped_failed(exc)
            return False, None
        if got is None:
            return False, None
        grads_a, grads_b, d_x = got
        for i, (a, b) in enumerate(pairs):
            if b.requires_grad:
                self.grads.put(b, grads_b[i].to(b.dtype))
            if a.requires_grad and grads_a is not None:
                self.grads.put(a, grads_a[i].to(a.dtype))
        return True, d_x

    def _grouped_input_grad(
        self,
        key: str,
        dy: Tensor,
        x: Callable[[], Tensor] | None,
        pairs: list[tuple[nn.Parameter, nn.Parameter]],
        need_dx: bool,
    ) -> tuple[bool, Tensor | None]:
        """:meth:`_grouped` with the weight gradients recorded for later (B/W split)."""
        sizes = [rows.stop - rows.start for rows in self.slices]
        try:
            got = grouped_lora_input_grad(
                dy,
                sizes,
                pairs,
                self.runner.scale,
                need_dx=need_dx,
                force=self.runner.grouped == "force",
                offs=self._offs,
            )
        except RuntimeError as exc:
            self.runner.grouped_failed(exc)
            return False, None
        if got is None:
            return False, None
        d, d_low, d_x = got
        lows = [rec.lows[key] for rec in self.records]
        self.grads.add(_grouped_weights(pairs, d, d_low, lows, x, self._offs))
        return True, d_x

    def _attention(self, attn: Any, d_heads: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """dL/d(q, k, v) before rotary, joined (N, width) each, from dL/d(heads)."""
        recs, head_dim = self.records, attn.head_dim
        classes = by_length([shape[1] for shape in self.shapes])
        whole = len(classes) == 1
        kv_width = recs[0].k.shape[1] * head_dim
        widths = (d_heads.shape[-1], kv_width, kv_width)
        outs = [d_heads.new_empty(d_heads.shape[0], w) for w in widths] if not whole else []
        for length, members in classes.items():
            rows = [self.slices[i] for i in members]
            part = [recs[i] for i in members]
            q, k, v = (join([getattr(r, n) for r in part]) for n in ("q", "k", "v"))
            heads = join([r.heads for r in part])
            d_out = (
                (d_heads if whole else join([d_heads[r] for r in rows]))
                .view(-1, length, q.shape[1], head_dim)
                .transpose(1, 2)
            )  # (B, H, T, D)
            out = heads.view(-1, length, q.shape[1], head_dim).transpose(1, 2)
            lse = None if part[0].lse is None else join([r.lse for r in part])  # type: ignore[misc]
            mask, positions = self.runner.attention_inputs(
                self.index,
                length,
                q,
                [self.segments[i] for i in members],
                [self.shapes[i][0] for i in members],
            )
            dq, dk, dv = _attend_backward(
                d_out, q, k, v, out, lse, mask, attn.scaling, self.runner.softcap
            )
            if self.runner.uses_rope(self.index):
                cos, sin = self.runner.rotary(length, q, self.index, positions)
                dq, dk = _rope_backward(dq, cos, sin), _rope_backward(dk, cos, sin)
            flat = [t.transpose(1, 2).reshape(-1, t.shape[1] * head_dim) for t in (dq, dk, dv)]
            if whole:
                return flat[0], flat[1], flat[2]
            start = 0
            for r in rows:
                size = r.stop - r.start
                for target, source in zip(outs, flat, strict=True):
                    target[r] = source[start : start + size]
                start += size
        return outs[0], outs[1], outs[2]


def _start(norm: str | None, residual: Tensor) -> Tensor | None:
    """Where a branch's input gradient starts: a copy of the residual's gradient when the
    branch has no input norm (OLMo 2), as autograd sums it first; else None (the norm's
    backward adds the residual, :func:`_rms_backward`)."""
    return residual.clone() if norm is None else None


class _Lazy:
    """A tensor made on first use, then kept (a recomputed input few linears may need)."""

    def __init__(self, make: Callable[[], Tensor]) -> None:
        self.make = make
        self.value: Tensor | None = None

    def __call__(self) -> Tensor:
        if self.value is None:
            self.value = self.make()
        return self.value


def _attend_backward(
    d_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor | None,
    mask: Tensor | None,
    scale: float,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """dL/d(q, k, v) of (B, H, T, D) attention: the fused CPU kernel's backward, or autograd
    (through eager attention where the logits are soft-capped)."""
    causal = mask is None and q.shape[2] > 1
    if lse is not None:
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            d_out.contiguous(),
            q,
            k,
            v,
            out,
            lse,
            0.0,
            causal,
            attn_mask=float_mask(mask, q.dtype),
            scale=scale,
        )
        return dq, dk, dv
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    if softcap is not None:
        with torch.enable_grad():
            again = eager_attention(leaves[0], leaves[1], leaves[2], mask, scale, softcap)
            dq, dk, dv = torch.autograd.grad(again, leaves, d_out)
        return dq, dk, dv
    with torch.enable_grad():
        again = torch.nn.functional.scaled_dot_product_attention(
            leaves[0],
            leaves[1],
            leaves[2],
            attn_mask=mask,
            is_causal=causal,
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        dq, dk, dv = torch.autograd.grad(again, leaves, d_out)
    return dq, dk, dv


def _rope_backward(d: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """dL/dx of x cos + rotate_half(x) sin; rotate_half's transpose is -rotate_half. With a
    partial rotary (cos narrower than x) the dims past it pass their gradient through."""
    dim = cos.shape[-1]
    if dim < d.shape[-1]:
        return torch.cat((_unrotate(d[..., :dim], cos, sin).to(d.dtype), d[..., dim:]), dim=-1)
    return _unrotate(d, cos, sin).to(d.dtype)


def _unrotate(d: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (1, 1, T, D)
    ds = d * sin
    half = d.shape[-1] // 2
    return d * cos + torch.cat((ds[..., half:], -ds[..., :half]), dim=-1)


def _rms_backward(
    norm: Any, x: Tensor, dy: Tensor, residual: Tensor | None, offset: float = 0.0
) -> Tensor:
    """dL/dx of ``x + f(norm(x))`` (HF's RMSNorm ``w * x * rsqrt(mean(x^2) + eps)``, its weight
    frozen) from the residual's gradient and the norm output's gradient ``dy``; without
    ``residual``, of ``norm(x)`` alone (a post-norm, a q/k norm). ``offset``: the norm scales
    by ``offset + w`` (Gemma's ``1 + w``, computed in float32 as its norm does).

    The three terms are those autograd forms through the residual, mul, pow, mean and rsqrt,
    summed in its order, so the result is the solo run's to the bit:
    (residual + g r) + (sum(g x) * -r^3 / 2) / C * 2 x.
    """
    xf = x.float()
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + _eps(norm))
    if offset:
        g = dy.float() * (offset + norm.weight.float())
    else:
        g = (dy * norm.weight).float()
    d_var = (g * xf).sum(-1, keepdim=True) * (-0.5 * r.pow(3))  # (N, 1)
    direct = g * r if residual is None else residual + g * r
    return (direct + (d_var / x.shape[-1]) * (2 * xf)).to(x.dtype)


def _eps(norm: Any) -> float:
    """An RMSNorm's epsilon (``variance_epsilon``; Gemma's ``eps``)."""
    eps = getattr(norm, "variance_epsilon", None)
    return float(norm.eps if eps is None else eps)


def _add(grads: Grads, param: nn.Parameter, grad: Tensor) -> None:
    have = grads.get(param)
    grads[param] = grad if have is None else have.add_(grad)


def _grad_b(b: nn.Parameter, g: Tensor, low: Tensor) -> WeightOp:
    """dL/dB of one tape's rows: g^T low, (out, n) @ (n, r)."""
    return lambda grads: _add(grads, b, g.t() @ low)


def _grad_a(a: nn.Parameter, d_low: Tensor, x: Callable[[], Tensor], rows: slice) -> WeightOp:
    """dL/dA of one tape's rows: d_low^T x, (r, n) @ (n, in); x is made when first needed."""
    return lambda grads: _add(grads, a, d_low.t() @ x()[rows].to(a.dtype))


def _grouped_weights(
    pairs: list[tuple[nn.Parameter, nn.Parameter]],
    d: Tensor,
    d_low: Tensor,
    lows: list[Tensor],
    x: Callable[[], Tensor] | None,
    offs: Tensor | None,
) -> WeightOp:
    """Every tape's dL/dA and dL/dB of one linear in two grouped matmuls."""

    def op(grads: Grads) -> None:
        grads_a, grads_b = grouped_lora_weight_grads(
            d, d_low, join(lows), None if x is None else x(), offs
        )
        for i, (a, b) in enumerate(pairs):
            if b.requires_grad:
                _add(grads, b, grads_b[i].to(b.dtype))
            if a.requires_grad and grads_a is not None:
                _add(grads, a, grads_a[i].to(a.dtype))

    return op


class TapedBlocks(torch.autograd.Function):
    """Gives one group's batched output an autograd path: its backward walks its tape.

    ``apply(x, y, runner, tape, *params)`` returns ``y``; the gradient reaches ``x`` and the
    adapter tensors ``params`` (the tape's adapter, flattened) as autograd would have.
    """

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, y: Tensor, runner: BlockRunner, tape: Tape, *params: Any
    ) -> Tensor:
        ctx.runner, ctx.tape, ctx.params = runner, tape, params
        return y

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
        tape: Tape = ctx.tape
        tape.need_input_grad = bool(ctx.needs_input_grad[0])
        (dx,), weights = backward_blocks(ctx.runner, [(tape, dy)])
        grads = weights.compute()
        return (dx, None, None, None, *(grads.get(p) for p in ctx.params))
