"""The StageServer's store of devices' delta caches between their sessions (one per round).

Delta coding (:mod:`fedpipe.compress.delta`) pays off when a device sees a sample again,
which in federated training mostly happens a round or more later. So when a session's
stream ends cleanly the server keeps the session's cache here, under the device's
authenticated id, and the device's next session may resume it (``OpenSession``):

- **Resume only on an exact match.** The device describes its own cache by a
  :class:`~fedpipe.compress.delta.CacheIdentity` (random id, committed rows, running
  digest); the server resumes its copy only if the identity, the cache size and the uplink
  codec all match. Anything else (the server or the device restarted, a step failed half
  way, a cache was evicted, another device's id, a new codec or size) starts both sides
  empty: one round of full sends, never a wrong base.
- **Bounded.** Each cache is at most ``server.max_delta_cache_mb`` (checked at OpenSession);
  the store holds at most ``server.delta_store_mb`` in all and evicts the devices whose
  caches were kept longest ago. A cache in use by a live session is not in the store.
- **Closed sessions only.** A cache is kept when the session's stream has been read to its end,
  and may resume only after the device closed the session (``CloseSession``): a stream the
  device cancelled can end on the server like a clean half-close.
- **Per run.** A new run (``BeginRound`` with another ``run_id``) empties the store, and a
  session opened in one run cannot put its cache back into another.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, replace

from fedpipe.compress.delta import CacheIdentity, DeltaCache
from fedpipe.errors import StageCapacityError
from fedpipe.server.budget import ByteBudget

__all__ = ["DeltaStore", "Resumed"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Kept:
    """A device's cache between sessions, with what it was made for."""

    cache: DeltaCache
    codec: str  # the uplink codec of the session that filled it
    session_id: str = ""  # the session that filled it
    # Whether that session was closed by the device (CloseSession). A stream the device
    # cancelled can end on the server like a clean half-close; only the close says it was.
    closed: bool = True


@dataclass(frozen=True)
class Resumed:
    """What OpenSession gives a delta session: its cache, and why it starts empty if it does."""

    cache: DeltaCache
    resumed: bool
    reason: str = ""  # empty when resumed


class DeltaStore:
    """Devices' delta caches between sessions: at most ``max_bytes`` in all, LRU over devices."""

    def __init__(self, max_bytes: int, budget: ByteBudget | None = None) -> None:
        if max_bytes < 0:
            raise ValueError(f"server.delta_store_mb must be >= 0, got {max_bytes} bytes")
        self.max_bytes = max_bytes
        self.budget = budget  # the server's: kept caches draw from it too
        self.run_id = ""
        self._kept: OrderedDict[str, _Kept] = OrderedDict()  # oldest kept first
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(k.cache.nbytes for k in self._kept.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._kept)

    def begin_run(self, run_id: str) -> None:
        """A round of ``run_id`` begins: a new run starts with no device's cache."""
        with self._lock:
            if run_id != self.run_id and self._kept:
                log.info("new run %r: dropping %d devices' delta caches", run_id, len(self._kept))
                self._give(sum(k.cache.nbytes for k in self._kept.values()))
                self._kept.clear()
            self.run_id = run_id

    def take(self, device_id: str, wanted: CacheIdentity, *, max_bytes: int, codec: str) -> Resumed:
        """The cache for ``device_id``'s new session: its kept one if ``wanted`` matches it.

        The kept cache leaves the store either way (a session owns its cache until it puts
        it back), so a mismatch also frees its memory.
        """
        with self._lock:
            kept = self._kept.pop(device_id, None)
            if kept is not None:
                self._give(kept.cache.nbytes)  # the session's own share holds it from here
        reason = _mismatch(kept, wanted, max_bytes, codec)
        if kept is not None and not reason:
            return Resumed(kept.cache, resumed=True)
        return Resumed(DeltaCache(max_bytes, cache_id=wanted.cache_id), False, reason)

    def keep(
        self, device_id: str, cache: DeltaCache, *, codec: str, run_id: str, session_id: str = ""
    ) -> None:
        """Keep ``device_id``'s cache after its stream of ``run_id`` was read to the end; evict
        the oldest. With ``session_id`` it resumes only once :meth:`confirm` says the device
        closed that session (without: at once)."""
        if not cache.cache_id:
            return  # the device keeps no cache across sessions: nothing to resume
        with self._lock:
            if run_id != self.run_id:
                return  # the session began in an earlier run
            old_kept = self._kept.pop(device_id, None)
            if old_kept is not None:
                self._give(old_kept.cache.nbytes)
            if cache.nbytes > self.max_bytes:
                log.info("delta cache of %s (%d bytes) exceeds the store", device_id, cache.nbytes)
                return
            if self.budget is not None:
                try:
                    self.budget.take(cache.nbytes, f"keeping {device_id}'s delta cache")
                except StageCapacityError as exc:
                    log.info("delta cache of %s not kept: %s", device_id, exc)
                    return
            self._kept[device_id] = _Kept(cache, codec, session_id, closed=not session_id)
            total = sum(k.cache.nbytes for k in self._kept.values())
            while total > self.max_bytes:
                evicted, old = self._kept.popitem(last=False)
                total -= old.cache.nbytes
                self._give(old.cache.nbytes)
                log.info(
                    "delta store full: evicted %s's cache (%d bytes)", evicted, old.cache.nbytes
                )

    def confirm(self, session_id: str) -> bool:
        """The device closed ``session_id`` (CloseSession): its kept cache may resume."""
        with self._lock:
            for device_id, kept in self._kept.items():
                if kept.session_id == session_id:
                    self._kept[device_id] = replace(kept, closed=True)
                    return True
        return False

    def _give(self, nbytes: int) -> None:
        if self.budget is not None:
            self.budget.give(nbytes)

    def get(self, device_id: str) -> DeltaCache | None:
        """``device_id``'s kept cache, if any (to inspect it: a session must ``take`` it)."""
        with self._lock:
            kept = self._kept.get(device_id)
        return kept.cache if kept is not None else None


def _mismatch(kept: _Kept | None, wanted: CacheIdentity, max_bytes: int, codec: str) -> str:
    """Why ``kept`` cannot resume as the device's cache ``wanted`` ("" if it can)."""
    if not wanted.cache_id:
        return "the device keeps no cache across sessions"
    if wanted.entries == 0:
        return "the device's cache is empty"
    if kept is None:
        return "the server holds no cache for this device (restarted, evicted or new run)"
    if not kept.closed:
        return (
            "the server holds no cache from a closed session: the device's last session "
            "ended without CloseSession (it failed or vanished)"
        )
    have = kept.cache.identity
    if have.cache_id != wanted.cache_id:
        return "the device's cache is another one than the server's (device restarted?)"
    if have.entries != wanted.entries:
        return (
            f"the caches' histories differ ({wanted.entries} rows on the device, "
            f"{have.entries} on the server: a session failed part way?)"
        )
    if have.digest != wanted.digest:
        return f"the caches' digests differ after {have.entries} rows: their contents differ"
    if kept.cache.max_bytes != max_bytes:
        return f"the cache size changed ({kept.cache.max_bytes} -> {max_bytes} bytes)"
    if kept.codec != codec:
        return f"the uplink codec changed ({kept.codec} -> {codec})"
    return ""
