"""One session request from device to runtime (fedpipe.wire.backend.SessionRequest): what a
device builds goes on the wire as the OpenSessionRequest it always was, and the servicer reads
it back into the same type."""

from __future__ import annotations

from dataclasses import replace

from fedpipe.compress.delta import CacheIdentity
from fedpipe.proto import stage_pb2 as pb
from fedpipe.split.agreement import SplitInfo
from fedpipe.wire.backend import SessionRequest
from fedpipe.wire.link_servicer import session_request
from fedpipe.wire.serde import session_request_to_proto, split_to_proto
from fedpipe.wire.tensors import codec_to_proto

SPLIT = SplitInfo(
    model="tiny-llama",
    num_layers=4,
    head_layers=2,
    tail_layers=1,
    mode="u",
    hidden_size=64,
    dtype="float32",
    fingerprint="f" * 16,
)
# Every field away from its default: codecs with names the enum cannot say (int4tg128).
REQUEST = SessionRequest(
    device_id="dev-3",
    round=7,
    token="tok",
    split=SPLIT,
    downlink_codec="bf16",
    gradient_codec="int4tg128",
    uplink_codec="int8",
    learning_rate=5e-3,
    weight_decay=0.01,
    microbatch_size=4,
    seq_len=32,
    frozen_head=True,
    error_feedback=True,
    stochastic_rounding=True,
    delta_cache_bytes=1 << 20,
    delta_identity=CacheIdentity("cache-1", 12, b"\x01\x02"),
)


def _as_before(r: SessionRequest) -> pb.OpenSessionRequest:
    """OpenSessionRequest as the device client built it field by field before the
    request had a type (the wire format the raw-protobuf tests speak)."""
    request = pb.OpenSessionRequest(
        split=split_to_proto(r.split),
        device_id=r.device_id,
        token=r.token,
        round=r.round,
        uplink_codec=codec_to_proto(r.uplink_codec),
        downlink_codec=codec_to_proto(r.downlink_codec),
        gradient_codec=codec_to_proto(r.gradient_codec) if r.gradient_codec else None,
        downlink_codec_name=r.downlink_codec,
        gradient_codec_name=r.gradient_codec,
        error_feedback=r.error_feedback,
        delta_cache_bytes=r.delta_cache_bytes,
        stochastic_rounding=r.stochastic_rounding,
        learning_rate=r.learning_rate,
        weight_decay=r.weight_decay,
        microbatch_size=r.microbatch_size,
        seq_len=r.seq_len,
        frozen_head=r.frozen_head,
    )
    if r.delta_identity.cache_id:
        request.delta_cache_id = r.delta_identity.cache_id
        request.delta_cache_entries = r.delta_identity.entries
        request.delta_cache_digest = r.delta_identity.digest
    return request


def test_the_request_goes_on_the_wire_as_before() -> None:
    for r in (REQUEST, SessionRequest(device_id="evaluator", round=0, split=SPLIT)):
        sent = session_request_to_proto(r).SerializeToString(deterministic=True)
        assert sent == _as_before(r).SerializeToString(deterministic=True)


def test_the_servicer_reads_the_request_back_into_the_same_type() -> None:
    """Every field comes back equal, but for what the wire carries in another form: the split
    as its proto, the uplink codec by its enum's name (no name field goes up for it), and the
    learning rate and weight decay as float32."""
    wire = session_request_to_proto(REQUEST)
    got = session_request(pb.OpenSessionRequest.FromString(wire.SerializeToString()))
    assert got.split == split_to_proto(SPLIT)
    assert got.uplink_codec == "INT8"
    assert abs(got.learning_rate - 5e-3) < 1e-9 and abs(got.weight_decay - 0.01) < 1e-9
    same = replace(got, split=SPLIT, uplink_codec="int8", learning_rate=5e-3, weight_decay=0.01)
    assert same == REQUEST
