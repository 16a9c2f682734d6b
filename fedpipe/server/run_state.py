"""The run and round the ServerApp has begun on this StageServer, in one place.

Session tokens are valid only for the current round of the current run; round-control calls
that need the run's state (the server adapter the ServerApp loaded) are refused by a server
that lacks it, for instance one restarted mid-run: carrying on would train silently wrong.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from fedpipe.errors import AuthError, RunStateError

__all__ = ["Authenticator", "RoundState", "RoundView"]

# (token, round, device_id, run_id, when the round began) -> None; raises AuthError
Authenticator = Callable[[str, int, str, str, float], None]


@dataclass(frozen=True)
class RoundView:
    """The round state at one moment (read under the lock, used after it)."""

    current: int
    run_id: str
    begun: float  # time.time() when BeginRound arrived
    adapter_set: bool  # LoadAdapter (load or reset) since this server started


class RoundState:
    """The current run and round, and whether the run's server adapter was loaded."""

    def __init__(self, authenticate: Authenticator | None = None) -> None:
        self.authenticate = authenticate
        self._view = RoundView(current=0, run_id="", begun=0.0, adapter_set=False)
        self._lock = threading.Lock()

    def view(self) -> RoundView:
        with self._lock:
            return self._view

    @property
    def current(self) -> int:
        return self.view().current

    @property
    def run_id(self) -> str:
        return self.view().run_id

    def begin(self, round_: int, run_id: str) -> None:
        """BeginRound: tokens of ``round_`` of ``run_id`` are valid from now on."""
        with self._lock:
            self._view = RoundView(round_, run_id, time.time(), self._view.adapter_set)

    def adapter_loaded(self) -> None:
        """LoadAdapter: this server now holds the run's server adapter."""
        with self._lock:
            v = self._view
            self._view = RoundView(v.current, v.run_id, v.begun, adapter_set=True)

    def admit(self, token: str, round_: int, device_id: str) -> RoundView:
        """Check a device's session token for ``round_`` (no-op without a secret)."""
        if not device_id:
            raise AuthError("OpenSession needs a device_id")
        view = self.view()
        if self.authenticate is not None:
            if round_ != view.current:
                raise AuthError(
                    f"session for round {round_}, but the server is in round {view.current}"
                )
            self.authenticate(token, round_, device_id, view.run_id, view.begun)
        return view

    def require_run(self, method: str, round_: int = -1) -> None:
        """Refuse a control call that needs the run's state when this server lacks it."""
        view = self.view()
        if not view.adapter_set:
            raise RunStateError(
                f"{method}: this StageServer has not been given the run's server adapter since "
                "it started (it restarted mid-run?): resume with `fedpipe run --resume`, which "
                "reloads it from the last checkpoint"
            )
        if round_ >= 0 and round_ != view.current:
            raise RunStateError(
                f"{method}: round {round_} was not begun on this StageServer (its round is "
                f"{view.current}): resume with `fedpipe run --resume`"
            )
