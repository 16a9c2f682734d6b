"""LoRA adapters: the math on a stage, the two adapter banks a server holds, and aggregation.

- :mod:`~fedpipe.lora.base`: settings, applying LoRA to a stage, state dicts, :class:`Group`;
- :mod:`~fedpipe.lora.peft_bank`: :class:`AdapterBank`, peft's adapters, one session at a time;
- :mod:`~fedpipe.lora.batched_bank`: :class:`BatchedAdapterBank`, every session in one call
  (its forward in :mod:`~fedpipe.lora.batched_blocks`, backward in
  :mod:`~fedpipe.lora.batched_backward`, grouped GPU kernels in :mod:`~fedpipe.lora.kernels`);
- :mod:`~fedpipe.lora.aggregation`: how adapters of many devices become one.
"""

from fedpipe.lora.base import (
    Group,
    LoraSettings,
    apply_lora,
    average_state_dicts,
    global_name,
    load_lora_state_dict,
    lora_parameters,
    lora_settings,
    lora_state_dict,
    set_active_adapter,
)
from fedpipe.lora.batched_bank import BatchedAdapterBank, adapter_bank, batchable
from fedpipe.lora.peft_bank import GLOBAL_ADAPTER, AdapterBank

__all__ = [
    "GLOBAL_ADAPTER",
    "AdapterBank",
    "BatchedAdapterBank",
    "Group",
    "LoraSettings",
    "adapter_bank",
    "apply_lora",
    "average_state_dicts",
    "batchable",
    "global_name",
    "load_lora_state_dict",
    "lora_parameters",
    "lora_settings",
    "lora_state_dict",
    "set_active_adapter",
]
