"""Token blocks for causal-LM training, and a resumable sampler of batches over them.

Documents are tokenised, each followed by the tokenizer's eos, concatenated into one stream and cut
into contiguous blocks of `seq_len` tokens (the remainder is dropped), GPT-2 style. Labels are the
input ids themselves: the model shifts them inside its loss.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from fedpipe.data.documents import Document

__all__ = [
    "tokenize_blocks",
    "held_out_blocks",
    "even_picks",
    "render_document",
    "BlockSampler",
]

log = logging.getLogger(__name__)

# Documents per tokenizer call: batched for speed, small enough to stop early at max_blocks.
_CHUNK_DOCS = 64


def render_document(doc: Document, tokenizer: Any) -> str:
    """A document as the text the model trains on; chats go through the tokenizer's chat template
    when it has one, else become "role: content" lines."""
    if doc.text is not None:
        return doc.text
    if doc.completion is not None:
        return (doc.prompt or "") + doc.completion
    messages = [dict(m) for m in doc.messages or ()]
    if getattr(tokenizer, "chat_template", None):
        return str(tokenizer.apply_chat_template(messages, tokenize=False))
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages)


def tokenize_blocks(
    docs: Sequence[Document], tokenizer: Any, seq_len: int, *, max_blocks: int | None = None
) -> torch.Tensor:
    """Pack `docs` into a LongTensor (N, seq_len) of contiguous token blocks.

    `tokenizer` is a Hugging Face tokenizer (callable, with `eos_token_id`). With `max_blocks`, only
    as many documents are tokenised as the first `max_blocks` blocks need.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if max_blocks is not None and max_blocks < 0:
        raise ValueError(f"max_blocks must be >= 0 or None, got {max_blocks}")
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise ValueError(
            "the tokenizer has no eos token to separate documents; set tokenizer.eos_token"
        )
    wanted = None if max_blocks is None else max_blocks * seq_len
    ids: list[int] = []
    for chunk_ids in _token_chunks(docs, tokenizer):
        for doc_ids in chunk_ids:
            ids.extend(doc_ids)
            ids.append(eos)
        if wanted is not None and len(ids) >= wanted:
            break
    n_blocks = len(ids) // seq_len if wanted is None else min(len(ids), wanted) // seq_len
    if n_blocks == 0:
        log.warning("%d tokens are fewer than one block of %d; no blocks", len(ids), seq_len)
    blocks = torch.tensor(ids[: n_blocks * seq_len], dtype=torch.long)
    return blocks.view(n_blocks, seq_len)  # (N, T)


def held_out_blocks(
    docs: Sequence[Document], tokenizer: Any, seq_len: int, n_blocks: int
) -> torch.Tensor:
    """``n_blocks`` blocks spread evenly over the token stream of every document in ``docs``.

    An evaluation set must stand for all of the held-out text: the first ``n_blocks`` blocks
    would be its first documents only (in the bundled corpus, 2-3 chapters of Genesis, which a
    by-source split puts on one device). Block ``i`` of ``n`` is taken at the middle of the
    ``i``-th of ``n`` equal spans of the stream, so every part of the text is represented in
    proportion to its length, and the choice is deterministic. Fewer blocks than asked: all.
    """
    if n_blocks < 0:
        raise ValueError(f"n_blocks must be >= 0, got {n_blocks}")
    blocks = tokenize_blocks(docs, tokenizer, seq_len)  # (N, T)
    total = blocks.shape[0]
    if total <= n_blocks:
        return blocks
    return blocks[even_picks(total, n_blocks)]


def even_picks(total: int, n: int) -> list[int]:
    """``n`` of ``total`` indices, each at the middle of one of ``n`` equal spans."""
    return [int((i + 0.5) * total / n) for i in range(n)]


def _token_chunks(docs: Sequence[Document], tokenizer: Any) -> Iterator[list[list[int]]]:
    """Token ids of the documents, a chunk of documents per tokenizer call, no special tokens added
    (a chat template writes its own)."""
    for start in range(0, len(docs), _CHUNK_DOCS):
        texts = [render_document(d, tokenizer) for d in docs[start : start + _CHUNK_DOCS]]
        # verbose=False: documents longer than the model's context are expected; we cut them.
        yield tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]


class BlockSampler:
    """Batches of blocks, deterministic per (seed, step), so a resumed run draws the same batches.

    The blocks are visited in epochs, each a permutation seeded by (seed, epoch); batch `step` takes
    positions [step * B, (step + 1) * B) of that endless sequence, crossing into the next epoch when
    it must (so batch_size may exceed the number of blocks).
    """

    def __init__(
        self,
        blocks: torch.Tensor,
        batch_size: int,
        *,
        seed: int,
        labels: torch.Tensor | None = None,
        segments: torch.Tensor | None = None,
    ) -> None:
        if blocks.dim() != 2 or blocks.shape[0] == 0:
            raise ValueError(
                f"need a non-empty (N, seq_len) tensor of blocks, got shape {tuple(blocks.shape)}; "
                "give this device more text or a shorter seq_len"
            )
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        for name, part in (("labels", labels), ("segments", segments)):
            if part is not None and part.shape != blocks.shape:
                raise ValueError(
                    f"{name} of shape {tuple(part.shape)} do not fit blocks {tuple(blocks.shape)}"
                )
        self.blocks = blocks.long()
        # Instruction rows carry their own labels (-100 off the answers); blocks are their labels.
        self.labels = labels.long() if labels is not None else None
        # Packed rows' segment ids (fedpipe.split.packing), drawn with their rows.
        self.segments = segments.long() if segments is not None else None
        self.batch_size = batch_size
        self.seed = seed
        self._perm_cache: tuple[int, np.ndarray] | None = None

    @property
    def num_examples(self) -> int:
        """Number of blocks (what a device reports as its number of examples)."""
        return int(self.blocks.shape[0])

    def epoch_of(self, step: int) -> int:
        """The epoch in which batch `step` starts."""
        return step * self.batch_size // self.num_examples

    def indices(self, step: int) -> np.ndarray:
        """Block indices of batch `step`, shape (B,)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        n = self.num_examples
        positions = np.arange(step * self.batch_size, (step + 1) * self.batch_size)
        out = np.empty(self.batch_size, dtype=np.int64)
        for epoch in np.unique(positions // n):
            mask = positions // n == epoch
            out[mask] = self._permutation(int(epoch))[positions[mask] % n]
        return out

    def batch(self, step: int) -> dict[str, torch.Tensor]:
        """{"input_ids": (B, T), "labels": (B, T)}; labels equal the inputs (the loss shifts),
        or are the rows' own labels where given; packed rows add "segments" (B, T)."""
        picks = torch.from_numpy(self.indices(step))
        input_ids = self.blocks[picks]  # (B, T)
        labels = input_ids.clone() if self.labels is None else self.labels[picks]
        if self.segments is None:
            return {"input_ids": input_ids, "labels": labels}
        return {"input_ids": input_ids, "labels": labels, "segments": self.segments[picks]}

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm_cache is None or self._perm_cache[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._perm_cache = (epoch, rng.permutation(self.num_examples))
        return self._perm_cache[1]
