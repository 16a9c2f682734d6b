"""Timelines of pipelined steps: events recorded while running, written as Chrome trace JSON.

Open a trace in Perfetto (ui.perfetto.dev) or chrome://tracing to see device compute, link
transfers and server compute side by side.

Runtimes record events under short codes (``F3``: forward of microbatch 3); a written trace
names them for people (``forward mb 3``) and keeps the code and the microbatch in ``args``, with
any other details the recorder gave (``bytes`` of a transfer). Codes:

======  ===========================  ======  ==============================
``F``   forward (device head)        ``a``   activation sent (uplink)
``T``   tail: forward, loss, back    ``o``   output received (downlink)
``B``   backward (device head)       ``g``   output gradient sent (uplink)
``O``   optimizer step               ``i``   input gradient received
``Sf``  server forward               ``Sb``  server backward
======  ===========================  ======  ==============================

Each trace is one process (a numeric ``pid`` with a ``process_name`` metadata event) whose
threads are the lanes (device, uplink, server, downlink).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Event", "Tracer", "readable_name"]

_CODES = {
    "Sf": "server forward",
    "Sb": "server backward",
    "F": "forward",
    "T": "tail",
    "B": "backward",
    "O": "optimizer step",
    "a": "activation",
    "o": "output",
    "g": "output grad",
    "i": "input grad",
    "end": "step end",
    "done": "step done",
}
_CODE = re.compile(r"^(Sf|Sb|end|done|[FTBOaogi])(\d*)$")


def readable_name(code: str) -> tuple[str, int | None]:
    """``"Sf3"`` -> ``("server forward mb 3", 3)``; an unknown code is returned as it is."""
    match = _CODE.match(code)
    if not match:
        return code, None
    kind, number = match.group(1), match.group(2)
    if not number:
        return _CODES[kind], None
    return f"{_CODES[kind]} mb {number}", int(number)


@dataclass(frozen=True)
class Event:
    """One span: ``lane`` is a row of the timeline (device, uplink, server, downlink)."""

    name: str
    lane: str
    start: float
    end: float
    args: dict[str, Any] | None = field(default=None, compare=False)

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

    def add(
        self, name: str, lane: str, start: float, end: float, args: dict[str, Any] | None = None
    ) -> None:
        """Record a span; ``args`` (e.g. ``{"bytes": n}``) go into the written trace."""
        with self._lock:
            if len(self.events) < self.max_events:
                self.events.append(Event(name, lane, start, end, args))

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

    def to_chrome(self, *, pid: int | str = 1, process_name: str = "") -> dict:
        """The events as a Chrome trace (``traceEvents`` with complete ``X`` events, in µs).

        A string ``pid`` (as older callers pass, e.g. ``"device 3"``) becomes the process name,
        and its trailing number (or 1) the numeric pid.
        """
        if isinstance(pid, str):
            process_name = process_name or pid
            digits = re.search(r"(\d+)$", pid)
            pid = int(digits.group(1)) + 1 if digits else 1
        with self._lock:
            events = list(self.events)
        t0 = min((e.start for e in events), default=0.0)
        lanes = _lane_order({e.lane for e in events})
        name = process_name or f"process {pid}"
        out: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}}
        ]
        out += [
            {"name": "thread_name", "ph": "M", "pid": pid, "tid": i, "args": {"name": lane}}
            for i, lane in enumerate(lanes)
        ]
        out += [_chrome_event(e, pid, lanes.index(e.lane), t0) for e in events]
        return {"traceEvents": out, "displayTimeUnit": "ms"}

    def write(self, path: str | Path, *, pid: int | str = 1, process_name: str = "") -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_chrome(pid=pid, process_name=process_name)))
        return path


_LANES = ("device", "uplink", "server", "downlink")


def _lane_order(lanes: set[str]) -> list[str]:
    return [lane for lane in _LANES if lane in lanes] + sorted(lanes - set(_LANES))


def _chrome_event(e: Event, pid: int, tid: int, t0: float) -> dict[str, Any]:
    name, microbatch = readable_name(e.name)
    args: dict[str, Any] = {"code": e.name}
    if microbatch is not None:
        args["microbatch"] = microbatch
    args |= e.args or {}
    return {
        "name": name,
        "ph": "X",
        "pid": pid,
        "tid": tid,
        "ts": (e.start - t0) * 1e6,
        "dur": e.duration * 1e6,
        "args": args,
    }
