"""Buffered asynchronous rounds (FedBuff, Nguyen et al. 2022): a slow device never holds a round.

``federated.mode = "async"``: the ServerApp pushes work to every free device at the current
*version* of the global adapters, pulls replies as they come, and once exactly
``federated.buffer`` (K) replies are in, aggregates those K and moves to the next version; the
devices that are free then get it at once. Each reply names the version it started from (its
train order's round); its staleness is how many versions were aggregated since. A reply staler
than ``federated.max_staleness`` is refused and counted; the others weigh their examples times
the staleness weight (``federated.staleness``: ``constant``, ``poly:a`` = ``1/(1+s)^a``,
``hinge:a,b`` = 1 up to ``b``, then ``1/(1 + a (s - b))``).

Both halves of the split move together: a device's head/tail adapters and the StageServer's
session adapter of the middle trained as a pair from the same version, and the K-batch commits
both with the same weights, each as its update against the version it started from
(:func:`~fedpipe.lora.aggregation.apply_updates` on both sides). The StageServer keeps the
globals of the last ``max_staleness`` versions, so a device's session starts from the version
its token names.

The loop is built on the run's :class:`~fedpipe.fl.rounds.FedpipeStrategy` (its train orders,
reply checks, the server's counts, records and stop policy): only the order of events differs
from a synchronous round. A version's record is the round's record, numbered by version.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp.strategy import Result

from fedpipe.config import FederatedConfig, parse_staleness
from fedpipe.fl.deadline_grid import DeadlineGrid
from fedpipe.fl.replies import TrainReply
from fedpipe.lora.aggregation import apply_updates, split_deltas
from fedpipe.wire.control_client import Committed

__all__ = ["Buffer", "BufferedRounds", "Refusal", "Staleness", "Taken"]

log = logging.getLogger(__name__)

State = dict[str, torch.Tensor]
_POLL_S = 0.2  # how often the loop pulls replies (a SuperLink answers every few seconds anyway)


@dataclass(frozen=True)
class Staleness:
    """How much a reply ``s`` versions stale weighs, relative to a fresh one."""

    rule: str = "constant"
    a: float = 0.5
    b: float = 0.0

    @classmethod
    def parse(cls, text: str) -> Staleness:
        rule, a, b = parse_staleness(text)
        return cls(rule, a, b)

    def weight(self, s: int) -> float:
        if s < 0:
            raise ValueError(f"staleness is a count of versions, got {s}")
        if self.rule == "poly":
            return float((1.0 + s) ** -self.a)
        if self.rule == "hinge":
            return 1.0 if s <= self.b else 1.0 / (1.0 + self.a * (s - self.b))
        return 1.0


@dataclass(frozen=True)
class Taken:
    """A reply let into the buffer: its device, the version it started from, its weight."""

    reply: Message
    node: int
    version: int
    examples: int


@dataclass(frozen=True)
class Refusal:
    """Why a reply was not let into the buffer: ``kind`` (stale, duplicate) and in words."""

    kind: str
    why: str


@dataclass
class Buffer:
    """Replies waiting to be aggregated, in arrival order, and what was refused.

    ``take`` lets a reply in unless it is staler than ``max_staleness`` or its device already
    replied for that version (either is counted and said why); ``full`` when K are in, and
    ``pop`` hands exactly K over (the rest wait for the next version).
    """

    size: int
    max_staleness: int
    waiting: list[Taken] = field(default_factory=list)
    seen: set[tuple[int, int]] = field(default_factory=set)  # (node, version) let in
    stale: int = 0
    duplicates: int = 0

    def take(self, reply: Message, node: int, version: int, now: int) -> Refusal | None:
        """Let ``reply`` (of ``node``, from ``version``) in at version ``now``; None, or why not."""
        if (node, version) in self.seen:
            return self.refuse_again(version)
        if now - version > self.max_staleness:
            self.stale += 1
            return Refusal(
                "stale",
                f"its update is {now - version} versions stale (from version {version}, the "
                f"global is at {now}), more than federated.max_staleness={self.max_staleness}",
            )
        self.seen.add((node, version))
        examples = TrainReply.read(reply.content).num_examples
        self.waiting.append(Taken(reply, node, version, examples))
        return None

    def refuse_again(self, version: int) -> Refusal:
        """A device's second reply for ``version``: counted, never aggregated."""
        self.duplicates += 1
        return Refusal("duplicate", f"it replied twice for version {version}: refused")

    @property
    def full(self) -> bool:
        return len(self.waiting) >= self.size

    def pop(self) -> list[Taken]:
        taken, self.waiting = self.waiting[: self.size], self.waiting[self.size :]
        return taken


