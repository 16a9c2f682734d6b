"""Stage messages to protobuf and back: the one place where runtime messages meet the wire."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

import torch

from fedpipe.errors import InvalidRequestError
from fedpipe.pipeline.messages import Kind, StageMsg
from fedpipe.proto import stage_pb2 as pb
from fedpipe.transport.codec import (
    TensorFormatError,
    labels_from_proto,
    labels_to_proto,
    payload_nbytes,
    tensor_from_proto,
    tensor_to_proto,
)

__all__ = ["MessageBounds", "codec_for", "msg_from_proto", "msg_to_proto", "wire_nbytes"]

_KINDS = {int(k) for k in Kind}
_DEVICE_KINDS = (Kind.ACTIVATION, Kind.OUTPUT_GRAD, Kind.STEP_END)
IGNORE_INDEX = -100  # labels that do not count in the loss (torch's cross-entropy default)
# Ids, kind, scalars, shapes and field tags of a message: a generous bound, not an exact count.
_HEADER_BYTES = 96


@dataclass(frozen=True)
class MessageBounds:
    """What a session declared at OpenSession; every tensor it sends must fit inside.

    Checked on the wire shape before anything is decoded or allocated, so a hostile shape such
    as ``(0, 2**40, C)`` costs nothing. ``vocab_size`` 0 leaves label values unchecked.
    """

    hidden_size: int
    max_batch: int  # the session's microbatch size
    max_tokens: int  # the session's sequence length (at most the model's positions)
    vocab_size: int = 0


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
    if msg.tensor is not None:  # filled in place: CopyFrom would copy the payload again
        tensor_to_proto(msg.tensor, codec, out=out.tensor)
    if msg.labels is not None:
        labels_to_proto(msg.labels, out=out.labels)
    return out


def wire_nbytes(raw: pb.StageMessage) -> int:
    """A message's size on the wire, from its tensors' shapes, within ``_HEADER_BYTES``.

    ``ByteSize()`` would serialise the whole message again to count it (about 1 ms for a
    9.4 MB activation), and reading ``data`` would copy it; link emulation and traffic stats
    only need the size to a few bytes.
    """
    size = _HEADER_BYTES + len(raw.error)
    if raw.HasField("tensor"):
        size += payload_nbytes(raw.tensor)
    if raw.HasField("labels"):
        size += payload_nbytes(raw.labels)
    return size


def msg_from_proto(
    raw: pb.StageMessage,
    *,
    hidden_size: int | None = None,
    max_elements: int | None = None,
    bounds: MessageBounds | None = None,
) -> StageMsg:
    """Decode and validate a message; tensors must be (batch, tokens, hidden_size).

    With ``bounds`` (the server's side), shapes must fit what the session declared, labels
    must be token ids or -100, and ``loss_scale`` must lie in [0, 1]; any violation raises
    ``InvalidRequestError`` (INVALID_ARGUMENT). Every float tensor must be finite, on both sides.
    """
    if raw.kind not in _KINDS:
        raise TensorFormatError(
            f"unknown message kind {raw.kind}; expected one of {sorted(_KINDS)}"
        )
    kind = Kind(raw.kind)
    if bounds is not None:
        _check_bounds(raw, kind, bounds)
        hidden_size = bounds.hidden_size
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
        wire_bytes=wire_nbytes(raw),
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
        if bounds is not None and bounds.vocab_size > 0:
            _check_label_values(msg.labels, bounds.vocab_size, kind, raw)
    return msg


def _check_bounds(raw: pb.StageMessage, kind: Kind, bounds: MessageBounds) -> None:
    """Refuse shapes and scales outside the session's declaration, from the wire shape alone."""
    where = f"{kind.name} (step {raw.step}, microbatch {raw.microbatch})"
    if kind not in _DEVICE_KINDS:
        raise InvalidRequestError(
            f"{where} is not a device-to-server message; send ACTIVATION, OUTPUT_GRAD or STEP_END"
        )
    if kind is not Kind.STEP_END and not raw.HasField("tensor"):
        raise InvalidRequestError(f"{where} carries no tensor")
    if raw.HasField("tensor"):
        name = f"{kind.name} tensor (step {raw.step}, microbatch {raw.microbatch})"
        _check_shape(tuple(raw.tensor.shape), bounds, name)
    if raw.HasField("labels"):
        labels = tuple(raw.labels.shape)
        if not raw.HasField("tensor") or labels != tuple(raw.tensor.shape)[:2]:
            tensor = tuple(raw.tensor.shape) if raw.HasField("tensor") else None
            raise InvalidRequestError(
                f"{where}: labels of shape {labels} must be (batch, tokens) of the tensor, "
                f"whose shape is {tensor}"
            )
    if not (math.isfinite(raw.loss_scale) and 0.0 <= raw.loss_scale <= 1.0):
        raise InvalidRequestError(
            f"{where}: loss_scale {raw.loss_scale} is outside [0, 1]; it must be "
            "1 / (tokens in the whole step)"
        )


def _check_shape(shape: tuple[int, ...], bounds: MessageBounds, name: str) -> None:
    limits = (bounds.max_batch, bounds.max_tokens)
    ok = (
        len(shape) == 3
        and shape[2] == bounds.hidden_size
        and all(1 <= d <= limit for d, limit in zip(shape[:2], limits, strict=True))
    )
    if not ok:
        raise InvalidRequestError(
            f"{name}: shape {shape} does not fit the session: expected (*, *, "
            f"{bounds.hidden_size}) with 1 <= batch <= {bounds.max_batch} (its microbatch "
            f"size) and 1 <= tokens <= {bounds.max_tokens} (its sequence length); open the "
            "session with the microbatch size and sequence length you send"
        )


def _check_label_values(
    labels: torch.Tensor, vocab_size: int, kind: Kind, raw: pb.StageMessage
) -> None:
    ok = (labels == IGNORE_INDEX) | ((labels >= 0) & (labels < vocab_size))
    if not bool(ok.all()):
        bad = labels[~ok]
        raise InvalidRequestError(
            f"{kind.name} (step {raw.step}, microbatch {raw.microbatch}): {bad.numel()} labels "
            f"outside [0, {vocab_size}) and not {IGNORE_INDEX} (first: {int(bad[0])}); labels "
            "are token ids of the server's model, or -100 for tokens that do not count"
        )
