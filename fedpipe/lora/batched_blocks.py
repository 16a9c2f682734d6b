"""Llama-layout blocks over several sessions' microbatches: joined rows, one tape per session.

The numbers are those of the Hugging Face decoder layer that :meth:`_Stage.run_blocks` calls
(RMSNorm, rotary positions arange(T), causal sdpa with GQA, the banded mask of a sliding window,
gated MLP); the difference is only where the work runs. What a family's layer does beyond the
Llama block (post-norms, q/k norms, fused projections, a residual multiplier, blocks without
rotary, soft-capped attention logits, Gemma's ``1 + w`` norms and GELU) is read from its
:class:`~fedpipe.models.families.BlockLayout`, the ``block`` of its table entry.

The tokens of every group in a block are joined into one (tokens, C) tensor, so each frozen
linear, norm, activation and residual is ONE op over all groups; each group's LoRA term runs on
its own rows, and attention runs once per sequence length (the groups of one length joined
along the batch). A group of packed rows (``Group.segments``) attends within each token's
segment at positions that restart per segment (fedpipe.split.packing); in a length class
with one, a row without segments is one segment.

The forward builds no autograd graph. When asked, it records per group a :class:`Tape`: what
the backward of each block needs (its inputs, q/k/v after rotary, the attention output and its
log-sum-exp, gate and up, the LoRA low-rank intermediates), on that group's rows only. The
backward (:mod:`fedpipe.lora.batched_backward`) walks the tapes of any set of groups, from any
forward calls, block by block; a tape is freed with the session's reference to it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedpipe.lora.base import Group
from fedpipe.lora.kernels import group_offsets, grouped_lora
from fedpipe.models.families import FAMILIES, BlockLayout
from fedpipe.split.loss import chunked_loss_sum, shifted_loss_sum
from fedpipe.split.packing import segment_mask, segment_positions
from fedpipe.split.quant import linear_product, linear_product_t
from fedpipe.split.stages import _window_mask, sliding_window

log = logging.getLogger(__name__)

__all__ = [
    "ACTIVATIONS",
    "BlockRunner",
    "BlockTape",
    "Tape",
    "eager_attention",
    "frozen_linear",
    "frozen_linears",
]

# linear's global name -> (A, B) of one adapter: (r, in), (out, r).
AdapterTensors = dict[str, tuple[nn.Parameter, nn.Parameter]]
Slices = list[slice]  # each group's rows in a joined (tokens, C) tensor

# The MLP activations the batched blocks compute: config name -> (f, (grad, x) -> grad * f'(x)).
ACTIVATIONS: dict[str, tuple[Callable[[Tensor], Tensor], Callable[[Tensor, Tensor], Tensor]]] = {
    "silu": (F.silu, torch.ops.aten.silu_backward),
    "gelu_pytorch_tanh": (
        lambda x: F.gelu(x, approximate="tanh"),
        lambda grad, x: torch.ops.aten.gelu_backward(grad, x, approximate="tanh"),
    ),
}


@dataclass(eq=False)
class BlockTape:
    """What one group's backward through one block needs, on its rows only.

    Row tensors are (b*T, width); attention tensors (b, heads, T, head_dim) after rotary.
    ``extra`` holds what a family's layout adds (its :meth:`BlockRunner._block`): q and k
    before their norms (``q``, ``k``), the attention and MLP outputs before their post-norms
    (``attn``, ``mlp``).
    """

    h0: Tensor  # block input (b*T, C)
    h1: Tensor  # after the attention residual (b*T, C)
    heads: Tensor  # attention output, o_proj's input (b*T, H*D)
    q: Tensor  # (b, H, T, D)
    k: Tensor  # (b, Hkv, T, D)
    v: Tensor  # (b, Hkv, T, D)
    lse: Tensor | None  # (b, H, T) log-sum-exp of the fused CPU kernel; None: recompute
    gate: Tensor  # gate_proj output before the activation (b*T, I)
    up: Tensor  # (b*T, I)
    lows: dict[str, Tensor] = field(default_factory=dict)  # linear -> x A^T (b*T, r)
    extra: dict[str, Tensor] = field(default_factory=dict)  # the layout's own (b*T, width)

    def _rows(self) -> tuple[Tensor, ...]:
        return self.h0, self.h1, self.heads, self.q, self.k, self.v, self.gate, self.up

    def tensors(self) -> Iterator[Tensor]:
        """Every tensor the record holds."""
        yield from self._rows()
        if self.lse is not None:
            yield self.lse
        yield from self.lows.values()
        yield from self.extra.values()

    def map(self, fn: Callable[[Tensor], Tensor]) -> BlockTape:
        """A record of ``fn`` of each tensor (moved elsewhere: host memory and back)."""
        h0, h1, heads, q, k, v, gate, up = (fn(t) for t in self._rows())
        lse = None if self.lse is None else fn(self.lse)
        lows = {key: fn(t) for key, t in self.lows.items()}
        extra = {key: fn(t) for key, t in self.extra.items()}
        return BlockTape(h0, h1, heads, q, k, v, lse, gate, up, lows, extra)


@dataclass(eq=False)
class Tape:
    """One group's record of a batched forward: enough for its backward, and nothing else."""

    shape: tuple[int, ...]  # (b, T, C) of its input and output
    adapter: AdapterTensors  # its adapter's Parameters (the ones the forward used)
    need_input_grad: bool = True  # False: the backward may stop at the LoRA gradients
    blocks: dict[int, BlockTape] = field(default_factory=dict)
    segments: Tensor | None = None  # (b, T) packed rows' segment ids (None: not packed)

    def tensors(self) -> Iterator[Tensor]:
        """Every tensor of every block's record (the adapter's Parameters are not the tape's)."""
        for record in self.blocks.values():
            yield from record.tensors()

    def map(self, fn: Callable[[Tensor], Tensor]) -> Tape:
        """The same tape with ``fn`` of each of its tensors (fedpipe.server.stash moves them)."""
        blocks = {index: record.map(fn) for index, record in self.blocks.items()}
        return Tape(self.shape, self.adapter, self.need_input_grad, blocks, self.segments)


