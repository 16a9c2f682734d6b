"""Low-bit codecs (int4, int2): bit packing, group error bounds, stochastic rounding, checks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedpipe.compress import lowbit
from fedpipe.errors import TensorFormatError
from fedpipe.proto import stage_pb2 as pb
from fedpipe.wire.tensors import encoded_nbytes, payload_nbytes, tensor_from_proto, tensor_to_proto

LOW_BIT = [
    "int4",
    "int2",
    "int4g16",
    "int2g16",
    "int4g128",
    "int2g1024",
    "int4t",
    "int2tg16",
    "int4to",
    "int2o8g16",
    "int4tog128",
]


def _bits_group(codec: str) -> tuple[int, int]:
    bits = 4 if codec.startswith("int4") else 2
    return bits, int(codec.split("g")[1]) if "g" in codec else 64


def _grouped(x: torch.Tensor, codec: str) -> torch.Tensor:
    """``x``'s values in the order the codec groups them (channel-major for ``t`` codecs)."""
    if codec[4:5] == "t":  # int4t, int2tg16
        return x.reshape(-1, x.shape[-1]).t().reshape(-1)
    return x.reshape(-1)


@settings(max_examples=200, deadline=None)
@given(bits=st.sampled_from([2, 4]), data=st.data())
def test_pack_unpack_round_trip_any_length(bits: int, data: st.DataObject) -> None:
    values = data.draw(st.lists(st.integers(0, 2**bits - 1), max_size=67))
    q = torch.tensor(values, dtype=torch.uint8)
    packed = lowbit.pack(q, bits)
    assert packed.numel() == lowbit.packed_nbytes(len(values), bits)
    assert torch.equal(lowbit.unpack(packed, bits, len(values)), q)


def test_packing_puts_the_first_value_in_the_low_bits() -> None:
    assert lowbit.pack(torch.tensor([0, 1, 2, 3, 3], dtype=torch.uint8), 2).tolist() == [
        0b11100100,
        0b00000011,  # unused high bits are zero
    ]
    assert lowbit.pack(torch.tensor([1, 15, 7], dtype=torch.uint8), 4).tolist() == [0xF1, 0x07]


def test_int2_wire_format() -> None:
    msg = tensor_to_proto(torch.tensor([1.0, 1.5, 2.0, 2.5, 2.4]), "int2g16")
    assert msg.codec == pb.INT2 and msg.group_size == 16
    assert list(msg.data) == [0b11100100, 0b00000011]  # q = 0, 1, 2, 3, 3 (2.8 rounds to 3)
    meta = torch.frombuffer(bytearray(msg.scales), dtype=torch.float32)
    assert meta.tolist() == [0.5, 1.0]  # one group: its scale, then its offset


@pytest.mark.parametrize("codec", LOW_BIT)
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 5), (2, 9, 13), (4, 64), (2, 3, 576)], ids=str)
def test_round_trip_within_half_a_step_per_group(codec: str, shape: tuple[int, ...]) -> None:
    bits, group = _bits_group(codec)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen) * torch.logspace(-3, 3, shape[-1])  # wide magnitudes
    msg = pb.Tensor.FromString(tensor_to_proto(x, codec).SerializeToString())
    assert len(msg.data) + len(msg.scales) == encoded_nbytes(shape, codec) == payload_nbytes(msg)
    y = tensor_from_proto(msg)
    assert y.shape == x.shape and y.dtype == torch.float32
    flat, err = _grouped(x, codec), _grouped(y - x, codec).abs()
    for start in range(0, flat.numel(), group):
        part = flat[start : start + group]
        step = float(part.max() - part.min()) / (2**bits - 1)
        slack = 4e-7 * float(part.abs().max())
        assert float(err[start : start + group].max()) <= step / 2 * (1 + 1e-5) + slack


@pytest.mark.parametrize("codec", ["int4", "int2"])
def test_constant_groups_and_extremes_decode_exactly(codec: str) -> None:
    x = torch.full((3, 64), -2.5)
    x[1] = 0.0
    assert torch.equal(tensor_from_proto(tensor_to_proto(x, codec)), x)
    x[2, :2] = torch.tensor([-1e30, 1e30])  # min and max of a group are exact
    y = tensor_from_proto(tensor_to_proto(x, codec))
    assert y[2, 0] == -1e30 and y[2, 1] == pytest.approx(1e30, rel=1e-6)


