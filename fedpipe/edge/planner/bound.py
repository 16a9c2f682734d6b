"""The lower bound on a pipelined step (docs/design/pipeline-bound.md), from measured components.

Per microbatch the device runs a head forward ``c_f`` and, after the server's gradient comes
back, a head backward ``c_b``; the server runs ``s_f`` and ``s_b``. The two split modes differ
in what crosses the link:

- U-shaped (``split="u"``, labels stay on the device): four transfers, activation up, server
  output down, its gradient up, the head's gradient down; the device also runs the tail
  forward+loss+backward ``c_t`` between the two round trips.
- Two-part (``split="two"``, the server computes the loss): two transfers, activation up and
  the head's gradient down; ``c_t`` is 0 and the server's work may all sit in ``s_b``.

Each transfer pays its occupancy ``tau`` (bytes / bandwidth) and the one-way latency ``L``.

For each resource r: T >= (earliest r can first be busy) + M * (r's work per microbatch) +
(shortest time after r's last use until the step can end). The device row counts its
unavoidable fill (no tail or head backward can start before the first result comes back;
until then only head forwards can run) and drain (after its last tail only head backwards
remain, and the last one waits a full round trip). Also T >= one microbatch's critical path,
and, for the server, T >= M * (s_f + s_b) + its optimizer step. The device's optimizer step
``c_opt`` follows its last head backward. The STEP_END/STEP_DONE round trip is not counted:
a runtime need not wait for it (the server's worker applies its optimizer before any later
message), so a runtime that waits pays it as overhead against the bound.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass

__all__ = [
    "Components",
    "in_flight_cap",
    "link_occupancy",
    "pipeline_bound",
    "predict_step",
    "relative_spread",
    "sequential_model",
]

SPLITS = ("u", "two")


@dataclass(frozen=True)
class Components:
    """Median component times (seconds) of one microbatch, and the optimizer steps."""

    c_f: float
    c_t: float
    c_b: float
    s_f: float
    s_b: float
    tau_up: float  # activation up
    tau_down: float  # server output down (U-shaped only)
    lat_up: float
    lat_down: float
    c_opt: float = 0.0  # the device's optimizer step, after its last head backward
    s_opt: float = 0.0  # the server's optimizer step, after its last backward
    tau_up_grad: float | None = None  # gradient of the output, up (None: as tau_up)
    tau_down_grad: float | None = None  # gradient of the activation, down (None: as tau_down)
    split: str = "u"

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise ValueError(f"Components.split must be one of {SPLITS}, got {self.split!r}")

    @property
    def transfers(self) -> tuple[float, ...]:
        """Occupancy of the transfers of one microbatch, in order (4 U-shaped, 2 two-part)."""
        up_g = self.tau_up if self.tau_up_grad is None else self.tau_up_grad
        down_g = self.tau_down if self.tau_down_grad is None else self.tau_down_grad
        if self.split == "two":
            return self.tau_up, down_g
        return self.tau_up, self.tau_down, up_g, down_g

    def as_dict(self) -> dict[str, float | str]:
        return {
            k: (round(v, 6) if isinstance(v, float) else v)
            for k, v in asdict(self).items()
            if v is not None
        }


def link_occupancy(nbytes: int, mbps: float) -> float:
    """Seconds ``nbytes`` occupy a link of ``mbps`` Mbit/s (0 for an unlimited link)."""
    return nbytes * 8 / (mbps * 1e6) if mbps != float("inf") else 0.0


def _terms_u(c: Components, m: int) -> dict[str, float]:
    act_up, out_down, grad_up, grad_down = c.transfers
    up, down = act_up + c.lat_up, out_down + c.lat_down
    up_g, down_g = grad_up + c.lat_up, grad_down + c.lat_down
    rtt_f = up + c.s_f + down  # end of a head forward -> its tail can start
    rtt_b = up_g + c.s_b + down_g  # end of a tail -> its head backward can start
    fill = max(0.0, rtt_f - (m - 1) * c.c_f)
    drain = max(0.0, rtt_b - (m - 1) * c.c_b)
    end = c.c_b + c.c_opt  # after the resource's last use: the last head backward, optimizer
    return {
        "device": m * (c.c_f + c.c_t + c.c_b) + fill + drain + c.c_opt,
        "uplink": c.c_f + m * (act_up + grad_up) + c.lat_up + c.s_b + down_g + end,
        "server": c.c_f + up + m * (c.s_f + c.s_b) + down_g + end,
        "server-steady": m * (c.s_f + c.s_b) + c.s_opt,
        "downlink": c.c_f + up + c.s_f + m * (out_down + grad_down) + c.lat_down + end,
        "critical-path": c.c_f + rtt_f + c.c_t + rtt_b + end,
    }


def _terms_two(c: Components, m: int) -> dict[str, float]:
    act_up, grad_down = c.transfers
    up, down = act_up + c.lat_up, grad_down + c.lat_down
    s = c.s_f + c.s_b
    rtt = up + s + down  # end of a head forward -> its head backward can start
    # Fill (before the first backward only forwards run) and drain (after the last forward only
    # backwards run) may overlap here, so only the larger idle is certain.
    idle = max(0.0, rtt - (m - 1) * c.c_f, rtt - (m - 1) * c.c_b)
    end = c.c_b + c.c_opt
    return {
        "device": m * (c.c_f + c.c_b) + idle + c.c_opt,
        "uplink": c.c_f + m * act_up + c.lat_up + s + down + end,
        "server": c.c_f + up + m * s + down + end,
        "server-steady": m * s + c.s_opt,
        "downlink": c.c_f + up + s + m * grad_down + c.lat_down + end,
        "critical-path": c.c_f + rtt + end,
    }


def bound_terms(c: Components, m: int) -> dict[str, float]:
    """Every lower-bound term for ``m`` microbatches (the bound is their maximum)."""
    if m < 1:
        raise ValueError(f"the bound needs at least one microbatch, got m={m}")
    return _terms_two(c, m) if c.split == "two" else _terms_u(c, m)


def pipeline_bound(c: Components, m: int) -> tuple[float, str]:
    """``(T_bound, binding term)`` for ``m`` microbatches."""
    terms = bound_terms(c, m)
    name = max(terms, key=terms.__getitem__)
    return terms[name], name


def in_flight_cap(schedule: str, m: int, max_in_flight: int | None = None) -> int:
    """Most microbatches a schedule keeps live on the device (as ``fedpipe.edge.schedules``).

    sequential 1; gpipe all ``m``; 1f1b ``min(m, max_in_flight or 4)``; greedy ``m`` or its cap.
    """
    if schedule == "sequential":
        return 1
    if schedule == "1f1b":
        return min(m, max_in_flight or 4)
    if schedule == "greedy" and max_in_flight:
        return min(m, max_in_flight)
    return m


def predict_step(
    c: Components, m: int, *, schedule: str = "greedy", max_in_flight: int | None = None
) -> tuple[float, str]:
    """``(predicted step time, what binds it)`` for ``m`` microbatches walked by ``schedule``.

    The one model the benchmark and the per-device planner share. Stop-and-wait is its sum
    (:func:`sequential_model`). A pipelined schedule is predicted by the lower bound, which the
    tail-first greedy schedule comes close to (docs/benchmarks/pipeline.md), plus one term
    when at most ``k < m`` microbatches may be live: each of the ``k`` slots carries its
    microbatches one after another, so ``T >= ceil(m / k)`` critical paths.
    """
    if schedule == "sequential":
        return sequential_model(c, m), "sequential"
    terms = bound_terms(c, m)
    k = in_flight_cap(schedule, m, max_in_flight)
    if k < m:
        path = terms["critical-path"] - c.c_opt
        terms["in-flight"] = math.ceil(m / k) * path + c.c_opt
    name = max(terms, key=terms.__getitem__)
    return terms[name], name


def sequential_model(c: Components, m: int) -> float:
    """Stop-and-wait time predicted from the components (for comparison with the measured one)."""
    compute = c.c_f + c.c_t + c.c_b + c.s_f + c.s_b
    transfers = c.transfers
    latencies = (len(transfers) // 2) * (c.lat_up + c.lat_down)
    return m * (compute + sum(transfers) + latencies) + max(c.c_opt, c.s_opt)


def relative_spread(samples: Sequence[float]) -> float:
    """Interquartile range over the median of repeated timings (0 for fewer than 4 samples).

    Why: the same computation on the same shapes should take the same time; a wide spread
    says the machine was busy with something else, and then no bound is trustworthy.
    """
    if len(samples) < 4:
        return 0.0
    q1, med, q3 = statistics.quantiles(samples, n=4)
    return (q3 - q1) / med if med > 0 else 0.0
