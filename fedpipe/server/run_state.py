"""The run and round the ServerApp has begun on this StageServer, in one place.

Session tokens are valid only for the current round of the current run (with asynchronous
rounds, for the current version and the ``window`` versions before it); round-control calls
that need the run's state (the server adapter the ServerApp loaded) are refused by a server
that lacks it, for instance one restarted mid-run: carrying on would train silently wrong.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

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
    window: int = 0  # async rounds: the versions admitted, `current` included (0: sync)
    # async rounds: when each admitted version began (the current one's is `begun`)
    versions: dict[int, float] = field(default_factory=dict)

    def began(self, round_: int) -> float | None:
        """When ``round_`` began, if its sessions are admitted now (None: they are not)."""
        if round_ == self.current:
            return self.begun
        if self.current - self.window < round_ < self.current:
            return self.versions.get(round_)
        return None


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

    def begin(self, round_: int, run_id: str, *, window: int = 0) -> None:
        """BeginRound: tokens of ``round_`` of ``run_id`` are valid from now on, and with
        ``window`` > 0 (async rounds) those of the ``window - 1`` versions before it still are."""
        now = time.time()
        with self._lock:
            v = self._view
            kept: dict[int, float] = {}
            if window and run_id == v.run_id:
                older = {**v.versions, v.current: v.begun}
                kept = {r: t for r, t in older.items() if round_ - window < r < round_}
            self._view = RoundView(round_, run_id, now, v.adapter_set, window, kept)

    def adapter_loaded(self) -> None:
        """LoadAdapter: this server now holds the run's server adapter."""
        with self._lock:
            v = self._view
            self._view = RoundView(
                v.current, v.run_id, v.begun, adapter_set=True, window=v.window, versions=v.versions
            )

    def admit(self, token: str, round_: int, device_id: str) -> RoundView:
        """Check a device's session token for ``round_`` (no-op without a secret)."""
        if not device_id:
            raise AuthError("OpenSession needs a device_id")
        view = self.view()
        if self.authenticate is not None:
            began = view.began(round_)
            if began is None:
                where = (
                    f"is in round {view.current}"
                    if not view.window
                    else f"admits versions {view.current - view.window + 1}..{view.current}"
                )
                raise AuthError(f"session for round {round_}, but the server {where}")
            self.authenticate(token, round_, device_id, view.run_id, began)
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
        if round_ >= 0 and view.began(round_) is None:
            raise RunStateError(
                f"{method}: round {round_} was not begun on this StageServer (its round is "
                f"{view.current}): resume with `fedpipe run --resume`"
            )
