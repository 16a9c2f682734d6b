"""Round control across StageServer replicas: the ServerApp's side, over gRPC only.

With several replicas (``run.stage-address`` a comma-separated list) the ServerApp holds one
signed control client per replica and:

- begins every round on every live replica, each under its own run id (``<run>/r<k>``), so a
  device's token is valid on its replica only; a replica found empty (Ray restarted it: it
  answers FAILED_PRECONDITION, no run's adapter) is loaded with the global adapter first, and
  a replica that does not answer sits the round out;
- assigns each sampled device to a live replica (:mod:`fedpipe.fl.assignment`) and tells the
  device that replica's address beside its token;
- at commit, collects every replica's part (CollectRound: the finished devices' server
  adapters, their weights, those dropped as non-finite), merges them with the bank's own
  function (:func:`~fedpipe.lora.aggregation.aggregate_held`: the run's aggregation and rule,
  folded base deltas added to the global ones) and loads the new global adapter into every
  replica before the next round. A replica lost mid-round fails the devices it held, each
  named with the reason; the others' are merged.

The global adapter lives here (:meth:`ReplicaControl.get_adapter`: checkpoints hold it once).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import grpc
import torch

from fedpipe.fl.assignment import assign_devices
from fedpipe.lora.aggregation import DELTA_SUFFIX, aggregate_held, split_deltas
from fedpipe.lora.robust import AggregationRule
from fedpipe.wire.backend import CollectedRound, SessionProgress
from fedpipe.wire.control_client import Committed, StageControlClient

__all__ = ["ReplicaControl", "Route", "replica_run_id", "stage_addresses"]

log = logging.getLogger(__name__)

State = dict[str, torch.Tensor]


def stage_addresses(text: str) -> list[str]:
    """``run.stage-address``: one address, or the replicas' comma-separated."""
    return [part.strip() for part in text.split(",") if part.strip()]


def replica_run_id(run_id: str, index: int) -> str:
    """The run id replica ``index`` begins rounds with: tokens for it name this one."""
    return f"{run_id}/r{index}"


@dataclass(frozen=True)
class Route:
    """Where one device (or the evaluator) goes this round: its replica and that one's run."""

    replica: int
    address: str
    run_id: str


@dataclass
class _AcrossReplicas:
    """What one round did across the replicas."""

    number: int = -1
    live: list[int] = field(default_factory=list)  # replicas begun
    assigned: dict[str, int] = field(default_factory=dict)  # device -> replica
    collected: dict[int, CollectedRound] = field(default_factory=dict)
    lost: dict[int, str] = field(default_factory=dict)  # replica -> why its part is gone


