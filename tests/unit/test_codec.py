"""Tensor codec: round trips within the documented error bounds, and validation that teaches."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from fedpipe.errors import TensorFormatError
from fedpipe.proto import stage_pb2 as pb
from fedpipe.wire.tensors import (
    CODECS,
    MAX_NDIM,
    bytes_per_value,
    codec_from_proto,
    codec_to_proto,
    encoded_nbytes,
    labels_from_proto,
    labels_to_proto,
    payload_nbytes,
    tensor_from_proto,
    tensor_to_proto,
)

SHAPES = [(), (7,), (3, 5), (2, 4, 16), (0, 4), (3, 0), (2, 3, 1, 9)]
FLOAT_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def _round_trip(x: torch.Tensor, codec: str, **kwargs: object) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. torch's non-writable-buffer warning
        msg = pb.Tensor.FromString(tensor_to_proto(x, codec).SerializeToString())
        return tensor_from_proto(msg, **kwargs)  # type: ignore[arg-type]


def _assert_within_bound(x: torch.Tensor, y: torch.Tensor, codec: str) -> None:
    """The error bounds stated in the codec's module docstring."""
    x = x.to(torch.float32)
    err = (y - x).abs()
    if codec == "fp32":
        assert torch.equal(y, x)
    elif codec == "bf16":
        assert (err <= 2**-8 * x.abs()).all()
    elif codec == "fp16":
        assert (err <= 2**-11 * x.abs() + 2**-25).all()  # + subnormal spacing below 6.1e-5
    elif x.numel() == 0:
        assert y.shape == x.shape
    elif codec in ("int4", "int2"):
        _assert_group_bound(x, y, bits=4 if codec == "int4" else 2, group=64)
    else:
        rows = x.reshape(-1, x.shape[-1] if x.dim() else 1)
        bound = 0.5 * rows.abs().amax(dim=1, keepdim=True) / 127
        # fp32 arithmetic in quantize and dequantize adds a few ulps on top of the bound.
        assert (err.reshape(rows.shape) <= bound * (1 + 1e-5) + 1e-30).all()


def _assert_group_bound(
    x: torch.Tensor, y: torch.Tensor, *, bits: int, group: int, stochastic: bool = False
) -> None:
    """|y - x| <= s / 2 (s < for stochastic rounding) per group of ``group`` row-major values."""
    flat, err = x.reshape(-1).float(), (y - x).reshape(-1).abs()
    for start in range(0, flat.numel(), group):
        part = flat[start : start + group]
        s = float(part.max() - part.min()) / (2**bits - 1)
        bound = s if stochastic else s / 2
        # fp32 arithmetic adds a few ulps of the group's magnitude on top of the bound.
        slack = 4e-7 * float(part.abs().max()) + 1e-30
        assert float(err[start : start + group].max()) <= bound * (1 + 1e-5) + slack


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_round_trip_within_bound(codec: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    y = _round_trip(x, codec)
    assert y.shape == x.shape and y.dtype == torch.float32
    assert y.is_contiguous()
    _assert_within_bound(x, y, codec)


@pytest.mark.parametrize("codec", CODECS)
def test_wide_magnitudes_within_bound(codec: str) -> None:
    gen = torch.Generator().manual_seed(1)
    # Rows of very different scales: per-row int8 scales keep small rows precise.
    scale = 10.0 ** torch.arange(-4, 5, dtype=torch.float32)[:, None]  # (9, 1)
    x = torch.randn(9, 64, generator=gen) * scale  # fp16's normal range: 6.1e-5 .. 65504
    _assert_within_bound(x, _round_trip(x, codec), codec)


def test_bf16_keeps_fp32_range() -> None:
    x = torch.tensor([1e-30, -3e38, 1e38, 12345.678])
    _assert_within_bound(x, _round_trip(x, "bf16"), "bf16")


def test_fp16_overflow_is_refused_at_decode() -> None:
    with pytest.raises(TensorFormatError, match=r"2 of 3 values are NaN or Inf.*use bf16"):
        _round_trip(torch.tensor([1e5, 1.0, -1e6]), "fp16")


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=str)
def test_non_finite_values_are_refused_at_decode(codec: str, bad: float) -> None:
    x = torch.ones(2, 3, 4)
    x[1, 2, 3] = bad
    msg = tensor_to_proto(x, codec)
    with pytest.raises(TensorFormatError, match=r"ACTIVATION: \d+ of 24 values are NaN or Inf"):
        tensor_from_proto(msg, name="ACTIVATION")


