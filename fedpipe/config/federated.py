"""``[federated]``: Flower rounds, devices, their data and profiles, aggregation and
asynchronous rounds."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fedpipe.config.checks import check, is_codec, list_entries
from fedpipe.config.codecs import codec_help, codec_token_groups
from fedpipe.config.cuts import parse_cuts
from fedpipe.config.profile_spec import parse_device_profile, split_specs

__all__ = [
    "AGGREGATIONS",
    "MAX_STALENESS",
    "ROBUST_STRATEGIES",
    "STALENESS_RULES",
    "FederatedConfig",
    "parse_profiles",
    "parse_staleness",
]

AGGREGATIONS = ("separate", "exact", "ffa", "stack")  # see fedpipe.lora.aggregation
# Flower strategies that combine adapters robustly (fedpipe.fl.strategies, fedpipe.lora.robust).
ROBUST_STRATEGIES = ("fedmedian", "fedtrimmedavg", "krum", "multikrum")

MAX_STALENESS = 100  # versions a StageServer admits sessions of (one adapter copy each)
STALENESS_RULES = ("constant", "poly", "hinge")


def parse_staleness(text: str) -> tuple[str, float, float]:
    """``federated.staleness``: ``constant``, ``poly:a`` or ``hinge:a,b`` -> (rule, a, b)."""
    name, _, args = str(text).strip().partition(":")
    numbers: list[float] = []
    try:
        numbers = [float(x) for x in args.split(",")] if args.strip() else []
    except ValueError:
        numbers = [-1.0]
    want = {"constant": 0, "poly": 1, "hinge": 2}.get(name)
    ok = want is not None and len(numbers) == want and all(x >= 0 for x in numbers)
    check(
        ok,
        f"federated.staleness {text!r} unknown: write constant, poly:A (weight 1/(1+s)^A) or "
        "hinge:A,B (1 up to B versions, then 1/(1 + A (s - B))), with A, B >= 0",
    )
    a = numbers[0] if numbers else 0.0
    b = numbers[1] if len(numbers) > 1 else 0.0
    return name, a, b


def parse_profiles(value: str | Sequence[Any], key: str = "federated.profiles") -> tuple[str, ...]:
    """Device profile entries (names and inline specs, :mod:`fedpipe.config.profile_spec`),
    each checked. A string is split as ``split_specs`` does (an inline spec keeps its commas);
    each entry of a list is one profile, commas and all."""
    if isinstance(value, str):
        entries = split_specs(value)
    else:
        entries = []
        for item in list_entries(value, key):
            parts = split_specs(item) if isinstance(item, str) else []
            check(
                len(parts) == 1,
                f"{key}: entry {item!r} is not one device profile (a name or one inline spec "
                "such as 'up=10,down=25,rtt=50ms')",
            )
            entries.append(parts[0])
    try:  # names and inline specs, checked here so a typo fails before any process starts
        for entry in entries:
            parse_device_profile(entry)
    except ValueError as exc:
        raise ValueError(f"{key}: {exc}") from None
    return tuple(entries)


@dataclass(frozen=True)
class FederatedConfig:
    """Flower rounds, devices and their data."""

    rounds: int = 3
    strategy: str = "fedavg"  # fedavg | fedprox | fedadam | ... | fedmedian | krum (fl.strategies)
    fraction_train: float = 1.0
    num_devices: int = 4
    # Device profiles cycled over devices: names and inline specs, a list or comma-separated
    profiles: tuple[str, ...] = ("jetson-ethernet", "rpi-wifi", "phone-lte", "laptop-wifi")
    # "H+T" cuts cycled over simulated devices, a list or comma-separated; none: the model's cut
    device_cuts: tuple[tuple[int, int], ...] = ()
    data: str = ""  # "" = the bundled public-domain corpus; else a file or folder
    partition: str = "by-source"  # iid | by-source | dirichlet
    device_blocks: int = 0  # > 0: each device keeps only this many blocks (small local data)
    dirichlet_alpha: float = 0.5
    eval_fraction: float = 0.1
    # > 0: each round's evaluation also generates greedy answers to this many held-out
    # prompt/completion examples and scores them as `fedpipe eval` does (exact match, contains)
    eval_generate: int = 0
    # Evaluate the global adapters (held-out loss, the round's record, a checkpoint) after
    # every `eval_every`-th round or version and after the last; 1: after every one. Async
    # versions come often and an evaluation on the server's host is not free.
    eval_every: int = 1
    proximal_mu: float = 0.01
    server_lr: float = 0.1
    # Robust strategies (fedmedian, fedtrimmedavg, krum, multikrum) run on both sides.
    trim_beta: float = 0.2  # fedtrimmedavg: the fraction cut from each end, per element
    malicious_devices: int = 0  # krum, multikrum: the hostile devices they assume (f)
    krum_select: int = 1  # multikrum: the updates it keeps and averages
    update_norm_bound: float = 0.0  # > 0: every update's L2 norm clipped to it, on both sides
    # How LoRA adapters are aggregated on both sides: separate | exact | ffa | stack
    # (fedpipe.lora.aggregation); exact and stack need a FedAvg-style strategy.
    aggregation: str = "separate"
    # Device adapters through Flower (fedpipe.fl.adapter_codec): fp32 sends them as they are;
    # another stage-link codec (int8, int4, ...) sends each device's update (its adapters minus
    # the round's global ones) in that codec, keeping what the codec dropped on the device for
    # its next round (error feedback).
    adapter_codec: str = "fp32"
    # The global adapters sent to the devices: fp32 as they are; in another codec, each device
    # trains from what it decoded and sends its update, added to the exact global adapters.
    adapter_downlink_codec: str = "fp32"
    # Round policy: wait up to connect_wait_s for num_devices to connect, then start with
    # those connected if there are at least min_devices; wait at most round_deadline_s for
    # replies, and (straggler_s > 0) at most straggler_s after the first device replied; say
    # whom the round waits for every report_every_s; stop the run (non-zero exit) once more
    # than max_failures devices have failed (-1: no limit).
    min_devices: int = 1
    connect_wait_s: float = 120.0
    round_deadline_s: float = 1800.0
    straggler_s: float = 0.0
    report_every_s: float = 30.0
    max_failures: int = -1
    # Buffered asynchronous rounds (fedpipe.fl.buffered): mode = async pushes work to every
    # free device and aggregates every `buffer` replies as they come, each aggregation a new
    # version (federated.rounds counts versions); a reply s versions stale weighs its examples
    # times `staleness` (constant | poly:a = 1/(1+s)^a | hinge:a,b) and one staler than
    # max_staleness is refused; the global moves by buffer_lr x the weighted mean update.
    mode: str = "sync"  # sync | async
    buffer: int = 2
    max_staleness: int = 4
    staleness: str = "poly:0.5"
    buffer_lr: float = 1.0

    def __post_init__(self) -> None:
        check(self.rounds >= 1, f"federated.rounds must be >= 1, got {self.rounds}")
        self._check_async()
        check(
            self.eval_every >= 1,
            f"federated.eval_every must be >= 1 (1: after every round), got {self.eval_every}",
        )
        check(
            self.eval_generate >= 0,
            f"federated.eval_generate must be >= 0 (0: off), got {self.eval_generate}",
        )
        check(
            1 <= self.min_devices <= self.num_devices,
            f"federated.min_devices must be in 1..num_devices ({self.num_devices}), "
            f"got {self.min_devices}",
        )
        check(
            self.round_deadline_s > 0
            and self.report_every_s > 0
            and self.connect_wait_s >= 0
            and self.straggler_s >= 0,
            "federated.round_deadline_s and report_every_s must be > 0, connect_wait_s and "
            "straggler_s >= 0",
        )
        check(self.max_failures >= -1, "federated.max_failures must be >= 0, or -1 (no limit)")
        check(
            self.device_blocks >= 0,
            f"federated.device_blocks must be >= 0 (0: the whole partition), "
            f"got {self.device_blocks}",
        )
        check(self.num_devices >= 1, f"federated.num_devices must be >= 1, got {self.num_devices}")
        check(0 < self.fraction_train <= 1, "federated.fraction_train must be in (0, 1]")
        check(
            self.partition in ("iid", "by-source", "dirichlet"),
            f"federated.partition must be iid, by-source or dirichlet, got {self.partition!r}",
        )
        check(
            self.aggregation in AGGREGATIONS,
            f"federated.aggregation {self.aggregation!r} unknown; choose one of "
            f"{', '.join(AGGREGATIONS)}",
        )
        check(
            0 <= self.trim_beta < 0.5,
            f"federated.trim_beta must be in [0, 0.5), got {self.trim_beta}",
        )
        check(
            self.malicious_devices >= 0 and self.krum_select >= 1,
            "federated.malicious_devices must be >= 0 and federated.krum_select >= 1",
        )
        check(
            self.update_norm_bound >= 0,
            f"federated.update_norm_bound must be >= 0 (0: off), got {self.update_norm_bound}",
        )
        check(
            self.strategy not in ROBUST_STRATEGIES
            and self.update_norm_bound == 0
            or self.aggregation in ("separate", "ffa"),
            f"federated.strategy = {self.strategy!r} with federated.update_norm_bound = "
            f"{self.update_norm_bound:g} combines adapters robustly, which "
            f"federated.aggregation = {self.aggregation!r} cannot (it folds a weighted mean); "
            "use separate or ffa",
        )
        check(
            self.aggregation not in ("exact", "stack") or self.strategy in ("fedavg", "fedprox"),
            f"federated.aggregation = {self.aggregation!r} averages the devices' models itself; "
            f"it needs federated.strategy fedavg or fedprox, got {self.strategy!r}",
        )
        for name in ("adapter_codec", "adapter_downlink_codec"):
            value = getattr(self, name)
            check(
                is_codec(value) and not codec_token_groups(value),
                f"federated.{name} {value!r} unknown; choose one of {codec_help()}, "
                "without t (an adapter has no tokens to group along)",
            )
        object.__setattr__(
            self, "device_cuts", parse_cuts(self.device_cuts, "federated.device_cuts")
        )
        object.__setattr__(self, "profiles", parse_profiles(self.profiles, "federated.profiles"))

    def _check_async(self) -> None:
        """mode = async: its own settings, and the settings it cannot hold, said by name."""
        check(
            self.mode in ("sync", "async"),
            f"federated.mode must be sync or async, got {self.mode!r}",
        )
        parse_staleness(self.staleness)
        check(
            0 <= self.max_staleness <= MAX_STALENESS,
            f"federated.max_staleness must be in 0..{MAX_STALENESS} (the StageServer keeps a "
            f"copy of the server adapter per version it admits), got {self.max_staleness}",
        )
        check(self.buffer_lr > 0, f"federated.buffer_lr must be > 0, got {self.buffer_lr:g}")
        if self.mode != "async":
            return
        check(
            1 <= self.buffer <= self.num_devices,
            f"federated.buffer = {self.buffer} with mode = async waits for more replies than "
            f"the {self.num_devices} devices (federated.num_devices) can ever send at once; "
            "set it in 1..num_devices",
        )
        cannot = [
            (self.strategy not in ("fedavg", "fedprox"), f"federated.strategy = {self.strategy}"),
            (self.aggregation != "separate", f"federated.aggregation = {self.aggregation}"),
            (self.update_norm_bound > 0, "federated.update_norm_bound > 0"),
            (self.adapter_codec != "fp32", f"federated.adapter_codec = {self.adapter_codec}"),
            (
                self.adapter_downlink_codec != "fp32",
                f"federated.adapter_downlink_codec = {self.adapter_downlink_codec}",
            ),
            (self.fraction_train < 1, "federated.fraction_train < 1"),
            (self.straggler_s > 0, "federated.straggler_s > 0"),
        ]
        for bad, what in cannot:
            check(
                not bad,
                f"federated.mode = async cannot hold {what}: it merges each update against "
                "its own version by the weighted mean (fedavg/fedprox, separate aggregation, "
                "fp32 adapters, every free device working); set it back or use mode = sync",
            )
