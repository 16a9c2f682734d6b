"""The round-control servicer: BeginRound, CommitRound, GetAdapter, LoadAdapter, RoundStatus,
Hello, and CollectRound (a replica's part of a commit merged across replicas).

Only the ServerApp calls it. Each call's MAC is checked over the request as re-serialised here
(:mod:`fedpipe.auth.calls`): it names this server and the run it is made in. The global adapter
moves as a stream of pieces (any size: exact aggregation's dense base deltas are hundreds of
MB), signed by its header's SHA-256. The rest is the backend's
(:class:`~fedpipe.wire.backend.StageBackend`).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from fedpipe.config import MAX_STALENESS
from fedpipe.errors import AuthError, InvalidRequestError
from fedpipe.proto import stage_pb2 as pb
from fedpipe.proto import stage_pb2_grpc as pb_grpc
from fedpipe.wire.backend import SessionProgress, StageBackend
from fedpipe.wire.status import status_for

__all__ = [
    "CHUNK_BYTES",
    "ControlAuth",
    "ControlServicer",
    "adapter_chunks",
    "adapter_from_chunks",
    "collected_payload",
    "collected_states",
]

log = logging.getLogger(__name__)

# (method, request bytes, metadata) -> what the call signed (``.run_id``); raises AuthError
ControlAuth = Callable[[str, bytes, Sequence[tuple[str, str | bytes]]], Any]
CHUNK_BYTES = 256 << 10  # a piece of the adapter: under any message limit a server sets


def adapter_chunks(state: dict[str, torch.Tensor] | None) -> Iterator[pb.AdapterChunk]:
    """``state`` as a header and pieces (None: a header that resets to the initial adapter)."""
    if state is None:
        yield pb.AdapterChunk(reset=True)
        return
    data = st_save({k: v.contiguous() for k, v in state.items()})
    yield pb.AdapterChunk(total_bytes=len(data), sha256=hashlib.sha256(data).digest())
    view = memoryview(data)
    for start in range(0, len(data), CHUNK_BYTES):
        yield pb.AdapterChunk(data=bytes(view[start : start + CHUNK_BYTES]))


def adapter_from_chunks(
    header: pb.AdapterChunk, pieces: Iterator[pb.AdapterChunk], *, max_bytes: int
) -> dict[str, torch.Tensor] | None:
    """The state a header and its pieces carry (None: reset); raises ValueError when the
    pieces do not add up to the header's length and digest, or pass ``max_bytes``."""
    if header.reset:
        return None
    if header.total_bytes > max_bytes:
        raise ValueError(
            f"an adapter of {header.total_bytes} bytes, more than this server takes ({max_bytes})"
        )
    data = bytearray()
    for piece in pieces:
        if len(data) + len(piece.data) > header.total_bytes:
            raise ValueError(f"the adapter's pieces pass its stated {header.total_bytes} bytes")
        data += piece.data
    if len(data) != header.total_bytes:
        raise ValueError(f"the adapter's pieces hold {len(data)} of {header.total_bytes} bytes")
    if hashlib.sha256(data).digest() != header.sha256:
        raise ValueError("the adapter's pieces do not match its header's SHA-256")
    return st_load(bytes(data))


