"""Packed rows on the stage link: each row's segment lengths travel with the ACTIVATION, under
its checksum, and a receiver refuses lengths that do not cut the activation's rows."""

from __future__ import annotations

import pytest
import torch

from fedpipe.errors import CorruptMessageError, TensorFormatError
from fedpipe.messages import Kind, StageMsg
from fedpipe.proto import stage_pb2 as pb
from fedpipe.split.packing import segments_from_lengths
from fedpipe.wire.serde import msg_from_proto, msg_from_wire, msg_to_proto, msg_to_wire, seal

LENGTHS = [[2, 3, 1], [6], [1, 1, 4]]


def _activation() -> StageMsg:
    msg = StageMsg(Kind.ACTIVATION, 1, 2, tensor=torch.randn(3, 6, 8))
    msg.segments = segments_from_lengths(LENGTHS, 6)
    return msg


def test_segments_cross_the_wire_as_lengths_and_come_back_the_same() -> None:
    msg = _activation()
    raw = msg_to_proto(msg, session_id="s", codec="fp32")
    assert list(raw.segment_lengths) == [n for row in LENGTHS for n in row]
    decoded = msg_from_wire(msg_to_wire(msg, session_id="s", codec="fp32"), hidden_size=8)
    assert decoded.segments is not None and torch.equal(decoded.segments, msg.segments)
    plain = msg_from_wire(
        msg_to_wire(
            StageMsg(Kind.ACTIVATION, 1, 2, tensor=msg.tensor), session_id="s", codec="fp32"
        )
    )
    assert plain.segments is None  # rows not packed: no field, no segments


def test_the_checksum_covers_the_segment_lengths() -> None:
    frame = bytearray(msg_to_wire(_activation(), session_id="s", codec="fp32"))
    raw = pb.StageMessage()
    raw.segment_lengths.extend([n for row in LENGTHS for n in row])
    field = raw.SerializeToString()  # the field's bytes as the frame holds them
    at = bytes(frame).index(field)
    frame[at + len(field) - 1] ^= 0x01  # the last length: 4 -> 5
    with pytest.raises(CorruptMessageError, match="corrupted in transit"):
        msg_from_wire(bytes(frame))


def test_generated_code_setting_the_field_after_the_checksum_is_read_the_same() -> None:
    raw = seal(msg_to_proto(_activation(), session_id="s", codec="fp32"))
    decoded = msg_from_wire(raw.SerializeToString(), hidden_size=8)
    assert decoded.segments is not None and torch.equal(decoded.segments, _activation().segments)


@pytest.mark.parametrize(
    "lengths",
    [
        [2, 3, 1, 6, 1, 1],  # a row short
        [2, 3, 1, 6, 1, 1, 4, 6],  # a row too many
        [2, 3, 2, 5, 1, 1, 4],  # a length crosses a row's end
        [0, 6, 6, 6],  # an empty segment
        [-1, 7, 6, 6],
    ],
)
def test_lengths_that_do_not_cut_the_rows_are_refused_in_one_error(lengths: list[int]) -> None:
    raw = msg_to_proto(
        StageMsg(Kind.ACTIVATION, 1, 2, tensor=torch.randn(3, 6, 8)), session_id="s", codec="fp32"
    )
    raw.segment_lengths.extend(lengths)
    with pytest.raises(TensorFormatError, match=r"do not cut the tensor's 3 rows of 6 tokens"):
        msg_from_proto(raw)


def test_lengths_on_another_kind_are_refused() -> None:
    raw = msg_to_proto(
        StageMsg(Kind.OUTPUT_GRAD, 1, 2, tensor=torch.randn(1, 6, 8)), session_id="s", codec="fp32"
    )
    raw.segment_lengths.extend([6])
    with pytest.raises(TensorFormatError, match="only with an ACTIVATION"):
        msg_from_proto(raw)