def test_finite_values_whose_sum_overflows_are_accepted() -> None:
    x = torch.tensor([3e38, 3e38, -1.0])  # the sum is inf, every value is finite
    assert torch.equal(_round_trip(x, "fp32"), x)


def test_int8_zero_rows_and_extremes() -> None:
    x = torch.zeros(3, 8)
    x[1] = torch.linspace(-1e30, 1e30, 8)
    y = _round_trip(x, "int8")
    assert torch.equal(y[0], torch.zeros(8)) and torch.equal(y[2], torch.zeros(8))
    assert torch.isfinite(y).all()
    _assert_within_bound(x, y, "int8")
    assert y[1].abs().max() == pytest.approx(1e30, rel=1e-6)  # max|row| is exact: 127 * scale


def test_int8_wire_format() -> None:
    msg = tensor_to_proto(torch.tensor([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0]]), "int8")
    assert list(torch.frombuffer(bytearray(msg.data), dtype=torch.int8)) == [64, -127, 32, 0, 0, 0]
    scales = torch.frombuffer(bytearray(msg.scales), dtype=torch.float32)
    assert scales.tolist() == pytest.approx([1 / 127, 0.0])


@pytest.mark.parametrize("codec", CODECS)
def test_encodes_views_and_grad_tensors(codec: str) -> None:
    base = torch.randn(4, 6, requires_grad=True)
    x = base.t()[1:, ::2] * 2  # non-contiguous, part of an autograd graph
    _assert_within_bound(x.detach(), _round_trip(x, codec), codec)


@pytest.mark.parametrize("codec", CODECS)
def test_decoded_tensor_is_writable_and_owns_its_memory(codec: str) -> None:
    msg = tensor_to_proto(torch.ones(2, 3), codec)
    y = tensor_from_proto(msg)
    y.add_(1)
    assert torch.equal(tensor_from_proto(msg), torch.ones(2, 3))


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_decodes_to_requested_dtype(codec: str, dtype: torch.dtype) -> None:
    x = torch.randn(2, 5)
    y = _round_trip(x, codec, dtype=dtype)
    assert y.dtype == dtype
    assert torch.equal(y, _round_trip(x, codec).to(dtype))


def test_rejects_non_float_types() -> None:
    with pytest.raises(TypeError, match="labels_to_proto"):
        tensor_to_proto(torch.arange(4), "fp32")
    with pytest.raises(TypeError, match="float dtype"):
        tensor_from_proto(tensor_to_proto(torch.ones(1), "fp32"), dtype=torch.int64)
    with pytest.raises(ValueError, match="choose one of fp32, bf16, fp16, int8, int4, int2"):
        tensor_to_proto(torch.ones(1), "fp8")


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("codec", CODECS)
def test_encoded_nbytes_matches_payload(shape: tuple[int, ...], codec: str) -> None:
    msg = tensor_to_proto(torch.randn(shape), codec)
    assert encoded_nbytes(shape, codec) == len(msg.data) + len(msg.scales)


def test_codec_names() -> None:
    assert [bytes_per_value(c) for c in CODECS] == [4, 2, 2, 1, 0.5, 0.25]
    protos = [pb.FP32, pb.BF16, pb.FP16, pb.INT8, pb.INT4, pb.INT2]
    assert [codec_to_proto(c) for c in CODECS] == protos
    assert [codec_from_proto(codec_to_proto(c)) for c in CODECS] == list(CODECS)
    assert codec_to_proto("int4g128") == pb.INT4 and bytes_per_value("int2g16") == 0.25
    assert codec_to_proto("int2tg16") == pb.INT2
    for bad in ("int3", "int4g48", "int4g064", "int8g64", "INT4", "int8t", "int4gt16", "int4tg"):
        with pytest.raises(ValueError, match=rf"unknown codec '{bad}'.*e.g. int4t, int4g128"):
            codec_to_proto(bad)
    for bad in (pb.CODEC_UNSPECIFIED, 99):
        with pytest.raises(TensorFormatError, match=rf"\({bad}\) is not a tensor codec"):
            codec_from_proto(bad)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.int16])
