"""Adapters through Flower in a stage-link codec (fedpipe.fl.adapter_codec): fp32 leaves the
messages as they are; an update decodes to within its codec's error; error feedback carries
what a round dropped into the next (in the node's ``context.state``); a malformed encoded
reply is refused with why; the settings refuse what an adapter cannot be sent in. (Through the
ServerApp's own rounds: tests/integration/test_adapter_codec_rounds.py.)"""

from __future__ import annotations

from collections.abc import Iterator
from typing import cast

import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity
from harness.close import assert_close_to_scale

from fedpipe.compress.feedback import ErrorFeedback
from fedpipe.config import FederatedConfig, FedpipeConfig
from fedpipe.fl.adapter_codec import (
    ENCODED,
    FEEDBACK_KEY,
    AdapterCodecs,
    AdapterFormatError,
    adapter_codec_mod,
    adapter_nbytes,
    decode_adapters,
    decode_reply,
    encode_adapters,
)


@pytest.fixture(autouse=True)
def task_identity() -> Iterator[None]:
    """Messages are built inside a Flower task; restore Flower's (class-level) identity after."""
    saved = {k: getattr(TaskIdentity, k) for k in ("_task_id", "_run_id", "_node_id")}
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1
    try:
        yield
    finally:
        for key, value in saved.items():
            setattr(TaskIdentity, key, value)


def _adapters(seed: int = 0, scale: float = 1.0) -> dict[str, torch.Tensor]:
    """LoRA-shaped tensors of two layers (A: r x in, B: out x r), one of an odd size."""
    g = torch.Generator().manual_seed(seed)
    return {
        "layers.0.q_proj.lora_A.weight": torch.randn(8, 96, generator=g) * scale,
        "layers.0.q_proj.lora_B.weight": torch.randn(96, 8, generator=g) * scale,
        "layers.1.v_proj.lora_A.weight": torch.randn(8, 33, generator=g) * scale,
        "layers.1.v_proj.lora_B.weight": torch.randn(33, 8, generator=g) * scale,
    }


def _context() -> Context:
    return Context(run_id=0, node_id=7, node_config={}, state=RecordDict(), run_config={})


def _train_message(arrays: ArrayRecord, codecs: AdapterCodecs) -> Message:
    config = ConfigRecord({"fedpipe-round": 1, **codecs.to_config()})
    return Message(
        RecordDict({"arrays": arrays, "config": config}), dst_node_id=7, message_type="train"
    )


def test_fp32_both_ways_is_the_default_and_passes_message_and_reply_as_they_are() -> None:
    codecs = AdapterCodecs.of(FederatedConfig())
    assert codecs.plain and codecs.to_config() == {}
    msg = _train_message(ArrayRecord(_adapters()), codecs)
    seen: list[Message] = []
    reply = Message(RecordDict({"arrays": ArrayRecord(_adapters(1))}), reply_to=msg)

    def train(m: Message, _: Context) -> Message:
        seen.append(m)
        return reply

    context = _context()
    assert adapter_codec_mod(msg, context, train) is reply
    assert seen == [msg] and seen[0].content["arrays"] is msg.content["arrays"]
    assert FEEDBACK_KEY not in context.state
    assert decode_reply(reply, _adapters(), codecs) == ""  # left as it is


@pytest.mark.parametrize(
    ("codec", "tol"), [("fp32", 0.0), ("bf16", 1e-2), ("int8", 2e-2), ("int4", 0.2)]
)
def test_an_update_decodes_to_within_its_codec_error_and_whole_adapters_come_back(
    codec: str, tol: float
) -> None:
    glob, trained = _adapters(0), _adapters(1)
    record = encode_adapters(trained, codec, reference=glob)
    assert all(record[k].stype == ENCODED for k in record.keys())
    got = decode_adapters(record, codec, reference=glob)
    assert got.keys() == trained.keys()
    for key, value in trained.items():
        if codec == "fp32":  # the update and the global adapter added back: bit for bit
            assert torch.equal(got[key], glob[key] + (value - glob[key]))
            continue
        err = (got[key] - value).abs().max().item()
        bound = tol * (value - glob[key]).abs().max().item()
        assert err <= bound, (key, err, bound)


