"""Delta coding of activations: mirrored caches, identical reconstruction, misses and eviction."""

from __future__ import annotations

import pytest
import torch

from fedpipe.compress.delta import DELTA_BIT, DeltaCache
from fedpipe.errors import TensorFormatError
from fedpipe.messages import Kind, StageMsg
from fedpipe.proto import stage_pb2 as pb
from fedpipe.wire.serde import msg_from_wire, msg_to_wire, wire_nbytes
from fedpipe.wire.stream_codec import StreamCodecs, StreamDecoder, StreamEncoder

T, C = 8, 64
ROW_BYTES = T * C * 4


def _pair(codec: str = "int4", cap: int = 10 * ROW_BYTES) -> tuple[StreamEncoder, StreamDecoder]:
    encoder = StreamEncoder(StreamCodecs(codec, delta_cache_bytes=cap), session_id="s")
    return encoder, StreamDecoder(delta_cache_bytes=cap)


def _ids(*samples: int) -> torch.Tensor:
    """Token ids of the given samples, one row each (sample k: tokens k, k+1, ...)."""
    return torch.stack([torch.arange(k, k + T) for k in samples])


def _send(
    encoder: StreamEncoder, decoder: StreamDecoder, x: torch.Tensor, ids: torch.Tensor, step: int
) -> StageMsg:
    frame = encoder.encode(StageMsg(Kind.ACTIVATION, step, 0, tensor=x, inputs=ids))
    return decoder.decode(frame)


def _assert_mirrored(encoder: StreamEncoder, decoder: StreamDecoder) -> None:
    assert encoder.delta is not None
    sent, got = encoder.delta.cache, decoder.delta.cache
    assert list(sent._rows) == list(got._rows) and sent.nbytes == got.nbytes
    for key, row in sent._rows.items():
        assert torch.equal(row, got._rows[key])  # bit for bit


def _activation(seed: int, rows: int = 2) -> torch.Tensor:
    return torch.randn(rows, T, C, generator=torch.Generator().manual_seed(seed)) * 4


def test_a_sample_seen_again_is_sent_as_a_difference_and_rebuilt_identically() -> None:
    encoder, decoder = _pair()
    x = _activation(0)
    first = _send(encoder, decoder, x, _ids(1, 2), step=0)
    assert not any(k & DELTA_BIT for k in first.sample_keys)  # cache miss: sent whole
    _assert_mirrored(encoder, decoder)
    moved = x + 0.01 * _activation(1)  # the head moved a little since
    second = _send(encoder, decoder, moved, _ids(1, 2), step=1)
    assert all(k & DELTA_BIT for k in second.sample_keys)  # cache hit: differences
    _assert_mirrored(encoder, decoder)
    assert second.tensor is not None and first.tensor is not None
    # The difference (the head's move plus the last send's error) spans a small range, so its
    # int4 error is far below a whole send's: each send corrects the base by about 15x.
    full_err = (first.tensor - x).abs().max()
    delta_err = (second.tensor - moved).abs().max()
    assert delta_err < full_err / 8
    third = _send(encoder, decoder, moved, _ids(1, 2), step=2)
    assert third.tensor is not None
    assert (third.tensor - moved).abs().max() < delta_err / 8


def test_hits_and_misses_mix_row_by_row() -> None:
    encoder, decoder = _pair("int2")
    _send(encoder, decoder, _activation(0), _ids(1, 2), step=0)
    msg = _send(encoder, decoder, _activation(2, rows=3), _ids(2, 3, 1), step=1)
    assert [bool(k & DELTA_BIT) for k in msg.sample_keys] == [True, False, True]
    _assert_mirrored(encoder, decoder)
    assert len(decoder.delta.cache) == 3


def test_eviction_drops_the_same_rows_on_both_sides() -> None:
    encoder, decoder = _pair(cap=2 * ROW_BYTES)  # room for two samples
    for step, sample in enumerate((1, 2, 3)):
        _send(encoder, decoder, _activation(step, rows=1), _ids(sample), step)
        _assert_mirrored(encoder, decoder)
    assert len(decoder.delta.cache) == 2
    again = _send(encoder, decoder, _activation(9, rows=1), _ids(1), step=3)  # 1 was evicted
    assert not again.sample_keys[0] & DELTA_BIT
    hit = _send(encoder, decoder, _activation(9, rows=1), _ids(3), step=4)
    assert hit.sample_keys[0] & DELTA_BIT
    _assert_mirrored(encoder, decoder)


