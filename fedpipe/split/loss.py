"""The tail's next-token loss, over the full logits or in chunks of tokens that never hold them.

``shifted_loss_sum`` takes (B, T, V) logits: for a 128k vocabulary at 2 x 2048 tokens that is
2 GB in fp32, and as much again for its gradient. ``chunked_loss_sum`` takes the final norm's
output instead and runs the LM head (``project``) and cross-entropy over chunks of the tokens
that count, each chunk under activation checkpointing: its forward keeps only its (chunk,)
token losses, its backward computes its logits again (Liger's fused linear cross-entropy and
Cut Cross-Entropy do the same in fused kernels). The peak holds one chunk's logits, not all.

Its sum is the one ``F.cross_entropy(..., reduction="sum")`` computes, in the same order: the
token losses go back to their positions (0 where a label is -100) and are summed by
``nll_loss``'s own reduction over all B * (T - 1) positions. Each token's loss is its own row's
log-softmax, and each row's logits are the same row of the full product wherever the matrix
library computes a row independently of the others' count (on the CPUs measured: products of
at least 12 rows), which is why chunks are cut evenly and no shorter than half of ``chunk``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from fedpipe.config.train import TrainConfig

__all__ = ["DEFAULT_LOSS_CHUNK", "IGNORE_INDEX", "chunked_loss_sum", "shifted_loss_sum"]

IGNORE_INDEX = -100
# Tokens per chunk (``train.loss_chunk``): a chunk's fp32 logits at a 128k vocabulary are 128 MB.
DEFAULT_LOSS_CHUNK: int = TrainConfig.loss_chunk

# Fewest rows a chunk's product runs on: fewer take the matrix library's small-product path.
_MIN_ROWS = 16

Project = Callable[[Tensor], Tensor]  # (n, C) final-norm output -> (n, V) logits


def shifted_loss_sum(logits: Tensor, labels: Tensor) -> tuple[Tensor, int]:
    """Sum of next-token cross-entropy (logits[:, :-1] vs labels[:, 1:]) and the tokens counted."""
    targets = labels[:, 1:].reshape(-1)  # (B*(T-1),)
    flat = logits[:, :-1].float().reshape(-1, logits.shape[-1])  # (B*(T-1), V)
    loss = F.cross_entropy(flat, targets, ignore_index=IGNORE_INDEX, reduction="sum")
    return loss, int((targets != IGNORE_INDEX).sum().item())


def chunked_loss_sum(
    normed: Tensor, labels: Tensor, project: Project, *, chunk: int
) -> tuple[Tensor, int]:
    """``shifted_loss_sum(project(normed), labels)`` with at most ``chunk`` tokens' logits held.

    ``normed`` (B, T, C) is the final norm's output, ``labels`` (B, T) with -100 where a token
    does not count. ``chunk`` = 0: the full logits, exactly ``shifted_loss_sum``.
    """
    if chunk < 0:
        raise ValueError(f"chunk must be >= 0 tokens (0: unchunked), got {chunk}")
    if chunk == 0:
        return shifted_loss_sum(project(normed), labels)
    targets = labels[:, 1:].reshape(-1)  # (N,) with N = B*(T-1)
    counted = targets != IGNORE_INDEX
    rows = _rows_to_run(counted)
    hidden = normed[:, :-1].reshape(-1, normed.shape[-1])[rows]  # (n, C)
    per_token = _token_losses(hidden, targets[rows], project, chunk)  # (n,)
    placed = per_token.new_zeros(targets.shape[0]).index_put((rows,), per_token)  # (N,)
    return _sum_in_cross_entropy_order(placed, counted), int(counted.sum().item())


def _rows_to_run(counted: Tensor) -> Tensor:
    """Positions whose logits are computed: those that count, and uncounted ones up to
    ``_MIN_ROWS`` (a product of fewer rows takes the small-matrix path; with none counted,
    they also keep the graph and its zero gradients)."""
    keep = counted.clone()
    short = _MIN_ROWS - int(counted.sum().item())
    if short > 0:
        keep[(~counted).nonzero().squeeze(1)[:short]] = True
    return keep.nonzero().squeeze(1)


def _token_losses(hidden: Tensor, targets: Tensor, project: Project, chunk: int) -> Tensor:
    """(n,) cross-entropy of each row of ``hidden`` (n, C), over even chunks of <= ``chunk``."""
    pieces = -(-hidden.shape[0] // chunk)  # ceil; past one piece, each has > chunk / 2 rows
    losses = []
    for h, t in zip(hidden.tensor_split(pieces), targets.tensor_split(pieces), strict=True):
        if torch.is_grad_enabled():  # keep (chunk,) losses; the backward recomputes the logits
            losses.append(checkpoint(_rows_loss, h, t, project, use_reentrant=False))
        else:
            losses.append(_rows_loss(h, t, project))
    return losses[0] if len(losses) == 1 else torch.cat(losses)


def _rows_loss(hidden: Tensor, targets: Tensor, project: Project) -> Tensor:
    """(n,) token losses of one chunk: its logits (n, V) in fp32 live only inside this call."""
    logits = project(hidden).float()
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="none")


def _sum_in_cross_entropy_order(placed: Tensor, counted: Tensor) -> Tensor:
    """The sum of ``placed`` (N,) as ``cross_entropy(reduction="sum")`` adds its token losses.

    ``nll_loss`` over (N, 1) inputs ``-placed`` with target 0 where counted reduces the same N
    positions with the same cascade as over (N, V) log-probabilities, so the sum keeps today's
    last digit (``placed.sum()`` adds in another order).
    """
    column = torch.where(counted, 0, IGNORE_INDEX)  # (N,)
    return F.nll_loss((-placed).unsqueeze(1), column, ignore_index=IGNORE_INDEX, reduction="sum")