class _Round(Protocol):
    """What the loop uses of the run's :class:`~fedpipe.fl.rounds.FedpipeStrategy`."""

    policy: FederatedConfig
    grid: DeadlineGrid
    number: int
    log: Callable[[dict[str, Any]], None]

    def begin_version(self, version: int, arrays: State) -> None: ...

    def orders(self, messages: Iterable[Message]) -> list[Message]: ...

    def valid_replies(self, replies: list[Message]) -> list[Message]: ...

    def weigh_by_server(self, replies: list[Message], number: int = -1) -> list[Message]: ...

    def commit_updates(
        self, merge: list[tuple[str, int, float]], discard: list[tuple[str, int]]
    ) -> Committed: ...

    def recorded(
        self,
        ok: list[Message],
        commit: tuple[int, int],
        dropped: dict[str, str],
        failures: list[dict[str, Any]],
    ) -> None: ...


@dataclass
class _Out:
    """A train message out to a device: the version it carries and when it went."""

    node: int
    version: int
    sent: float


class BufferedRounds:
    """``federated.rounds`` versions of buffered asynchronous aggregation (module docstring)."""

    def __init__(self, round_: _Round) -> None:
        fed = round_.policy
        self.round = round_
        self.grid = round_.grid
        self.staleness = Staleness.parse(fed.staleness)
        self.server_lr = fed.buffer_lr  # both sides step by it (the server: commit_updates)
        self.buffer = Buffer(fed.buffer, fed.max_staleness)
        self.deadline_s = fed.round_deadline_s
        self.out: dict[str, _Out] = {}  # message id -> the device and version it carries
        self.answered: dict[str, _Out] = {}  # replied to, as long as their version may be
        self.given: dict[int, int] = {}  # node -> the last version it was sent
        self.globals: dict[int, State] = {}  # version -> the device global (the window)
        self.failures: list[dict[str, Any]] = []  # since the last aggregation
        self.discard: list[tuple[str, int]] = []  # (device, version): sessions not merged

    def run(
        self,
        arrays: State,
        *,
        versions: int,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """``versions`` aggregations from the global device adapters ``arrays``.

        As in a synchronous run, the number the run is at is the version being built: its
        devices train from the global the versions before made, and its aggregation makes
        the global it names (its record, evaluation and checkpoint).
        """
        round_, fed = self.round, self.round.policy
        first = round_.number  # a resumed run goes on from its version
        result = Result(arrays=ArrayRecord(arrays))
        if evaluate_fn is not None:
            evaluate_fn(0, result.arrays)
        self.grid.wait_for_devices(
            want=fed.num_devices, min_devices=fed.min_devices, wait_s=fed.connect_wait_s
        )
        self._begin(first + 1, arrays)
        while True:
            self._dispatch()
            self._pull()
            self._expire()
            if not self.buffer.full:
                time.sleep(_POLL_S)
                continue
            arrays = self._aggregate()
            result.arrays = ArrayRecord({k: v.contiguous() for k, v in arrays.items()})
            if evaluate_fn is not None:
                evaluate_fn(round_.number - first, result.arrays)
            if round_.number >= first + versions:
                break
            self._begin(round_.number + 1, arrays)
        self._cancel_out()
        return result

    # -- versions ---------------------------------------------------------------------------
    def _begin(self, version: int, arrays: State) -> None:
        """Version ``version`` is being built from ``arrays``: devices get them from now on."""
        self.round.begin_version(version, arrays)
        self.globals[version] = split_deltas(arrays)[0]
        oldest = version - self.buffer.max_staleness
        for old in [v for v in self.globals if v < oldest]:
            del self.globals[old]
        for msg_id in [m for m, o in self.answered.items() if o.version < oldest]:
            del self.answered[msg_id]

    def _dispatch(self) -> None:
        """Every connected device with no work out that has not had the current version
        gets it (one that has waits for the next: an update per device and version)."""
        version = self.round.number
        busy = {o.node for o in self.out.values()}
        free = [
            n for n in self.grid.get_node_ids() if n not in busy and self.given.get(n, -1) < version
        ]
        if not free:
            return
        arrays = ArrayRecord(self.globals[version])
        config = ConfigRecord(
            {"server-round": version, "proximal-mu": self.round.policy.proximal_mu}
        )
        messages = [
            self.grid.create_message(
                RecordDict({"arrays": arrays, "config": ConfigRecord(dict(config))}),
                MessageType.TRAIN,
                node,
                str(version),
            )
            for node in free
        ]
        ordered = self.round.orders(messages)
        now = time.monotonic()
        for msg_id, msg in zip(self.grid.push_messages(ordered), ordered, strict=True):
            node = msg.metadata.dst_node_id
            self.given[node] = version
            if msg_id:
                self.out[msg_id] = _Out(node, version, now)
            else:
                self._fail(node, "Flower could not send it the version")

    def _pull(self) -> None:
        """Take every reply that has arrived: checked, weighed by the server, into the buffer."""
        if not self.out:
            return
        for reply in self.grid.pull_messages(list(self.out)):
            msg_id = reply.metadata.reply_to_message_id
            sent = self.out.pop(msg_id, None)
            if sent is None:  # a second reply to one message, or one past its deadline
                again = self.answered.get(msg_id)
                if again is not None and (again.node, again.version) in self.buffer.seen:
                    self._refuse(again, self.buffer.refuse_again(again.version))
                continue
            self.answered[msg_id] = sent
            if reply.has_error():
                self._fail(sent, reply.error.reason or f"error code {reply.error.code}")
                continue
            self.grid.devices.learn(sent.node, reply)
            kept = self.round.valid_replies([reply])
            if not kept:  # its failure is recorded by the reply checks
                self.discard.append((str(sent.node), sent.version))
                continue
            self.round.weigh_by_server(kept, sent.version)
            refused = self.buffer.take(kept[0], sent.node, sent.version, self.round.number)
            if refused is not None:
                self._refuse(sent, refused)

    def _expire(self) -> None:
        """A device whose reply is not in within the round deadline fails; it is free again."""
        now = time.monotonic()
        for msg_id, sent in list(self.out.items()):
            if now - sent.sent >= self.deadline_s:
                del self.out[msg_id]
                self._fail(sent, f"no reply within the round deadline ({self.deadline_s:g} s)")

    def _cancel_out(self) -> None:
        """At the end: replies still out are not waited for (their sessions are reaped)."""
        if self.out:
            log.info("async run: %d device updates still out are not waited for", len(self.out))
        self.discard += [(str(o.node), o.version) for o in self.out.values()]
        self.out.clear()
        if self.discard:
            self.round.commit_updates([], self.discard)
            self.discard = []

    # -- aggregation ------------------------------------------------------------------------
    def _aggregate(self) -> State:
        """Exactly K replies: both sides' updates, each against its own version, one weight."""
        round_, version = self.round, self.round.number
        taken = self.buffer.pop()
        weights = {
            str(t.node): t.examples * self.staleness.weight(version - t.version) for t in taken
        }
        merge = [(str(t.node), t.version, weights[str(t.node)]) for t in taken]
        committed = round_.commit_updates(merge, self.discard)
        self.discard = []
        dropped = committed.dropped
        kept = [t for t in taken if str(t.node) not in dropped]
        current = self.globals[version]
        moved = apply_updates(
            current,
            [self.globals[t.version] for t in kept],
            [
                dict(cast(ArrayRecord, t.reply.content["arrays"]).to_torch_state_dict())
                for t in kept
            ],
            [weights[str(t.node)] for t in kept],
            server_lr=self.server_lr,
        )
        staleness = [version - t.version for t in taken]
        round_.log(
            {
                "event": "version",
                "round": version,
                "updates": len(taken),
                "staleness": staleness,
                "stale_refused": self.buffer.stale,
                "duplicates_refused": self.buffer.duplicates,
            }
        )
        failures, self.failures = self.failures, []
        round_.recorded(
            [t.reply for t in taken], (committed.merged, committed.discarded), dropped, failures
        )
        return {**current, **moved}

    def _fail(self, sent: _Out | int, why: str) -> None:
        """A device's update failed: said, counted, and (known) its server session dropped."""
        node = sent.node if isinstance(sent, _Out) else sent
        self.grid.failure(node, why)
        self.failures.append({"node_id": node, "reason": why})
        if isinstance(sent, _Out):
            self.discard.append((str(sent.node), sent.version))

    def _refuse(self, sent: _Out, refused: Refusal) -> None:
        """A reply not aggregated (stale, or a second one): counted and said. A stale one's
        server session is dropped; a second reply's session is the first's, kept for it."""
        self.round.log(
            {
                "event": "refused",
                "round": self.round.number,
                **self.grid.devices.fields(sent.node),
                "version": sent.version,
                "kind": refused.kind,
                "reason": refused.why,
            }
        )
        name = self.grid.devices.name(sent.node)
        log.warning("version %d: %s: %s", self.round.number, name, refused.why)
        if refused.kind == "stale":
            self.discard.append((str(sent.node), sent.version))
