"""The per-device planner: measure at session start, pick the plan with the shortest step.

``plan`` is pure (no torch); ``measure`` times the device's compute and the stage link;
``auto`` runs both for a device whose run sets ``pipeline.plan = "auto"``.
"""

from fedpipe.edge.planner.plan import (
    LinkFigures,
    Measured,
    OpTimes,
    Options,
    StepPlan,
    divisors,
    link_drift,
    plan_step,
)

__all__ = [
    "LinkFigures",
    "Measured",
    "OpTimes",
    "Options",
    "StepPlan",
    "divisors",
    "link_drift",
    "plan_step",
]
