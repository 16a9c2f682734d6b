"""Llama-family blocks over several sessions' microbatches: one frozen matmul, own graphs.

The numbers are those of the Hugging Face decoder layer that :meth:`_Stage.run_blocks` calls
(RMSNorm, rotary positions arange(T), causal sdpa with GQA, the banded mask of a sliding window,
SiLU-gated MLP); the difference is only where the matmuls run. Each frozen linear multiplies the
tokens of every group at once (:func:`frozen_linear`); each group's LoRA term, attention and
everything else run on its own tensors, so a group's autograd graph never touches another's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from fedpipe.split.stages import _window_mask, shifted_loss_sum, sliding_window

if TYPE_CHECKING:
    from fedpipe.split.multilora import Group

__all__ = ["BlockRunner", "frozen_linear", "frozen_linears"]

# (linear's global name, adapter, input) -> the adapter's low-rank term, or None (not a target).
LoraTerm = Callable[[str, str, Tensor], Tensor | None]


class _FrozenRows(torch.autograd.Function):
    """One group's rows of a frozen linear computed for the whole batch: y = x W^T + b.

    The forward result ``y`` was computed (without a graph) in one matmul with the other
    groups; this node gives it a gradient path back to this group's ``x`` only. It saves no
    activation (the weight is the stage's own, frozen), so nothing outlives the group's graph.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, y: Tensor, weight: Tensor) -> Tensor:
        ctx.weight = weight
        return y

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return grad @ ctx.weight, None, None  # (..., out) @ (out, in) -> (..., in)


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
        ys = [F.linear(joined, lin.weight, lin.bias) for lin in linears]  # (sum tokens, out)
    track = torch.is_grad_enabled()
    result = []
    for lin, y in zip(linears, ys, strict=True):
        outs = []
        for x, out in zip(xs, y.split(sizes), strict=True):
            out = out.view(*x.shape[:-1], out.shape[-1])
            if track and x.requires_grad:
                out = _FrozenRows.apply(x, out, lin.weight)
            outs.append(out)
        result.append(outs)
    return result