def collected_payload(states: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Several adapters as one state: the ``i``-th one's tensors under ``"<i>/<name>"``."""
    return {f"{i}/{name}": value for i, state in enumerate(states) for name, value in state.items()}


def collected_states(payload: dict[str, torch.Tensor], count: int) -> list[dict[str, torch.Tensor]]:
    """:func:`collected_payload` undone: ``count`` adapters (raises ValueError on a stray key)."""
    states: list[dict[str, torch.Tensor]] = [{} for _ in range(count)]
    for key, value in payload.items():
        index, sep, name = key.partition("/")
        if not sep or not index.isdigit() or int(index) >= count:
            raise ValueError(f"a collected adapter's key {key!r} names no held device")
        states[int(index)][name] = value
    return states


class ControlServicer(pb_grpc.StageControlServicer):
    """StageControl over a :class:`StageBackend`; ``auth`` None serves unsigned calls."""

    def __init__(self, backend: StageBackend, auth: ControlAuth | None) -> None:
        self.backend = backend
        self.auth = auth

    def _check(self, method: str, request, context: grpc.ServicerContext) -> str | None:  # type: ignore[no-untyped-def]
        """Verify the call's MAC; the run it was signed for (None when calls are unsigned)."""
        if self.auth is None:
            return None
        try:
            body = request.SerializeToString(deterministic=True)
            meta = context.invocation_metadata()
            return str(self.auth(f"/fedpipe.proto.StageControl/{method}", body, meta).run_id)
        except AuthError as exc:
            log.warning("%s", exc)
            context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
        return None  # not reached: abort raises

    def BeginRound(self, request: pb.BeginRoundRequest, context: grpc.ServicerContext):  # noqa: N802
        signed = self._check("BeginRound", request, context)
        if signed is not None and signed != request.run_id:
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                f"BeginRound refused: signed for run {signed!r}, it begins {request.run_id!r}",
            )
        try:
            if request.frozen_below < 0 or not 0 <= request.window <= MAX_STALENESS + 1:
                raise InvalidRequestError(
                    f"BeginRound: frozen_below must be >= 0 and window in 0..{MAX_STALENESS + 1}, "
                    f"got {request.frozen_below} and {request.window}"
                )
            self.backend.begin_round(
                request.round,
                request.run_id,
                request.aggregation or "separate",
                request.rule,
                frozen_below=request.frozen_below,
                window=request.window,
            )
        except Exception as exc:
            context.abort(status_for(exc), str(exc))
        return pb.BeginRoundReply()

    def CommitRound(self, request: pb.CommitRoundRequest, context: grpc.ServicerContext):  # noqa: N802
        signed = self._check("CommitRound", request, context)
        weights = {f.device_id: f.weight for f in request.finished}
        try:
            result = self.backend.commit_round(request.round, weights, signed_run=signed)
        except Exception as exc:
            context.abort(status_for(exc), str(exc))
        return pb.CommitRoundReply(
            merged=result.merged,
            discarded=result.discarded,
            dropped=list(result.dropped),
            dropped_reason=list(result.dropped.values()),
        )

    def CommitUpdates(self, request: pb.CommitUpdatesRequest, context: grpc.ServicerContext):  # noqa: N802
        signed = self._check("CommitUpdates", request, context)
        merge = [(u.device_id, u.round, u.weight) for u in request.merge]
        discard = [(u.device_id, u.round) for u in request.discard]
        try:
            result = self.backend.commit_updates(
                request.round,
                merge,
                discard,
                server_lr=request.server_lr or 1.0,
                signed_run=signed,
            )
        except Exception as exc:
            context.abort(status_for(exc), str(exc))
        return pb.CommitRoundReply(
            merged=result.merged,
            discarded=result.discarded,
            dropped=list(result.dropped),
            dropped_reason=list(result.dropped.values()),
        )

    def GetAdapter(self, request: pb.AdapterRequest, context: grpc.ServicerContext):  # noqa: N802
        signed = self._check("GetAdapter", request, context)
        try:
            state = self.backend.global_adapter(signed_run=signed)
        except Exception as exc:
            context.abort(status_for(exc), str(exc))
        yield from adapter_chunks(state)

    def LoadAdapter(self, request_iterator, context: grpc.ServicerContext):  # type: ignore[no-untyped-def]  # noqa: N802
        header = next(request_iterator, None)
        if header is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "LoadAdapter sent no header")
        assert header is not None  # abort raises
        self._check("LoadAdapter", header, context)
        try:
            state = adapter_from_chunks(
                header, request_iterator, max_bytes=self.backend.max_adapter_bytes
            )
            self.backend.load_adapter(state)
        except Exception as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad adapter: {exc}")
        return pb.LoadAdapterReply()

    def RoundStatus(self, request: pb.RoundStatusRequest, context: grpc.ServicerContext):  # noqa: N802
        self._check("RoundStatus", request, context)
        try:
            sessions = self.backend.round_status(request.round)
        except Exception as exc:
            context.abort(status_for(exc), str(exc))
        return pb.RoundStatusReply(sessions=[_session_to_proto(s) for s in sessions])

    def CollectRound(self, request: pb.CollectRoundRequest, context: grpc.ServicerContext):  # noqa: N802
        signed = self._check("CollectRound", request, context)
        weights = {f.device_id: f.weight for f in request.finished}
        try:
            got = self.backend.collect_round(request.round, weights, signed_run=signed)
        except Exception as exc:
            context.abort(status_for(exc), str(exc))
        pieces = adapter_chunks(collected_payload(got.states))
        yield pb.CollectedPart(
            held=[
                pb.DeviceWeight(device_id=d, weight=w)
                for d, w in zip(got.devices, got.weights, strict=True)
            ],
            discarded=got.discarded,
            dropped=list(got.dropped),
            dropped_reason=list(got.dropped.values()),
            microbatches=got.microbatches,
            round_s=got.round_s,
            chunk=next(pieces),
        )
        for piece in pieces:
            yield pb.CollectedPart(chunk=piece)

    def Hello(self, request: pb.HelloRequest, context: grpc.ServicerContext):  # noqa: N802
        return pb.HelloReply(server_id=self.backend.server_id)


def _session_to_proto(progress: SessionProgress) -> pb.SessionStatus:
    return pb.SessionStatus(
        device_id=progress.device_id,
        steps_done=progress.steps_done,
        opened_s_ago=progress.opened_s_ago,
        first_step_s_ago=progress.first_step_s_ago or 0.0,
        last_step_s_ago=progress.last_step_s_ago or 0.0,
        closed=progress.closed,
        rows_done=progress.rows_done,
        tokens_done=progress.tokens_done,
    )
