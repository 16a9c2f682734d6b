"""Splitting a causal LM into stages that hold only their own weights (LoRA: fedpipe.lora)."""

from fedpipe.split.agreement import SplitLike, SplitTerms, check_agreement
from fedpipe.split.build import build_device_stages, build_stage, stage_blocks, stage_file_keys
from fedpipe.split.memory import device_memory_report
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
    "IGNORE_INDEX",
    "HeadStage",
    "MiddleStage",
    "ServerLossStage",
    "SplitMode",
    "SplitLike",
    "SplitPlan",
    "SplitTerms",
    "TailStage",
    "build_device_stages",
    "build_stage",
    "check_agreement",
    "device_memory_report",
    "plan_split",
    "shifted_loss_sum",
    "sliding_window",
    "stage_blocks",
    "stage_file_keys",
]
