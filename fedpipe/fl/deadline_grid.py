"""How the ServerApp waits in a round: for devices to connect, then for their replies.

Flower's strategies wait for ``min_available_nodes`` without limit and give the user no word
while they wait; an error reply names the SuperLink, not the device that failed. fedpipe's
round policy, as a :class:`DeadlineGrid` between the strategy and Flower's grid:

- before a round, wait up to ``connect_wait_s`` for every device, then start with those that
  are connected if there are at least ``min_devices`` (else the run stops with the reason);
  later rounds wait only for the last round's devices that Flower still lists, so a device
  Flower reports gone (its heartbeat expired) costs no wait at all;
- after sending, wait for replies no longer than ``deadline_s``, and (``straggler_s`` > 0) no
  longer than ``straggler_s`` after the first device replied; a device that has not replied
  by then is a failure ("no reply within ...");
- while replies are out (with a :class:`~fedpipe.fl.progress.StepWatch`), log a
  ``progress`` record every few seconds when it changed, and every ``report_every_s`` when
  it did not: each device's steps done (the StageServer's count) and state;
- every ``report_every_s`` of waiting, log a ``waiting`` record naming whom it waits for:
  before a round, the devices not connected; while replies are out, only the devices that
  are late, each with why (without a watch, or when the StageServer cannot say: every device
  still out);
- each error reply is logged as a ``failure`` record as soon as it arrives, mapped back to
  its device through ``reply_to_message_id`` (in deployment the SuperLink, not the device,
  answers for a node that vanished).

Records go through ``log`` (the run folder's metrics.jsonl, read live by ``fedpipe simulate``
and ``fedpipe run``, which print them).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from flwr.app import Message, MessageType
from flwr.serverapp import Grid

from fedpipe.errors import one_line
from fedpipe.fl.progress import DeviceProgress, StepWatch
from fedpipe.fl.replies import TrainReply

__all__ = ["DeadlineGrid", "DeviceBook", "StopRun", "clean_reason"]

Record = dict[str, Any]


class StopRun(RuntimeError):
    """The round policy ends the run early (the reason is said and recorded)."""


@dataclass(frozen=True)
class DeviceInfo:
    """What the ServerApp knows of one Flower node, from its replies."""

    partition: int
    profile: str

    @property
    def name(self) -> str:
        suffix = f" ({self.profile})" if self.profile else ""
        return f"partition {self.partition}{suffix}"


class DeviceBook:
    """Flower node id -> the device behind it (partition, profile), learned from replies."""

    def __init__(self) -> None:
        self.known: dict[int, DeviceInfo] = {}

    def learn(self, node_id: int, reply: Message) -> DeviceInfo:
        said = TrainReply.read(reply.content)
        info = DeviceInfo(said.partition, said.profile)
        self.known[node_id] = info
        return info

    def name(self, node_id: int) -> str:
        info = self.known.get(node_id)
        return info.name if info else f"node {node_id} (not heard from yet)"

    def names(self, node_ids: Iterable[int]) -> list[str]:
        """Known devices by name; the others (before their first reply) as a count."""
        ids = list(node_ids)
        names = sorted(self.known[n].name for n in ids if n in self.known)
        unknown = sum(1 for n in ids if n not in self.known)
        if unknown:
            names.append(f"{unknown} device{'s' if unknown > 1 else ''} not heard from yet")
        return names

    def fields(self, node_id: int) -> Record:
        """The device fields of a record about ``node_id``."""
        info = self.known.get(node_id)
        out: Record = {"device": self.name(node_id), "node_id": node_id}
        if info is not None:
            out |= {"partition": info.partition, "profile": info.profile}
        return out


_FLOWER_WRAPPED = re.compile(r"Message:\s*(.*?)'?>?\s*$", re.DOTALL)
_IDENTITY = re.compile(r"^\[partition (-?\d+) \(([^)]*)\)\]\s*")


def clean_reason(reason: str) -> str:
    """Flower's ``<class '...ClientAppException'>:<'\\nException ... Message: why'>`` -> ``why``."""
    match = _FLOWER_WRAPPED.search(reason)
    return one_line(match.group(1) if match else reason, 400)


def identity_from_reason(reason: str) -> tuple[DeviceInfo | None, str]:
    """The ``[partition P (profile)]`` prefix the ClientApp puts on its errors, and the rest."""
    match = _IDENTITY.match(reason)
    if not match:
        return None, reason
    return DeviceInfo(int(match.group(1)), match.group(2)), reason[match.end() :]