class BlockRunner:
    """Runs a Llama-family stage's blocks (and its loss head) over groups of sessions."""

    def __init__(self, stage: nn.Module, lora_term: LoraTerm) -> None:
        self.stage: Any = stage  # a MiddleStage or ServerLossStage (layers, rotary_emb, norm)
        self.lora_term = lora_term
        self.block_indices: tuple[int, ...] = tuple(getattr(stage, "block_indices"))  # noqa: B009

    def blocks(self, groups: Sequence[Group]) -> list[Tensor]:
        """Hidden states of each group after every block: (b, T, C) per group."""
        hs = [g.hidden for g in groups]
        rope = self._rotary(hs)
        for index in self.block_indices:
            # A group with its own block range (a device with another cut) skips the others.
            active = [i for i, g in enumerate(groups) if g.blocks is None or index in g.blocks]
            if not active:
                continue
            sub = [hs[i] for i in active]
            layer = self.stage.layers[str(index)]
            adapters = [groups[i].adapter for i in active]
            outs = self._block(index, layer, sub, adapters, rope, self._masks(sub, index))
            for i, out in zip(active, outs, strict=True):
                hs[i] = out
        return hs

    def loss(self, groups: Sequence[Group]) -> list[tuple[Tensor, int]]:
        """(summed shifted loss, tokens counted) per group: blocks, norm, LM head, loss."""
        hs = self.blocks(groups)
        normed = [self.stage.norm(h) for h in hs]
        logits = frozen_linear(normed, self.stage.lm_head)  # (b, T, V) per group
        out = []
        for group, group_logits in zip(groups, logits, strict=True):
            assert group.labels is not None
            out.append(shifted_loss_sum(group_logits, group.labels))
        return out

    def _rotary(self, hs: list[Tensor]) -> dict[int, tuple[Tensor, Tensor]]:
        """(cos, sin) at positions arange(T), once per distinct T in the call."""
        out: dict[int, tuple[Tensor, Tensor]] = {}
        for h in hs:
            length = h.shape[1]
            if length not in out:
                positions = torch.arange(length, device=h.device).unsqueeze(0)  # (1, T)
                cos, sin = self.stage.rotary_emb(h, position_ids=positions)
                out[length] = (cos, sin)
        return out

    def _masks(self, hs: list[Tensor], index: int) -> dict[int, Tensor | None]:
        window = sliding_window(self.stage.config, index)
        return {h.shape[1]: _window_mask(h.shape[1], window, h.device) for h in hs}

    def _linear(
        self,
        keys: Sequence[str],
        linears: Sequence[nn.Linear],
        xs: list[Tensor],
        adapters: list[str],
    ) -> list[list[Tensor]]:
        """Frozen ``linears`` of the same inputs over every group at once, plus each group's
        own LoRA term; one list of outputs per linear."""
        result = []
        for key, outs in zip(keys, frozen_linears(xs, linears), strict=True):
            with_lora = []
            for x, y, adapter in zip(xs, outs, adapters, strict=True):
                term = self.lora_term(key, adapter, x)
                with_lora.append(y if term is None else (y + term).to(y.dtype))
            result.append(with_lora)
        return result

    def _block(
        self,
        index: int,
        layer: Any,  # an HF decoder layer of the Llama layout
        hs: list[Tensor],
        adapters: list[str],
        rope: dict[int, tuple[Tensor, Tensor]],
        masks: dict[int, Tensor | None],
    ) -> list[Tensor]:
        """One decoder layer: h + attn(norm(h)), then h + mlp(norm(h)), per group."""
        attn, mlp, prefix = layer.self_attn, layer.mlp, f"layers.{index}"
        normed = [layer.input_layernorm(h) for h in hs]
        names = ("q_proj", "k_proj", "v_proj")
        q, k, v = self._linear(
            [f"{prefix}.self_attn.{n}" for n in names],
            [getattr(attn, n) for n in names],
            normed,
            adapters,
        )
        heads = [
            _attend(attn, qi, ki, vi, rope[h.shape[1]], masks[h.shape[1]])
            for h, qi, ki, vi in zip(hs, q, k, v, strict=True)
        ]
        (o,) = self._linear([f"{prefix}.self_attn.o_proj"], [attn.o_proj], heads, adapters)
        hs = [h + oi for h, oi in zip(hs, o, strict=True)]
        normed = [layer.post_attention_layernorm(h) for h in hs]
        gate, up = self._linear(
            [f"{prefix}.mlp.gate_proj", f"{prefix}.mlp.up_proj"],
            [mlp.gate_proj, mlp.up_proj],
            normed,
            adapters,
        )
        inner = [mlp.act_fn(g) * u for g, u in zip(gate, up, strict=True)]
        (down,) = self._linear([f"{prefix}.mlp.down_proj"], [mlp.down_proj], inner, adapters)
        return [h + d for h, d in zip(hs, down, strict=True)]


def _attend(
    attn: Any,  # the HF attention module: head_dim, scaling, num_key_value_groups
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cos_sin: tuple[Tensor, Tensor],
    mask: Tensor | None,
) -> Tensor:
    """Causal (or banded) multi-head attention of one group: (b, T, H*D) -> (b, T, H*D)."""
    b, length = q.shape[:2]
    head_dim = attn.head_dim
    q = q.view(b, length, -1, head_dim).transpose(1, 2)  # (b, H, T, D)
    k = k.view(b, length, -1, head_dim).transpose(1, 2)  # (b, Hkv, T, D)
    v = v.view(b, length, -1, head_dim).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, *cos_sin)
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        is_causal=mask is None and length > 1,
        scale=attn.scaling,
        enable_gqa=attn.num_key_value_groups > 1,
    )
    return out.transpose(1, 2).reshape(b, length, -1)  # (b, T, H*D)
