"""Pipeline schedules as data: the device's list of actions for one training step.

A step splits a batch into M microbatches. With the U-shaped split, every microbatch passes
through three device actions, in this order of dependency:

- ``F`` (head forward): embeddings + head blocks, then the activation goes up the link.
- ``T`` (tail): wait for the server's output, tail forward + loss + tail backward, send the
  output's gradient up.
- ``B`` (head backward): wait for the gradient of the activation, backward through the head.

With the two-part split the server computes the loss, so a microbatch has only ``F`` and ``B``.

A schedule is an ordered tuple of actions (``F0 F1 T0 B0 ...``) that prints, validates and is
walked by :class:`fedpipe.edge.runtime.DeviceRuntime`. Strict schedules are walked in order,
blocking on each action's input. The ``greedy`` schedule is dynamic instead: at each point the
runtime runs whatever is ready by priority, tail work before head backwards before new forwards,
so forwards only fill idle time (docs/design/pipeline-bound.md says why tail work goes first).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

__all__ = [
    "SCHEDULES",
    "Action",
    "Op",
    "Schedule",
    "make_schedule",
]


class Op(StrEnum):
    """A device action kind."""

    FORWARD = "F"  # head forward, send activation
    TAIL = "T"  # receive output, tail forward + loss + backward, send its gradient
    BACKWARD = "B"  # receive activation gradient, head backward


@dataclass(frozen=True, order=True)
class Action:
    """One device action on one microbatch, printed as ``F3``, ``T0``, ``B7``."""

    op: Op
    microbatch: int

    def __str__(self) -> str:
        return f"{self.op.value}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Parse ``"F3"`` into ``Action(Op.FORWARD, 3)``."""
        try:
            return cls(Op(text[0]), int(text[1:]))
        except (ValueError, IndexError) as exc:
            raise ValueError(f"bad action {text!r}: expected F<n>, T<n> or B<n>") from exc


@dataclass(frozen=True)
class Schedule:
    """The device's actions for one step; ``strict=False`` makes the order a priority list."""

    name: str
    num_microbatches: int
    actions: tuple[Action, ...]
    has_tail: bool = True
    strict: bool = True
    max_in_flight: int | None = None

    def __post_init__(self) -> None:
        _validate(self)

    def __str__(self) -> str:
        return f"{self.name}(M={self.num_microbatches}): " + " ".join(map(str, self.actions))

    @property
    def ops(self) -> tuple[Op, ...]:
        """The ops each microbatch goes through, in dependency order."""
        return (Op.FORWARD, Op.TAIL, Op.BACKWARD) if self.has_tail else (Op.FORWARD, Op.BACKWARD)

    def peak_in_flight(self) -> int:
        """Most microbatches whose head forward ran but whose head backward did not (memory)."""
        live = peak = 0
        for action in self.actions:
            if action.op is Op.FORWARD:
                live += 1
                peak = max(peak, live)
            elif action.op is Op.BACKWARD:
                live -= 1
        return peak


def _validate(schedule: Schedule) -> None:
    m = schedule.num_microbatches
    if m < 1:
        raise ValueError(f"a schedule needs at least 1 microbatch, got {m}")
    expected = {Action(op, i) for op in schedule.ops for i in range(m)}
    seen: set[Action] = set()
    for action in schedule.actions:
        if action not in expected:
            raise ValueError(
                f"{schedule.name}: action {action} is not part of a {m}-microbatch step"
            )
        if action in seen:
            raise ValueError(f"{schedule.name}: action {action} appears twice")
        prior = schedule.ops[: schedule.ops.index(action.op)]
        missing = [str(Action(op, action.microbatch)) for op in prior]
        missing = [a for a in missing if Action.parse(a) not in seen]
        if missing:
            raise ValueError(f"{schedule.name}: {action} comes before {', '.join(missing)}")
        seen.add(action)
    if seen != expected:
        absent = sorted(str(a) for a in expected - seen)
        raise ValueError(f"{schedule.name}: missing actions {' '.join(absent)}")
    if schedule.max_in_flight is not None and schedule.max_in_flight < 1:
        raise ValueError(f"max_in_flight must be >= 1, got {schedule.max_in_flight}")


def _chain(m: int, ops: tuple[Op, ...]) -> list[Action]:
    return [Action(op, i) for i in range(m) for op in ops]


def _sequential(m: int, has_tail: bool, in_flight: int | None) -> Schedule:
    ops = (Op.FORWARD, Op.TAIL, Op.BACKWARD) if has_tail else (Op.FORWARD, Op.BACKWARD)
    return Schedule("sequential", m, tuple(_chain(m, ops)), has_tail)


def _gpipe(m: int, has_tail: bool, in_flight: int | None) -> Schedule:
    actions = [Action(Op.FORWARD, i) for i in range(m)]
    if has_tail:
        actions += [Action(Op.TAIL, i) for i in range(m)]
    actions += [Action(Op.BACKWARD, i) for i in range(m)]
    return Schedule("gpipe", m, tuple(actions), has_tail)


def _one_f_one_b(m: int, has_tail: bool, in_flight: int | None) -> Schedule:
    """Warm up with ``k`` forwards, then alternate finishing the oldest and starting the next.

    At most ``k`` microbatches are live on the device (activation memory bounded by ``k``,
    not ``M``); ``k`` defaults to ``min(M, 4)``.
    """
    k = min(m, in_flight or 4)
    actions = [Action(Op.FORWARD, i) for i in range(k)]
    for i in range(m):
        if has_tail:
            actions.append(Action(Op.TAIL, i))
        actions.append(Action(Op.BACKWARD, i))
        if i + k < m:  # only after B(i) frees its slot: at most k live
            actions.append(Action(Op.FORWARD, i + k))
    return Schedule("1f1b", m, tuple(actions), has_tail, max_in_flight=k)


def _greedy(m: int, has_tail: bool, in_flight: int | None) -> Schedule:
    """Dynamic, tail-first: the runtime runs a ready ``T`` first, else a ready ``B``, else the
    next ``F`` (while fewer than ``max_in_flight`` microbatches are live), else waits.

    The action tuple is the nominal dependency order; the runtime picks by that priority.
    """
    ops = (Op.FORWARD, Op.TAIL, Op.BACKWARD) if has_tail else (Op.FORWARD, Op.BACKWARD)
    return Schedule(
        "greedy", m, tuple(_chain(m, ops)), has_tail, strict=False, max_in_flight=in_flight
    )


SCHEDULES: dict[str, Callable[[int, bool, int | None], Schedule]] = {
    "sequential": _sequential,
    "gpipe": _gpipe,
    "1f1b": _one_f_one_b,
    "greedy": _greedy,
}


def make_schedule(
    name: str, num_microbatches: int, *, has_tail: bool = True, max_in_flight: int | None = None
) -> Schedule:
    """Build a named schedule (``sequential``, ``gpipe``, ``1f1b``, ``greedy``)."""
    try:
        factory = SCHEDULES[name]
    except KeyError:
        raise ValueError(
            f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}"
        ) from None
    return factory(num_microbatches, has_tail, max_in_flight)