def test_stochastic_rounding_is_unbiased_and_within_one_step() -> None:
    x = torch.linspace(-1.0, 1.0, 64).repeat(400, 1)  # the same group 400 times
    gen = torch.Generator().manual_seed(3)
    packed, scales, offsets = lowbit.quantize(x, 2, 64, generator=gen)
    y = lowbit.dequantize(packed, scales, offsets, 2, 64, x.numel()).view_as(x)
    step = 2.0 / 3
    assert ((y - x).abs() < step * (1 + 1e-6)).all()
    nearest = lowbit.dequantize(*lowbit.quantize(x, 2, 64), 2, 64, x.numel()).view_as(x)
    # Nearest rounding is off by up to step / 2 for a value, every time; the stochastic mean
    # over 400 draws is within 4 standard errors (step / 2 / sqrt(400) each) of the truth.
    assert (nearest[0] - x[0]).abs().max() > 0.3
    assert (y.mean(dim=0) - x[0]).abs().max() < 4 * step / 2 / 20


def _lowbit_msg(
    codec: str = "int4", shape: tuple[int, ...] = (3, 70), **fields: object
) -> pb.Tensor:
    msg = tensor_to_proto(torch.randn(shape), codec)
    for key, value in fields.items():
        setattr(msg, key, value)
    return msg


@pytest.mark.parametrize(
    ("msg", "pattern"),
    [
        (
            _lowbit_msg(data=b"\0" * 104),
            r"data has 104 bytes, expected 105 for shape \(3, 70\) as int4",
        ),
        (_lowbit_msg(data=b"\0" * 106), r"data has 106 bytes, expected 105"),
        (_lowbit_msg("int2g16", data=b"\0" * 52), r"data has 52 bytes, expected 53 .* as int2g16"),
        (_lowbit_msg(scales=b"\0" * 24), r"scales has 24 bytes, expected 32 .* as int4"),
        (_lowbit_msg(scales=b"\0" * 40), r"scales has 40 bytes, expected 32"),
        (_lowbit_msg(group_size=0), r"INT4 group_size 0 is not one of 16, 32, 64"),
        (_lowbit_msg(group_size=48), r"group_size 48 is not one of"),
        (_lowbit_msg("int8", group_size=64), r"codec INT8 has no groups, got group_size 64"),
        (_lowbit_msg("fp16", token_groups=True), r"FP16 has no groups, .* token_groups True"),
        (_lowbit_msg("fp32", outliers=1), r"FP32 has no groups, .* outliers 1"),
        (_lowbit_msg(outliers=3), r"INT4 outliers 3 per group is not one of 0, 1, 2, 4, 8"),
        (_lowbit_msg("int4to", outliers=0), r"scales has 56 bytes, expected 32 .* as int4t$"),
        (_lowbit_msg("int4to", outliers=2), r"scales has 56 bytes, expected 80 .* as int4to2$"),
        (
            pb.Tensor(codec=pb.INT4, shape=[2**40], group_size=64, outliers=8),
            r"data has 0 bytes, expected 549755813888",  # refused before any allocation
        ),
        (
            pb.Tensor(codec=pb.INT2, shape=[2**40], group_size=64),
            r"data has 0 bytes, expected 274877906944",  # refused before any allocation
        ),
    ],
    ids=[
        "short",
        "long",
        "int2-short",
        "few-scales",
        "many-scales",
        "no-group",
        "odd-group",
        "int8-group",
        "fp16-tokens",
        "fp32-outliers",
        "odd-outliers",
        "outliers-dropped",
        "outliers-added",
        "huge-outliers",
        "huge",
    ],
)
def test_wrong_payload_sizes_are_refused(msg: pb.Tensor, pattern: str) -> None:
    with pytest.raises(TensorFormatError, match=pattern):
        tensor_from_proto(msg)


def test_non_finite_scales_are_refused() -> None:
    msg = _lowbit_msg(shape=(2, 64))
    meta = torch.frombuffer(bytearray(msg.scales), dtype=torch.float32).clone()
    meta[1] = float("nan")
    msg.scales = meta.numpy().tobytes()
    with pytest.raises(TensorFormatError, match=r"64 of 128 values are NaN or Inf"):
        tensor_from_proto(msg)


