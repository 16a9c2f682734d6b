"""Splitting a causal LM into stages that hold only their own weights (LoRA: fedpipe.lora)."""

from fedpipe.split.agreement import SplitLike, SplitTerms, check_agreement
from fedpipe.split.build import build_device_stages, build_stage, stage_blocks, stage_file_keys
from fedpipe.split.layout import SplitLayout, SplitMode, split_layout
from fedpipe.split.loss import chunked_loss_sum
from fedpipe.split.memory import device_memory_report, device_param_report
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
    "SplitLayout",
    "SplitTerms",
    "TailStage",
    "build_device_stages",
    "build_stage",
    "check_agreement",
    "chunked_loss_sum",
    "device_memory_report",
    "device_param_report",
    "split_layout",
    "shifted_loss_sum",
    "sliding_window",
    "stage_blocks",
    "stage_file_keys",
]
