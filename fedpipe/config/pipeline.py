"""``[pipeline]``: microbatches, schedules, codecs and the device's planner."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fedpipe.config.checks import check, is_codec, split_entries
from fedpipe.config.codecs import codec_bits, codec_help

__all__ = ["FREEZE_MODES", "SCHEDULE_NAMES", "PipelineConfig", "parse_plan_codecs"]

# The device schedules (fedpipe.edge.schedules builds them; a test keeps the two in step).
SCHEDULE_NAMES = ("sequential", "gpipe", "1f1b", "greedy")
FREEZE_MODES = ("off", "progressive")  # pipeline.freeze (fedpipe.fl.freeze)


def parse_plan_codecs(value: Any, key: str = "pipeline.plan_codecs") -> tuple[str, ...]:
    """``"fp32, int8"`` or ``["fp32", "int8"]`` -> ("fp32", "int8"), each a codec name."""
    entries = split_entries(value, key, "codec name")
    bad = [c for c in entries if not is_codec(c)]
    text = value.strip() if isinstance(value, str) else ",".join(entries)
    check(not bad, f"{key} {text!r}: unknown {bad}; list some of {codec_help()}")
    return entries


@dataclass(frozen=True)
class PipelineConfig:
    """How a step is cut into microbatches and scheduled, and how tensors are encoded."""

    microbatches: int = 4
    schedule: str = "greedy"  # sequential | gpipe | 1f1b | greedy
    max_in_flight: int = 0  # 0 = no cap (greedy) or min(M, 4) (1f1b)
    uplink_codec: str = "fp32"
    downlink_codec: str = "fp32"
    gradient_codec: str = ""  # "" = each direction's codec; e.g. int8 activations, bf16 grads
    error_feedback: bool = False  # gradients: each side adds what its last send lost to the next
    stochastic_rounding: bool = False  # int4/int2 gradients round stochastically (unbiased)
    delta: bool = False  # activations: send the change since the sample's last send (AQ-SGD)
    delta_cache_mb: float = 64.0  # with delta: decoded samples kept, on both sides
    delta_resume: bool = True  # with delta: the caches outlive the round (false: one session)
    delta_codec: str = ""  # with delta: codec of activations sent all as differences ("": uplink's)
    timeout_s: float = 120.0
    # false: frozen-device mode: the device's head and tail train nothing, the head runs
    # forward only and the server sends no input gradient down (LoRA trains on the server).
    device_trains: bool = True
    # true: the head's forward keeps no graph; its backward recomputes it (device memory:
    # per microbatch in flight only the head's output is stashed, not its activations).
    recompute_head: bool = False
    # fixed: the settings above; auto: each device measures its compute and link and picks its
    # microbatches, schedule and codecs (fedpipe.edge.planner), among plan_codecs (lossy only if
    # listed), re-planning when the link's RTT or a rate moves by more than replan_drift;
    # memory_cap_mb (0: none) bounds the device's parameters plus stashed activations.
    plan: str = "fixed"
    plan_codecs: tuple[str, ...] = ("fp32",)  # a list or comma-separated
    replan_drift: float = 0.25
    memory_cap_mb: float = 0.0
    # off, or progressive: after each round the ServerApp freezes the lowest blocks whose
    # adapters have converged, on the devices and the StageServer (fedpipe.fl.freeze); a
    # device whose head blocks are all frozen runs its head forward only from the next round.
    freeze: str = "off"
    # progressive: a block has converged when its adapter's relative change in a round fell to
    # this fraction of the largest change it made in a round so far.
    freeze_ratio: float = 0.5
    # progressive: the first decision is taken after this round, so blocks freeze from round
    # freeze_after + 1 on at the earliest.
    freeze_after: int = 2
    # progressive: at most this fraction of the model's blocks ever freeze (rounded down).
    freeze_max: float = 0.5

    def __post_init__(self) -> None:
        check(
            self.microbatches >= 1, f"pipeline.microbatches must be >= 1, got {self.microbatches}"
        )
        check(
            self.schedule in SCHEDULE_NAMES,
            f"pipeline.schedule {self.schedule!r} unknown; "
            f"choose one of {', '.join(SCHEDULE_NAMES)}",
        )
        for name in ("uplink_codec", "downlink_codec", "gradient_codec", "delta_codec"):
            value = getattr(self, name)
            check(
                is_codec(value) or (name in ("gradient_codec", "delta_codec") and value == ""),
                f"pipeline.{name} {value!r} unknown; choose one of {codec_help()}",
            )
        check(
            not self.stochastic_rounding or self.plan == "auto" or self._low_bit_gradients(),
            "pipeline.stochastic_rounding applies to int4/int2 gradients, but they go as "
            f"{self.gradient_codec or self.uplink_codec} up and "
            f"{self.gradient_codec or self.downlink_codec} down; set pipeline.gradient_codec "
            "to int4 or int2, or turn stochastic_rounding off",
        )
        check(
            self.delta_cache_mb > 0,
            f"pipeline.delta_cache_mb must be > 0, got {self.delta_cache_mb}; to turn delta "
            "coding off set pipeline.delta = false",
        )
        check(
            self.plan in ("fixed", "auto"),
            f"pipeline.plan must be fixed or auto, got {self.plan!r}",
        )
        object.__setattr__(self, "plan_codecs", parse_plan_codecs(self.plan_codecs))
        check(self.replan_drift > 0, f"pipeline.replan_drift must be > 0, got {self.replan_drift}")
        check(
            self.memory_cap_mb >= 0,
            f"pipeline.memory_cap_mb must be >= 0, got {self.memory_cap_mb}",
        )
        check(
            self.freeze in FREEZE_MODES,
            f"pipeline.freeze must be {' or '.join(FREEZE_MODES)}, got {self.freeze!r}",
        )
        check(
            0 < self.freeze_ratio < 1,
            f"pipeline.freeze_ratio must be in (0, 1), got {self.freeze_ratio}",
        )
        check(
            self.freeze_after >= 1, f"pipeline.freeze_after must be >= 1, got {self.freeze_after}"
        )
        check(
            0 < self.freeze_max < 1,
            f"pipeline.freeze_max must be in (0, 1) (a fraction of the model's blocks), "
            f"got {self.freeze_max}",
        )

    def _low_bit_gradients(self) -> bool:
        """Whether the gradients go as int4/int2 in at least one direction."""
        ups = self.gradient_codec or self.uplink_codec
        downs = self.gradient_codec or self.downlink_codec
        return codec_bits(ups) > 0 or codec_bits(downs) > 0

    @property
    def codec_choices(self) -> tuple[str, ...]:
        """``plan_codecs`` as a tuple; fp32 (lossless) is always a choice."""
        return tuple(dict.fromkeys(["fp32", *self.plan_codecs]))
