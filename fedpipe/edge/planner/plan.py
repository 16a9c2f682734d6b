"""The per-device planner: from measured figures to the plan with the shortest predicted step.

A pure function of data (no torch, no I/O), so tests drive it with synthetic figures whose best
plan is known. Figures come from :mod:`fedpipe.edge.planner.measure`: the device's compute per
microbatch size, the server's, the link's RTT and each direction's bandwidth as the stage link
itself carries them, and each codec's message size and cost. The options are what the run
allows: microbatch counts that divide the batch, schedules, codecs (lossy ones only when the
run's settings list them) and the cuts the server offers. Each candidate is priced with
:func:`fedpipe.edge.planner.bound.predict_step`, the model the pipeline benchmark judges itself by,
so the planner and the benchmark never disagree about what a plan should cost.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from itertools import product

from fedpipe.edge.planner.bound import Components, in_flight_cap, link_occupancy, predict_step

__all__ = [
    "LinkFigures",
    "Measured",
    "OpTimes",
    "Options",
    "StepPlan",
    "divisors",
    "link_drift",
    "plan_step",
    "figures_for_cut",
    "with_frozen_head",
]

LOSSLESS = "fp32"
# Schedules in order of preference when predictions tie (greedy adapts to what is ready).
PREFERENCE = ("greedy", "gpipe", "1f1b", "sequential")


@dataclass(frozen=True)
class OpTimes:
    """Device seconds for one microbatch of one size: head forward, tail (forward + loss +
    backward; 0 in the two-part split), head backward."""

    head_forward: float
    tail: float
    head_backward: float


@dataclass(frozen=True)
class LinkFigures:
    """The stage link as measured through it: round trip of a tiny message, Mbit/s each way."""

    rtt_s: float
    up_mbps: float
    down_mbps: float

    def __str__(self) -> str:
        rates = f"up {self.up_mbps:.1f} / down {self.down_mbps:.1f} Mbit/s"
        return f"RTT {self.rtt_s * 1e3:.1f} ms, {rates}"


@dataclass(frozen=True)
class Measured:
    """What one device measured for one cut; keys ``rows`` are sequences per microbatch.

    ``server`` holds the server's ``(forward, backward)`` seconds per microbatch size,
    ``message_bytes`` the encoded size of one boundary tensor per ``(codec, rows)``, and
    ``codec_s`` the device's encode + decode seconds of one such tensor (the server is charged
    the same). ``stash_bytes`` is what one live microbatch holds on the device until its head
    backward; ``memory_budget_bytes`` (0: no cap) is what stashed microbatches may use.
    """

    batch_size: int
    device: Mapping[int, OpTimes]
    server: Mapping[int, tuple[float, float]]
    link: LinkFigures
    message_bytes: Mapping[tuple[str, int], int]
    codec_s: Mapping[tuple[str, int], float] = field(default_factory=dict)
    stash_bytes: Mapping[int, int] = field(default_factory=dict)
    memory_budget_bytes: int = 0
    c_opt: float = 0.0
    s_opt: float = 0.0
    split: str = "u"
    # The head runs forward only (frozen-device mode, or pipeline.freeze froze its blocks): no
    # head backward, and the server's gradient reply carries no tensor.
    frozen_head: bool = False


def with_frozen_head(figures: Measured) -> Measured:
    """``figures`` once the head trains nothing: no head backward, no gradient down."""
    device = {b: replace(ops, head_backward=0.0) for b, ops in figures.device.items()}
    return replace(figures, device=device, frozen_head=True)


@dataclass(frozen=True)
class Options:
    """What the planner may choose among (every field non-empty)."""

    microbatches: tuple[int, ...]
    schedules: tuple[str, ...] = PREFERENCE
    codecs: tuple[str, ...] = (LOSSLESS,)
    max_in_flight: int = 0  # the run's cap (0: none); 1f1b's k
    # Only this (activation, gradient) pair: a session already open with these codecs.
    codec_pair: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        for name in ("microbatches", "schedules", "codecs"):
            if not getattr(self, name):
                raise ValueError(f"planner Options.{name} is empty: give at least one choice")


@dataclass(frozen=True)
class StepPlan:
    """A device's choice and the step time the model predicts for it."""

    cut: str
    microbatches: int
    schedule: str
    codec: str  # activations, both directions
    gradient_codec: str  # gradients, both directions
    max_in_flight: int  # 0: the schedule's own
    predicted_s: float
    binding: str  # the term of the model that binds
    link: LinkFigures | None = None  # what the plan was made for (drift is judged against it)

    def __str__(self) -> str:
        cap = f", <= {self.max_in_flight} live" if self.max_in_flight else ""
        grads = f"/{self.gradient_codec}" if self.gradient_codec != self.codec else ""
        return (
            f"{self.cut} M={self.microbatches} {self.schedule}{cap} {self.codec}{grads}: "
            f"predicted {self.predicted_s:.3f} s ({self.binding})"
        )

    def as_dict(self) -> dict[str, str | int | float]:
        """Flat, JSON- and Flower-ready (the link as three numbers)."""
        out: dict[str, str | int | float] = {
            k: v for k, v in asdict(self).items() if k != "link" and v is not None
        }
        out["predicted_s"] = round(self.predicted_s, 4)
        if self.link is not None:
            out |= {
                "link_rtt_s": round(self.link.rtt_s, 5),
                "link_up_mbps": round(self.link.up_mbps, 2),
                "link_down_mbps": round(self.link.down_mbps, 2),
            }
        return out


