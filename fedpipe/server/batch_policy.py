"""Which queued work the StageServer computes next, and with whom: the batching policy as data.

The runtime shows the policy a :class:`QueueView` (per session, in round-robin order, the kind,
size and age of its first queued messages) and runs the :class:`BatchChoice` it gets back: a list of
(session, how many of its first messages) to compute in one call. The policy is a pure function
of that view: tests drive it without torch, threads or clocks.

Rules, in order:

1. **One lane per call, round trips first.** Messages fall in lanes by what their reply unblocks:
   ``CONTROL`` (step end, a reset, a stream's end: no compute, and the device's next step or the
   memory of a failed one waits on it), ``BACKWARD`` (the reply completes a device's round trip
   and frees the cached graph), ``EVAL`` (a forward whose reply is all the device waits for),
   ``FORWARD`` (starts new work, whose memory stays cached until its gradient comes). A call
   takes the most urgent lane among the sessions' first messages...
2. **...but nobody waits without bound.** The session at the head of the ring (served least
   recently) may be passed over for a more urgent lane at most ``max_skips`` calls; then its lane
   is the call's. A session at position p of the ring is served within (p + 1) *
   (max_skips + 1) calls, however much the others send.
3. **A heavy session takes its share only.** The call is filled in passes over the ring: every
   session with work of the lane gets its first message before any gets its second, up to
   ``quantum`` each and ``batch_tokens`` in all (the ring's head always gets one, however large).
   Sessions served move to the back of the ring.
4. **Waiting to fill is measured.** When the call is under its token budget and other sessions
   are mid-step with nothing queued (their next message is on the way), the worker may wait for
   them, at most ``wait_fraction`` of the measured time of a call and at most ``max_wait_s``,
   counted from when the oldest message of the call arrived. With no measurement yet, it does
   not wait.

With ``enabled`` False the plan is today's one message at a time, round-robin, ``quantum``
messages per turn.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

__all__ = ["BatchPolicy", "Item", "Lane", "BatchChoice", "QueueView", "SessionView", "choose_batch"]


class Lane(IntEnum):
    """What a message's reply unblocks; lower is more urgent."""

    CONTROL = 0  # STEP_END, a reset, a stream's end
    BACKWARD = 1  # OUTPUT_GRAD
    EVAL = 2  # ACTIVATION, forward only
    FORWARD = 3  # ACTIVATION of a training step


@dataclass(frozen=True)
class BatchPolicy:
    """Settings of the server's batching (``server.batching``, ``batch_tokens``, ...)."""

    enabled: bool = True
    # Tokens (rows x sequence length, summed) per call. 2048 is 8 microbatches of 2 x 128:
    # about what a GPU needs to stop being launch-bound on a SmolLM2-sized stage, and on a CPU
    # (compute-bound from one microbatch) a call of at most ~8 microbatches' time per turn.
    batch_tokens: int = 2048
    max_wait_s: float = 0.005  # cap on waiting to fill a call
    wait_fraction: float = 0.25  # ... and at most this fraction of a measured call's time
    quantum: int = 2  # messages of one session per call (per turn when disabled)
    max_skips: int = 2  # calls the ring's head may be passed over for a more urgent lane

    def __post_init__(self) -> None:
        if self.batch_tokens < 1:
            raise ValueError(f"batch_tokens must be >= 1, got {self.batch_tokens}")
        if self.max_wait_s < 0 or not 0 <= self.wait_fraction <= 1:
            raise ValueError(
                f"max_wait_s must be >= 0 and wait_fraction in [0, 1], got {self.max_wait_s}, "
                f"{self.wait_fraction}"
            )
        if self.quantum < 1 or self.max_skips < 0:
            raise ValueError(
                f"quantum must be >= 1 and max_skips >= 0, got {self.quantum}, {self.max_skips}"
            )


@dataclass(frozen=True)
class Item:
    """One queued message as the policy sees it."""

    lane: Lane
    tokens: int = 0  # rows x sequence length of its tensor (0: none)
    waited_s: float = 0.0  # since it was queued


@dataclass(frozen=True)
class SessionView:
    """A session with queued work: its first messages, oldest first."""

    key: str
    items: tuple[Item, ...]


@dataclass(frozen=True)
class QueueView:
    """The queue's state: sessions with work in round-robin order (the next turn first)."""

    ring: tuple[SessionView, ...]
    head_served: int = 0  # messages the ring's head has had in its current turn
    head_skipped: int = 0  # calls the ring's head has been passed over
    expected: int = 0  # sessions mid-step with nothing queued: their next message is coming
    call_s: float = 0.0  # measured seconds of a recent call (0: not measured yet)


@dataclass(frozen=True)
class BatchChoice:
    """What to compute now: (session, how many of its first messages), in ring order."""

    picks: tuple[tuple[str, int], ...]
    lane: Lane
    tokens: int = 0
    wait_s: float = 0.0  # > 0: wait up to this long for more work, then plan again
    end_turn: bool = True  # served sessions go to the back of the ring (False: quantum turns)


def choose_batch(policy: BatchPolicy, view: QueueView) -> BatchChoice | None:
    """The next call's work (None when nothing is queued)."""
    if not view.ring:
        return None
    if not policy.enabled:
        head = view.ring[0]
        first = head.items[0]
        return BatchChoice(((head.key, 1),), first.lane, first.tokens, end_turn=False)
    lane = _lane(policy, view)
    picks, tokens = _fill(policy, view, lane)
    return BatchChoice(picks, lane, tokens, wait_s=_wait(policy, view, lane, picks, tokens))


def _lane(policy: BatchPolicy, view: QueueView) -> Lane:
    """The most urgent lane, unless the ring's head has been passed over too often."""
    head_lane = view.ring[0].items[0].lane
    best = min(s.items[0].lane for s in view.ring)
    return best if view.head_skipped < policy.max_skips else head_lane


def _fill(
    policy: BatchPolicy, view: QueueView, lane: Lane
) -> tuple[tuple[tuple[str, int], ...], int]:
    """Each session's first messages of ``lane``, in passes over the ring, within the budget."""
    taken = {s.key: 0 for s in view.ring}
    tokens = 0
    for depth in range(policy.quantum):
        for session in view.ring:
            if taken[session.key] != depth or depth >= len(session.items):
                continue  # a session's messages are taken in order, without gaps
            item = session.items[depth]
            if item.lane is not lane:
                continue
            if tokens and tokens + item.tokens > policy.batch_tokens:
                continue  # a smaller message of another session may still fit
            taken[session.key] += 1
            tokens += item.tokens
    picks = tuple((s.key, taken[s.key]) for s in view.ring if taken[s.key])
    return picks, tokens


def _wait(
    policy: BatchPolicy,
    view: QueueView,
    lane: Lane,
    picks: tuple[tuple[str, int], ...],
    tokens: int,
) -> float:
    """How much longer to wait for expected work (0: run now)."""
    if lane is Lane.CONTROL or view.expected <= 0 or tokens >= policy.batch_tokens:
        return 0.0
    allowance = min(policy.max_wait_s, policy.wait_fraction * view.call_s)
    by_key = {s.key: s for s in view.ring}
    oldest = max(by_key[key].items[i].waited_s for key, n in picks for i in range(n))
    return max(0.0, allowance - oldest)
