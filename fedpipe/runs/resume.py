"""Which settings a resumed run continues with, and which changes it refuses.

A run folder records its resolved settings (``settings.json``). ``--resume`` starts from them,
so a resume without flags continues the run as it was; settings given again on the command
line win. A change that would make the checkpoints or the data mean something else (the model,
its split, the LoRA adapters' shape, the data and how it is partitioned) cannot be continued
and is refused in one line; any other change (more rounds, another learning rate) is allowed
and said.
"""

from __future__ import annotations

from typing import Any

from fedpipe.config import FedpipeConfig
from fedpipe.config.lists import LIST_SETTINGS, canonical_list_text

__all__ = ["FROZEN", "ResumeRefused", "resume_settings"]

# Settings a checkpoint or the run's data depends on.
FROZEN = (
    "model.name",
    "model.head_layers",
    "model.tail_layers",
    "model.cuts",  # the checkpoints hold the blocks of every offered cut
    "model.split",
    "model.lora_r",
    "model.lora_alpha",
    "model.lora_targets",
    "model.seed",
    "federated.num_devices",
    "federated.data",
    "federated.partition",
    "federated.dirichlet_alpha",
    "federated.eval_fraction",
    "federated.aggregation",  # exact/stack fold base deltas that the others would drop
    # The stage link's (epsilon, delta) is accounted over every round with one mechanism: a
    # changed clip or noise would misprice the rounds already run.
    "privacy.mechanism",
    "privacy.activation_clip",
    "privacy.activation_noise",
    "privacy.gradient_clip",
    "privacy.gradient_noise",
    "privacy.devices",
    "privacy.delta",
)


def _as_written(key: str, value: Any) -> Any:
    """A saved value as this version writes it: a list setting saved as ``"1+1, 2+2"`` is
    the same setting as ``"1+1,2+2"``, not a change (a value it refuses is left as saved)."""
    if key not in LIST_SETTINGS:
        return value
    try:
        return canonical_list_text(key, value)
    except ValueError:
        return value


class ResumeRefused(ValueError):
    """A resume asked for a change the run's checkpoints cannot continue with."""


def resume_settings(
    saved: dict[str, Any] | None, config: FedpipeConfig, *, explicit: set[str] | None = None
) -> tuple[FedpipeConfig, list[str]]:
    """The settings to resume with, and one line per change (or about missing settings).

    ``explicit`` names the settings the user gave for this resume (flags, ``--set``, a
    ``--config`` file); the others come from ``saved``. None means all of ``config`` is
    explicit (an API caller passing the whole config). Raises :class:`ResumeRefused`.
    """
    if saved is None:
        return config, ["this run folder records no settings (an older run): using these"]
    flat = config.to_flat()
    known = {k: _as_written(k, v) for k, v in saved.items() if k in flat}
    chosen = flat if explicit is None else {k: flat[k] for k in explicit if k in flat}
    resolved = FedpipeConfig().with_overrides({**known, **chosen})
    new = resolved.to_flat()
    changes = [(k, known[k], new[k]) for k in sorted(known) if known[k] != new[k]]
    refused = [c for c in changes if c[0] in FROZEN]
    if refused:
        what = "; ".join(f"{k} was {old!r}, now {now!r}" for k, old, now in refused)
        raise ResumeRefused(
            f"cannot resume with a changed {', '.join(k for k, _, _ in refused)} ({what}): the "
            "checkpoints were trained with the old value; drop the change, or start a new run "
            "with another --name"
        )
    return resolved, [f"resuming with {k} changed: {old!r} -> {now!r}" for k, old, now in changes]
