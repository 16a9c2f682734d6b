"""The round-control servicer: BeginRound, CommitRound, GetAdapter, LoadAdapter, RoundStatus.

Only the ServerApp calls it. Each call's MAC is checked over the request as re-serialised here
(:mod:`fedpipe.auth.calls`); the rest is the backend's
(:class:`~fedpipe.wire.backend.StageBackend`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import grpc
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from fedpipe.errors import AuthError
from fedpipe.proto import stage_pb2 as pb
from fedpipe.proto import stage_pb2_grpc as pb_grpc
from fedpipe.wire.backend import SessionProgress, StageBackend
from fedpipe.wire.status import status_for

__all__ = ["ControlAuth", "ControlServicer"]

log = logging.getLogger(__name__)

# (method, request bytes, metadata) -> None; raises AuthError
ControlAuth = Callable[[str, bytes, Sequence[tuple[str, str | bytes]]], None]


class ControlServicer(pb_grpc.StageControlServicer):
    """StageControl over a :class:`StageBackend`; ``auth`` None serves unsigned calls."""

    def __init__(self, backend: StageBackend, auth: ControlAuth | None) -> None:
        self.backend = backend
        self.auth = auth

    def _check(self, method: str, request, context: grpc.ServicerContext) -> None:  # type: ignore[no-untyped-def]
        """Verify the call's MAC (over the method and the request as re-serialised here)."""
        if self.auth is None:
            return
        try:
            body = request.SerializeToString(deterministic=True)
            self.auth(f"/fedpipe.proto.StageControl/{method}", body, context.invocation_metadata())
        except AuthError as exc:
            log.warning("%s", exc)
            context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))

    def BeginRound(self, request: pb.BeginRoundRequest, context: grpc.ServicerContext):  # noqa: N802
        self._check("BeginRound", request, context)
        try:
            self.backend.begin_round(
                request.round, request.run_id, request.aggregation or "separate"
            )
        except Exception as exc:
            context.abort(status_for(exc), str(exc))
        return pb.BeginRoundReply()

    def CommitRound(self, request: pb.CommitRoundRequest, context: grpc.ServicerContext):  # noqa: N802
        self._check("CommitRound", request, context)
        weights = {f.device_id: f.weight for f in request.finished}
        try:
            result = self.backend.commit_round(request.round, weights)
        except Exception as exc:
            context.abort(status_for(exc), str(exc))
        return pb.CommitRoundReply(
            merged=result.merged,
            discarded=result.discarded,
            dropped=list(result.dropped),
            dropped_reason=list(result.dropped.values()),
        )

    def GetAdapter(self, request: pb.AdapterRequest, context: grpc.ServicerContext):  # noqa: N802
        self._check("GetAdapter", request, context)
        try:
            state = self.backend.global_adapter()
        except Exception as exc:
            context.abort(status_for(exc), str(exc))
        return pb.AdapterReply(safetensors=st_save({k: v.contiguous() for k, v in state.items()}))

    def LoadAdapter(self, request: pb.LoadAdapterRequest, context: grpc.ServicerContext):  # noqa: N802
        self._check("LoadAdapter", request, context)
        try:
            state = st_load(request.safetensors) if request.safetensors else None
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


def _session_to_proto(progress: SessionProgress) -> pb.SessionStatus:
    return pb.SessionStatus(
        device_id=progress.device_id,
        steps_done=progress.steps_done,
        opened_s_ago=progress.opened_s_ago,
        first_step_s_ago=progress.first_step_s_ago or 0.0,
        last_step_s_ago=progress.last_step_s_ago or 0.0,
        closed=progress.closed,
    )