@dataclass
class _Progress:
    """A round's progress while its replies are out: what was looked at and last said."""

    watch: StepWatch
    nodes: list[int]
    outcome: dict[int, str] = field(default_factory=dict)  # node -> done | failed
    devices: list[DeviceProgress] | None = None  # the last look (None: the server cannot say)
    looked: float = -math.inf
    said: list[tuple[int, int, str]] | None = None
    said_at: float = -math.inf


def _no_round() -> int:
    return 0


class DeadlineGrid(Grid):
    """Flower's grid with fedpipe's round policy (see the module docstring). ``number``: the
    run's round under way, as its owner (the strategy) counts it, for the records."""

    def __init__(
        self,
        grid: Grid,
        *,
        number: Callable[[], int] = _no_round,
        log: Callable[[Record], None],
        devices: DeviceBook,
        deadline_s: float,
        report_every_s: float,
        straggler_s: float = 0.0,
        poll_s: float = 1.0,
        watch: StepWatch | None = None,
    ) -> None:
        self.grid, self.log, self.devices = grid, log, devices
        self.deadline_s, self.report_every_s, self.poll_s = deadline_s, report_every_s, poll_s
        self.straggler_s = straggler_s
        self.watch = watch
        self.number = number
        self.failures: list[Record] = []  # this round's, as logged
        self.last_nodes: list[int] | None = None  # the nodes the last round began with
        self._progress: _Progress | None = None  # the round's, while its replies are out

    # -- waiting for devices ----------------------------------------------------------------
    def wait_for_devices(self, *, want: int, min_devices: int, wait_s: float) -> list[int]:
        """Connected node ids once ``want`` are connected, or after ``wait_s`` if >= min.

        After the first round, the round waits only for the devices of the last round that
        Flower still lists (a device Flower reports gone, its heartbeat expired, is not waited
        for) and starts at once with them when there are at least ``min_devices``.
        """
        start = last = time.monotonic()
        while len(nodes := list(self.grid.get_node_ids())) < self._expected(
            nodes, want, min_devices
        ):
            now = time.monotonic()
            if now - start >= wait_s:
                break
            if now - last >= self.report_every_s:
                last = now
                self._log_connect_wait(nodes, want, now - start, wait_s)
            time.sleep(min(self.poll_s, max(wait_s - (now - start), 0.01)))
        if len(nodes) < min_devices:
            if self.last_nodes is not None:  # the devices the round hoped for
                want = min(want, max(len(self.last_nodes), min_devices))
            raise StopRun(
                f"round {self.number()}: only {len(nodes)} of {want} devices connected after "
                f"{wait_s:.0f} s (federated.min_devices={min_devices}); start more devices "
                "or lower federated.min_devices"
            )
        if len(nodes) < self._expected(nodes, want, min_devices):
            self._log_connect_wait(nodes, want, time.monotonic() - start, wait_s, going=True)
        self.last_nodes = nodes
        return nodes

    def _expected(self, nodes: list[int], want: int, min_devices: int) -> int:
        """How many connected devices the round starts with: ``want``, or after the first
        round, the last round's devices Flower still lists (at least ``min_devices``)."""
        if self.last_nodes is None:
            return want
        alive = len(set(self.last_nodes) & set(nodes))
        return min(want, max(alive, min_devices))

    def _log_connect_wait(
        self, nodes: list[int], want: int, waited: float, wait_s: float, *, going: bool = False
    ) -> None:
        missing = sorted(self.devices.name(n) for n in set(self.devices.known) - set(nodes))
        self.log(
            {
                "event": "waiting",
                "phase": "start" if going else "connect",
                "round": self.number(),
                "connected": len(nodes),
                "want": want,
                "waiting_for": missing,
                "waited_s": round(waited, 1),
                "deadline_s": wait_s,
            }
        )

    # -- sending and receiving --------------------------------------------------------------
    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Push, then pull replies until all are in or ``deadline_s`` has passed.

        ``timeout`` (the strategy's) is ignored in favour of the round deadline.
        """
        messages = list(messages)
        self.failures = []
        if not messages:
            return []
        ids = list(self.grid.push_messages(messages))
        pending: dict[str, int] = {}
        for msg_id, msg in zip(ids, messages, strict=True):
            if msg_id:
                pending[msg_id] = msg.metadata.dst_node_id
            else:
                self.failure(msg.metadata.dst_node_id, "Flower could not send it the round")
        training = any(m.metadata.message_type == MessageType.TRAIN for m in messages)
        if self.watch is not None and training:
            self._progress = _Progress(self.watch, list(pending.values()))
        try:
            return self._collect(pending)
        finally:
            self._progress = None

    def _collect(self, pending: dict[str, int]) -> list[Message]:
        replies: list[Message] = []
        start = last = time.monotonic()
        end, why = start + self.deadline_s, f"the round deadline ({self.deadline_s:g} s)"
        while pending:
            for reply in self.grid.pull_messages(list(pending)):
                node = pending.pop(reply.metadata.reply_to_message_id, None)
                node = reply.metadata.src_node_id if node is None else node
                replies.append(reply)
                if reply.has_error():
                    self.failure(node, reply.error.reason or f"error code {reply.error.code}")
                    continue
                self._replied(node, "done")
                self.devices.learn(node, reply)
                if self.straggler_s > 0 and time.monotonic() + self.straggler_s < end:
                    end = time.monotonic() + self.straggler_s
                    why = f"{self.straggler_s:g} s of the first reply (federated.straggler_s)"
            now = time.monotonic()
            if not pending or now >= end:
                break
            self._look(now - start)
            if now - last >= self.report_every_s:
                last = now
                self._log_reply_wait(pending.values(), now - start, end - start)
            time.sleep(min(self.poll_s, max(end - now, 0.01)))
        for node in pending.values():
            self.failure(node, f"no reply within {why}")
        self._look(time.monotonic() - start, final=True)
        return replies

    def _replied(self, node: int, outcome: str) -> None:
        if self._progress is not None:
            self._progress.outcome[node] = outcome

    def _look(self, waited: float, *, final: bool = False) -> None:
        """The round's ``progress`` record, when it changed since the last one (looked at every
        ``watch.every_s``) or ``report_every_s`` after it; at the end, when it changed."""
        progress = self._progress
        if progress is None:
            return
        now = time.monotonic()
        if not final and now - progress.looked < progress.watch.every_s:
            return
        progress.looked = now
        devices = progress.watch.look(self.number(), progress.nodes, progress.outcome, waited)
        progress.devices = devices
        if devices is None:
            return
        key = [(d.node_id, d.steps_done, d.state) for d in devices]
        if key == progress.said and (final or now - progress.said_at < self.report_every_s):
            return
        progress.said, progress.said_at = key, now
        self.log(
            {
                "event": "progress",
                "round": self.number(),
                "elapsed_s": round(waited, 1),
                "steps": progress.watch.steps,
                "devices": [self._device_progress(d) for d in devices],
            }
        )

    def _device_progress(self, progress: DeviceProgress) -> Record:
        """One device in a progress record: kept small, as a round logs many of them."""
        record: Record = {"node_id": progress.node_id}
        info = self.devices.known.get(progress.node_id)
        if info is not None:
            record["partition"] = info.partition
        record |= {"steps_done": progress.steps_done, "state": progress.state}
        if progress.why:
            record["why"] = progress.why
        return record

    def _log_reply_wait(self, nodes: Iterable[int], waited: float, limit: float) -> None:
        """Whom the round waits for: the late devices and why (all still out, if unknown)."""
        known = self._progress.devices if self._progress is not None else None
        late = [] if known is None else [d for d in known if d.state == "late"]
        if known is not None and not late:
            return  # every device still out is on time: the progress records say how far
        record: Record = {"event": "waiting", "phase": "replies", "round": self.number()}
        if known is None:
            record["waiting_for"] = self.devices.names(nodes)
        else:
            record["waiting_for"] = [self.devices.name(d.node_id) for d in late]
            record["why"] = [d.why for d in late]
        record |= {"waited_s": round(waited, 1), "deadline_s": round(limit, 1)}
        self.log(record)

    def failure(self, node: int, reason: str) -> None:
        """Record and report that ``node`` failed this round (``reason`` may be Flower's)."""
        info, why = identity_from_reason(clean_reason(reason))
        if info is not None and node not in self.devices.known:
            self.devices.known[node] = info
        record = {"event": "failure", "round": self.number(), **self.devices.fields(node)}
        record["reason"] = why
        self._replied(node, "failed")
        self.failures.append(record)
        self.log(record)

    # -- the rest is Flower's grid ----------------------------------------------------------
    def set_run(self, run: Any) -> None:
        self.grid.set_run(run)

    @property
    def run(self) -> Any:
        return self.grid.run

    def create_message(self, *args: Any, **kwargs: Any) -> Message:
        return self.grid.create_message(*args, **kwargs)

    def get_node_ids(self) -> Iterable[int]:
        return self.grid.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self.grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self.grid.pull_messages(message_ids)
