"""The lower bound on a pipelined step (notes/pipeline-bound.md), from measured components.

U-shaped split, per microbatch: device head forward ``c_f``, tail forward+loss+backward
``c_t``, head backward ``c_b``; server forward ``s_f`` and backward ``s_b``; four transfers
(activation up, output down, its gradient up, the head's gradient down), each paying the
link's occupancy ``tau`` (bytes / bandwidth) and one-way latency ``L``. Activations and
gradients may use different codecs, so each direction has an occupancy for its activation-like
transfer (``tau_up``: activation, ``tau_down``: output) and for its gradient (``*_grad``).

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
    tau_up: float  # activation up
    tau_down: float  # output down
    lat_up: float
    lat_down: float
    t_opt: float = 0.0  # optimizer tail after the last microbatch
    tau_up_grad: float | None = None  # gradient of the output, up (None: as tau_up)
    tau_down_grad: float | None = None  # gradient of the activation, down (None: as tau_down)

    @property
    def transfers(self) -> tuple[float, float, float, float]:
        """Occupancy of the four transfers of a microbatch, in order."""
        up_g = self.tau_up if self.tau_up_grad is None else self.tau_up_grad
        down_g = self.tau_down if self.tau_down_grad is None else self.tau_down_grad
        return self.tau_up, self.tau_down, up_g, down_g

    def as_dict(self) -> dict[str, float]:
        return {k: round(v, 6) for k, v in asdict(self).items() if v is not None}


def pipeline_bound(c: Components, m: int) -> tuple[float, str]:
    """``(T_bound, binding term)`` for ``m`` microbatches."""
    act_up, out_down, grad_up, grad_down = c.transfers
    up, down = act_up + c.lat_up, out_down + c.lat_down  # the forward transfers
    up_g, down_g = grad_up + c.lat_up, grad_down + c.lat_down  # the backward transfers
    terms = {
        "device": m * (c.c_f + c.c_t + c.c_b),
        "uplink": c.c_f + m * (act_up + grad_up) + c.lat_up + c.s_b + down_g + c.c_b,
        "server": c.c_f + up + m * (c.s_f + c.s_b) + down_g + c.c_b,
        "downlink": c.c_f + up + c.s_f + m * (out_down + grad_down) + c.lat_down + c.c_b,
        "critical-path": c.c_f + up + c.s_f + down + c.c_t + up_g + c.s_b + down_g + c.c_b,
        "tail-phase": c.c_f + up + c.s_f + down + m * c.c_t + up_g + c.s_b + down_g + c.c_b,
    }
    name = max(terms, key=terms.__getitem__)
    return terms[name] + c.t_opt, name


def sequential_model(c: Components, m: int) -> float:
    """Stop-and-wait time predicted from the components (for comparison with the measured one)."""
    compute = c.c_f + c.c_t + c.c_b + c.s_f + c.s_b
    per_mb = compute + sum(c.transfers) + 2 * (c.lat_up + c.lat_down)
    return m * per_mb + c.t_opt
