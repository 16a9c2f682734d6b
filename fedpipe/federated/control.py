"""The ServerApp's client for the StageServer's round control service."""

from __future__ import annotations

import grpc
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from fedpipe.proto import stage_pb2 as pb
from fedpipe.proto import stage_pb2_grpc as pb_grpc
from fedpipe.transport.errors import retry_call

__all__ = ["StageControlClient"]


class StageControlClient:
    """Begin and commit rounds, and move the server's global adapter (all retried)."""

    def __init__(
        self, address: str, secret: str, *, root_certificates: bytes | None = None
    ) -> None:
        if root_certificates is not None:
            creds = grpc.ssl_channel_credentials(root_certificates=root_certificates)
            self.channel = grpc.secure_channel(address, creds)
        else:
            self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.StageControlStub(self.channel)
        self.secret = secret

    def begin_round(self, round_: int) -> None:
        request = pb.BeginRoundRequest(round=round_, secret=self.secret)
        retry_call(lambda: self.stub.BeginRound(request, timeout=30))

    def commit_round(self, round_: int, finished: dict[str, float]) -> tuple[int, int]:
        """Merge the finished devices' server adapters (by weight); returns (merged, discarded)."""
        request = pb.CommitRoundRequest(
            round=round_,
            secret=self.secret,
            finished=[pb.DeviceWeight(device_id=d, weight=w) for d, w in finished.items()],
        )
        reply = retry_call(lambda: self.stub.CommitRound(request, timeout=60))
        return reply.merged, reply.discarded

    def get_adapter(self) -> dict[str, torch.Tensor]:
        reply = retry_call(
            lambda: self.stub.GetAdapter(pb.AdapterRequest(secret=self.secret), timeout=60)
        )
        return st_load(reply.safetensors)

    def load_adapter(self, state: dict[str, torch.Tensor]) -> None:
        data = st_save({k: v.contiguous() for k, v in state.items()})
        request = pb.LoadAdapterRequest(secret=self.secret, safetensors=data)
        retry_call(lambda: self.stub.LoadAdapter(request, timeout=60))

    def reset_adapter(self) -> None:
        """Start the server's global adapter afresh (a new run, not a resumed one)."""
        request = pb.LoadAdapterRequest(secret=self.secret)
        retry_call(lambda: self.stub.LoadAdapter(request, timeout=60))

    def close(self) -> None:
        self.channel.close()
