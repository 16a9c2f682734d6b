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
from typing import Any

import torch
from torch import Tensor

from fedpipe.split.stages import IGNORE_INDEX, shifted_loss_sum

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
        targets = labels[:, 1:]
        probs = torch.softmax(logits[:, :-1].detach().float(), dim=-1).cpu()  # (B, T-1, V)
        draws = torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1, generator=self.generator)
        draws = draws.reshape(targets.shape).to(labels.device)
        flip = torch.rand(targets.shape, generator=self.generator).to(labels.device) < self.rate
        flip &= targets != IGNORE_INDEX
        out = labels.clone()
        out[:, 1:] = torch.where(flip, draws, targets)
        return out

    def __call__(
        self, tail: Any, x: Tensor, labels: Tensor, total_tokens: int
    ) -> tuple[Tensor, Tensor]:
        """(the true loss sum, the gradient to send up); the tail's parameters get the true
        loss's gradient. ``x`` is the tail's input, a leaf that requires grad."""
        logits = tail.logits(x)  # (b, T, V)
        loss_sum, _ = shifted_loss_sum(logits, labels)
        told, _ = shifted_loss_sum(logits, self.relabel(logits, labels))
        scale = 1.0 / max(total_tokens, 1)
        (sent,) = torch.autograd.grad(told * scale, x, retain_graph=True)
        (loss_sum * scale).backward()  # the tail's own update: true labels
        return loss_sum.detach(), sent / (1.0 - self.rate)
