"""The adapters' weight gradients that batched backwards left for later (zero-bubble's B/W split).

With ``server.input_grad_first`` a batched backward computes the input gradients, whose replies
the device waits for, and only records the weight gradients
(:meth:`~fedpipe.lora.BatchedAdapterBank.backward_inputs`). They wait here, oldest first, until
the worker is idle (:meth:`DeferredWeights.compute_all`) or a session's ``STEP_END`` or reset
needs its own (:meth:`DeferredWeights.compute_for`). Either way they are computed in the order of
their backwards, so every ``.grad`` sums as the backward that computes both at once sums it, to
the bit.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from fedpipe.lora.batched_backward import WeightGrads

__all__ = ["DeferredWeights"]


@dataclass
class _Later:
    """Weight gradients one batched backward recorded, for the sessions it served."""

    weights: WeightGrads
    sessions: frozenset[str]


class DeferredWeights:
    """Recorded weight gradients, oldest first; ``add`` computes one backward's into ``.grad``.

    A computation that fails adds nothing; each session it served gets the error from
    :meth:`failure` (its step cannot end).
    """

    def __init__(self, add: Callable[[WeightGrads], None]) -> None:
        self._add = add
        self._later: deque[_Later] = deque()
        self._failed: dict[str, Exception] = {}  # session -> why its weight gradients failed
        self.computed = 0  # backwards whose weight gradients were computed after their reply

    @property
    def pending(self) -> bool:
        """Whether backwards left weight gradients to compute."""
        return bool(self._later)

    def put(self, weights: WeightGrads, sessions: set[str]) -> None:
        """Keep one backward's recorded weight gradients, for ``sessions``."""
        self._later.append(_Later(weights, frozenset(sessions)))

    def compute_all(self) -> int:
        """Every pending weight gradient, oldest first; returns how many backwards'."""
        done = 0
        while self._later:
            self._compute(self._later.popleft())
            done += 1
        return done

    def compute_for(self, session_id: str) -> None:
        """The weight gradients of backwards that served ``session_id``: every pending one up
        to its last, oldest first (an adapter's gradient then sums in its backwards' order
        whichever session's step comes first)."""
        last = max(
            (i for i, later in enumerate(self._later) if session_id in later.sessions), default=-1
        )
        for _ in range(last + 1):
            self._compute(self._later.popleft())

    def failure(self, session_id: str) -> Exception | None:
        """Why the session's weight gradients failed (once; None if they did not)."""
        return self._failed.pop(session_id, None)

    def _compute(self, later: _Later) -> None:
        self.computed += 1
        try:
            self._add(later.weights)
        except Exception as exc:
            for session_id in later.sessions:
                self._failed.setdefault(session_id, exc)