def test_int4_updates_take_under_a_quarter_of_the_fp32_bytes_and_int8_under_0_3() -> None:
    glob, trained = _adapters(0), _adapters(1)
    fp32 = adapter_nbytes(ArrayRecord(trained))
    assert fp32 == sum(t.numel() * 4 for t in trained.values())
    int8 = adapter_nbytes(encode_adapters(trained, "int8", reference=glob))
    int4 = adapter_nbytes(encode_adapters(trained, "int4", reference=glob))
    assert int4 < fp32 / 4 and int8 < 0.3 * fp32, (fp32, int8, int4)


def test_error_feedback_sends_over_rounds_all_the_updates_but_the_last_residual() -> None:
    """Round k sends u_k plus what round k-1 dropped: the decoded sum is the true sum minus
    only the last residual (and without feedback, int4 drifts further)."""
    feedback, plain = ErrorFeedback(), []
    updates = [_adapters(10 + k, scale=0.01) for k in range(4)]
    zero = {k: torch.zeros_like(v) for k, v in updates[0].items()}
    sent = dict.fromkeys(zero, torch.zeros(()))
    for update in updates:
        record = encode_adapters(update, "int4", feedback=feedback)
        decoded = decode_adapters(record, "int4", reference=zero)
        sent = {k: sent[k] + decoded[k] for k in zero}
        plain.append(decode_adapters(encode_adapters(update, "int4"), "int4", reference=zero))
    for key in zero:
        true = sum(u[key] for u in updates)
        residual = cast(torch.Tensor, feedback.residual(key))
        assert_close_to_scale(sent[key] + residual, true, rel=0, atol=1e-6)
        without = sum(p[key] for p in plain)
        assert (sent[key] - true).norm() < (without - true).norm()


def test_the_mod_keeps_residuals_in_context_state_and_adds_them_the_next_round() -> None:
    codecs = AdapterCodecs(up="int4", down="fp32")
    glob = _adapters(0)
    context = _context()
    replies = []
    for k in range(2):
        msg = _train_message(ArrayRecord(glob), codecs)
        trained = {key: v + 0.01 * _adapters(20 + k)[key] for key, v in glob.items()}

        def train(m: Message, _: Context, trained: dict[str, torch.Tensor] = trained) -> Message:
            received = cast(ArrayRecord, m.content["arrays"]).to_torch_state_dict()
            assert all(torch.equal(received[key], glob[key]) for key in glob)  # fp32 downlink
            return Message(RecordDict({"arrays": ArrayRecord(trained)}), reply_to=m)

        replies.append(adapter_codec_mod(msg, context, train))
        residuals = cast(ArrayRecord, context.state[FEEDBACK_KEY]).to_torch_state_dict()
        assert residuals.keys() == glob.keys()
        assert all(r.abs().sum() > 0 for r in residuals.values())
    # the second reply is its own update plus the first round's residual, encoded again
    first = decode_adapters(cast(ArrayRecord, replies[0].content["arrays"]), "int4", reference=glob)
    first_residual = {k: glob[k] + 0.01 * _adapters(20)[k] - first[k] for k in glob}
    expected = encode_adapters(
        {k: 0.01 * _adapters(21)[k] + first_residual[k] for k in glob}, "int4"
    )
    second = cast(ArrayRecord, replies[1].content["arrays"])
    for key in glob:
        got = decode_adapters(ArrayRecord({key: second[key]}), "int4", reference={key: glob[key]})
        want = decode_adapters(
            ArrayRecord({key: expected[key]}), "int4", reference={key: glob[key]}
        )
        assert_close_to_scale(got[key], want[key], rel=0, atol=1e-6)


