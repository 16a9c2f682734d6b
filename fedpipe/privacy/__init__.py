"""Defences on what a device sends, and what they guarantee (threat model: docs/privacy.md)."""

from fedpipe.privacy.accountant import LinkAccountant, releases_so_far, sample_noise_multiplier
from fedpipe.privacy.link import ChannelNoise, LinkDefence, clip_per_token

__all__ = [
    "ChannelNoise",
    "LinkAccountant",
    "LinkDefence",
    "clip_per_token",
    "releases_so_far",
    "sample_noise_multiplier",
]
