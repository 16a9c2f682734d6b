"""The ServerApp's client for the StageServer's round control service.

Every call is signed with a MAC of its request (see :mod:`fedpipe.auth.calls`); the
secret itself never leaves this process. Calls are retried with backoff, each try signed anew,
except the read-only looks (RoundStatus, the access check), which try once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import grpc
import torch
from google.protobuf.message import Message as ProtoMessage
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from fedpipe.auth.calls import sign_call
from fedpipe.proto import stage_pb2 as pb
from fedpipe.proto import stage_pb2_grpc as pb_grpc
from fedpipe.wire.backend import SessionProgress
from fedpipe.wire.channels import secure_channel_credentials
from fedpipe.wire.status import retry_call

__all__ = ["Committed", "StageControlClient"]

_SERVICE = "/fedpipe.proto.StageControl/"

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
        root_certificates: bytes | None = None,
        certificate_chain: bytes | None = None,
        private_key: bytes | None = None,
    ) -> None:
        if root_certificates is not None:
            creds = secure_channel_credentials(root_certificates, certificate_chain, private_key)
            self.channel = grpc.secure_channel(address, creds)
        else:
            self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.StageControlStub(self.channel)
        self._secret = secret

    def _call(self, name: str, request: ProtoMessage, timeout: float) -> Any:
        """Call ``name`` with a fresh signature per try (a retried call is not a replay)."""
        method: Callable[..., Any] = getattr(self.stub, name)
        body = request.SerializeToString(deterministic=True)

        def once() -> Any:
            return method(request, timeout=timeout, metadata=self._signed(name, body))

        return retry_call(once)

    def _signed(self, name: str, body: bytes) -> tuple[tuple[str, str], ...] | None:
        """The metadata that signs one try of ``name`` (None without a secret)."""
        return sign_call(self._secret, _SERVICE + name, body) if self._secret else None

    def begin_round(self, round_: int, run_id: str = "", aggregation: str = "") -> None:
        """Tell the StageServer that ``round_`` of ``run_id`` starts: tokens must name both.

        ``aggregation`` (federated.aggregation; "" = separate) is how its commit merges."""
        request = pb.BeginRoundRequest(round=round_, run_id=run_id, aggregation=aggregation)
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

    def get_adapter(self) -> dict[str, torch.Tensor]:
        reply = self._call("GetAdapter", pb.AdapterRequest(), 60)
        return st_load(reply.safetensors)

    def load_adapter(self, state: dict[str, torch.Tensor]) -> None:
        data = st_save({k: v.contiguous() for k, v in state.items()})
        self._call("LoadAdapter", pb.LoadAdapterRequest(safetensors=data), 60)

    def reset_adapter(self) -> None:
        """Start the server's global adapter afresh (a new run, not a resumed one)."""
        self._call("LoadAdapter", pb.LoadAdapterRequest(), 60)

    def round_status(self, round_: int, timeout: float = 5.0) -> list[SessionProgress] | None:
        """How far each session of ``round_`` has got, as the StageServer counts it; None when
        the server cannot say (it is unreachable, or older and lacks RoundStatus).

        Read-only and asked while a round runs, so one try, not retried: a later call asks again.
        """
        request = pb.RoundStatusRequest(round=round_)
        body = request.SerializeToString(deterministic=True)
        try:
            reply = self.stub.RoundStatus(
                request, timeout=timeout, metadata=self._signed("RoundStatus", body)
            )
        except grpc.RpcError as exc:
            log.debug("RoundStatus: %s", exc)
            return None
        return [_session_from_proto(s) for s in reply.sessions]

    def check_access(self, timeout: float = 10.0) -> None:
        """One signed, read-only call (no retry): raises ``grpc.RpcError`` unless the server
        accepts this client's secret. A fresh StageServer answers FAILED_PRECONDITION (no run's
        adapter yet) only after it checked the signature, so that answer passes too."""
        request = pb.AdapterRequest()
        body = request.SerializeToString(deterministic=True)
        metadata = self._signed("GetAdapter", body)
        try:
            self.stub.GetAdapter(request, timeout=timeout, metadata=metadata)
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
    )
