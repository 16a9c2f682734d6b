"""Defences on what a device sends, and what they guarantee (threat model: docs/privacy.md)."""

from fedpipe.privacy.accountant import LinkAccountant, releases_so_far, sample_noise_multiplier
from fedpipe.privacy.decorrelation import Decorrelation, distance_correlation
from fedpipe.privacy.labels import LabelResample
from fedpipe.privacy.uplink import ChannelNoise, LinkDefence, TokenNoise, clip_per_token

__all__ = [
    "ChannelNoise",
    "Decorrelation",
    "LabelResample",
    "LinkAccountant",
    "LinkDefence",
    "TokenNoise",
    "clip_per_token",
    "distance_correlation",
    "releases_so_far",
    "sample_noise_multiplier",
]
