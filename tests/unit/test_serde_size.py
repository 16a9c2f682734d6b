"""The stage link's serde: sizes from shapes, one-copy framing, the transport benchmark."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import xxhash
from hypothesis import event, given, settings
from hypothesis import strategies as st

from fedpipe.errors import CorruptMessageError, InvalidRequestError, TensorFormatError
from fedpipe.messages import Kind, StageMsg
from fedpipe.proto import stage_pb2 as pb
from fedpipe.wire.serde import (
    MessageBounds,
    msg_from_proto,
    msg_from_wire,
    msg_to_proto,
    msg_to_wire,
    seal,
    wire_header,
    wire_nbytes,
)
from fedpipe.wire.tensors import CODECS

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("labels", [False, True])
def test_wire_size_from_shapes_is_within_the_header_bound(codec: str, labels: bool) -> None:
    msg = StageMsg(Kind.ACTIVATION, 3, 5, tensor=torch.randn(2, 7, 16), loss_scale=0.25)
    if labels:
        msg.labels = torch.randint(0, 50, (2, 7))
    raw = msg_to_proto(msg, session_id="s" * 32, codec=codec)
    assert raw.ByteSize() <= wire_nbytes(raw) <= raw.ByteSize() + 96
    decoded = msg_from_proto(pb.StageMessage.FromString(raw.SerializeToString()))
    assert decoded.wire_bytes == wire_nbytes(raw)


def test_decoded_tensors_do_not_share_memory_with_each_other() -> None:
    """Two decodes of one message are independent: writing one leaves the other intact."""
    raw = msg_to_proto(
        StageMsg(Kind.OUTPUT, 0, 0, tensor=torch.ones(2, 3, 4)), session_id="", codec="fp32"
    )
    first, second = msg_from_proto(raw), msg_from_proto(raw)
    assert first.tensor is not None and second.tensor is not None
    first.tensor.add_(1)
    assert torch.equal(second.tensor, torch.ones(2, 3, 4))
    assert torch.equal(msg_from_proto(raw).tensor, torch.ones(2, 3, 4))


def _msg(codec_labels: bool = True) -> StageMsg:
    msg = StageMsg(Kind.ACTIVATION, 4, 2, tensor=torch.randn(2, 5, 8), loss_scale=0.125)
    if codec_labels:
        msg.labels = torch.randint(0, 50, (2, 5))
    return msg


@pytest.mark.parametrize("codec", CODECS)
def test_framed_messages_are_ordinary_stage_messages(codec: str) -> None:
    """msg_to_wire's bytes parse as a StageMessage; protobuf's own bytes decode by msg_from_wire."""
    msg = _msg()
    frame = msg_to_wire(msg, session_id="s1", codec=codec)
    parsed = msg_from_proto(pb.StageMessage.FromString(frame))
    framed = msg_from_wire(frame)
    reference = seal(msg_to_proto(msg, session_id="s1", codec=codec)).SerializeToString()
    for decoded in (parsed, framed, msg_from_wire(reference)):
        assert decoded.tensor is not None and decoded.labels is not None
        assert torch.equal(decoded.tensor, parsed.tensor)  # type: ignore[arg-type]
        assert torch.equal(decoded.labels, msg.labels)  # type: ignore[arg-type]
        assert (decoded.step, decoded.microbatch, decoded.loss_scale) == (4, 2, 0.125)
    assert framed.wire_bytes == len(frame)
    assert wire_header(frame).kind == pb.ACTIVATION and wire_header(frame).microbatch == 2


def test_a_frame_with_its_tensor_split_in_two_fields_decodes_as_protobuf_merges_it() -> None:
    """Protobuf merges repeated message fields (last data wins); the framer falls back to it."""
    first = msg_to_proto(_msg(False), session_id="", codec="fp32").SerializeToString()
    second = pb.StageMessage(tensor=pb.Tensor(data=bytes(2 * 5 * 8 * 4))).SerializeToString()
    checksum = pb.StageMessage(checksum=xxhash.xxh3_64_intdigest(first + second))
    checksum_bytes = checksum.SerializeToString()
    decoded = msg_from_wire(first + second + checksum_bytes)
    assert decoded.tensor is not None and torch.equal(decoded.tensor, torch.zeros(2, 5, 8))


@pytest.mark.parametrize(
    "frame",
    [b"\x2a\xff\xff\xff\xff\x0f", b"\x2a\x05\x1a", b"\xff" * 11, b"\x2f", b"\x2a\x02\x1a\x09"],
    ids=["tensor-past-end", "truncated", "overlong-varint", "wire-type-7", "data-past-end"],
)
def test_malformed_frames_are_refused_as_format_errors(frame: bytes) -> None:
    # The top level is parsed first; what lies inside a field is past the checksum's check.
    with pytest.raises(TensorFormatError, match="malformed stage message|0 checksum fields"):
        msg_from_wire(frame)


@pytest.mark.parametrize("codec", ["fp32", "bf16", "int8", "int4"])
@pytest.mark.parametrize("where", ["tensor", "header", "checksum"])
def test_a_frame_corrupted_anywhere_is_refused_as_corrupted_in_transit(
    codec: str, where: str
) -> None:
    """One flipped bit, in the tensor's bytes, the header or the checksum itself, is refused
    before decoding as corruption (naming the message), never as a diverged computation."""
    msg = StageMsg(Kind.OUTPUT, 7, 3, tensor=torch.randn(2, 16, 8))
    frame = bytearray(msg_to_wire(msg, session_id="abcdefgh12345", codec=codec))
    at = {"tensor": len(frame) - 40, "header": 1, "checksum": len(frame) - 1}[where]
    frame[at] ^= 0x10
    with pytest.raises(CorruptMessageError, match="corrupted in transit") as refused:
        msg_from_wire(bytes(frame))
    assert "NaN" not in str(refused.value) and "diverged" not in str(refused.value)
    if where != "header":
        assert "OUTPUT (session abcdefgh…, step 7, microbatch 3)" in str(refused.value)


def test_a_frame_without_its_checksum_is_refused() -> None:
    raw = msg_to_proto(_msg(False), session_id="s1", codec="fp32")
    with pytest.raises(CorruptMessageError, match="0 checksum fields"):
        msg_from_wire(raw.SerializeToString())
    assert msg_from_wire(seal(raw).SerializeToString()).step == 4  # sealed, it is taken


def test_the_checksum_covers_every_byte_before_it() -> None:
    frame = msg_to_wire(_msg(), session_id="s1", codec="fp32")
    assert frame[-9] == (15 << 3 | 1)  # the checksum field (fixed64) closes the frame
    assert int.from_bytes(frame[-8:], "little") == xxhash.xxh3_64_intdigest(frame[:-9])


def test_a_framed_tensor_is_checked_like_any_other() -> None:
    bad = StageMsg(Kind.ACTIVATION, 0, 0, tensor=torch.tensor([[[1.0, float("nan")]]]))
    with pytest.raises(TensorFormatError, match="NaN or Inf"):
        msg_from_wire(msg_to_wire(bad, session_id="", codec="fp32"))
    bounds = MessageBounds(hidden_size=8, max_batch=1, max_tokens=5)
    with pytest.raises(InvalidRequestError, match="does not fit the session"):
        msg_from_wire(msg_to_wire(_msg(False), session_id="", codec="fp32"), bounds=bounds)


@st.composite
def _frames(draw: st.DrawFn) -> tuple[bytes, StageMsg | None, str]:
    """(frame, the message it encodes or None, how it was made): a frame ``msg_to_wire`` wrote
    for a real message, the same with bytes flipped, cut or appended, or random bytes."""
    how = draw(st.sampled_from(["valid", "flip", "truncate", "extend", "random"]))
    if how == "random":
        return draw(st.binary(max_size=120)), None, how
    shape = (draw(st.integers(1, 3)), draw(st.integers(1, 6)), draw(st.integers(1, 8)))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    msg = StageMsg(
        draw(st.sampled_from([Kind.ACTIVATION, Kind.OUTPUT, Kind.OUTPUT_GRAD, Kind.INPUT_GRAD])),
        draw(st.integers(0, 2**31)),
        draw(st.integers(0, 64)),
        tensor=torch.randn(shape, generator=gen),
        loss_scale=draw(st.sampled_from([0.0, 0.125, 1.0])),
    )
    if msg.kind == Kind.ACTIVATION and draw(st.booleans()):
        msg.labels = torch.randint(0, 50, shape[:2], generator=gen)
    frame = bytearray(msg_to_wire(msg, session_id="s1", codec=draw(st.sampled_from(CODECS))))
    if how == "flip":
        # distinct positions: two flips of one byte by the same value would cancel, and the
        # "damaged" frame would be the one that was sent
        where = st.lists(st.integers(0, len(frame) - 1), min_size=1, max_size=3, unique=True)
        for at in draw(where):
            frame[at] ^= draw(st.integers(1, 255))
    elif how == "truncate":
        del frame[draw(st.integers(0, len(frame) - 1)) :]
    elif how == "extend":
        frame += draw(st.binary(min_size=1, max_size=12))
    return bytes(frame), (msg if how == "valid" else None), how


def test_fuzz_frames_decode_when_valid_and_are_refused_with_format_errors_otherwise() -> None:
    """msg_from_wire on generated frames: every frame msg_to_wire wrote decodes to its message;
    a damaged frame is refused as corrupted (its checksum), a random one with
    TensorFormatError/InvalidRequestError, never another exception; both outcomes occur often."""
    outcomes = {"decoded": 0, "refused": 0}

    @settings(max_examples=150, deadline=None)
    @given(case=_frames())
    def decode(case: tuple[bytes, StageMsg | None, str]) -> None:
        frame, sent, how = case
        try:
            got = msg_from_wire(frame)
        except (TensorFormatError, InvalidRequestError):
            outcomes["refused"] += 1
            event(f"refused ({how})")
            assert sent is None, "a frame msg_to_wire wrote was refused"
            return
        assert how in ("valid", "random"), f"a {how} frame was decoded"
        outcomes["decoded"] += 1
        event(f"decoded ({how})")
        assert got.wire_bytes == len(frame)
        if sent is not None:
            assert (got.kind, got.step, got.microbatch) == (sent.kind, sent.step, sent.microbatch)
            assert got.tensor is not None and sent.tensor is not None
            assert got.tensor.shape == sent.tensor.shape
            if sent.labels is not None:
                assert torch.equal(got.labels, sent.labels)  # type: ignore[arg-type]

    decode()
    # both outcomes, many times (a fifth of the cases are valid frames on average; at least
    # 5 of 150 holds for any seed hypothesis draws)
    assert outcomes["decoded"] >= 5 and outcomes["refused"] >= 5, outcomes


def test_writing_a_one_byte_tensor_leaves_the_process_wide_byte_alone() -> None:
    """CPython (and upb, for a 1-byte field) share one ``bytes`` object per byte value: a
    tensor decoded over it must be a copy, or writing to it would change that byte in every
    ``bytes`` of length one in the process."""
    from fedpipe.wire.tensors import _from_bytes

    field = pb.Tensor(data=bytes([7])).data  # what upb hands a decoder: the shared object
    assert field is bytes([7])
    t = _from_bytes(field, torch.int8, (1,))
    t.add_(1)
    assert bytes([7]) == b"\x07" and field[0] == 7
