"""The lower bound on a pipelined step (notes/pipeline-bound.md), from measured components.

U-shaped split, per microbatch: device head forward ``c_f``, tail forward+loss+backward
``c_t``, head backward ``c_b``; server forward ``s_f`` and backward ``s_b``; four transfers
(activation up, output down, its gradient up, the head's gradient down), each paying the
link's occupancy ``tau`` (bytes / bandwidth) and one-way latency ``L``.

For each resource r: T >= (earliest r can first be busy) + M * (r's work per microbatch) +
(shortest time after r's last use until the step can end); also T >= the critical path of one
microbatch, and T >= the tail phase (first output back, then M tails on the device, then the
last gradient's round trip and head backward). The optimizer tail is added to the largest.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["Components", "pipeline_bound", "sequential_model"]


@dataclass(frozen=True)
class Components:
    """Median component times (seconds) of one microbatch, measured in the same run."""

    c_f: float
    c_t: float
    c_b: float
    s_f: float
    s_b: float
    tau_up: float
    tau_down: float
    lat_up: float
    lat_down: float
    t_opt: float = 0.0  # optimizer tail after the last microbatch

    def as_dict(self) -> dict[str, float]:
        return {k: round(v, 6) for k, v in asdict(self).items()}


def pipeline_bound(c: Components, m: int) -> tuple[float, str]:
    """``(T_bound, binding term)`` for ``m`` microbatches."""
    up = c.tau_up + c.lat_up
    down = c.tau_down + c.lat_down
    terms = {
        "device": m * (c.c_f + c.c_t + c.c_b),
        "uplink": c.c_f + m * 2 * c.tau_up + c.lat_up + c.s_b + down + c.c_b,
        "server": c.c_f + up + m * (c.s_f + c.s_b) + down + c.c_b,
        "downlink": c.c_f + up + c.s_f + m * 2 * c.tau_down + c.lat_down + c.c_b,
        "critical-path": c.c_f + 2 * up + c.s_f + 2 * down + c.c_t + c.s_b + c.c_b,
        "tail-phase": c.c_f + up + c.s_f + down + m * c.c_t + up + c.s_b + down + c.c_b,
    }
    name = max(terms, key=terms.__getitem__)
    return terms[name] + c.t_opt, name


def sequential_model(c: Components, m: int) -> float:
    """Stop-and-wait time predicted from the components (for comparison with the measured one)."""
    per_mb = (
        c.c_f + c.c_t + c.c_b + c.s_f + c.s_b + 2 * (c.tau_up + c.lat_up + c.tau_down + c.lat_down)
    )
    return m * per_mb + c.t_opt
