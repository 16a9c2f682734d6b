"""The ServerApp's client for the StageServer's round control service.

Every call is signed with a MAC of its request, the server's identity and the run (see
:mod:`fedpipe.auth.calls`); the secret itself never leaves this process. The server's identity
comes from its Hello; a server that restarted has a new one, which the client fetches and signs
with on the next try. Calls are retried with backoff, each try signed anew. The global adapter
moves in pieces (:func:`~fedpipe.wire.control_servicer.adapter_chunks`), so any size works.
The read-only looks (RoundStatus, the access check) try once.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import grpc
import torch
from google.protobuf.message import Message as ProtoMessage

from fedpipe.auth.calls import sign_call
from fedpipe.proto import stage_pb2 as pb
from fedpipe.proto import stage_pb2_grpc as pb_grpc
from fedpipe.wire.backend import CollectedRound, SessionProgress
from fedpipe.wire.channels import channel_options, secure_channel_credentials
from fedpipe.wire.control_servicer import (
    adapter_chunks,
    adapter_from_chunks,
    collected_states,
)
from fedpipe.wire.status import retry_call

__all__ = ["Committed", "StageControlClient"]

_SERVICE = "/fedpipe.proto.StageControl/"
_MESSAGE_BYTES = 64 * 2**20  # the control link's messages: far above a piece of an adapter
_ADAPTER_BYTES = 1 << 40  # what GetAdapter accepts: the ServerApp trusts its own StageServer

log = logging.getLogger(__name__)


class Committed(NamedTuple):
    """What CommitRound did: sessions merged and discarded, devices dropped (device -> why)."""

    merged: int
    discarded: int
    dropped: dict[str, str]


class StageControlClient:
    """Begin and commit rounds, and move the server's global adapter (all signed and retried)."""

    def __init__(
        self,
        address: str,
        secret: str,
        *,
        run_id: str = "",
        root_certificates: bytes | None = None,
        certificate_chain: bytes | None = None,
        private_key: bytes | None = None,
    ) -> None:
        # Its own connection, not one shared with other channels to the same address: a new
        # client for a server that restarted connects at once instead of inheriting the old
        # connection's reconnect backoff (the ServerApp makes one for a lost replica).
        options = [*channel_options(_MESSAGE_BYTES), ("grpc.use_local_subchannel_pool", 1)]
        if root_certificates is not None:
            creds = secure_channel_credentials(root_certificates, certificate_chain, private_key)
            self.channel = grpc.secure_channel(address, creds, options=options)
        else:
            self.channel = grpc.insecure_channel(address, options=options)
        self.stub = pb_grpc.StageControlStub(self.channel)
        self.run_id = run_id  # the run the calls are made in (begin_round sets it)
        self._secret = secret
        self._server_id: str | None = None  # the server's Hello, fetched at the first call

    def join_run(self, run_id: str) -> None:
        """Make the calls from now on in ``run_id`` (a replica's own, once its run is known)."""
        self.run_id = run_id

    @contextlib.contextmanager
    def outside_run(self) -> Iterator[None]:
        """Calls inside name no run (read before any run was begun), then the run again."""
        run_id, self.run_id = self.run_id, ""
        try:
            yield
        finally:
            self.run_id = run_id

    def _metadata(self, name: str, body: bytes) -> Any:
        if not self._secret:
            return None
        if self._server_id is None:
            self._server_id = self.stub.Hello(pb.HelloRequest(), timeout=30).server_id
        server_id = self._server_id
        return sign_call(
            self._secret, _SERVICE + name, body, server_id=server_id, run_id=self.run_id
        )

    def _call(self, name: str, request: ProtoMessage, timeout: float) -> Any:
        """Call ``name`` with a fresh signature per try (a retried call is not a replay)."""
        method: Callable[..., Any] = getattr(self.stub, name)
        body = request.SerializeToString(deterministic=True)

        def once() -> Any:
            try:
                return method(request, timeout=timeout, metadata=self._metadata(name, body))
            except grpc.RpcError as exc:
                self._forget_server(exc)
                raise

        return retry_call(once)

    def _forget_server(self, exc: grpc.RpcError) -> None:
        """A server that restarted refuses the old identity: ask it again on the next try."""
        if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED):
            self._server_id = None

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
        """Tell the StageServer that ``round_`` of ``run_id`` starts: tokens must name both.

        ``aggregation`` (federated.aggregation; "" = separate) is how its commit merges, and
        ``rule`` (``AggregationRule.text()``; "" = the weighted mean) by which rule; the
        round's sessions train no adapter of a block below ``frozen_below`` (pipeline.freeze).
        ``window`` > 0 (async rounds): the versions whose sessions are admitted, this one
        included (``max_staleness + 1``)."""
        self.run_id = run_id or self.run_id
        request = pb.BeginRoundRequest(
            round=round_,
            run_id=self.run_id,
            aggregation=aggregation,
            rule=rule,
            frozen_below=frozen_below,
            window=window,
        )
        self._call("BeginRound", request, 30)

    def commit_round(self, round_: int, finished: dict[str, float]) -> Committed:
        """Merge the finished devices' server adapters (by weight); the server leaves out (and
        names in ``dropped``) any whose adapter is not finite."""
        request = pb.CommitRoundRequest(
            round=round_,
            finished=[pb.DeviceWeight(device_id=d, weight=w) for d, w in finished.items()],
        )
        reply = self._call("CommitRound", request, 60)
        dropped = dict(zip(reply.dropped, reply.dropped_reason, strict=False))
        return Committed(reply.merged, reply.discarded, dropped)

    def commit_updates(
        self,
        round_: int,
        merge: list[tuple[str, int, float]],
        discard: list[tuple[str, int]],
        *,
        server_lr: float = 1.0,
    ) -> Committed:
        """Async rounds: merge each (device, version) session of ``merge`` as its update
        against its version, by its weight and ``server_lr``; drop those of ``discard``."""
        request = pb.CommitUpdatesRequest(
            round=round_,
            merge=[pb.SessionUpdate(device_id=d, round=v, weight=w) for d, v, w in merge],
            discard=[pb.SessionUpdate(device_id=d, round=v) for d, v in discard],
            server_lr=server_lr,
        )
        reply = self._call("CommitUpdates", request, 60)
        dropped = dict(zip(reply.dropped, reply.dropped_reason, strict=False))
        return Committed(reply.merged, reply.discarded, dropped)

    def collect_round(self, round_: int, finished: dict[str, float]) -> CollectedRound:
        """A replica's part of the commit of ``round_``: the finished devices' adapters (and
        which were left out, and why); the replica discards the round's sessions. Retried as
        a whole, the stream read to its end each try (the replica answers a retry the same)."""
        request = pb.CollectRoundRequest(
            round=round_,
            finished=[pb.DeviceWeight(device_id=d, weight=w) for d, w in finished.items()],
        )
        body = request.SerializeToString(deterministic=True)

        def once() -> CollectedRound:
            try:
                parts: Iterator[pb.CollectedPart] = self.stub.CollectRound(
                    request, timeout=600, metadata=self._metadata("CollectRound", body)
                )
                first = next(parts)
                payload = adapter_from_chunks(
                    first.chunk, (p.chunk for p in parts), max_bytes=_ADAPTER_BYTES
                )
            except grpc.RpcError as exc:
                self._forget_server(exc)
                raise
            held = list(first.held)
            return CollectedRound(
                devices=[h.device_id for h in held],
                weights=[h.weight for h in held],
                states=collected_states(payload or {}, len(held)),
                discarded=first.discarded,
                dropped=dict(zip(first.dropped, first.dropped_reason, strict=False)),
                microbatches=first.microbatches,
                round_s=first.round_s,
            )

        return retry_call(once)

    def get_adapter(self) -> dict[str, torch.Tensor]:
        """The server's global adapter (and folded base deltas), of any size."""
        pieces: Iterator[pb.AdapterChunk] = self._call("GetAdapter", pb.AdapterRequest(), 600)
        header = next(pieces)
        state = adapter_from_chunks(header, pieces, max_bytes=_ADAPTER_BYTES)
        assert state is not None  # the server never sends a reset
        return state

    def load_adapter(self, state: dict[str, torch.Tensor]) -> None:
        self._load(state)

    def reset_adapter(self) -> None:
        """Start the server's global adapter afresh (a new run, not a resumed one)."""
        self._load(None)

    def _load(self, state: dict[str, torch.Tensor] | None) -> None:
        chunks = list(adapter_chunks(state))
        header = chunks[0]
        body = header.SerializeToString(deterministic=True)

        def once() -> Any:
            try:
                return self.stub.LoadAdapter(
                    iter(chunks), timeout=600, metadata=self._metadata("LoadAdapter", body)
                )
            except grpc.RpcError as exc:
                self._forget_server(exc)
                raise

        retry_call(once)

    def round_status(self, round_: int, timeout: float = 5.0) -> list[SessionProgress] | None:
        """How far each session of ``round_`` has got, as the StageServer counts it; None when
        the server cannot say (it is unreachable, or older and lacks RoundStatus).

        Read-only and asked while a round runs, so one try, not retried: a later call asks again.
        """
        request = pb.RoundStatusRequest(round=round_)
        body = request.SerializeToString(deterministic=True)
        try:
            reply = self.stub.RoundStatus(
                request, timeout=timeout, metadata=self._metadata("RoundStatus", body)
            )
        except grpc.RpcError as exc:
            self._forget_server(exc)
            log.debug("RoundStatus: %s", exc)
            return None
        return [_session_from_proto(s) for s in reply.sessions]

    def check_access(self, timeout: float = 10.0) -> None:
        """One signed, read-only call (no retry): raises ``grpc.RpcError`` unless the server
        accepts this client's secret. A fresh StageServer answers FAILED_PRECONDITION (no run's
        adapter yet) only after it checked the signature, so that answer passes too."""
        request = pb.AdapterRequest()
        metadata = self._metadata("GetAdapter", request.SerializeToString(deterministic=True))
        try:
            for _ in self.stub.GetAdapter(request, timeout=timeout, metadata=metadata):
                break  # its first piece: the server accepted the call
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise

    def close(self) -> None:
        self.channel.close()


def _session_from_proto(status: pb.SessionStatus) -> SessionProgress:
    stepped = status.steps_done > 0
    return SessionProgress(
        device_id=status.device_id,
        steps_done=status.steps_done,
        opened_s_ago=status.opened_s_ago,
        first_step_s_ago=status.first_step_s_ago if stepped else None,
        last_step_s_ago=status.last_step_s_ago if stepped else None,
        closed=status.closed,
        rows_done=status.rows_done,
        tokens_done=status.tokens_done,
    )
