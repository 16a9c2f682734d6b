"""Timelines of pipelined steps: events recorded while running, written as Chrome trace JSON.

Open a trace in Perfetto (ui.perfetto.dev) or chrome://tracing to see device compute, link
transfers and server compute side by side.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Event", "Tracer"]


@dataclass(frozen=True)
class Event:
    """One span: ``lane`` is a row of the timeline (device, uplink, server, downlink)."""

    name: str
    lane: str
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


class Tracer:
    """Collects events; thread-safe; bounded so a long run does not grow without limit."""

    def __init__(self, *, max_events: int = 200_000, clock=time.perf_counter) -> None:
        self.events: list[Event] = []
        self.max_events = max_events
        self.clock = clock
        self._lock = threading.Lock()

    def add(self, name: str, lane: str, start: float, end: float) -> None:
        with self._lock:
            if len(self.events) < self.max_events:
                self.events.append(Event(name, lane, start, end))

    @contextmanager
    def span(self, name: str, lane: str) -> Iterator[None]:
        start = self.clock()
        try:
            yield
        finally:
            self.add(name, lane, start, self.clock())

    def durations(self, prefix: str, lane: str | None = None) -> list[float]:
        """Durations of the events whose name starts with ``prefix`` (e.g. ``"T"``)."""
        with self._lock:
            return [
                e.duration
                for e in self.events
                if e.name.startswith(prefix) and (lane is None or e.lane == lane)
            ]

    def clear(self) -> None:
        with self._lock:
            self.events.clear()

    def to_chrome(self, *, pid: str = "fedpipe") -> dict:
        """The events as a Chrome trace (``traceEvents`` with complete ``X`` events, in µs)."""
        with self._lock:
            events = list(self.events)
        t0 = min((e.start for e in events), default=0.0)
        lanes = sorted({e.lane for e in events})
        out = [
            {"name": "thread_name", "ph": "M", "pid": pid, "tid": i, "args": {"name": lane}}
            for i, lane in enumerate(lanes)
        ]
        for e in events:
            out.append(
                {
                    "name": e.name,
                    "ph": "X",
                    "pid": pid,
                    "tid": lanes.index(e.lane),
                    "ts": (e.start - t0) * 1e6,
                    "dur": e.duration * 1e6,
                }
            )
        return {"traceEvents": out, "displayTimeUnit": "ms"}

    def write(self, path: str | Path, *, pid: str = "fedpipe") -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_chrome(pid=pid)))
        return path