def test_a_row_larger_than_the_cache_is_never_stored() -> None:
    cache = DeltaCache(100)
    cache.put(1, torch.zeros(10))  # 40 bytes
    cache.put(1, torch.zeros(30))  # 120 bytes: too large, and the old value is gone too
    assert len(cache) == 0 and cache.nbytes == 0
    with pytest.raises(ValueError, match=">= 0 bytes"):
        DeltaCache(-1)


def test_a_difference_whose_base_is_missing_is_refused() -> None:
    encoder, _ = _pair()
    _send(encoder, StreamDecoder(delta_cache_bytes=10 * ROW_BYTES), _activation(0), _ids(1, 2), 0)
    frame = encoder.encode(
        StageMsg(Kind.ACTIVATION, 1, 0, tensor=_activation(1), inputs=_ids(1, 2))
    )
    with pytest.raises(TensorFormatError, match=r"row 0 is a difference from sample .* holds none"):
        StreamDecoder(delta_cache_bytes=10 * ROW_BYTES).decode(frame)  # a receiver that lost it


def test_keys_are_salted_per_session_and_only_go_with_activations() -> None:
    a, _ = _pair()
    b, _ = _pair()
    assert a.delta is not None and b.delta is not None
    assert a.delta.keys_for(_ids(1)) != b.delta.keys_for(_ids(1))
    assert a.delta.keys_for(_ids(1)) == a.delta.keys_for(_ids(1))
    grad = StageMsg(Kind.OUTPUT_GRAD, 0, 0, tensor=torch.zeros(2, T, C), sample_keys=(1, 2))
    with pytest.raises(TensorFormatError, match="only with an ACTIVATION, one per row"):
        msg_from_wire(msg_to_wire(grad, session_id="", codec="fp32"))
    short = StageMsg(Kind.ACTIVATION, 0, 0, tensor=torch.zeros(2, T, C), sample_keys=(1,))
    with pytest.raises(TensorFormatError, match=r"1 sample keys; .* \(2 rows here\)"):
        msg_from_wire(msg_to_wire(short, session_id="", codec="fp32"))


def test_without_token_ids_or_a_cache_nothing_changes() -> None:
    encoder, decoder = _pair()
    plain = encoder.encode(StageMsg(Kind.ACTIVATION, 0, 0, tensor=_activation(0)))  # no inputs
    assert not pb.StageMessage.FromString(plain).sample_keys
    off = StreamEncoder(StreamCodecs("int4"), session_id="s")
    x = _activation(0)
    frame = off.encode(StageMsg(Kind.ACTIVATION, 0, 0, tensor=x, inputs=_ids(1, 2)))
    plain_frame = msg_to_wire(
        StageMsg(Kind.ACTIVATION, 0, 0, tensor=x), session_id="s", codec="int4"
    )
    assert frame == plain_frame  # the token ids are never sent
    assert len(decoder.delta.cache) == 0


def test_wire_size_from_shapes_counts_the_sample_keys() -> None:
    msg = StageMsg(Kind.ACTIVATION, 0, 0, tensor=torch.zeros(4, T, C), sample_keys=(1, 2, 3, 2**63))
    raw = pb.StageMessage.FromString(msg_to_wire(msg, session_id="s" * 32, codec="int4"))
    assert list(raw.sample_keys) == [1, 2, 3, 2**63]
    assert raw.ByteSize() <= wire_nbytes(raw) <= raw.ByteSize() + 96


def test_a_difference_that_overflows_its_base_is_refused_and_not_stored() -> None:
    """A finite difference from a finite base can sum to Inf (3e38 + 3e38 in fp32): the rebuilt
    row is checked, refused, and the base the receiver holds stays as it was."""
    decoder = StreamDecoder(delta_cache_bytes=10 * ROW_BYTES)
    big = torch.full((1, T, C), 3e38)
    key = 0x1234
    first = StageMsg(Kind.ACTIVATION, 0, 0, tensor=big, sample_keys=(key,))
    decoder.decode(msg_to_wire(first, session_id="s", codec="fp32"))
    held = decoder.delta.cache.get(key)
    assert held is not None and torch.equal(held, big[0])
    second = StageMsg(Kind.ACTIVATION, 1, 0, tensor=big, sample_keys=(key | DELTA_BIT,))
    with pytest.raises(TensorFormatError, match="row 0 holds NaN or Inf once its base is added"):
        decoder.decode(msg_to_wire(second, session_id="s", codec="fp32"))
    assert torch.equal(decoder.delta.cache.get(key), big[0])  # type: ignore[arg-type]
