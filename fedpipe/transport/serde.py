"""Stage messages to protobuf and back: the one place where runtime messages meet the wire."""

from __future__ import annotations

from typing import cast

from fedpipe.pipeline.messages import Kind, StageMsg
from fedpipe.proto import stage_pb2 as pb
from fedpipe.transport.codec import (
    TensorFormatError,
    labels_from_proto,
    labels_to_proto,
    tensor_from_proto,
    tensor_to_proto,
)

__all__ = ["codec_for", "msg_from_proto", "msg_to_proto"]

_KINDS = {int(k) for k in Kind}


def codec_for(kind: Kind, direction_codec: str, gradient_codec: str = "") -> str:
    """The codec of one message: gradients may use their own, everything else the direction's."""
    if gradient_codec and kind in (Kind.OUTPUT_GRAD, Kind.INPUT_GRAD):
        return gradient_codec
    return direction_codec


def msg_to_proto(msg: StageMsg, *, session_id: str, codec: str) -> pb.StageMessage:
    """Encode a runtime message; float tensors use ``codec``, labels go as int64."""
    out = pb.StageMessage(
        session_id=session_id,
        step=msg.step,
        microbatch=msg.microbatch,
        kind=cast(pb.Kind, int(msg.kind)),  # Kind mirrors the proto enum's numbers
        loss_scale=msg.loss_scale,
        loss_sum=msg.loss_sum,
        tokens=msg.tokens,
        error=msg.error,
        compute_s=msg.compute_s,
        forward_only=msg.forward_only,
    )
    if msg.tensor is not None:
        out.tensor.CopyFrom(tensor_to_proto(msg.tensor, codec))
    if msg.labels is not None:
        out.labels.CopyFrom(labels_to_proto(msg.labels))
    return out


def msg_from_proto(
    raw: pb.StageMessage, *, hidden_size: int | None = None, max_elements: int | None = None
) -> StageMsg:
    """Decode and validate a message; tensors must be (batch, tokens, hidden_size)."""
    if raw.kind not in _KINDS:
        raise TensorFormatError(
            f"unknown message kind {raw.kind}; expected one of {sorted(_KINDS)}"
        )
    kind = Kind(raw.kind)
    if raw.step < 0 or raw.microbatch < 0:
        raise TensorFormatError(
            f"{kind.name}: step and microbatch must be >= 0, got {raw.step} and {raw.microbatch}"
        )
    msg = StageMsg(
        kind,
        raw.step,
        raw.microbatch,
        loss_scale=raw.loss_scale,
        loss_sum=raw.loss_sum,
        tokens=raw.tokens,
        error=raw.error,
        compute_s=raw.compute_s,
        forward_only=raw.forward_only,
        wire_bytes=raw.ByteSize(),
    )
    if raw.HasField("tensor"):
        msg.tensor = tensor_from_proto(
            raw.tensor,
            expect_shape=(None, None, hidden_size) if hidden_size else None,
            max_elements=max_elements,
            name=f"{kind.name} tensor (step {raw.step}, microbatch {raw.microbatch})",
        )
    if raw.HasField("labels"):
        msg.labels = labels_from_proto(
            raw.labels, expect_shape=(None, None), max_elements=max_elements
        )
    return msg
