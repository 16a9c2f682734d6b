"""The honest-but-curious server's attacks on what the stage link carried.

The attacker has what any fedpipe server has: the public base weights of the whole model (not
the device's LoRA adapters) and public text of its own, disjoint from the devices' text. It
knows the run's settings, so against a defended link it trains on public traffic defended the
same way (with its own noise draws): an adaptive attacker.

- :class:`ReconstructionAttack` (input reconstruction from uplink activations): push the public
  text through the frozen base head, fit a ridge regression from each token's (unit-norm)
  hidden state to that token's unit-norm embedding row, and decode a received hidden state as
  the vocabulary row most similar to its image. Fitting is closed form (seconds on a CPU).
- :class:`LabelAttack` (label inference from output gradients): the server holds the tail's
  input ``x`` (its own output) and the base tail, so it computes ``p = softmax(tail(x))`` and,
  from the received gradient ``g = J^T (p - onehot(y)) / N``, the label part
  ``d = J^T p - N g = J^T onehot(y)``, where ``J`` is the Jacobian of the logits with respect
  to ``x``. ``d`` is close to the label's LM-head row seen through the tail; a ridge map fitted
  on public text decodes it, and the base model's own prediction ``log p`` is added as a prior.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from fedpipe.split import HeadStage, TailStage

__all__ = [
    "LabelAttack",
    "Prior",
    "ReconstructionAttack",
    "label_features",
    "PublicGradients",
    "ridge",
]

Defend = Callable[[Tensor], Tensor]  # the link's defence, as the attacker reproduces it
_CHUNK = 512  # rows scored against the vocabulary at once: (512, V) floats
_TUNE_ROWS = 512  # public positions the prior's weight is tuned on
_TOP_K = 256  # the base model's most likely next tokens kept per position as the label prior


def _unit(x: Tensor) -> Tensor:
    return x / (x.norm(dim=-1, keepdim=True) + 1e-12)


def ridge(features: Tensor, targets: Tensor, lam: float = 1e-2) -> Tensor:
    """(C+1, D) weights of ridge regression from (N, C) features (plus a bias) to (N, D)."""
    x = torch.cat([features, torch.ones(len(features), 1)], dim=1).double()
    gram = x.T @ x + lam * len(x) / 1000 * torch.eye(x.shape[1], dtype=x.dtype)
    return torch.linalg.solve(gram, x.T @ targets.double()).float()


def _apply(weights: Tensor, features: Tensor) -> Tensor:
    return torch.cat([features, torch.ones(len(features), 1)], dim=1) @ weights


@dataclass
class Prior:
    """The base model's top-k next-token log-probabilities per position (a sparse prior)."""

    values: Tensor  # (N, k)
    indices: Tensor  # (N, k)

    @classmethod
    def of(cls, log_p: Tensor, k: int = _TOP_K) -> Prior:
        top = log_p.topk(min(k, log_p.shape[-1]), dim=-1)
        return cls(top.values, top.indices)

    @classmethod
    def cat(cls, priors: list[Prior]) -> Prior:
        return cls(torch.cat([p.values for p in priors]), torch.cat([p.indices for p in priors]))

    def add_to(self, scores: Tensor, rows: slice, weight: float) -> Tensor:
        """``scores`` (n, V) + weight * log p, where tokens outside the top k get its k-th value."""
        values, indices = self.values[rows], self.indices[rows]
        floor = values[:, -1:]  # (n, 1)
        scores = scores + weight * floor
        return scores.scatter_add(1, indices, weight * (values - floor))


def _decode(
    images: Tensor, vocab: Tensor, prior: Prior | None = None, weight: float = 0.0
) -> Tensor:
    """Argmax over the vocabulary of image . row (+ weight * prior), in chunks; (N,) token ids."""
    out = []
    for i in range(0, len(images), _CHUNK):
        scores = images[i : i + _CHUNK] @ vocab.T  # (n, V)
        if prior is not None and weight > 0:
            scores = prior.add_to(scores, slice(i, i + _CHUNK), weight)
        out.append(scores.argmax(dim=1))
    return torch.cat(out) if out else torch.empty(0, dtype=torch.long)


@dataclass
class ReconstructionAttack:
    """Token ids from head activations, fitted on the attacker's public text."""

    weights: Tensor  # (C+1, C)
    vocab: Tensor  # (V, C) unit-norm embedding rows

    @classmethod
    @torch.no_grad()
    def fit(
        cls, head: HeadStage, public: Tensor, hidden: Tensor, defend: Defend | None = None
    ) -> ReconstructionAttack:
        """Fit on ``public`` (N, T) token blocks and their base head output ``hidden`` (N, T, C).

        ``defend`` (the link's defence, with the attacker's own noise) is applied first.
        """
        if defend is not None:
            hidden = defend(hidden)
        vocab = _unit(head.embedding.weight.detach().float())
        features = _unit(hidden.reshape(-1, hidden.shape[-1]).float())
        return cls(ridge(features, vocab[public.reshape(-1)]), vocab)

    @torch.no_grad()
    def predict(self, activations: Tensor) -> Tensor:
        """(..., C) received hidden states -> (...) token ids."""
        features = _unit(activations.reshape(-1, activations.shape[-1]).float())
        images = _unit(_apply(self.weights, features))
        return _decode(images, self.vocab).reshape(activations.shape[:-1])


