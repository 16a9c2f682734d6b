"""Stage modules: each holds only its own blocks and weights, under global block indices.

The Llama-layout families (every entry of :data:`fedpipe.models.families.FAMILIES`) are built
from their own Hugging Face decoder layer, norm and rotary classes; what a family adds (a scaled
embedding, logits post-processing, a rotary per layer type) comes from its table entry. GPT-2
keeps its own path. Block containers keep the Hugging Face names (``layers``, ``h`` for GPT-2)
keyed by the global block index, so ``layers.5.self_attn.q_proj`` names the same module in every
stage and in the unsplit model (after its ``model.`` / ``transformer.`` prefix). Positions are
``arange(T)``; attention is causal sdpa with no mask (right padding, pads masked out of the loss by
label -100), except in blocks with a sliding window shorter than the sequence (``layer_types``
``sliding_attention``, or every block of Mistral), which get the banded causal mask the unsplit
model uses; under eager attention (Gemma 2) every block gets the additive causal mask.

Packed rows (``data.packing``): with ``segments`` (B, T) given (fedpipe.split.packing), every
block attends causally within each token's own segment (and its window), and positions (rotary,
or GPT-2's position embeddings) restart at 0 per segment. Without them, the path above runs
unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

from fedpipe.models.families import FAMILIES, FamilySpec, family_spec
from fedpipe.models.loading import model_family
from fedpipe.split.loss import (
    DEFAULT_LOSS_CHUNK,
    IGNORE_INDEX,
    chunked_loss_sum,
    shifted_loss_sum,
)
from fedpipe.split.packing import segment_mask, segment_positions

__all__ = [
    "IGNORE_INDEX",
    "HeadStage",
    "MiddleStage",
    "TailStage",
    "ServerLossStage",
    "attention_mask",
    "shifted_loss_sum",
    "sliding_window",
]


def rotary_embedding(config: Any) -> nn.Module:
    """A fresh rotary embedding for a Llama-layout config (its buffers are computed, not loaded)."""
    return family_spec(config).rotary(config=config)


def sliding_window(config: Any, block: int) -> int | None:
    """How many tokens ``block`` attends to (itself included), or None for full causal attention.

    Where the family's table entry says: Mistral and Phi-3 put their ``sliding_window`` on
    every block; Qwen2/3, SmolLM3 and Gemma on the blocks their ``layer_types`` mark
    ``sliding_attention``; Llama, OLMo 2 and Granite on none (their code ignores the field).
    """
    window = getattr(config, "sliding_window", None)
    spec = FAMILIES.get(getattr(config, "model_type", None) or "")
    if not window or spec is None or spec.sliding == "none":
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        kind = layer_types[block]
    else:
        kind = "sliding_attention" if spec.sliding == "every_block" else "full_attention"
    if kind not in ("full_attention", "sliding_attention"):
        raise ValueError(
            f"block {block} has attention type {kind!r}; fedpipe's stages compute "
            "full_attention and sliding_attention blocks only, so this model cannot be split"
        )
    return int(window) if kind == "sliding_attention" else None


def attention_mask(
    config: Any, block: int, like: Tensor, segments: Tensor | None = None
) -> Tensor | None:
    """The mask ``block`` attends with over ``like`` (B, T, C): sdpa's bool mask (None: causal)
    or, under eager attention, the additive mask (0 where allowed, the dtype's minimum elsewhere)
    that Hugging Face's eager attention adds to the scores. With ``segments`` (B, T), the
    (B, 1, T, T) mask of packed rows: causal within each segment."""
    length, window = like.shape[1], sliding_window(config, block)
    if segments is not None:
        allowed = segment_mask(segments, window)
    elif config._attn_implementation != "eager":
        return _window_mask(length, window, like.device)
    else:
        allowed = _banded(length, length if window is None else window, like.device)
    if config._attn_implementation != "eager":
        return allowed
    return torch.where(allowed, torch.tensor(0.0, dtype=like.dtype), torch.finfo(like.dtype).min)


def _window_mask(length: int, window: int | None, device: torch.device) -> Tensor | None:
    """(1, 1, T, T) bool, True where query i may attend key j: j <= i and i - j < window."""
    if window is None or window >= length:
        return None  # plain causal attention (sdpa's is_causal) is the same and faster
    return _banded(length, window, device)


def _banded(length: int, window: int, device: torch.device) -> Tensor:
    """(1, 1, T, T) bool: j <= i and i - j < window."""
    i = torch.arange(length, device=device).unsqueeze(1)  # (T, 1)
    j = torch.arange(length, device=device).unsqueeze(0)  # (1, T)
    return ((j <= i) & (j > i - window)).unsqueeze(0).unsqueeze(0)


class _Stage(nn.Module):
    """Common part of every stage: the blocks it owns and how to run them."""

    def __init__(self, config: Any, blocks: Sequence[int]) -> None:
        super().__init__()
        self.config = config
        self.family = model_family(config)
        self.block_indices = tuple(int(i) for i in blocks)
        self.spec: FamilySpec | None = None  # GPT-2 has its own layout, not a table entry
        if self.family == "llama":
            self.spec = family_spec(config)
            layer_cls = self.spec.decoder_layer
            for i in self.block_indices:
                sliding_window(config, i)  # refuses attention types the stages cannot compute
            self.layers = nn.ModuleDict({str(i): layer_cls(config, i) for i in self.block_indices})
            if self.block_indices:
                self.rotary_emb = rotary_embedding(config)
        else:
            self.h = nn.ModuleDict({str(i): GPT2Block(config, layer_idx=i) for i in blocks})

    @property
    def blocks(self) -> nn.ModuleDict:
        return self.layers if self.family == "llama" else self.h

    def run_blocks(
        self,
        hidden: Tensor,
        blocks: Sequence[int] | None = None,
        segments: Tensor | None = None,
    ) -> Tensor:
        """Run this stage's blocks (or the subset ``blocks`` of them) on ``hidden`` (B, T, C)
        at positions arange(T). A device whose cut leaves the server fewer blocks runs a subset.
        ``segments`` (B, T): packed rows, each segment attending to itself at its own positions.
        """
        indices = self._subset(blocks)
        if not indices:
            return hidden
        if self.family == "gpt2":
            for i in indices:
                if segments is None:
                    hidden = self.h[str(i)](hidden)
                else:
                    mask = attention_mask(self.config, i, hidden, segments)
                    hidden = self.h[str(i)](hidden, attention_mask=mask)
            return hidden
        if segments is None:
            positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)  # (1, T)
        else:
            positions = segment_positions(segments)  # (B, T)
        rotaries = self._rotaries(hidden, positions, indices)
        for index in indices:
            hidden = self.layers[str(index)](
                hidden,
                attention_mask=attention_mask(self.config, index, hidden, segments),
                position_ids=positions,
                position_embeddings=rotaries[self._rotary_key(index)],
            )
        return hidden

    def _rotary_key(self, block: int) -> str | None:
        """Which rotary ``block`` uses: its layer type where the family has one per type."""
        assert self.spec is not None
        return self.config.layer_types[block] if self.spec.rotary_per_layer_type else None

    def _rotaries(
        self, hidden: Tensor, positions: Tensor, indices: Sequence[int]
    ) -> dict[str | None, tuple[Tensor, Tensor]]:
        """(cos, sin) at ``positions`` for every rotary the blocks ``indices`` use."""
        keys = dict.fromkeys(self._rotary_key(i) for i in indices)
        if None in keys:
            return {None: self.rotary_emb(hidden, position_ids=positions)}
        return {key: self.rotary_emb(hidden, positions, key) for key in keys}

    def _subset(self, blocks: Sequence[int] | None) -> tuple[int, ...]:
        """``blocks`` checked against the held ones (all of them when None), in order."""
        if blocks is None:
            return self.block_indices
        wanted = tuple(int(b) for b in blocks)
        if wanted != tuple(b for b in self.block_indices if b in wanted):
            raise ValueError(
                f"blocks {list(wanted)} are not a subset of this stage's blocks "
                f"{list(self.block_indices)} in order"
            )
        return wanted


class HeadStage(_Stage):
    """Device side, first: token (+ GPT-2 position) embeddings and the head blocks."""

    def __init__(self, config: Any, blocks: Sequence[int]) -> None:
        super().__init__(config, blocks)
        vocab, width = config.vocab_size, config.hidden_size
        if self.family == "llama":
            self.embed_tokens = nn.Embedding(vocab, width, config.pad_token_id)
        else:
            self.wte = nn.Embedding(vocab, width)
            self.wpe = nn.Embedding(config.max_position_embeddings, width)
            self.drop = nn.Dropout(config.embd_pdrop)

    @property
    def embedding(self) -> nn.Embedding:
        return self.embed_tokens if self.family == "llama" else self.wte

    def forward(self, input_ids: Tensor, segments: Tensor | None = None) -> Tensor:
        """(B, T) token ids -> (B, T, C) hidden states after the head blocks (``segments``:
        packed rows, see :meth:`run_blocks`)."""
        hidden = self.embedding(input_ids)  # (B, T, C)
        if self.spec is not None and self.spec.embed is not None:
            hidden = self.spec.embed(hidden, self.config)  # Gemma's sqrt(C), Granite's multiplier
        if self.family == "gpt2":
            if segments is None:
                positions = torch.arange(input_ids.shape[1], device=input_ids.device)
            else:
                positions = segment_positions(segments)  # (B, T)
            hidden = self.drop(hidden + self.wpe(positions))
        return self.run_blocks(hidden, segments=segments)


class MiddleStage(_Stage):
    """Server side in U mode: the middle blocks, hidden states in and out."""

    def forward(
        self,
        hidden: Tensor,
        blocks: Sequence[int] | None = None,
        segments: Tensor | None = None,
    ) -> Tensor:
        """(B, T, C) -> (B, T, C), through ``blocks`` (None: all the stage's)."""
        return self.run_blocks(hidden, blocks, segments)


class TailStage(_Stage):
    """Device side, last: tail blocks, final norm, LM head and the loss (labels never leave)."""

    def __init__(self, config: Any, blocks: Sequence[int]) -> None:
        super().__init__(config, blocks)
        width = config.hidden_size
        if self.family == "llama":
            assert self.spec is not None
            self.norm = self.spec.norm(width, eps=config.rms_norm_eps)
        else:
            self.ln_f = nn.LayerNorm(width, eps=config.layer_norm_epsilon)
        self.lm_head = nn.Linear(width, config.vocab_size, bias=False)
        self.loss_chunk = DEFAULT_LOSS_CHUNK  # tokens whose logits the loss holds at once

    @property
    def final_norm(self) -> nn.Module:
        return self.norm if self.family == "llama" else self.ln_f

    def normed(
        self,
        hidden: Tensor,
        blocks: Sequence[int] | None = None,
        segments: Tensor | None = None,
    ) -> Tensor:
        """(B, T, C) hidden states from the previous stage -> (B, T, C) after the final norm."""
        return self.final_norm(self.run_blocks(hidden, blocks, segments))

    def project(self, normed: Tensor) -> Tensor:
        """(..., C) hidden states after the final norm -> (..., V) logits: the LM head and the
        family's post-processing (Gemma's final soft-capping, Granite's logits scaling). Rows
        are independent, so the chunked loss calls it on one chunk of tokens at a time."""
        logits = self.lm_head(normed)
        if self.spec is not None and self.spec.logits is not None:
            logits = self.spec.logits(logits, self.config)
        return logits

    def logits(
        self,
        hidden: Tensor,
        blocks: Sequence[int] | None = None,
        segments: Tensor | None = None,
    ) -> Tensor:
        """(B, T, C) hidden states from the previous stage -> (B, T, V) logits."""
        return self.project(self.normed(hidden, blocks, segments))

    def forward(
        self,
        hidden: Tensor,
        labels: Tensor,
        blocks: Sequence[int] | None = None,
        segments: Tensor | None = None,
    ) -> tuple[Tensor, int]:
        """(sum of shifted token cross-entropy, number of counted tokens); pads carry label -100.

        ``blocks`` (the server's loss stage): a suffix of the stage's blocks a shorter head
        leaves to it (None: all). The LM head and cross-entropy run over chunks of
        ``loss_chunk`` tokens (0: over the full logits; fedpipe.split.loss). Packed rows
        (``segments``) carry -100 on each example's first token, so no loss crosses them."""
        normed = self.normed(hidden, blocks, segments)
        return chunked_loss_sum(normed, labels, self.project, chunk=self.loss_chunk)


class ServerLossStage(TailStage):
    """Server side in mode "two": every block after the head, final norm, LM head and the loss."""
