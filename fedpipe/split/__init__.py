"""Splitting a causal LM into stages that hold only their own weights, with LoRA adapters."""

from fedpipe.split.adapters import GLOBAL_ADAPTER, AdapterBank
from fedpipe.split.agreement import SplitLike, SplitTerms, check_agreement
from fedpipe.split.build import build_device_stages, build_stage, stage_blocks, stage_file_keys
from fedpipe.split.lora import (
    LoraSettings,
    apply_lora,
    average_state_dicts,
    global_name,
    load_lora_state_dict,
    lora_parameters,
    lora_state_dict,
    set_active_adapter,
)
from fedpipe.split.memory import device_memory_report
from fedpipe.split.multilora import BatchedAdapterBank, Group, adapter_bank, batchable
from fedpipe.split.plan import SplitMode, SplitPlan, plan_split
from fedpipe.split.stages import (
    IGNORE_INDEX,
    HeadStage,
    MiddleStage,
    ServerLossStage,
    TailStage,
    shifted_loss_sum,
    sliding_window,
)

__all__ = [
    "GLOBAL_ADAPTER",
    "IGNORE_INDEX",
    "AdapterBank",
    "BatchedAdapterBank",
    "Group",
    "HeadStage",
    "LoraSettings",
    "MiddleStage",
    "ServerLossStage",
    "SplitMode",
    "SplitLike",
    "SplitPlan",
    "SplitTerms",
    "TailStage",
    "adapter_bank",
    "apply_lora",
    "average_state_dicts",
    "batchable",
    "build_device_stages",
    "build_stage",
    "check_agreement",
    "device_memory_report",
    "global_name",
    "load_lora_state_dict",
    "lora_parameters",
    "lora_state_dict",
    "plan_split",
    "set_active_adapter",
    "shifted_loss_sum",
    "sliding_window",
    "stage_blocks",
    "stage_file_keys",
]