def label_features(tail: TailStage, x: Tensor, grad: Tensor, tokens: int) -> tuple[Tensor, Prior]:
    """(d, prior) for the positions that carry a label: d = J^T p - N g, (B*(T-1), C).

    ``x`` (B, T, C) is what the server sent down, ``grad`` what came back, ``tokens`` the step's
    label count N (the device divides its loss by it).
    """
    x = x.detach().float().requires_grad_(True)
    logits = tail.logits(x)  # (B, T, V)
    probs = torch.softmax(logits.detach(), dim=-1)
    probs[:, -1] = 0.0  # the last position has no label: the loss never reaches it
    (pull,) = torch.autograd.grad(logits, x, probs)  # J^T p, (B, T, C)
    label_part = pull - tokens * grad.float()
    width = x.shape[-1]
    log_p = torch.log_softmax(logits.detach()[:, :-1], dim=-1)
    prior = Prior.of(log_p.reshape(-1, log_p.shape[-1]))
    return label_part[:, :-1].reshape(-1, width).detach(), prior


@dataclass
class PublicGradients:
    """The attacker's own public text through the base tail, trained on as a device would."""

    pull: Tensor  # J^T p, (N, T, C)
    grads: Tensor  # the output gradients a device would send, (N, T, C)
    prior: Prior
    labels: Tensor  # (N * (T-1),)
    tokens: int  # label count per step (the device's divisor)

    @classmethod
    def of(
        cls,
        tail: TailStage,
        x: Tensor,
        ids: Tensor,
        batch_size: int,
        *,
        relabel: Callable[[Tensor, Tensor], Tensor] | None = None,
        scale: float = 1.0,
    ) -> PublicGradients:
        """Per chunk of ``batch_size`` rows (one step's worth), scaled as a device scales.

        ``relabel(logits, ids)``: the labels the gradient is taken against, as a device with
        ``privacy.label_resample`` draws them (its gradient then times ``scale``); ``labels``
        stay the true ones, which the attacker fits to."""
        tokens = batch_size * (ids.shape[1] - 1)
        pulls, grads, priors = [], [], []
        for xs, chunk in zip(x.split(batch_size), ids.split(batch_size), strict=True):
            leaf = xs.detach().float().requires_grad_(True)
            logits = tail.logits(leaf)  # (b, T, V)
            flat = logits[:, :-1].reshape(-1, logits.shape[-1])
            told = chunk if relabel is None else relabel(logits, chunk)
            loss = F.cross_entropy(flat, told[:, 1:].reshape(-1), reduction="sum")
            (grad,) = torch.autograd.grad(loss * (scale / tokens), leaf, retain_graph=True)
            probs = torch.softmax(logits.detach(), dim=-1)
            probs[:, -1] = 0.0
            (pull,) = torch.autograd.grad(logits, leaf, probs)
            pulls.append(pull)
            grads.append(grad)
            priors.append(Prior.of(torch.log_softmax(flat.detach(), dim=-1)))
        labels = ids[:, 1:].reshape(-1)
        return cls(torch.cat(pulls), torch.cat(grads), Prior.cat(priors), labels, tokens)

    def features(self, defend: Defend | None) -> Tensor:
        """d = J^T p - N g of every labelled position, with the link's defence on g."""
        grads = self.grads if defend is None else defend(self.grads)
        d = self.pull - self.tokens * grads
        return d[:, :-1].reshape(-1, d.shape[-1])


@dataclass
class LabelAttack:
    """Next-token labels from output gradients, fitted on the attacker's public text."""

    weights: Tensor  # (C+1, C)
    vocab: Tensor  # (V, C) unit-norm LM-head rows
    prior_weight: float  # how much the base model's own prediction counts

    @classmethod
    @torch.no_grad()
    def fit(cls, tail: TailStage, d: Tensor, prior: Prior, labels: Tensor) -> LabelAttack:
        """Ridge from unit ``d`` to the label's unit LM-head row; the prior's weight is tuned
        on (a slice of) the public text itself."""
        vocab = _unit(tail.lm_head.weight.detach().float())
        weights = ridge(_unit(d), vocab[labels])
        rows = slice(0, min(len(d), _TUNE_ROWS))
        scores = _unit(_apply(weights, _unit(d[rows]))) @ vocab.T  # (n, V), computed once
        best = (-1.0, 0.0)
        # up to a weight where the prior decides alone (for gradients that mislead: labels
        # resampled by the device, or drowned in noise)
        for weight in (0.0, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 100.0):
            guess = prior.add_to(scores, rows, weight) if weight else scores
            accuracy = float((guess.argmax(dim=1) == labels[rows]).float().mean())
            best = max(best, (accuracy, weight))
        return cls(weights, vocab, best[1])

    @torch.no_grad()
    def predict(self, d: Tensor, prior: Prior) -> Tensor:
        images = _unit(_apply(self.weights, _unit(d)))
        return _decode(images, self.vocab, prior, self.prior_weight)