class _FrozenRows(torch.autograd.Function):
    """One group's rows of a frozen linear computed for the whole batch: y = x W^T + b.

    The forward result ``y`` was computed (without a graph) in one matmul with the other
    groups; this node gives it a gradient path back to this group's ``x`` only. It saves no
    activation (the weight is the stage's own, frozen), so nothing outlives the group's graph.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, y: Tensor, linear: nn.Linear) -> Tensor:
        ctx.linear = linear
        return y

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return linear_product_t(ctx.linear, grad), None, None  # (..., out) @ (out, in)


def frozen_linear(xs: Sequence[Tensor], linear: nn.Linear) -> list[Tensor]:
    """``linear`` (frozen) on every tensor of ``xs`` in one matmul over all their tokens.

    Each ``x`` is (..., in) with its own leading shape; returns (..., out) per input, each with a
    gradient path to its own input only.
    """
    return frozen_linears(xs, [linear])[0]


def frozen_linears(xs: Sequence[Tensor], linears: Sequence[nn.Linear]) -> list[list[Tensor]]:
    """Several frozen linears of the same inputs (q, k, v): the tokens are joined once."""
    flat = [x.reshape(-1, x.shape[-1]) for x in xs]  # (tokens_g, in)
    sizes = [f.shape[0] for f in flat]
    with torch.no_grad():
        joined = flat[0] if len(flat) == 1 else torch.cat(flat)
        ys = [linear_product(lin, joined) for lin in linears]  # (sum tokens, out)
    track = torch.is_grad_enabled()
    result = []
    for lin, y in zip(linears, ys, strict=True):
        outs = []
        for x, out in zip(xs, y.split(sizes), strict=True):
            out = out.view(*x.shape[:-1], out.shape[-1])
            if track and x.requires_grad:
                out = _FrozenRows.apply(x, out, lin)
            outs.append(out)
        result.append(outs)
    return result


def join(parts: Sequence[Tensor]) -> Tensor:
    """Tensors of several groups joined along dim 0 (their order kept).

    Parts that already lie back to back in one storage (the rows of one call, in its order)
    are joined as a view; otherwise copied.
    """
    if len(parts) == 1:
        return parts[0]
    if _adjacent(parts):
        first = parts[0]
        size = (sum(p.shape[0] for p in parts), *first.shape[1:])
        return first.as_strided(size, first.stride(), first.storage_offset())
    return torch.cat(list(parts))


def _adjacent(parts: Sequence[Tensor]) -> bool:
    """Whether each part starts in the same storage where the previous one ends (dim 0)."""
    first = parts[0]
    storage = first.untyped_storage().data_ptr()
    for prev, part in zip(parts, parts[1:], strict=False):
        if (
            part.untyped_storage().data_ptr() != storage
            or part.stride() != first.stride()
            or part.shape[1:] != first.shape[1:]
            or part.storage_offset() != prev.storage_offset() + prev.shape[0] * prev.stride(0)
        ):
            return False
    return True


def row_slices(sizes: Sequence[int]) -> Slices:
    """Each group's rows in the joined tensor of groups of ``sizes`` rows."""
    out, start = [], 0
    for size in sizes:
        out.append(slice(start, start + size))
        start += size
    return out


