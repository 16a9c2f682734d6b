"""Clipping and calibrated Gaussian noise on what a device sends up the stage link.

A device sends the server two things that carry its text: the head's activations (the tokens it
read) and, in the U-shaped split, the gradient of its loss with respect to the tail's input (the
labels, i.e. the next tokens). :class:`LinkDefence` is the ``transform_up(kind, tensor)`` hook
that :class:`fedpipe.edge.runtime.DeviceRuntime` calls just before sending either.

Clipping is per token: every token's C-dimensional vector is scaled down to L2 norm at most
``clip``. Per token rather than per sample because hidden-state norms differ across positions by
orders of magnitude (Llama-family models put a "massive activation" on the first token): a
per-sample bound would be spent on that one token and shrink every other token to nothing, while a
per-token bound keeps every position on one scale. Noise of standard deviation
``noise * clip`` is then added to every coordinate.

Two other mechanisms (``privacy.mechanism``) clip nothing and scale the noise to each token
instead (:class:`TokenNoise`): ``token`` adds noise of standard deviation ``noise`` times the
token's own norm to each coordinate (the clip mechanism's formula, with the token's norm in
place of the clip); ``token-dim`` spreads the same noise energy over the dimensions as the
microbatch's energy is spread, so that every dimension keeps the same signal-to-noise ratio.
Neither bounds a token's influence, so neither has an (epsilon, delta); both keep the first
token's large vector (which the model's later blocks rely on) at its size, where clipping at a
typical token's norm shrinks it.

The noise is drawn from a generator seeded by the operating system, never from the run's
``model.seed``: the server knows the run config, and noise it could regenerate would protect
nothing. (Tests pass a seed explicitly.)
"""

from __future__ import annotations

import secrets

import torch
from torch import Tensor

from fedpipe.config import PrivacyConfig
from fedpipe.messages import Kind

__all__ = ["ChannelNoise", "LinkDefence", "TokenNoise", "clip_per_token"]

_EPS = 1e-12


def clip_per_token(x: Tensor, clip: float) -> Tensor:
    """Scale each vector along the last dimension to L2 norm <= ``clip`` (differentiable).

    (..., C) in, (..., C) out; vectors already inside the ball are returned unchanged.
    """
    norms = x.norm(dim=-1, keepdim=True)  # (..., 1)
    return x * torch.clamp(clip / (norms + _EPS), max=1.0)


class ChannelNoise:
    """Per-token clipping then Gaussian noise of std ``noise * clip`` on one kind of tensor."""

    def __init__(self, clip: float, noise: float, generator: torch.Generator) -> None:
        if clip <= 0 or noise < 0:
            raise ValueError(f"need clip > 0 and noise >= 0, got clip={clip}, noise={noise}")
        self.clip, self.noise, self.generator = clip, noise, generator

    @property
    def std(self) -> float:
        """Standard deviation of the noise on every coordinate."""
        return self.noise * self.clip

    def __call__(self, x: Tensor) -> Tensor:
        clipped = clip_per_token(x, self.clip)
        if self.noise == 0:
            return clipped
        draw = torch.randn(x.shape, generator=self.generator, dtype=torch.float32)
        return clipped + (draw * self.std).to(device=x.device, dtype=x.dtype)  # a constant


class TokenNoise:
    """Gaussian noise scaled to each token's own norm (``token``), and per dimension to the
    microbatch's energy (``token-dim``); nothing is clipped.

    For a token vector ``x_t`` (C values) the noise on dimension ``d`` has standard deviation
    ``noise * |x_t| * sqrt(C) * q_d``: ``q_d = 1 / sqrt(C)`` (``token``: ``noise * |x_t|`` on
    every coordinate), or ``q_d`` the root mean square of ``x[:, d] / |x|`` over the tensor's
    tokens (``token-dim``). Either way ``sum_d q_d^2 = 1``, so a token's noise has expected norm
    ``noise * sqrt(C) * |x_t|`` under both. The scale is computed from the values without a
    graph: the noise is a constant added to the tensor.
    """

    def __init__(self, noise: float, generator: torch.Generator, *, per_dim: bool) -> None:
        if noise < 0:
            raise ValueError(f"need noise >= 0, got {noise}")
        self.noise, self.generator, self.per_dim = noise, generator, per_dim

    def scale(self, x: Tensor) -> Tensor:
        """(..., C) standard deviations of the noise on ``x`` (before the multiplier)."""
        x = x.detach().float()
        norms = x.norm(dim=-1, keepdim=True)  # (..., 1)
        if not self.per_dim:
            return norms.expand_as(x)
        share = (x / (norms + _EPS)).reshape(-1, x.shape[-1]).pow(2).mean(dim=0)  # (C,)
        return norms * (share * x.shape[-1]).sqrt()

    def __call__(self, x: Tensor) -> Tensor:
        if self.noise == 0:
            return x
        draw = torch.randn(x.shape, generator=self.generator, dtype=torch.float32)
        noise = draw * self.scale(x).cpu() * self.noise
        return x + noise.to(device=x.device, dtype=x.dtype)  # a constant


Channel = ChannelNoise | TokenNoise


class LinkDefence:
    """The device runtime's ``transform_up``: defends activations and output gradients.

    Called with the activation still in the head's graph, it returns a tensor in that graph
    (clip is differentiable, the noise a constant), so the head's backward runs through the
    clipping with the gradient the server computed for the very values it received.
    """

    def __init__(
        self,
        *,
        activations: Channel | None = None,
        gradients: Channel | None = None,
    ) -> None:
        self.channels: dict[Kind, Channel] = {}
        if activations is not None:
            self.channels[Kind.ACTIVATION] = activations
        if gradients is not None:
            self.channels[Kind.OUTPUT_GRAD] = gradients

    @classmethod
    def from_config(cls, cfg: PrivacyConfig, *, seed: int | None = None) -> LinkDefence | None:
        """The defence ``cfg`` asks for, or None when the stage link is undefended (default)."""
        if not cfg.link_defended:
            return None
        generator = torch.Generator().manual_seed(secrets.randbits(63) if seed is None else seed)
        act: Channel | None = None
        grad: Channel | None = None
        if cfg.mechanism != "clip":
            per_dim = cfg.mechanism == "token-dim"
            if cfg.activation_noise > 0:
                act = TokenNoise(cfg.activation_noise, generator, per_dim=per_dim)
            if cfg.gradient_noise > 0:
                grad = TokenNoise(cfg.gradient_noise, generator, per_dim=per_dim)
            return cls(activations=act, gradients=grad)
        if cfg.activation_clip > 0:
            act = ChannelNoise(cfg.activation_clip, cfg.activation_noise, generator)
        if cfg.gradient_clip > 0:
            grad = ChannelNoise(cfg.gradient_clip, cfg.gradient_noise, generator)
        return cls(activations=act, gradients=grad)

    def __call__(self, kind: Kind, tensor: Tensor) -> Tensor:
        channel = self.channels.get(kind)
        return tensor if channel is None else channel(tensor)