class ReplicaControl:
    """The ServerApp's round control over several StageServer replicas (one client each)."""

    def __init__(
        self,
        addresses: list[str],
        secret: str,
        *,
        run_id: str,
        lora_scale: float,
        wait_s: float = 120.0,
        root_certificates: bytes | None = None,
        certificate_chain: bytes | None = None,
        private_key: bytes | None = None,
    ) -> None:
        if len(addresses) < 2:
            raise ValueError(f"replicas need two addresses or more, got {addresses}")
        self.addresses = list(addresses)
        self.run_id = run_id
        self.lora_scale = lora_scale
        self.wait_s = wait_s  # how long a round waits for a replica when none answers
        self._credentials = (secret, root_certificates, certificate_chain, private_key)
        self.clients = [self._client(k) for k in range(len(addresses))]
        self.global_state: State = {}
        self.initial: State = {}  # the seeded adapter (`stack` restarts from it)
        self.aggregation = "separate"
        self.frozen_below = 0  # pipeline.freeze: the round's frozen blocks (BeginRound)
        self.rule = AggregationRule()
        self.needs_load: set[int] = set()  # replicas that must get the global adapter first
        self.round = _AcrossReplicas()

    def _client(self, index: int) -> StageControlClient:
        secret, roots, chain, key = self._credentials
        return StageControlClient(
            self.addresses[index],
            secret,
            run_id=replica_run_id(self.run_id, index),
            root_certificates=roots,
            certificate_chain=chain,
            private_key=key,
        )

    # -- the global adapter -------------------------------------------------------------------
    def reset_adapter(self) -> None:
        """A new run: every replica back to the seeded adapter, which becomes the global one."""
        self._learn_initial()
        self.global_state = dict(self.initial)
        self._load_all()

    def load_adapter(self, state: State) -> None:
        """A resumed run: the checkpoint's global adapter, loaded into every replica."""
        self._learn_initial()
        self.global_state = dict(state)
        self._load_all()

    def get_adapter(self) -> State:
        """The global adapter (and folded base deltas): the coordinator's copy."""
        return {k: v.clone() for k, v in self.global_state.items()}

    def _learn_initial(self) -> None:
        """The seeded adapter, read from the first replica that answers after a reset."""
        if self.initial:
            return
        errors = []
        for address, client in zip(self.addresses, self.clients, strict=True):
            try:
                with client.outside_run():  # read outside any run: none begun yet
                    client.reset_adapter()
                    self.initial = client.get_adapter()
                return
            except grpc.RpcError as exc:
                errors.append(f"{address}: {exc.code().name}")
        raise RuntimeError(f"no StageServer replica answers: {'; '.join(errors)}")

    def _load_all(self) -> None:
        self.needs_load = set(range(len(self.clients)))
        for index in range(len(self.clients)):
            self._load(index)

    def _load(self, index: int) -> bool:
        try:
            self.clients[index].load_adapter(self.global_state)
        except grpc.RpcError as exc:
            log.warning(
                "replica %d (%s): the global adapter was not loaded (%s); it gets it before "
                "its next round",
                index,
                self.addresses[index],
                exc.code().name,
            )
            return False
        self.needs_load.discard(index)
        return True

    # -- a round ------------------------------------------------------------------------------
    def begin_round(
        self,
        round_: int,
        run_id: str = "",
        aggregation: str = "",
        rule: str = "",
        *,
        frozen_below: int = 0,
        window: int = 0,
    ) -> None:
        """Begin ``round_`` on every replica that answers (each under its own run id); their
        sessions train no adapter of a block below ``frozen_below`` (pipeline.freeze).
        Replicas serve synchronous rounds only (``window`` 0)."""
        if window:
            raise ValueError("StageServer replicas serve synchronous rounds only (window 0)")
        self.frozen_below = frozen_below
        if run_id and run_id != self.run_id:
            self.run_id = run_id
            for index, client in enumerate(self.clients):
                client.join_run(replica_run_id(run_id, index))
        self.aggregation = aggregation or "separate"
        self.rule = AggregationRule.parse(rule)
        deadline = time.monotonic() + self.wait_s
        while not (live := self._begin_each(round_, aggregation, rule)):
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"round {round_}: no StageServer replica answered for {self.wait_s:g} s "
                    f"({', '.join(self.addresses)})"
                )
            time.sleep(2.0)
        self.round = _AcrossReplicas(number=round_, live=live)

    def _begin_each(self, round_: int, aggregation: str, rule: str) -> list[int]:
        live = []
        for index in range(len(self.clients)):
            if index in self.needs_load:  # lost or not loaded: a new connection, at once
                self.clients[index].close()
                self.clients[index] = self._client(index)
            try:
                if index in self.needs_load:
                    self._load_or_raise(index)
                self._begin_one(index, round_, aggregation, rule)
            except grpc.RpcError as exc:
                log.warning(
                    "replica %d (%s) sits round %d out: %s: %s",
                    index,
                    self.addresses[index],
                    round_,
                    exc.code().name,
                    exc.details(),
                )
                self.needs_load.add(index)
                continue
            live.append(index)
        return live

    def _begin_one(self, index: int, round_: int, aggregation: str, rule: str) -> None:
        """BeginRound on one replica; one found restarted is loaded first (raises if it fails).

        A restarted replica has a new identity: the first signed call is refused, the client
        fetches the new one (Hello), and the call is made again; it then answers
        FAILED_PRECONDITION (no run's adapter) until the global adapter is loaded."""
        run = replica_run_id(self.run_id, index)
        for attempt in range(3):
            try:
                self.clients[index].begin_round(
                    round_, run, aggregation, rule, frozen_below=self.frozen_below
                )
                return
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.UNAUTHENTICATED and attempt == 0:
                    continue  # signed for the replica before its restart
                if exc.code() != grpc.StatusCode.FAILED_PRECONDITION or attempt == 2:
                    raise
                log.warning(
                    "replica %d (%s) holds no run adapter (restarted?): loading it",
                    index,
                    self.addresses[index],
                )
                self._load_or_raise(index)

    def _load_or_raise(self, index: int) -> None:
        for attempt in range(2):
            try:
                self.clients[index].load_adapter(self.global_state)
                self.needs_load.discard(index)
                return
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAUTHENTICATED or attempt == 1:
                    raise

    def routes(self, devices: Iterable[str]) -> dict[str, Route]:
        """Each device's replica this round (the live ones, by :func:`assign_devices`)."""
        assigned = assign_devices(devices, len(self.clients), self.round.live)
        self.round.assigned = assigned
        return {device: self._route(k) for device, k in assigned.items()}

    def evaluator(self) -> Route:
        """Where held-out evaluation runs: the first replica of this round that still holds
        it (begun, not lost, the global adapter loaded). When every one was lost, a restarted
        replica is loaded and begun again for it (raises when none answers)."""
        ready = [
            k for k in self.round.live if k not in self.round.lost and k not in self.needs_load
        ]
        if not ready and self.round.number:
            ready = self._begin_each(self.round.number, self.aggregation, self.rule.text())
        if not ready and self.round.number:
            raise RuntimeError(
                f"round {self.round.number}: no StageServer replica to evaluate on: every one "
                f"was lost ({', '.join(self.addresses)})"
            )
        return self._route(ready[0] if ready else 0)

    def _route(self, index: int) -> Route:
        return Route(index, self.addresses[index], replica_run_id(self.run_id, index))

    def round_status(self, round_: int, timeout: float = 5.0) -> list[SessionProgress] | None:
        """Every live replica's sessions of ``round_`` (None when none can say)."""
        answers = [self.clients[k].round_status(round_, timeout) for k in self.round.live]
        known = [a for a in answers if a is not None]
        return [s for answer in known for s in answer] if known else None

    # -- commit -------------------------------------------------------------------------------
    def collect(self, round_: int, finished: dict[str, float]) -> dict[str, str]:
        """Every live replica's part of ``round_``; returns the finished devices whose server
        adapter was lost with their replica (device -> why). Each replica discards the round."""
        state = self.round
        state.collected, state.lost = {}, {}
        for index in state.live:
            mine = {d: w for d, w in finished.items() if state.assigned.get(d) == index}
            try:
                state.collected[index] = self.clients[index].collect_round(round_, mine)
            except grpc.RpcError as exc:
                state.lost[index] = f"{exc.code().name}: {exc.details()}"
                self.needs_load.add(index)
        lost = {}
        for device, index in state.assigned.items():
            if index in state.lost and device in finished:
                lost[device] = (
                    f"server adapter lost: replica {index} ({self.addresses[index]}) was lost "
                    f"mid-round ({state.lost[index]})"
                )
        for device, why in lost.items():
            log.warning("round %d: device %s: %s", round_, device, why)
        return lost

    def commit_round(self, round_: int, finished: dict[str, float]) -> Committed:
        """Merge the collected adapters of ``round_`` into the global one and load it into
        every replica; devices a replica left out as non-finite are in ``dropped``."""
        if self.round.number != round_ or not self.round.collected and not self.round.lost:
            self.collect(round_, finished)
        parts = [self.round.collected[k] for k in sorted(self.round.collected)]
        states = [s for part in parts for s in part.states]
        weights = [w for part in parts for w in part.weights]
        dropped = {d: why for part in parts for d, why in part.dropped.items()}
        merged = len(states) if states and sum(weights) > 0 else 0
        if merged:
            self.global_state = self._merged(states, weights)
        for index in range(len(self.clients)):
            if index in self.round.live and index not in self.round.lost:
                if merged:
                    self._load(index)
            else:
                self.needs_load.add(index)
        discarded = sum(p.discarded for p in parts) + (len(states) - merged)
        return Committed(merged, discarded, dropped)

    def _merged(self, states: list[State], weights: list[float]) -> State:
        """The new global state: as the bank's merge would leave it (same function, same
        arithmetic), each adapter tensor in the dtype the replicas hold it in."""
        adapter, deltas = split_deltas(self.global_state)
        merged, folded = aggregate_held(
            states,
            weights,
            self.aggregation,
            scale=self.lora_scale,
            initial=self.initial,
            rule=self.rule,
            global_state=adapter if self.rule.norm_bound > 0 else None,
        )
        cast = {k: v.to(adapter[k].dtype) if k in adapter else v for k, v in merged.items()}
        new = {**adapter, **cast}
        total = dict(deltas)
        for name, delta in folded.items():
            delta = delta.detach().float().cpu()
            total[name] = total[name] + delta if name in total else delta.clone()
        return {**new, **{k + DELTA_SUFFIX: v for k, v in total.items()}}

    def round_figures(self) -> dict[str, list[float] | list[int]]:
        """Per replica, from its own counts: sessions it held at commit, microbatches/s."""
        sessions, rates = [], []
        for index in range(len(self.clients)):
            part = self.round.collected.get(index)
            if part is None:
                sessions.append(0)
                rates.append(0.0)
                continue
            sessions.append(len(part.devices) + part.discarded)
            rates.append(part.microbatches / part.round_s if part.round_s > 0 else 0.0)
        return {"sessions_per_replica": sessions, "replica_mb_per_s": rates}

    def close(self) -> None:
        for client in self.clients:
            client.close()