def by_length(lengths: Sequence[int]) -> dict[int, list[int]]:
    """Group positions by sequence length, in order: attention runs once per length."""
    out: dict[int, list[int]] = {}
    for i, length in enumerate(lengths):
        out.setdefault(length, []).append(i)
    return out


def float_mask(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """A boolean keep-mask as the additive one the fused CPU kernel takes (0 or -inf)."""
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
        ~mask, float("-inf")
    )


class BlockRunner:
    """Runs a Llama-layout stage's blocks (and its loss head) over groups of sessions."""

    def __init__(
        self, stage: nn.Module, adapter: Callable[[str], AdapterTensors], scale: float
    ) -> None:
        self.stage: Any = stage  # a MiddleStage or ServerLossStage (layers, rotary_emb, norm)
        self.adapter = adapter  # an adapter's tensors by name
        self.scale = scale  # LoRA alpha / r
        self.block_indices: tuple[int, ...] = tuple(getattr(stage, "block_indices"))  # noqa: B009
        config: Any = getattr(stage, "config")  # noqa: B009
        self.spec = FAMILIES[config.model_type]
        self.layout: BlockLayout = self.spec.block  # what the family's layer adds to Llama's
        shape = self.layout
        self.activation, self.activation_backward = ACTIVATIONS[activation_name(config, shape)]
        # Granite's residual multiplier and Gemma 2's attention soft-cap (None: none).
        self.residual_multiplier = _config_value(config, shape.residual_multiplier)
        self.softcap = _config_value(config, shape.softcap)
        # The fused CPU attention kernel keeps its log-sum-exp for the backward; elsewhere the
        # backward recomputes attention under autograd (the same numbers, one more forward).
        self.fused_attention = True
        # Rows per run of the backward on a CPU, where joining more rows saves nothing in the
        # matmuls but pushes the row-wise ops out of the cache (measured: 1024 beat 256, 512
        # and all of 8 x 2 x 128 on small-llama); None: all rows at once, as on a GPU.
        self.cpu_chunk_rows: int | None = 1024
        # Each group's LoRA term of a linear: "auto" runs every group's in two grouped matmuls
        # (fedpipe.lora.kernels) where the kernel applies (CUDA, bf16, cc >= 9.0) and
        # loops over the groups elsewhere (the exact reference); "off" always loops; "force"
        # takes the grouped kernel wherever torch runs it (tests on a CPU).
        self.grouped: Literal["auto", "off", "force"] = "auto"
        self._offsets: dict[tuple[int, ...], Tensor] = {}  # group sizes -> offs, per call

    def chunk_rows(self, device: torch.device) -> int | None:
        """Rows per run of the backward on ``device`` (None: one run)."""
        return self.cpu_chunk_rows if device.type == "cpu" else None

    # -- forward -------------------------------------------------------------------------------
    def blocks(self, groups: Sequence[Group], tapes: Sequence[Tape] | None = None) -> list[Tensor]:
        """Hidden states of each group after every block, (b, T, C) per group, no graph.

        With ``tapes`` (one per group), each group's backward record is written to its tape.
        """
        hs = [g.hidden for g in groups]
        segments = [g.segments for g in groups]
        adapters = [self.adapter(g.adapter) for g in groups]
        self._offsets = {}
        with torch.no_grad():
            for index in self.block_indices:
                # A group with its own block range (a device with another cut) skips the others.
                active = [i for i, g in enumerate(groups) if g.blocks is None or index in g.blocks]
                if not active:
                    continue
                records = [tapes[i].blocks for i in active] if tapes is not None else None
                outs = self._block(
                    index,
                    [hs[i] for i in active],
                    [adapters[i] for i in active],
                    records,
                    [segments[i] for i in active],
                )
                for i, out in zip(active, outs, strict=True):
                    hs[i] = out
        return hs

    def head_loss(self, hs: Sequence[Tensor], labels: Sequence[Tensor]) -> list[tuple[Tensor, int]]:
        """(summed shifted loss, tokens counted) per group: norm, LM head, loss (autograd).

        The stage's ``loss_chunk`` > 0: each group's LM head and loss run over chunks of
        tokens (fedpipe.split.loss); 0: all groups' logits in one matmul, held whole.
        """
        normed = [self.stage.norm(h) for h in hs]
        chunk = int(self.stage.loss_chunk)
        if chunk:
            project = self.stage.project
            pairs = zip(normed, labels, strict=True)
            return [chunked_loss_sum(n, lb, project, chunk=chunk) for n, lb in pairs]
        logits = frozen_linear(normed, self.stage.lm_head)  # (b, T, V) per group
        if self.spec.logits is not None:  # Gemma's final soft-capping, Granite's scaling
            logits = [self.spec.logits(lg, self.stage.config) for lg in logits]
        return [shifted_loss_sum(lg, lb) for lg, lb in zip(logits, labels, strict=True)]

    def rotary(
        self,
        length: int,
        like: Tensor,
        index: int | None = None,
        positions: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """(cos, sin) at positions arange(T): (1, T, D) each (block ``index``'s where the
        family has a rotary per layer type: Gemma 3's local and global); at ``positions``
        (B, T) instead where given (packed rows): (B, T, D) each."""
        if positions is None:
            positions = torch.arange(length, device=like.device).unsqueeze(0)  # (1, T)
        if index is not None and self.spec.rotary_per_layer_type:
            kind = self.stage.config.layer_types[index]
            cos, sin = self.stage.rotary_emb(like, positions, kind)
            return cos, sin
        cos, sin = self.stage.rotary_emb(like, position_ids=positions)
        return cos, sin

    def uses_rope(self, index: int) -> bool:
        """Whether block ``index`` applies rotary to q and k (SmolLM3's NoPE blocks do not)."""
        name = self.layout.rope_layers
        return name is None or bool(getattr(self.stage.config, name)[index])

    def mask(self, index: int, length: int, like: Tensor) -> Tensor | None:
        """Block ``index``'s attention mask at length T (None: plain causal)."""
        window = sliding_window(self.stage.config, index)
        return _window_mask(length, window, like.device)

    def attention_inputs(
        self,
        index: int,
        length: int,
        like: Tensor,
        segments: Sequence[Tensor | None],
        rows: Sequence[int],
    ) -> tuple[Tensor | None, Tensor | None]:
        """Block ``index``'s mask and positions for the joined sequences of one length class:
        :meth:`mask` and None (arange) when no member is packed; else the (B, 1, T, T) mask
        of every row's segments and their (B, T) positions (``rows``: each member's count)."""
        if all(s is None for s in segments):
            return self.mask(index, length, like), None
        joined = torch.cat(
            [
                torch.zeros(n, length, dtype=torch.long, device=like.device)
                if s is None
                else s.to(like.device)
                for s, n in zip(segments, rows, strict=True)
            ]
        )  # (B, T)
        window = sliding_window(self.stage.config, index)
        return segment_mask(joined, window), segment_positions(joined)

    def lora(
        self,
        key: str,
        linear: nn.Linear,
        x: Tensor,
        slices: Slices,
        adapters: Sequence[AdapterTensors],
        lows: Sequence[dict[str, Tensor]] | None,
    ) -> Tensor:
        """Frozen ``linear`` over the joined rows ``x`` plus each group's own LoRA term."""
        y = linear_product(linear, x)  # (N, out): one matmul for every group
        if self._grouped_term(key, x, y, slices, adapters, lows):
            return y
        for i, (rows, tensors) in enumerate(zip(slices, adapters, strict=True)):
            pair = tensors.get(key)
            if pair is None:
                continue
            a, b = pair
            low = F.linear(x[rows].to(a.dtype), a)  # (n, r)
            y[rows] += F.linear(low, b) * self.scale
            if lows is not None:
                lows[i][key] = low
        return y

    def may_group(self, x: Tensor, groups: int) -> bool:
        """Whether to try the grouped kernel for ``groups`` groups of ``x`` (a CPU never does
        unless forced: the loop there is exact and costs nothing extra)."""
        if self.grouped == "off" or groups < 2:
            return False
        return self.grouped == "force" or x.device.type == "cuda"

    def grouped_failed(self, exc: RuntimeError) -> None:
        """The grouped kernel raised where its checks let it run (a layout or a driver the
        checks do not know): loop over the sessions from now on, said once in the log, rather
        than fail every call. Under ``force`` (tests) and out of memory the error stands."""
        if self.grouped == "force" or isinstance(exc, torch.OutOfMemoryError):
            raise exc
        log.warning(
            "server adapters: the grouped LoRA kernel failed (%s: %s); each session's LoRA "
            "term runs on its own from now on",
            type(exc).__name__,
            str(exc).splitlines()[0] if str(exc) else "",
        )
        self.grouped = "off"

    def _grouped_term(
        self,
        key: str,
        x: Tensor,
        y: Tensor,
        slices: Slices,
        adapters: Sequence[AdapterTensors],
        lows: Sequence[dict[str, Tensor]] | None,
    ) -> bool:
        """Add every group's LoRA term to ``y`` in two grouped matmuls; False where it does not
        apply (grouping off, one group, a group without this adapter, or the kernel refuses)."""
        if not self.may_group(x, len(slices)):
            return False
        pairs = [pair for tensors in adapters if (pair := tensors.get(key)) is not None]
        if len(pairs) < len(adapters):
            return False
        sizes = tuple(rows.stop - rows.start for rows in slices)
        offs = self._offsets.get(sizes)
        if offs is None:
            offs = self._offsets[sizes] = group_offsets(sizes, x.device)
        try:
            got = grouped_lora(
                x, sizes, pairs, self.scale, force=self.grouped == "force", offs=offs
            )
        except RuntimeError as exc:
            self.grouped_failed(exc)
            return False
        if got is None:
            return False
        term, group_lows = got
        y += term.to(y.dtype)
        if lows is not None:
            for i, (low, pair) in enumerate(zip(group_lows, pairs, strict=True)):
                lows[i][key] = low.to(pair[0].dtype)
        return True

    def _block(
        self,
        index: int,
        hs: list[Tensor],
        adapters: list[AdapterTensors],
        records: list[dict[int, BlockTape]] | None,
        segments: list[Tensor | None],
    ) -> list[Tensor]:
        """One decoder layer over the joined rows: h + attn(norm(h)), then h + mlp(norm(h)),
        with what the family's layout adds (post-norms, q/k norms, fused linears, a residual
        multiplier)."""
        layer = self.stage.layers[str(index)]
        attn, mlp, prefix = layer.self_attn, layer.mlp, f"layers.{index}"
        shape = self.layout
        width = hs[0].shape[-1]
        slices = row_slices([h.shape[0] * h.shape[1] for h in hs])
        lows: list[dict[str, Tensor]] | None = None if records is None else [{} for _ in hs]
        extra: dict[str, Tensor] = {}  # joined rows the layout's backward needs
        h0 = join([h.reshape(-1, width) for h in hs])  # (N, C)
        normed = _norm(layer, shape.attn_norm, h0)
        q, k, v = self._qkv(prefix, attn, normed, slices, adapters, lows)
        if shape.qk_norm != "none":
            extra["q"], extra["k"] = q, k
            q = _norm_heads(attn.q_norm, q, shape, attn)
            k = _norm_heads(attn.k_norm, k, shape, attn)
        heads, saved = self._attention(index, attn, hs, slices, q, k, v, segments)
        out = self.lora(f"{prefix}.self_attn.o_proj", attn.o_proj, heads, slices, adapters, lows)
        h1 = self._residual(layer, shape.attn_post_norm, h0, out, extra, "attn")
        normed = _norm(layer, shape.mlp_norm, h1)
        gate, up = self._gate_up(prefix, mlp, normed, slices, adapters, lows)
        inner = getattr(mlp, shape.act)(gate) * up
        out = self.lora(f"{prefix}.mlp.down_proj", mlp.down_proj, inner, slices, adapters, lows)
        h2 = self._residual(layer, shape.mlp_post_norm, h1, out, extra, "mlp")
        if records is not None and lows is not None:
            for i, rows in enumerate(slices):
                qi, ki, vi, lse = saved[i]
                records[i][index] = BlockTape(
                    h0[rows],
                    h1[rows],
                    heads[rows],
                    qi,
                    ki,
                    vi,
                    lse,
                    gate[rows],
                    up[rows],
                    lows[i],
                    {key: t[rows] for key, t in extra.items()},
                )
        return [h2[rows].view(h.shape) for h, rows in zip(hs, slices, strict=True)]

    def _qkv(
        self,
        prefix: str,
        attn: Any,
        x: Tensor,
        slices: Slices,
        adapters: Sequence[AdapterTensors],
        lows: Sequence[dict[str, Tensor]] | None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """q, k and v (N, width) of the joined rows: three linears, or one fused (Phi-3)."""
        names = self.layout.qkv
        if len(names) == 1:
            fused = self.lora(
                f"{prefix}.self_attn.{names[0]}", getattr(attn, names[0]), x, slices, adapters, lows
            )
            q, k, v = fused.split(qkv_widths(attn), dim=-1)
            return q, k, v
        q, k, v = (
            self.lora(f"{prefix}.self_attn.{n}", getattr(attn, n), x, slices, adapters, lows)
            for n in names
        )
        return q, k, v

    def _gate_up(
        self,
        prefix: str,
        mlp: Any,
        x: Tensor,
        slices: Slices,
        adapters: Sequence[AdapterTensors],
        lows: Sequence[dict[str, Tensor]] | None,
    ) -> tuple[Tensor, Tensor]:
        """The MLP's gate and up (N, I) of the joined rows: two linears, or one fused (Phi-3:
        gate first)."""
        names = self.layout.gate_up
        if len(names) == 1:
            fused = self.lora(
                f"{prefix}.mlp.{names[0]}", getattr(mlp, names[0]), x, slices, adapters, lows
            )
            gate, up = fused.chunk(2, dim=-1)
            return gate, up
        gate, up = (
            self.lora(f"{prefix}.mlp.{n}", getattr(mlp, n), x, slices, adapters, lows)
            for n in names
        )
        return gate, up

    def _residual(
        self,
        layer: Any,
        post_norm: str | None,
        h: Tensor,
        out: Tensor,
        extra: dict[str, Tensor],
        key: str,
    ) -> Tensor:
        """h + out: out after the layer's post-norm where it has one (kept for the backward
        as ``extra[key]``), times the residual multiplier where the family has one."""
        if post_norm is not None:
            extra[key] = out
            out = getattr(layer, post_norm)(out)
        if self.residual_multiplier is not None:
            return h + out * self.residual_multiplier
        return h + out

    def _attention(
        self,
        index: int,
        attn: Any,  # the HF attention module: head_dim, scaling
        hs: list[Tensor],
        slices: Slices,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        segments: list[Tensor | None],
    ) -> tuple[Tensor, list[tuple[Tensor, Tensor, Tensor, Tensor | None]]]:
        """Causal (or banded) attention, once per sequence length over its groups.

        Returns the joined heads (N, H*D) and per group (q, k, v after rotary, lse).
        """
        head_dim = attn.head_dim
        classes = by_length([h.shape[1] for h in hs])
        whole = len(classes) == 1
        heads = q if whole else torch.empty_like(q)  # overwritten when not whole
        saved: list[Any] = [None] * len(hs)
        for length, members in classes.items():
            rows = [slices[i] for i in members]
            qc, kc, vc = (
                (t if whole else join([t[r] for r in rows]))
                .view(-1, length, t.shape[-1] // head_dim, head_dim)
                .transpose(1, 2)
                for t in (q, k, v)
            )  # (B, heads, T, D)
            sizes = [hs[i].shape[0] for i in members]
            mask, positions = self.attention_inputs(
                index, length, qc, [segments[i] for i in members], sizes
            )
            if self.uses_rope(index):
                cos, sin = self.rotary(length, qc, index, positions)
                qc, kc = _rope(qc, cos, sin), _rope(kc, cos, sin)
            out, lse = self._attend(qc, kc, vc, mask, attn.scaling)
            flat = out.transpose(1, 2).reshape(-1, q.shape[-1])  # (B*T, H*D)
            if whole:
                heads = flat
            start = 0
            for i, size, r in zip(members, sizes, rows, strict=True):
                batch = slice(start, start + size)
                saved[i] = (qc[batch], kc[batch], vc[batch], None if lse is None else lse[batch])
                if not whole:
                    heads[r] = flat[start * length : (start + size) * length]
                start += size
        return heads, saved

    def _attend(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float
    ) -> tuple[Tensor, Tensor | None]:
        """(B, H, T, D) attention output, and the log-sum-exp when the fused kernel ran."""
        if self.softcap is not None:  # Gemma 2: eager attention with soft-capped logits
            return eager_attention(q, k, v, mask, scale, self.softcap), None
        causal = mask is None and q.shape[2] > 1
        if self.fused_attention and q.device.type == "cpu":
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, 0.0, causal, attn_mask=float_mask(mask, q.dtype), scale=scale
            )
            return out, lse
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=causal,
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        return out, None


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding of (B, heads, T, D) at (1 or B, T, D') cos and sin (HF's formula); with
    D' < D (Phi-3's partial_rotary_factor) the first D' dims rotate and the rest pass. In x's
    dtype (OLMo 2's rotary is float32 whatever the weights' dtype; its code casts back)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    dim = cos.shape[-1]
    if dim < x.shape[-1]:
        return torch.cat((_rotate(x[..., :dim], cos, sin).to(x.dtype), x[..., dim:]), dim=-1)
    return _rotate(x, cos, sin).to(x.dtype)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def eager_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, softcap: float | None
) -> Tensor:
    """(B, H, T, D) causal attention as Hugging Face's eager code computes it (Gemma 2's, with
    the logits soft-capped: cap * tanh(scores / cap)); ``mask`` the banded (or packed rows')
    keep-mask or None."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:  # HF's repeat_kv
        b, heads, length, dim = k.shape
        k = k[:, :, None].expand(b, heads, groups, length, dim).reshape(b, -1, length, dim)
        v = v[:, :, None].expand(b, heads, groups, length, dim).reshape(b, -1, length, dim)
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    length = q.shape[2]
    if mask is None:
        mask = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    floor = torch.tensor(torch.finfo(scores.dtype).min, dtype=scores.dtype, device=q.device)
    scores = scores + torch.where(mask, torch.zeros((), dtype=scores.dtype, device=q.device), floor)
    weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v)


def _config_value(config: Any, name: str | None) -> float | None:
    """The config field ``name`` as a float (None without a name or a value)."""
    value = None if name is None else getattr(config, name, None)
    return None if value is None else float(value)


def activation_name(config: Any, layout: BlockLayout) -> str:
    """The MLP activation ``config`` names (the field its family's layout says)."""
    return str(getattr(config, layout.act_config, None) or "silu")


def qkv_widths(attn: Any) -> list[int]:
    """The widths of q, k and v in a fused projection (Phi-3's ``qkv_proj``)."""
    config, dim = attn.config, attn.head_dim
    kv = config.num_key_value_heads * dim
    return [config.num_attention_heads * dim, kv, kv]


def _norm(layer: Any, name: str | None, x: Tensor) -> Tensor:
    """The layer's norm ``name`` of ``x`` (``x`` itself where the layout has none there)."""
    return x if name is None else getattr(layer, name)(x)


def _norm_heads(norm: nn.Module, x: Tensor, layout: BlockLayout, attn: Any) -> Tensor:
    """q or k (N, heads * D) through its norm: over each head (Qwen3, Gemma 3) or the whole
    projection (OLMo 2)."""
    if layout.qk_norm == "projection":
        return norm(x)
    return norm(x.view(x.shape[0], -1, attn.head_dim)).view(x.shape[0], -1)
