"""A server-side stats hook for ``fedpipe bench server``: compute calls timed, messages counted.

With ``stash`` it also turns on the executor's stash meter
(:class:`fedpipe.server.stash.StashMeter`) where it has one: each snapshot carries the stash
bytes and their peaks since the last one.

It changes nothing in the runtime's code: :meth:`ComputeProbe.install` wraps the executor's
``compute*`` methods on the instance. Each outermost call becomes one record
``(start, end, messages, tokens)`` on ``time.monotonic`` (the same clock in every process of the
machine, so the bench can cut the records to its own measurement window):

- ``messages``: forward and backward messages (``ACTIVATION``, ``OUTPUT_GRAD``) the call computed,
  found among its arguments (a ``StageMsg``, or lists/tuples/dicts of them, as a batched call
  takes). An optimizer step (``STEP_END``) is a call with 0 messages: busy time, not batch size.
- ``tokens``: rows x tokens of those messages' tensors.

With today's one-message-at-a-time runtime every forward or backward is its own call, so the
mean batch is 1.0 by counting; a batched runtime that computes several sessions' messages in
one ``compute*`` call shows its batch sizes here without any change to this module.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from fedpipe.messages import Kind, StageMsg

__all__ = ["ComputeProbe", "CallRecord", "window_stats"]

CallRecord = tuple[float, float, int, int]  # (start, end, messages, tokens)
_WORK = (Kind.ACTIVATION, Kind.OUTPUT_GRAD)
# How deep messages are looked for: (args, kwargs), then an argument, then 3 levels of its
# lists/tuples/dicts (e.g. a list of (session, message) pairs).
_SEARCH_DEPTH = 5


class ComputeProbe:
    """Times a :class:`~fedpipe.server.runtime.StageRuntime`'s compute calls."""

    def __init__(
        self,
        runtime: Any,
        *,
        max_calls: int = 200_000,
        cuda_events: bool = False,
        stash: bool = False,
    ) -> None:
        self.runtime = runtime
        self.stash = stash  # also count the executor's stash bytes (its StashMeter)
        self.cuda_events = cuda_events  # also time each call on the GPU stream (gpu_busy_s)
        self._events: list[tuple[Any, Any]] = []
        self.calls: deque[CallRecord] = deque(maxlen=max_calls)
        self._lock = threading.Lock()
        self._local = threading.local()
        self.wrapped: list[str] = []
        self._meter: Any = None

    def install(self) -> ComputeProbe:
        """Wrap the executor's ``compute*`` methods; returns self."""
        executor = self.runtime.executor
        for name in dir(type(executor)):
            if name.startswith("compute") and callable(getattr(executor, name)):
                setattr(executor, name, self._timed(getattr(executor, name)))
                self.wrapped.append(name)
        if not self.wrapped:
            raise RuntimeError(
                f"{type(executor).__name__} has no compute* method to time; update "
                "benchmarks/fedpipe_bench/server_probe.py to the runtime's executor"
            )
        meter = getattr(getattr(executor, "stash", None), "meter", None)
        if self.stash and meter is not None:  # the stash bytes (peak_stash_bytes), from now
            meter.enabled = True
            self._meter = meter
        return self

    def snapshot(self) -> dict[str, Any]:
        """Records since the last snapshot, this process's CPU seconds and the clock now."""
        with self._lock:
            calls, self.calls = list(self.calls), deque(maxlen=self.calls.maxlen)
        times = os.times()
        stash = None if self._meter is None else self._meter.snapshot(reset=True)
        return {
            "calls": calls,
            "cpu_s": times.user + times.system,
            "now": time.monotonic(),
            "wrapped": self.wrapped,
            "stash": stash,  # stash bytes now and their peaks since the last snapshot
        }

    def gpu_busy_s(self) -> float:
        """GPU seconds between each call's start and end events since the last ask (syncs).

        Launch gaps inside a call count as busy; gaps between calls (decoding, scheduling,
        Python between batches) are what ``1 - gpu_busy_s / wall`` shows as idle.
        """
        import torch

        torch.cuda.synchronize()
        with self._lock:
            events, self._events = self._events, []
        return sum(start.elapsed_time(end) for start, end in events) / 1e3

    def _timed(self, method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._local, "inside", False):  # a compute* calling another
                return method(*args, **kwargs)
            self._local.inside = True
            started = _cuda_event() if self.cuda_events else None
            start = time.monotonic()
            try:
                return method(*args, **kwargs)
            finally:
                self._local.inside = False
                if started is not None:
                    self._events.append((started, _cuda_event()))
                self._record(start, time.monotonic(), list(_messages([args, kwargs])))

        return timed

    def _record(self, start: float, end: float, found: list[StageMsg]) -> None:
        work = [m for m in found if m.kind in _WORK]
        with self._lock:
            self.calls.append((start, end, len(work), sum(_tokens(m) for m in work)))


def _cuda_event() -> Any:
    """A timing CUDA event recorded now on the current stream."""
    import torch

    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _messages(value: Any, depth: int = _SEARCH_DEPTH) -> Iterable[StageMsg]:
    """Every ``StageMsg`` in ``value``, looking ``depth`` levels into containers."""
    if isinstance(value, StageMsg):
        yield value
    elif depth > 0 and isinstance(value, list | tuple | dict):
        items = value.values() if isinstance(value, dict) else value
        for item in items:
            yield from _messages(item, depth - 1)


def _tokens(msg: StageMsg) -> int:
    t = msg.tensor
    return int(t.shape[0] * t.shape[1]) if t is not None and t.dim() >= 2 else 0


def window_stats(calls: Iterable[CallRecord], start: float, end: float) -> dict[str, float]:
    """Server figures over the window ``[start, end]`` from compute-call records.

    ``busy``: the fraction of the window inside compute calls (each call clipped to the
    window). ``mean_batch``: forward/backward messages per call that computed any, over the
    calls that began in the window (1.0 when there were none: nothing was batched).
    ``busy_s``, ``calls`` and ``messages`` are the sums behind them.
    """
    if end <= start:
        raise ValueError(f"window must end after it starts, got [{start}, {end}]")
    busy = 0.0
    batches: list[int] = []
    for c_start, c_end, messages, _ in calls:
        busy += max(0.0, min(c_end, end) - max(c_start, start))
        if start <= c_start < end and messages > 0:
            batches.append(messages)
    return {
        "busy": busy / (end - start),
        "busy_s": busy,
        "mean_batch": sum(batches) / len(batches) if batches else 1.0,
        "calls": float(len(batches)),
        "messages": float(sum(batches)),
    }