def figures_for_cut(
    figures: Measured,
    *,
    current: tuple[int, int],
    cut: tuple[int, int],
    num_layers: int,
    block: Mapping[int, tuple[float, float]],
    memory_budget_bytes: int,
) -> Measured:
    """``figures`` (measured at cut ``current``) moved to ``cut`` block by block.

    ``block`` is one device block's (forward, backward) seconds per microbatch size: each
    block the cut adds to the head costs that in the head's forward and backward, each one it
    adds to the tail both in the tail's pass. The server's time scales with its share of the
    blocks; the stash with the head's blocks (the embedding counted as one). The memory budget
    is the cap less the cut's own parameters (the caller's figure).
    """
    dh, dt = cut[0] - current[0], cut[1] - current[1]
    device = {}
    for rows, ops in figures.device.items():
        f, b = block.get(rows, (0.0, 0.0))
        tail = 0.0 if figures.split == "two" else max(0.0, ops.tail + dt * (f + b))
        device[rows] = OpTimes(
            max(0.0, ops.head_forward + dh * f), tail, max(0.0, ops.head_backward + dh * b)
        )
    share = (num_layers - sum(cut)) / max(1, num_layers - sum(current))
    server = {rows: (sf * share, sb * share) for rows, (sf, sb) in figures.server.items()}
    stash = {r: int(v * (cut[0] + 1) / (current[0] + 1)) for r, v in figures.stash_bytes.items()}
    return replace(
        figures,
        device=device,
        server=server,
        stash_bytes=stash,
        memory_budget_bytes=memory_budget_bytes,
    )


def divisors(n: int) -> tuple[int, ...]:
    """Microbatch counts that cut ``n`` sequences into equal microbatches."""
    return tuple(m for m in range(1, n + 1) if n % m == 0)


def components(figures: Measured, rows: int, codec: str, gradient_codec: str) -> Components:
    """The bound's components for microbatches of ``rows`` sequences and the given codecs."""
    ops, (s_f, s_b), link = figures.device[rows], figures.server[rows], figures.link
    act, grad = figures.message_bytes[codec, rows], figures.message_bytes[gradient_codec, rows]
    ca = figures.codec_s.get((codec, rows), 0.0)
    cg = figures.codec_s.get((gradient_codec, rows), 0.0)
    two = figures.split == "two"
    # A frozen head gets no gradient: nothing to decode, run or carry for it (the reply's
    # header alone, a few bytes, is left out).
    down_grad = 0 if figures.frozen_head else grad
    cb = 0.0 if figures.frozen_head else cg
    # The device encodes its activation (F) and gradient (T), decodes the output (T) and the
    # head's gradient (B); the server decodes and encodes one of each per pass.
    return Components(
        c_f=ops.head_forward + ca / 2,
        c_t=0.0 if two else ops.tail + (ca + cg) / 2,
        c_b=ops.head_backward + cb / 2,
        s_f=s_f + (0.0 if two else ca),
        s_b=s_b + (ca if two else (cg + cb) / 2),
        tau_up=link_occupancy(act, link.up_mbps),
        tau_down=link_occupancy(act, link.down_mbps),
        tau_up_grad=link_occupancy(grad, link.up_mbps),
        tau_down_grad=link_occupancy(down_grad, link.down_mbps),
        lat_up=link.rtt_s / 2,
        lat_down=link.rtt_s / 2,
        c_opt=figures.c_opt,
        s_opt=figures.s_opt,
        split=figures.split,
    )


def _codec_pairs(codecs: Sequence[str]) -> list[tuple[str, str]]:
    """(activation, gradient) codecs; gradients keep 16 bits or more (they tolerate integer
    quantisation less: int8 and below only with error feedback, which the planner leaves to the
    run's own settings)."""
    grads = [c for c in codecs if not c.startswith("int")] or [LOSSLESS]
    return [(a, g) for a in codecs for g in grads]