def test_labels_round_trip(dtype: torch.dtype) -> None:
    x = torch.randint(0, 200, (3, 17), dtype=dtype)
    if dtype.is_signed:
        x[0, 0] = -100  # the ignore index
    msg = pb.Tensor.FromString(labels_to_proto(x).SerializeToString())
    assert msg.codec == pb.CODEC_UNSPECIFIED
    y = labels_from_proto(msg, expect_shape=(3, None))
    assert y.dtype == torch.int64 and torch.equal(y, x.to(torch.int64))
    y[0, 0] = 1  # writable


def test_labels_reject_floats_and_float_codecs() -> None:
    with pytest.raises(TypeError, match="integer tensors"):
        labels_to_proto(torch.ones(2))
    with pytest.raises(TensorFormatError, match=r"expected codec CODEC_UNSPECIFIED .* got FP32"):
        labels_from_proto(tensor_to_proto(torch.ones(2), "fp32"))
    with pytest.raises(TensorFormatError, match="expected 16"):
        labels_from_proto(pb.Tensor(shape=[2], data=b"\0" * 15))
    with pytest.raises(TensorFormatError, match="not a tensor codec"):
        tensor_from_proto(labels_to_proto(torch.ones(2, dtype=torch.int64)))


def _msg(enc: str = "fp32", size: tuple[int, ...] = (2, 3), **fields: object) -> pb.Tensor:
    """A valid message of ``size`` encoded with ``enc``, then with ``fields`` overwritten."""
    msg = tensor_to_proto(torch.ones(size), enc)
    for key, value in fields.items():
        if key == "shape":
            del msg.shape[:]
            msg.shape.extend(value)  # type: ignore[arg-type]
        else:
            setattr(msg, key, value)
    return msg


INVALID = [
    ("codec-99", _msg(codec=99), {}, r"tensor: codec <unknown> \(99\) is not a tensor codec"),
    ("unspecified", _msg(codec=0), {}, r"CODEC_UNSPECIFIED \(0\) is not a tensor codec"),
    ("negative-dim", _msg(shape=[2, -3]), {}, r"shape \(2, -3\) has a negative dimension"),
    (
        "wrong-shape",
        _msg("bf16", (2, 128, 65)),
        {"expect_shape": (2, 128, 64), "name": "ACTIVATION tensor"},
        r"^ACTIVATION tensor: expected shape \(2, 128, 64\), got \(2, 128, 65\)$",
    ),
    (
        "wrong-ndim",
        _msg(size=(2, 3)),
        {"expect_shape": (2, None, 3)},
        r"expected shape \(2, \*, 3\), got \(2, 3\)",
    ),
    ("wrong-1d", _msg(size=(4,)), {"expect_shape": (5,)}, r"expected shape \(5,\), got \(4,\)"),
    ("short-data", _msg(data=b"\0" * 20), {}, r"data has 20 bytes, expected 24 for shape"),
    ("long-data", _msg("fp16", data=b"\0" * 13), {}, r"data has 13 bytes, expected 12 .* as fp16"),
    ("int8-scales", _msg("int8", scales=b"\0" * 4), {}, r"scales has 4 bytes, expected 8"),
    ("int8-no-scales", _msg("int8", scales=b""), {}, r"scales has 0 bytes, expected 8"),
    ("stray-scales", _msg("fp32", scales=b"\0" * 8), {}, r"FP32 carries no scales, got 8"),
    (
        "too-many",
        _msg(size=(100, 100)),
        {"max_elements": 9999},
        r"has 10000 elements, more than the limit of 9999",
    ),
    ("too-many-dims", _msg(shape=[1] * (MAX_NDIM + 1)), {}, rf"at most {MAX_NDIM} allowed"),
    ("huge-shape", _msg(shape=[2**40, 2**40]), {}, r"shape \(1099511627776, .* is too large"),
    ("huge-empty", _msg(shape=[2**62, 2**62, 0], data=b""), {}, r"too large"),
    ("huge-empty-0", _msg(shape=[0, 2**63 - 1, 2**63 - 1], data=b""), {}, r"too large"),
]


