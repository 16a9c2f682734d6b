"""A device's own stage-link defences, written as a one-line spec.

A phone may want more protection than a lab box, so the device-side defences of ``[privacy]``
can be set per device: ``privacy.devices`` (simulations: entries cycled over the simulated
devices, as ``federated.device_cuts`` is) and ``fedpipe client --privacy`` (a deployed device).

A spec is comma-separated ``key=value`` pairs over the device-side keys below, applied on top of
the run's ``[privacy]``; ``off`` turns every device-side defence off, and an empty entry keeps
the run's. Entries of a list are separated by ``;``::

    privacy.devices = "off; mechanism=token,activation_noise=0.1,gradient_noise=0.1"

The adapters' DP (``adapter_dp``) and ``delta`` are the run's: the ServerApp applies and
reports them for all devices.
"""

from __future__ import annotations

import difflib
from typing import Any

__all__ = ["DEVICE_KEYS", "MECHANISMS", "OFF", "parse_privacy_spec", "parse_privacy_specs"]

# privacy.mechanism: how noise is calibrated (fedpipe.privacy.uplink)
MECHANISMS = ("clip", "token", "token-dim")
# The settings a device may choose for itself, and their types.
DEVICE_KEYS: dict[str, type] = {
    "mechanism": str,
    "activation_clip": float,
    "activation_noise": float,
    "gradient_clip": float,
    "gradient_noise": float,
    "decorrelation": float,
    "label_resample": float,
}
# What ``off`` stands for: no device-side defence at all.
OFF: dict[str, Any] = {
    "mechanism": "clip",
    "activation_clip": 0.0,
    "activation_noise": 0.0,
    "gradient_clip": 0.0,
    "gradient_noise": 0.0,
    "decorrelation": 0.0,
    "label_resample": 0.0,
}


def parse_privacy_spec(text: str, key: str) -> dict[str, Any]:
    """``"mechanism=token,activation_noise=0.1"`` -> the overrides it names ({} for "")."""
    text = text.strip()
    if not text:
        return {}
    if text.lower() == "off":
        return dict(OFF)
    out: dict[str, Any] = {}
    for part in text.split(","):
        name, sep, value = (s.strip() for s in part.partition("="))
        if not sep or not name or not value:
            raise ValueError(f"{key}: {part.strip()!r} is not key=value (in {text!r})")
        if name not in DEVICE_KEYS:
            close = difflib.get_close_matches(name, list(DEVICE_KEYS), n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"known: {', '.join(DEVICE_KEYS)}"
            raise ValueError(f"{key}: unknown key {name!r} in {text!r}; {hint}")
        if name in out:
            raise ValueError(f"{key}: {name!r} is given twice in {text!r}")
        if DEVICE_KEYS[name] is float:
            try:
                out[name] = float(value)
            except ValueError:
                raise ValueError(f"{key}: {name} must be a number, got {value!r}") from None
        else:
            if value not in MECHANISMS:
                raise ValueError(
                    f"{key}: mechanism must be one of {', '.join(MECHANISMS)}, got {value!r}"
                )
            out[name] = value
    return out


def parse_privacy_specs(text: str, key: str) -> tuple[dict[str, Any], ...]:
    """A ``;``-separated list of specs (``privacy.devices``); () when ``text`` is blank."""
    if not text.strip():
        return ()
    return tuple(parse_privacy_spec(entry, key) for entry in text.split(";"))