def test_token_groups_follow_a_channel_along_the_tokens() -> None:
    x = torch.ones(64, 3)  # 64 tokens, 3 channels
    x[:, 1] = torch.linspace(0, 15, 64)  # one channel spans a wide range ...
    x[:, 2] = 1000.0  # ... another is large but constant
    y = tensor_from_proto(tensor_to_proto(x, "int4t"))
    assert torch.equal(y[:, 0], x[:, 0]) and torch.equal(y[:, 2], x[:, 2])  # exact: constant
    assert (y[:, 1] - x[:, 1]).abs().max() <= 0.5 * (1 + 1e-6)  # step 1 over 0..15
    row_groups = tensor_from_proto(tensor_to_proto(x, "int4"))  # rows mix 1, 0..15 and 1000
    assert (row_groups - x).abs().max() > 10


def test_token_group_names() -> None:
    msg = tensor_to_proto(torch.randn(2, 8, 64), "int2tg32")
    assert (msg.codec, msg.group_size, msg.token_groups) == (pb.INT2, 32, True)
    assert not tensor_to_proto(torch.randn(2, 64), "int4").token_groups


@pytest.mark.parametrize("codec", ["int4o2", "int2to", "int4tog128", "int2o8g16"])
@pytest.mark.parametrize("shape", [(5,), (3, 70), (2, 64, 24)], ids=str)
def test_outliers_decode_exactly_and_the_rest_within_half_their_step(
    codec: str, shape: tuple[int, ...]
) -> None:
    bits, group = _bits_group(codec)
    k = {"o2": 2, "o8": 8}.get(codec[4:6], 1)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=gen)
    x.view(-1)[:: max(1, x.numel() // 7)] *= 1000.0  # a few huge values
    msg = pb.Tensor.FromString(tensor_to_proto(x, codec).SerializeToString())
    assert msg.outliers == k
    assert len(msg.data) + len(msg.scales) == encoded_nbytes(shape, codec) == payload_nbytes(msg)
    flat, got = _grouped(x, codec), _grouped(tensor_from_proto(msg), codec)
    for start in range(0, flat.numel(), group):
        part, back = flat[start : start + group], got[start : start + group]
        top = part.abs().topk(min(k, part.numel())).indices
        assert torch.equal(back[top], part[top])  # sent exactly
        rest = torch.ones_like(part, dtype=torch.bool).index_fill_(0, top, False)
        if rest.any():
            step = float(part[rest].max() - part[rest].min()) / (2**bits - 1)
            slack = 4e-7 * float(part[rest].abs().max())
            assert float((back - part)[rest].abs().max()) <= step / 2 * (1 + 1e-5) + slack


def test_an_outlier_no_longer_coarsens_its_group() -> None:
    x = torch.linspace(-1.0, 1.0, 64)
    x[10] = 500.0  # one attention-sink-like value
    plain = (tensor_from_proto(tensor_to_proto(x, "int4")) - x).abs().max()
    exact = (tensor_from_proto(tensor_to_proto(x, "int4o")) - x).abs().max()
    assert float(plain) > 1.5 and float(exact) <= 1 / 15 * (1 + 1e-5)


def test_outlier_positions_outside_their_group_are_refused() -> None:
    msg = tensor_to_proto(torch.randn(2, 64), "int4o2g32")  # 4 groups of 2 outliers
    raw = bytearray(msg.scales)
    positions = torch.frombuffer(raw, dtype=torch.int16, offset=4 * 4 * 4).clone()
    positions[3] = 32
    msg.scales = bytes(raw[: 4 * 4 * 4]) + positions.numpy().tobytes()
    with pytest.raises(TensorFormatError, match=r"1 outlier positions lie outside \[0, 32\)"):
        tensor_from_proto(msg)


def test_outlier_names() -> None:
    from fedpipe.config.codecs import check_codec, codec_name, codec_outliers

    assert [codec_outliers(c) for c in ("int4", "int4to", "int2o4g16", "fp32")] == [0, 1, 4, 0]
    assert codec_name("int4", 128, True, 2) == "int4to2g128" and codec_name("int4", 64, False, 1)
    for bad in ("int4o3", "int4o0", "int4ot", "int4o16g16", "int4o8g16x", "int8o"):
        with pytest.raises(ValueError, match="o<K>"):
            check_codec(bad)