@pytest.mark.parametrize(
    ("msg", "kwargs", "pattern"), [c[1:] for c in INVALID], ids=[c[0] for c in INVALID]
)
def test_invalid_messages_teach(msg: pb.Tensor, kwargs: dict, pattern: str) -> None:
    with pytest.raises(TensorFormatError, match=pattern):
        tensor_from_proto(msg, **kwargs)


def test_expect_shape_wildcards_accept_any_size() -> None:
    msg = tensor_to_proto(torch.ones(3, 7, 2), "fp16")
    assert tensor_from_proto(msg, expect_shape=(None, None, 2), max_elements=42).shape == (3, 7, 2)


_int64 = st.integers(-(2**63), 2**63 - 1)
_dim = st.one_of(st.integers(-2, 6), st.integers(0, 2**40), _int64, st.just(2**63 - 1))
_FUZZ_CODECS = (*CODECS, "int4g16", "int2tg16", "int4to", "int2o8g16")


@st.composite
def _random_tensor_message(draw: st.DrawFn) -> pb.Tensor:
    """Any field values at all: nearly always a message no sender could have written."""
    return pb.Tensor(
        codec=draw(st.one_of(st.sampled_from(range(7)), st.integers(-(2**31), 2**31 - 1))),
        shape=draw(st.lists(_dim, max_size=5) | st.lists(st.integers(0, 1), max_size=MAX_NDIM + 3)),
        data=draw(st.binary(max_size=200)),
        scales=draw(st.binary(max_size=40)),
        group_size=draw(st.sampled_from([0, 16, 64, 3])),
        token_groups=draw(st.booleans()),
    )


def _mutate(draw: st.DrawFn, msg: pb.Tensor) -> str:
    """Change one field of an encoded message as a broken or hostile sender might."""
    how = draw(st.sampled_from(["flip", "truncate", "extend", "shape", "codec", "group", "scales"]))
    if how == "flip" and msg.data:
        at = draw(st.integers(0, len(msg.data) - 1))
        data = bytearray(msg.data)
        data[at] ^= draw(st.integers(1, 255))  # may stay a finite value, or become NaN
        msg.data = bytes(data)
    elif how == "truncate":
        msg.data = msg.data[: draw(st.integers(0, max(len(msg.data) - 1, 0)))]
    elif how == "extend":
        msg.data += draw(st.binary(min_size=1, max_size=9))
    elif how == "shape" and msg.shape:
        msg.shape[draw(st.integers(0, len(msg.shape) - 1))] = draw(_dim)
    elif how == "codec":
        msg.codec = draw(st.integers(-1, 8))
    elif how == "group":
        msg.group_size = draw(st.sampled_from([0, 3, 16, 64, 128, 2**20]))
    else:
        msg.scales = draw(st.binary(max_size=40))
    return how


@st.composite
def _tensor_cases(draw: st.DrawFn) -> tuple[pb.Tensor, torch.Tensor | None, str]:
    """(message, the tensor it encodes or None, how it was made): a valid encoding of a real
    tensor, the same with one field changed, or random field values."""
    kind = draw(st.sampled_from(["valid", "mutated", "random"]))
    if kind == "random":
        return draw(_random_tensor_message()), None, kind
    codec = draw(st.sampled_from(_FUZZ_CODECS))
    shape = tuple(draw(st.lists(st.integers(0, 6), max_size=4)))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    x = torch.randn(shape, generator=gen) * draw(st.sampled_from([1e-3, 1.0, 1e3]))
    msg = pb.Tensor.FromString(tensor_to_proto(x, codec).SerializeToString())
    if kind == "mutated":
        return msg, None, _mutate(draw, msg)
    return msg, x, codec


def _decode_options(draw: st.DrawFn, msg: pb.Tensor) -> dict[str, object]:
    """expect_shape and max_elements: fitting the message (wildcards included), or anything."""
    shape = list(msg.shape)
    expect: list[int | None] | None = draw(
        st.none()
        | st.lists(st.none() | st.integers(0, 6), max_size=5)
        | st.just([d if draw(st.booleans()) else None for d in shape])
    )
    limit = draw(st.none() | st.integers(0, 100))
    return {"expect_shape": expect, "max_elements": limit}