def test_a_compressed_downlink_is_decoded_before_training_and_the_update_is_against_it() -> None:
    codecs = AdapterCodecs(up="int8", down="int8")
    glob = _adapters(0)
    down = encode_adapters(glob, "int8")
    decoded = decode_adapters(down, "int8")
    seen: dict[str, torch.Tensor] = {}

    def train(m: Message, _: Context) -> Message:
        seen.update(cast(ArrayRecord, m.content["arrays"]).to_torch_state_dict())
        return Message(RecordDict({"arrays": ArrayRecord(dict(seen))}), reply_to=m)  # no change

    reply = adapter_codec_mod(_train_message(down, codecs), _context(), train)
    assert all(torch.equal(seen[k], decoded[k]) for k in glob)
    update = decode_adapters(cast(ArrayRecord, reply.content["arrays"]), "int8", reference=None)
    assert all(torch.count_nonzero(update[k]) == 0 for k in glob)  # trained nothing: no update


def _reply_with(arrays: ArrayRecord) -> Message:
    msg = _train_message(ArrayRecord(), AdapterCodecs("int8"))
    return Message(RecordDict({"arrays": arrays}), reply_to=msg)


def _garbage(record: ArrayRecord, key: str) -> ArrayRecord:
    arrays = {k: record[k] for k in record.keys()}
    a = arrays[key]
    arrays[key] = Array(dtype=a.dtype, shape=a.shape, stype=ENCODED, data=b"\xff\x00garbage")
    return ArrayRecord(arrays)


def _reshaped(record: ArrayRecord, key: str) -> ArrayRecord:
    arrays = {k: record[k] for k in record.keys()}
    a = arrays[key]
    arrays[key] = Array(dtype=a.dtype, shape=(a.shape[1], a.shape[0]), stype=ENCODED, data=a.data)
    return ArrayRecord(arrays)


def _renamed(record: ArrayRecord, key: str) -> ArrayRecord:
    arrays = {k: record[k] for k in record.keys()}
    arrays["model.norm.lora_A.weight"] = arrays.pop(key)
    return ArrayRecord(arrays)


def _plain(record: ArrayRecord, key: str) -> ArrayRecord:
    arrays = {k: record[k] for k in record.keys()}
    arrays[key] = Array(torch.zeros(tuple(arrays[key].shape)).numpy())
    return ArrayRecord(arrays)


@pytest.mark.parametrize(
    ("name", "make", "why"),
    [
        ("garbage bytes", lambda r, k: _garbage(r, k), "not an encoded tensor"),
        ("another codec", None, "encoded as int4, expected int8"),
        ("another shape", lambda r, k: _reshaped(r, k), "has shape"),
        ("a key of no global adapter", lambda r, k: _renamed(r, k), "no global adapter holds"),
        ("not encoded", lambda r, k: _plain(r, k), "is not encoded as int8"),
    ],
)
def test_a_malformed_encoded_reply_is_refused_naming_why(name: str, make, why: str) -> None:  # type: ignore[no-untyped-def]
    glob, trained = _adapters(0), _adapters(1)
    key = "layers.1.v_proj.lora_B.weight"
    if make is None:
        record = encode_adapters(trained, "int4", reference=glob)
    else:
        record = make(encode_adapters(trained, "int8", reference=glob), key)
    reply = _reply_with(record)
    reason = decode_reply(reply, glob, AdapterCodecs("int8"))
    assert reason.startswith("reply not aggregated: its adapter update does not decode"), name
    assert why in reason, reason
    with pytest.raises(AdapterFormatError):
        decode_adapters(record, "int8", reference=glob)


def test_the_settings_take_stage_link_codecs_but_not_token_groups_or_unknown_names() -> None:
    for codec in ("fp32", "bf16", "int8", "int4", "int4g128", "int2"):
        cfg = FedpipeConfig().with_overrides(
            {"federated.adapter_codec": codec, "federated.adapter_downlink_codec": codec}
        )
        assert AdapterCodecs.of(cfg.federated) == AdapterCodecs(codec, codec)
    for bad in ("int4t", "int9", ""):
        with pytest.raises(ValueError, match="federated.adapter_codec"):
            FedpipeConfig().with_overrides({"federated.adapter_codec": bad})
        with pytest.raises(ValueError, match="federated.adapter_downlink_codec"):
            FedpipeConfig().with_overrides({"federated.adapter_downlink_codec": bad})
