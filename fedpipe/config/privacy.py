"""``[privacy]``: defences on what a device sends, and each device's own overrides."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from fedpipe.config.checks import check, list_entries
from fedpipe.config.privacy_spec import MECHANISMS, parse_privacy_spec

__all__ = ["PrivacyConfig", "parse_privacy_devices"]


def parse_privacy_devices(value: Any, key: str = "privacy.devices") -> tuple[str, ...]:
    """``"off; ; decorrelation=1"`` or ``["off", "", "decorrelation=1"]`` -> the specs, each
    checked (:func:`~fedpipe.config.privacy_spec.parse_privacy_spec`); an empty entry keeps
    the run's defences, a blank string (or one empty entry) means none."""
    if isinstance(value, str):
        entries = tuple(e.strip() for e in value.split(";")) if value.strip() else ()
    else:
        items = list_entries(value, key)
        for item in items:
            check(
                isinstance(item, str) and ";" not in item,
                f"{key}: entry {item!r} is not one device's spec (key=value pairs joined by ',')",
            )
        entries = tuple(e.strip() for e in items)
    for entry in entries:
        parse_privacy_spec(entry, key)
    return () if entries == ("",) else entries


@dataclass(frozen=True)
class PrivacyConfig:
    """Defences on what a device sends (fedpipe.privacy); all off by default.

    Stage link, by ``mechanism``:

    - ``clip``: each token's vector of the activations (and of the output gradients) a device
      sends up is clipped to L2 norm ``*_clip``, then Gaussian noise of standard deviation
      ``*_noise * *_clip`` is added to every coordinate. The (epsilon, delta) guarantee is per
      sample (one training sequence) and is reported per device and round.
    - ``token``: no clipping; every coordinate of a token's vector gets Gaussian noise of
      standard deviation ``*_noise`` times the token's own norm (the same signal-to-noise ratio
      for every token). An empirical defence: no (epsilon, delta).
    - ``token-dim``: as ``token``, with the same noise energy spread over the dimensions as the
      microbatch's own energy is (a dimension that carries more signal gets more noise).

    ``decorrelation`` > 0 trains the device's head to hide which token it read: a distance-
    correlation penalty (NoPeek) between the tokens and the activations sent up, added to the
    task loss with this weight. ``label_resample`` = r: the gradient sent up is taken against
    labels a share r of which are drawn from the device's own prediction (randomized response;
    unbiased, the tail trains on the true labels). ``devices``: per-device overrides of the
    device-side keys (fedpipe.config.privacy_spec). Adapters: Flower's fixed-clipping DP
    wrappers (``adapter_dp`` = server | client) with ``adapter_noise`` and ``adapter_clip``.
    """

    mechanism: str = "clip"  # clip | token | token-dim: how the link's noise is calibrated
    activation_clip: float = 0.0  # per-token L2 norm bound of activations sent up; 0 = off
    activation_noise: float = 0.0  # std = noise * clip (clip) or * the token's norm (token)
    gradient_clip: float = 0.0  # per-token L2 norm bound of output gradients sent up; 0 = off
    gradient_noise: float = 0.0  # as activation_noise, on the output gradients
    decorrelation: float = 0.0  # weight of the head's distance-correlation penalty; 0 = off
    label_resample: float = 0.0  # share of positions whose upward gradient uses a drawn label
    # Per-device overrides, cycled over simulated devices: a list, or specs separated by ";"
    # (an empty entry: the run's own); none: every device runs the run's
    devices: tuple[str, ...] = ()
    delta: float = 1e-5  # the delta of the reported (epsilon, delta)
    adapter_dp: str = "off"  # off | server | client: Flower's fixed-clipping DP on adapters
    adapter_noise: float = 1.0  # Flower's noise_multiplier (with adapter_dp)
    adapter_clip: float = 1.0  # Flower's clipping_norm of a device's adapter update

    def __post_init__(self) -> None:
        check(
            self.mechanism in MECHANISMS,
            f"privacy.mechanism must be one of {', '.join(MECHANISMS)}, got {self.mechanism!r}",
        )
        for name in ("activation", "gradient"):
            clip, noise = getattr(self, f"{name}_clip"), getattr(self, f"{name}_noise")
            check(clip >= 0, f"privacy.{name}_clip must be >= 0 (0 = off), got {clip}")
            check(noise >= 0, f"privacy.{name}_noise must be >= 0, got {noise}")
            if self.mechanism == "clip":
                check(
                    noise == 0 or clip > 0,
                    f"privacy.{name}_noise = {noise} needs privacy.{name}_clip > 0: the noise "
                    "is calibrated to the clipping norm (or set privacy.mechanism = token)",
                )
            else:
                check(
                    clip == 0,
                    f"privacy.mechanism = {self.mechanism} scales the noise to each token's own "
                    f"norm and clips nothing, but privacy.{name}_clip = {clip}: set it to 0",
                )
        check(
            self.decorrelation >= 0,
            f"privacy.decorrelation must be >= 0 (0 = off), got {self.decorrelation}",
        )
        check(
            0 <= self.label_resample < 1,
            f"privacy.label_resample must be in [0, 1) (0 = off), got {self.label_resample}",
        )
        object.__setattr__(self, "devices", parse_privacy_devices(self.devices))
        for entry in self.device_specs:
            try:
                replace(self, devices=(), **entry)
            except ValueError as exc:
                raise ValueError(f"privacy.devices entry {entry}: {exc}") from None
        check(0 < self.delta < 1, f"privacy.delta must be in (0, 1), got {self.delta}")
        check(
            self.adapter_dp in ("off", "server", "client"),
            f"privacy.adapter_dp must be off, server or client, got {self.adapter_dp!r}",
        )
        check(
            self.adapter_noise >= 0, f"privacy.adapter_noise must be >= 0, got {self.adapter_noise}"
        )
        check(self.adapter_clip > 0, f"privacy.adapter_clip must be > 0, got {self.adapter_clip}")

    @property
    def link_defended(self) -> bool:
        """Whether anything is done to the tensors a device sends up (noise or clipping)."""
        if self.mechanism == "clip":
            return self.activation_clip > 0 or self.gradient_clip > 0
        return self.activation_noise > 0 or self.gradient_noise > 0

    def for_device(self, spec: str | dict[str, Any]) -> PrivacyConfig:
        """The run's settings with a device's own overrides (a spec string or parsed)."""
        entry = parse_privacy_spec(spec, "--privacy") if isinstance(spec, str) else spec
        return replace(self, devices=(), **entry) if entry else self

    @property
    def device_specs(self) -> tuple[dict[str, Any], ...]:
        """``devices`` parsed: each device's overrides ({} = the run's own)."""
        return tuple(parse_privacy_spec(entry, "privacy.devices") for entry in self.devices)
