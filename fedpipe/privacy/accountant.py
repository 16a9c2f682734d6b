"""(epsilon, delta) of the stage-link defences, from Google's ``dp-accounting`` library.

What the guarantee covers, precisely:

- **Unit: one sample** (one training sequence of ``seq_len`` tokens). Two datasets are
  neighbours when they differ in one sequence (any content). Clipping is per token (see
  :mod:`fedpipe.privacy.uplink`), so a sequence's release, T token vectors each of norm <= C, moves
  by at most ``2 C sqrt(T)`` in L2 when the sequence is replaced by any other. With noise of std
  ``sigma C`` per coordinate that is a Gaussian mechanism of noise multiplier
  ``z = sigma / (2 sqrt(T))``. There is no per-token guarantee: in a head with attention, one
  token moves the vectors of every later token of its sequence, so a single token's privacy is
  bounded only by its sequence's.
- **Releases per step**: each time a sequence is in a batch it is released twice, once as the
  activations of all its tokens (uplink) and once as the output gradient of all its tokens
  (the labels). Both channels compose; a channel without noise has no guarantee at all, and the
  combined ``epsilon`` is then not reported.
- **Over steps and rounds**: releases compose. No amplification by subsampling is claimed: the
  batches are drawn from a permutation seeded by ``model.seed`` (known to the server), so the
  server can tell which rows are the same sequence. The count is the number of times the
  most-used sequence of the device was released so far (:func:`releases_so_far`), assuming the
  device trained in every round up to this one (an upper bound).
- Not covered: the device's LoRA adapters sent through Flower each round (see
  ``privacy.adapter_dp``), evaluation traffic (the evaluator's held-out text is not private),
  and side channels (timing, message sizes).

The accountant is dp-accounting's RDP accountant: its PLD accountant is tighter but takes minutes
at the small noise multipliers that per-sample sensitivity gives (z well below 1), and RDP stays
within milliseconds at any z.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import dp_accounting
import numpy as np
from dp_accounting.rdp import rdp_privacy_accountant

from fedpipe.config import PrivacyConfig

__all__ = ["LinkAccountant", "releases_so_far", "sample_noise_multiplier"]


def sample_noise_multiplier(noise: float, seq_len: int) -> float:
    """z of one sequence's release: noise std (``noise * C``) over its sensitivity 2 C sqrt(T)."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    return noise / (2.0 * math.sqrt(seq_len))


def releases_so_far(indices: list[np.ndarray]) -> int:
    """How often the most-used sequence was released, from each step's block indices."""
    if not indices:
        return 0
    return int(np.bincount(np.concatenate(indices)).max())


@dataclass(frozen=True)
class LinkAccountant:
    """Per-sample (epsilon, delta) of the stage link's noised channels after k releases."""

    activation_noise: float  # sigma of the activations' noise (0: not noised)
    gradient_noise: float  # sigma of the output gradients' noise (0: not noised)
    seq_len: int
    delta: float = 1e-5

    @classmethod
    def from_config(cls, cfg: PrivacyConfig, *, seq_len: int) -> LinkAccountant | None:
        """None when no channel is noised, or the mechanism bounds nothing (then no guarantee
        applies: ``token`` and ``token-dim`` scale the noise to the token, unclipped)."""
        if cfg.mechanism != "clip":
            return None
        act = cfg.activation_noise if cfg.activation_clip > 0 else 0.0
        grad = cfg.gradient_noise if cfg.gradient_clip > 0 else 0.0
        if act == 0 and grad == 0:
            return None
        return cls(act, grad, seq_len, cfg.delta)

    def event(self, releases: int, channels: tuple[str, ...]) -> dp_accounting.DpEvent:
        """The DpEvent of ``releases`` releases of one sequence on ``channels``."""
        noises = {"activations": self.activation_noise, "gradients": self.gradient_noise}
        events: list[dp_accounting.DpEvent] = []
        for name in channels:
            if noises[name] <= 0:
                raise ValueError(f"channel {name} is not noised: no guarantee to account")
            z = sample_noise_multiplier(noises[name], self.seq_len)
            events.append(
                dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(z), releases)
            )
        return dp_accounting.ComposedDpEvent(events)

    def epsilon(self, releases: int, channels: tuple[str, ...]) -> float:
        """epsilon at ``self.delta`` for ``releases`` releases on ``channels`` (0 releases: 0)."""
        if releases <= 0:
            return 0.0
        accountant = rdp_privacy_accountant.RdpAccountant()
        accountant.compose(self.event(releases, channels))
        return float(accountant.get_epsilon(self.delta))

    def report(self, releases: int) -> dict[str, float]:
        """Flat metrics: releases, epsilon per noised channel, and both combined when both are."""
        out: dict[str, float] = {"privacy-releases": float(releases), "privacy-delta": self.delta}
        if self.activation_noise > 0:
            out["privacy-epsilon-activations"] = self.epsilon(releases, ("activations",))
        if self.gradient_noise > 0:
            out["privacy-epsilon-gradients"] = self.epsilon(releases, ("gradients",))
        if self.activation_noise > 0 and self.gradient_noise > 0:
            out["privacy-epsilon"] = self.epsilon(releases, ("activations", "gradients"))
        return out
