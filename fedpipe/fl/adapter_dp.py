"""Differential privacy on the device adapters, through Flower's own fixed-clipping wrappers.

``privacy.adapter_dp``:

- ``server``: Flower's ``DifferentialPrivacyServerSideFixedClipping``. The ServerApp clips each
  device's update (its adapters minus the round's global ones) to ``adapter_clip`` and adds
  Gaussian noise of std ``adapter_noise * adapter_clip / devices`` to the average. The ServerApp
  sees each update unclipped: this protects the published global adapters (against other devices
  and whoever receives the model), not against the operator.
- ``client``: ``DifferentialPrivacyClientSideFixedClipping`` with Flower's ``fixedclipping_mod`` on
  the ClientApp: each device clips its own update before it leaves; the noise is still added on
  the server, so the guarantee is again about the aggregate.

Flower's wrappers skip a round's aggregation when any reply is an error: with adapter DP on, a
failed device costs its round's update (fedpipe's failure-tolerant rounds otherwise average the
rest). Flower does not account this guarantee unless given an accountant; fedpipe logs Flower's
own messages.
"""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp.mod import fixedclipping_mod
from flwr.clientapp.typing import ClientAppCallable
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideFixedClipping,
    Strategy,
)
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM

from fedpipe.config import PrivacyConfig

__all__ = ["adapter_clipping_mod", "with_adapter_dp"]


def with_adapter_dp(strategy: Strategy, cfg: PrivacyConfig, *, sampled_devices: int) -> Strategy:
    """``strategy`` wrapped in Flower's fixed-clipping DP as ``cfg.adapter_dp`` says (or as is)."""
    if cfg.adapter_dp == "off":
        return strategy
    wrapper = (
        DifferentialPrivacyServerSideFixedClipping
        if cfg.adapter_dp == "server"
        else DifferentialPrivacyClientSideFixedClipping
    )
    return wrapper(
        strategy,
        noise_multiplier=cfg.adapter_noise,
        clipping_norm=cfg.adapter_clip,
        num_sampled_clients=max(1, sampled_devices),
    )


def adapter_clipping_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Flower's ``fixedclipping_mod`` when the round asks for client-side clipping, else a no-op.

    The client-side DP wrapper puts the clipping norm in the train config; runs without it (DP
    off, or server-side clipping) pass straight through.
    """
    if any(KEY_CLIPPING_NORM in record for record in msg.content.config_records.values()):
        return fixedclipping_mod(msg, context, call_next)
    return call_next(msg, context)
