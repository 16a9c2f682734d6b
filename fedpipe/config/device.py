"""``[device]``: what each device holds of the model and computes in."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fedpipe.config.checks import check, list_entries

__all__ = ["DEVICE_DTYPES", "DEVICE_WEIGHTS", "DeviceConfig", "parse_device_weights"]

# device.weights: how a device stores its frozen weights (fedpipe.split.quant)
DEVICE_WEIGHTS = ("fp32", "bf16", "int8", "int4")
# device.dtype: what the device's head and tail compute in (fedpipe.edge.runtime)
DEVICE_DTYPES = ("fp32", "bf16")


def parse_device_weights(
    value: str | Sequence[Any], key: str = "device.weights"
) -> tuple[str, ...]:
    """``"int4, fp32"`` or ``["int4", "fp32"]`` -> ("int4", "fp32"); each one of
    :data:`DEVICE_WEIGHTS`."""
    if isinstance(value, str):
        entries = tuple(w.strip() for w in value.split(",") if w.strip())
    else:
        entries = tuple(w.strip() if isinstance(w, str) else w for w in list_entries(value, key))
    check(bool(entries), f"{key} is empty; choose one of {', '.join(DEVICE_WEIGHTS)}")
    for entry in entries:
        check(
            entry in DEVICE_WEIGHTS,
            f"{key} {entry!r} unknown; choose one of {', '.join(DEVICE_WEIGHTS)}",
        )
    return entries


@dataclass(frozen=True)
class DeviceConfig:
    """What each device holds of the model, whatever the server runs (fedpipe.split.quant)."""

    # How a device stores its frozen token embedding, block linears and LM head: fp32 as read,
    # or bf16, int8 (per output channel) or int4 (groups of 64, two per byte), dequantized
    # slab by slab into fp32 compute; LoRA, its gradients and AdamW stay fp32. Several, a list
    # or comma-separated ("int4,fp32"), are dealt to simulated devices in turn; `fedpipe client
    # --weights` sets a deployed device's own.
    weights: tuple[str, ...] = ("fp32",)
    # What the head's and tail's forwards (and so their backwards) compute in: fp32, or bf16
    # under torch.autocast (CPUs with native bf16 matmuls: AMX, avx512_bf16). LoRA, its
    # gradients, AdamW, the loss and the tensors sent to the server stay fp32.
    dtype: str = "fp32"

    def __post_init__(self) -> None:
        object.__setattr__(self, "weights", parse_device_weights(self.weights))
        check(
            self.dtype in DEVICE_DTYPES,
            f"device.dtype {self.dtype!r} unknown; choose one of {', '.join(DEVICE_DTYPES)}",
        )

    @property
    def stored(self) -> str:
        """The storage of a device built from this config: the first entry (a device's own
        config carries one; ``FedpipeConfig.with_device_weights`` makes it)."""
        return self.weights[0]