def _fit_memory(figures: Measured, schedule: str, m: int, rows: int, cap: int) -> int | None:
    """The in-flight cap that keeps stashed microbatches in the budget (0: none needed), or
    None when the schedule cannot fit (even one live microbatch, or a fixed-depth schedule)."""
    budget, stash = figures.memory_budget_bytes, figures.stash_bytes.get(rows, 0)
    live = in_flight_cap(schedule, m, cap or None)
    if budget <= 0 or live * stash <= budget:
        return cap
    if schedule != "greedy":
        return None
    fits = budget // stash if stash else m
    return int(fits) if fits >= 1 else None


def _candidates(cut: str, figures: Measured, options: Options) -> list[StepPlan]:
    plans = []
    counts = [m for m in options.microbatches if figures.batch_size % m == 0]
    pairs = [options.codec_pair] if options.codec_pair else _codec_pairs(options.codecs)
    for m, schedule, (codec, grad) in product(counts, options.schedules, pairs):
        rows = figures.batch_size // m
        if rows not in figures.device or rows not in figures.server:
            continue  # not measured at this size
        cap = _fit_memory(figures, schedule, m, rows, options.max_in_flight)
        if cap is None:
            continue
        comp = components(figures, rows, codec, grad)
        t, term = predict_step(comp, m, schedule=schedule, max_in_flight=cap or None)
        plans.append(StepPlan(cut, m, schedule, codec, grad, cap, t, term, figures.link))
    return plans


def _rank(plan: StepPlan, options: Options) -> tuple[float, int, int, int]:
    """Shortest predicted step; ties go to the preferred schedule, then lossless, then fewer
    microbatches (less per-message overhead)."""
    order = {name: i for i, name in enumerate(PREFERENCE)}
    lossy = int(plan.codec != LOSSLESS) + int(plan.gradient_codec != LOSSLESS)
    return (round(plan.predicted_s, 9), order.get(plan.schedule, 9), lossy, plan.microbatches)


def plan_step(measured: Mapping[str, Measured], options: Options) -> StepPlan:
    """The plan with the shortest predicted step over every offered cut (``measured`` keys).

    Raises ``ValueError`` naming the figures when no candidate fits (no measured size for the
    allowed microbatch counts, or the memory budget too small for even one live microbatch).
    """
    plans = [p for cut, fig in measured.items() for p in _candidates(cut, fig, options)]
    if not plans:
        budgets = {cut: fig.memory_budget_bytes for cut, fig in measured.items()}
        stashes = {cut: dict(fig.stash_bytes) for cut, fig in measured.items()}
        raise ValueError(
            f"no plan fits: microbatch counts {options.microbatches}, schedules "
            f"{options.schedules}, memory budget {budgets} bytes, per-microbatch stash "
            f"{stashes}; allow more microbatches (smaller ones) or raise pipeline.memory_cap_mb"
        )
    return min(plans, key=lambda p: _rank(p, options))


NOISE_FLOOR_S = 0.005
"""Changes of link time smaller than this are noise (a sleep-based emulator delivers a few
milliseconds late on a busy machine: docs/design/pipeline-bound.md); only larger ones count as
drift."""


def link_drift(
    planned: LinkFigures, now: LinkFigures, threshold: float, message_bytes: int
) -> str | None:
    """Why the link drifted past ``threshold`` (a fraction) since the plan, or None.

    Judged on what the step pays: the round trip, and the time one ``message_bytes`` message
    occupies each direction. A rate measured on small messages is noisy, but then so little
    time rides on it that its change stays under :data:`NOISE_FLOOR_S` and is ignored.
    """
    why = []
    for name, old, new in (
        ("RTT", planned.rtt_s, now.rtt_s),
        (
            "uplink",
            link_occupancy(message_bytes, planned.up_mbps),
            link_occupancy(message_bytes, now.up_mbps),
        ),
        (
            "downlink",
            link_occupancy(message_bytes, planned.down_mbps),
            link_occupancy(message_bytes, now.down_mbps),
        ),
    ):
        change = (new - old) / old if old > 0 else math.inf
        if abs(new - old) > NOISE_FLOOR_S and abs(change) > threshold:
            why.append(f"{name} {old * 1e3:.1f} -> {new * 1e3:.1f} ms ({change:+.0%})")
    if not why:
        return None
    return (
        f"{', '.join(why)} (a {message_bytes}-byte message each way): past the "
        f"{threshold:.0%} drift threshold"
    )