def _assert_decodes_within_bound(msg: pb.Tensor, x: torch.Tensor, *, codec: str) -> None:
    """``msg`` (``x`` encoded with ``codec``) decodes to fp32 within the codec's stated bound.

    Low-bit codecs of any group layout: within half a step of the whole tensor's range, which
    bounds every group's half step."""
    y = tensor_from_proto(msg)
    if codec in CODECS:
        _assert_within_bound(x, y, codec)
    elif x.numel():
        step = float(x.max() - x.min()) / (2 ** (4 if codec.startswith("int4") else 2) - 1)
        slack = 4e-7 * float(x.abs().max()) + 1e-30
        assert float((y - x).abs().max()) <= step / 2 * (1 + 1e-5) + slack


def test_fuzz_decodes_valid_messages_and_refuses_others_with_format_errors() -> None:
    """Generated messages: real encodings (which must decode within the codec's bound), real
    encodings with one field broken, and random fields. Any refusal is a TensorFormatError, every
    decoded tensor has the declared shape and dtype, and both outcomes occur often."""
    outcomes: dict[str, int] = {"decoded": 0, "refused": 0}

    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(case=_tensor_cases(), data=st.data(), dtype=st.sampled_from(FLOAT_DTYPES))
    def decode(
        case: tuple[pb.Tensor, torch.Tensor | None, str], data: st.DataObject, dtype: torch.dtype
    ) -> None:
        msg, original, how = case
        kwargs = _decode_options(data.draw, msg)
        try:
            y = tensor_from_proto(msg, dtype=dtype, **kwargs)  # type: ignore[arg-type]
        except TensorFormatError:
            outcomes["refused"] += 1
            event(f"refused ({how})")
            return
        outcomes["decoded"] += 1
        event(f"decoded ({how})")
        assert tuple(y.shape) == tuple(msg.shape) and y.dtype == dtype and y.is_contiguous()
        assert payload_nbytes(msg) == len(msg.data) + len(msg.scales)
        if original is not None:  # an untouched encoding: within the codec's stated bound
            _assert_decodes_within_bound(msg, original, codec=how)

    decode()
    # The property must see both sides: a fuzz whose every case is refused checks nothing about
    # what decodes (random bytes almost never match a shape), and one that never refuses
    # checks no error path.
    assert outcomes["decoded"] >= 30 and outcomes["refused"] >= 30, outcomes


@st.composite
def _label_cases(draw: st.DrawFn) -> tuple[pb.Tensor, torch.Tensor | None, str]:
    """Labels as ``labels_to_proto`` writes them, the same with one field changed, or random."""
    kind = draw(st.sampled_from(["valid", "mutated", "random"]))
    if kind == "random":
        msg = pb.Tensor(
            codec=draw(st.integers(-5, 5)),
            shape=draw(st.lists(_dim, max_size=4)),
            data=draw(st.binary(max_size=64)),
        )
        return msg, None, kind
    shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
    x = torch.tensor(
        draw(st.lists(_int64, min_size=math.prod(shape), max_size=math.prod(shape))),
        dtype=torch.int64,
    ).reshape(shape)
    msg = pb.Tensor.FromString(labels_to_proto(x).SerializeToString())
    if kind == "mutated":
        return msg, None, _mutate(draw, msg)
    return msg, x, kind


def test_fuzz_decodes_valid_labels_and_refuses_others_with_format_errors() -> None:
    outcomes: dict[str, int] = {"decoded": 0, "refused": 0}

    @settings(max_examples=150, deadline=None)
    @given(case=_label_cases())
    def decode(case: tuple[pb.Tensor, torch.Tensor | None, str]) -> None:
        msg, original, how = case
        try:
            y = labels_from_proto(msg)
        except TensorFormatError:
            outcomes["refused"] += 1
            event(f"refused ({how})")
            return
        outcomes["decoded"] += 1
        event(f"decoded ({how})")
        assert tuple(y.shape) == tuple(msg.shape) and y.dtype == torch.int64
        if original is not None:
            assert torch.equal(y, original)

    decode()
    assert outcomes["decoded"] >= 15 and outcomes["refused"] >= 15, outcomes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("codec", CODECS)
def test_encodes_cuda_tensors(codec: str) -> None:
    x = torch.randn(4, 33, device="cuda", dtype=torch.bfloat16)
    _assert_within_bound(x.cpu(), _round_trip(x, codec), codec)
