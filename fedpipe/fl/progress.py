"""How far each device of a round has got, and which devices are late.

The ServerApp asks the StageServer (RoundStatus) how many steps each session of the round has
completed and when: a count the server makes itself, not a device's claim. From it and the
replies so far, :func:`assess` gives every device of the round a state:

- ``starting``: no session on the StageServer yet (loading the model, or, in a simulation,
  waiting for a free slot), or a session but no step yet;
- ``training``: some of its steps done; ``finished``: all done, its reply on its way;
- ``done``: its reply arrived; ``failed``: its error reply arrived or it was given up on;
- ``late``, with the reason, when a device still owing its reply:

  - has done no step for :data:`LATE_STEPS` times its own mean step time (and ``grace_s``);
  - opened its session but did no step for :data:`LATE_STEPS` times the slowest step time
    measured in the round (and ``grace_s``; ``start_s`` while no step time is measured);
  - did all its steps ``grace_s`` ago and its reply has not arrived;
  - has no session (not connected) while no other device of the round trains, and the round
    has been quiet for ``grace_s`` since the others' last step (``start_s`` when no device
    of the round has connected at all). While others train, a device without a session is
    ``starting``: it may be waiting for their slot.

``start_s`` is how long a device may take to start (a deployed device starts its ClientApp
and loads the model every round): :class:`StepWatch` allows the longest of
``federated.connect_wait_s``, :data:`START_S` and twice the longest start it has seen in the
run. It asks and assesses; :class:`~fedpipe.fl.deadline_grid.DeadlineGrid` records the result as
``progress`` records and names only the late devices in its ``waiting`` records.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from fedpipe.wire.backend import SessionProgress

__all__ = [
    "LATE_STEPS",
    "START_S",
    "DeviceProgress",
    "StepWatch",
    "assess",
    "by_device",
    "step_seconds",
]

LATE_STEPS = 5.0  # a device is late after this many of its mean step times without a step
START_S = 120.0  # the least time a device may take to open its session in a round

Status = Callable[[int], list[SessionProgress] | None]  # round -> its sessions (None: unknown)


@dataclass(frozen=True)
class DeviceProgress:
    """One device of a round: its steps done (the StageServer's count), its state, why late."""

    node_id: int
    steps_done: int
    state: str
    why: str = ""


def step_seconds(session: SessionProgress) -> float | None:
    """The session's mean seconds per step: between its first and last step, or, after one
    step, since it opened (which counts its setup too: a lenient estimate)."""
    first, last = session.first_step_s_ago, session.last_step_s_ago
    if first is None or last is None:
        return None
    if session.steps_done >= 2:
        return (first - last) / (session.steps_done - 1)
    return session.opened_s_ago - last


def _first_step_bound(others: list[SessionProgress], grace_s: float, start_s: float) -> float:
    """How long a session may go without its first step: ``LATE_STEPS`` of the slowest step
    time the round has measured (at least ``grace_s``); ``start_s`` while none is measured."""
    measured = [t for t in map(step_seconds, others) if t is not None]
    if not measured:
        return max(grace_s, start_s)
    return max(grace_s, LATE_STEPS * max(measured))


def _late_in_session(
    session: SessionProgress,
    others: list[SessionProgress],
    *,
    steps: int,
    grace_s: float,
    start_s: float,
) -> str:
    """Why a device with a session is late, or "" when it is not."""
    last = session.last_step_s_ago
    if last is None:
        if session.opened_s_ago > _first_step_bound(others, grace_s, start_s):
            return f"connected {session.opened_s_ago:.0f} s ago, no step done yet"
        return ""
    if session.steps_done >= steps:
        if last > grace_s:
            return f"did its {session.steps_done} steps {last:.0f} s ago; no reply yet"
        return ""
    step_s = step_seconds(session) or 0.0
    if last > max(grace_s, LATE_STEPS * step_s):
        return f"no step for {last:.0f} s (its steps take {step_s:.1f} s)"
    return ""


def _trains(session: SessionProgress | None, steps: int) -> bool:
    return session is not None and session.steps_done < steps and not session.closed


def _late_unconnected(
    node: int,
    sessions: Mapping[str, SessionProgress],
    pending: list[int],
    *,
    steps: int,
    elapsed_s: float,
    grace_s: float,
    start_s: float,
) -> str:
    """Why a device without a session is late, or "" when it is not (see the module)."""
    if any(_trains(sessions.get(str(m)), steps) for m in pending if m != node):
        return ""
    others = [s for d, s in sessions.items() if d != str(node)]
    quiet, bound = elapsed_s, max(grace_s, start_s)
    if others:
        last = [s.opened_s_ago if s.last_step_s_ago is None else s.last_step_s_ago for s in others]
        quiet, bound = min(elapsed_s, *last), grace_s
    if quiet > bound:
        return f"not connected to the StageServer {elapsed_s:.0f} s into the round"
    return ""


def _state(session: SessionProgress | None, steps: int) -> str:
    if session is None or session.steps_done == 0:
        return "starting"
    return "finished" if session.steps_done >= steps else "training"


def assess(
    nodes: Iterable[int],
    sessions: Mapping[str, SessionProgress],
    outcome: Mapping[int, str],
    *,
    steps: int,
    elapsed_s: float,
    grace_s: float,
    start_s: float,
) -> list[DeviceProgress]:
    """Every device of the round: its steps done and state.

    ``nodes``: the round's Flower node ids (a device opens its sessions with its node id as
    ``device_id``; other sessions are left out); ``outcome``: node -> ``done`` or ``failed``
    for the devices whose reply is in; ``steps``: the steps each device owes."""
    nodes = list(nodes)
    ids = {str(n) for n in nodes}
    sessions = {d: s for d, s in sessions.items() if d in ids}  # not the evaluator's, say
    pending = [n for n in nodes if n not in outcome]
    out = []
    for node in nodes:
        session = sessions.get(str(node))
        done = session.steps_done if session is not None else 0
        if node in outcome:
            out.append(DeviceProgress(node, done, outcome[node]))
            continue
        if session is not None:
            others = [s for d, s in sessions.items() if d != str(node)]
            why = _late_in_session(session, others, steps=steps, grace_s=grace_s, start_s=start_s)
        else:
            why = _late_unconnected(
                node,
                sessions,
                pending,
                steps=steps,
                elapsed_s=elapsed_s,
                grace_s=grace_s,
                start_s=start_s,
            )
        out.append(DeviceProgress(node, done, "late" if why else _state(session, steps), why))
    return out


def by_device(sessions: Iterable[SessionProgress]) -> dict[str, SessionProgress]:
    """The newest session of each device (a device's new session replaces its old one)."""
    newest: dict[str, SessionProgress] = {}
    for s in sessions:
        kept = newest.get(s.device_id)
        if kept is None or s.opened_s_ago < kept.opened_s_ago:
            newest[s.device_id] = s
    return newest


class StepWatch:
    """Asks the StageServer how the round goes and assesses each device (see the module).

    ``status``: round -> its sessions, or None when the server cannot say (then nothing is
    assessed and the round's waiting records name every device still out, as before).
    """

    def __init__(
        self,
        status: Status,
        *,
        steps: int,
        grace_s: float,
        connect_s: float,
        every_s: float = 2.0,
    ) -> None:
        self.status, self.steps, self.every_s = status, steps, every_s
        self.grace_s, self.connect_s = grace_s, connect_s
        self.longest_start_s = 0.0  # the longest a device of the run took to open a session

    @property
    def start_s(self) -> float:
        """How long a device may take to open its session in a round (see the module)."""
        return max(self.connect_s, START_S, 2 * self.longest_start_s)

    def look(
        self, round_: int, nodes: Iterable[int], outcome: Mapping[int, str], elapsed_s: float
    ) -> list[DeviceProgress] | None:
        """The round's devices ``elapsed_s`` after it sent them their work."""
        status = self.status(round_)
        if status is None:
            return None
        nodes = list(nodes)
        sessions = by_device(status)
        for node in nodes:  # when each device opened its session, after the round began
            if (session := sessions.get(str(node))) is not None:
                start = elapsed_s - session.opened_s_ago
                self.longest_start_s = max(self.longest_start_s, start)
        return assess(
            nodes,
            sessions,
            outcome,
            steps=self.steps,
            elapsed_s=elapsed_s,
            grace_s=self.grace_s,
            start_s=self.start_s,
        )
