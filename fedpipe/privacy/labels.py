"""Labels the server cannot read from the gradients: randomized response with the model's prior.

In the U-shaped split the device computes the loss, and the gradient it sends up,
``g = J^T (p - onehot(y)) / N``, carries the label ``y`` of every position: a server that runs
the base tail recovers it (``fedpipe bench privacy``). ``privacy.label_resample = r`` makes the
gradient sent up lie about a random share ``r`` of the positions: there the gradient is taken
against a label drawn from the device's own prediction ``p`` instead of the true one (Ghazi et
al., 2021, randomized response with a prior, here the model's own).

- **Training stays unbiased.** A label drawn from ``p`` gives a gradient whose expectation is
  ``J^T (p - p) = 0``, so the positions that lie add zero-mean noise; the gradient sent up is
  divided by ``1 - r`` so that its expectation is the true gradient. The device's own tail is
  trained on the true labels.
- **What the server reads.** At a position that lies, the decoded label is a draw from ``p``,
  right only as often as the model already was; the server cannot tell which positions lie (a
  drawn label is as plausible as a true one).

No (epsilon, delta) is reported: the figure it would give is label-DP of the resampled
positions only, and the activations still carry the text.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor

from fedpipe.split.loss import IGNORE_INDEX, chunked_loss_sum, shifted_loss_sum

__all__ = ["LabelResample"]


class LabelResample:
    """The device runtime's ``tail_step``: the tail's loss on the true labels, and the gradient
    to send up taken against labels a share ``rate`` of which are drawn from the tail's own
    prediction (rescaled by ``1 / (1 - rate)``)."""

    def __init__(self, rate: float, *, seed: int | None = None) -> None:
        if not 0 < rate < 1:
            raise ValueError(f"need 0 < rate < 1, got {rate}")
        self.rate = rate
        self.generator = torch.Generator().manual_seed(
            secrets.randbits(63) if seed is None else seed
        )

    @torch.no_grad()
    def relabel(self, logits: Tensor, labels: Tensor) -> Tensor:
        """``labels`` (B, T) with a random share of the positions that count replaced by draws
        from ``softmax(logits)`` of the position before (what next-token loss compares)."""
        flat = logits[:, :-1].reshape(-1, logits.shape[-1])  # (B*(T-1), V)
        return self._relabel(labels, lambda rows: [flat[rows]])

    @torch.no_grad()
    def relabel_chunked(
        self, normed: Tensor, labels: Tensor, project: Callable[[Tensor], Tensor], chunk: int
    ) -> Tensor:
        """:meth:`relabel` from the final norm's output, with the logits of at most ``chunk``
        positions held at once (only the positions that lie are projected)."""
        hidden = normed[:, :-1].reshape(-1, normed.shape[-1])  # (B*(T-1), C)

        def logits_of(rows: Tensor) -> Iterator[Tensor]:
            for part in rows.split(chunk):
                yield project(hidden[part])

        return self._relabel(labels, logits_of)

    def _relabel(self, labels: Tensor, logits_of: Callable[[Tensor], Iterable[Tensor]]) -> Tensor:
        """Which positions lie (a share ``rate`` of those that count), then a draw for each
        from the prediction at the position before (``logits_of(rows)``: their logits, in
        pieces of rows in order)."""
        targets = labels[:, 1:]
        flip = torch.rand(targets.shape, generator=self.generator).to(labels.device) < self.rate
        flip &= targets != IGNORE_INDEX
        rows = flip.reshape(-1).nonzero().squeeze(1)
        out = labels.clone()
        if rows.numel() == 0:
            return out
        draws = [
            torch.multinomial(
                torch.softmax(piece.detach().float(), dim=-1).cpu(), 1, generator=self.generator
            ).squeeze(1)
            for piece in logits_of(rows)
        ]
        told = targets.reshape(-1).clone()
        told[rows] = torch.cat(draws).to(labels.device)
        out[:, 1:] = told.reshape(targets.shape)
        return out

    def __call__(
        self, tail: Any, x: Tensor, labels: Tensor, total_tokens: int
    ) -> tuple[Tensor, Tensor]:
        """(the true loss sum, the gradient to send up); the tail's parameters get the true
        loss's gradient. ``x`` is the tail's input, a leaf that requires grad.

        A fedpipe tail stage (``loss_chunk`` > 0) never holds the full logits: both losses run
        over chunks of tokens (:func:`fedpipe.split.loss.chunked_loss_sum`) and the labels that
        lie are drawn chunk by chunk."""
        chunk = getattr(tail, "loss_chunk", 0)
        if chunk and hasattr(tail, "normed") and hasattr(tail, "project"):
            normed = tail.normed(x)
            loss_sum, _ = chunked_loss_sum(normed, labels, tail.project, chunk=chunk)
            lies = self.relabel_chunked(normed, labels, tail.project, chunk)
            told, _ = chunked_loss_sum(normed, lies, tail.project, chunk=chunk)
        else:
            logits = tail.logits(x)  # (b, T, V)
            loss_sum, _ = shifted_loss_sum(logits, labels)
            told, _ = shifted_loss_sum(logits, self.relabel(logits, labels))
        scale = 1.0 / max(total_tokens, 1)
        (sent,) = torch.autograd.grad(told * scale, x, retain_graph=True)
        (loss_sum * scale).backward()  # the tail's own update: true labels
        return loss_sum.detach(), sent / (1.0 - self.rate)
