"""Tensors to and from the wire: the ``fedpipe.proto.Tensor`` message and its codecs.

This is the only module besides the gRPC transport that touches protobuf tensors. A float tensor
(activation, output or gradient at the cut) is sent with one of ``CODECS``. Error bound of a decoded
value ``y`` against the sent value ``x`` (taken as fp32):

- ``fp32`` (4 bytes/value): exact for fp32 input; other float dtypes are cast to fp32 exactly.
- ``bf16`` (2 bytes/value): ``|y - x| <= 2**-8 * |x|`` (round to nearest even, 8-bit significand).
  bf16 has fp32's exponent range, so this holds for all normal values up to ``3.38e38``.
- ``fp16`` (2 bytes/value): ``|y - x| <= 2**-11 * |x|`` in fp16's normal range
  ``6.1e-5 <= |x| <= 65504``. Below it the absolute error is at most ``2**-25``; above it values
  overflow to ``inf``, which the receiver refuses -- use bf16 for such tensors.
- ``int8`` (1 byte/value + one fp32 scale per row, a row being the last dimension): symmetric
  per-row quantization with ``scale = max|row| / 127``, so ``|y - x| <= 0.5 * max|row| / 127``
  per element; an all-zero row decodes to zeros. Inputs must be finite.
- ``int4`` / ``int2`` (0.5 / 0.25 bytes/value + two fp32 numbers, scale and offset, per group
  of ``G`` values; ``G`` = 64 unless the name says otherwise, e.g. ``int4g128``): asymmetric
  group quantization, bit-packed; ``|y - x| <= s / 2`` with ``s = (max - min) / 15`` (int4)
  or ``/ 3`` (int2) over the value's group. See :mod:`fedpipe.compress.lowbit`. The group
  size travels in the message's ``group_size``. With ``t`` (``int4t``, ``int2tg32``) a group is
  ``G`` consecutive tokens (rows) of one channel (last dimension) instead of ``G`` consecutive
  values of a row: the message's ``token_groups`` is set and the payload is channel-major.
  With ``o<K>`` (``int4to``, ``int2o2g128``) the ``K`` values of largest magnitude in each
  group are sent exactly (6 bytes each: fp32 value, int16 position; the message's
  ``outliers`` is ``K``) and ``s`` is taken over the group's other values.

Integer tensors (labels, token ids) are not compressed: ``labels_to_proto`` and
``labels_from_proto`` carry them as little-endian int64 with ``codec = CODEC_UNSPECIFIED`` (the
proto has no integer codec, and an unspecified codec on a float tensor is an error, so the two
cannot be confused).

Decoding validates everything a peer could get wrong -- codec, shape, byte counts, scales, and
that every value is finite (NaN and Inf are refused) -- and
raises ``TensorFormatError`` (a ``ValueError``; the server maps it to ``INVALID_ARGUMENT``) with the
numbers and what was expected. Decoded tensors are contiguous and writable, and share memory with
nothing the caller can reach: with protobuf's upb runtime every read of ``data`` yields a fresh
``bytes``, so the decoder reads it once and wraps it with ``torch.frombuffer`` (no further copy);
other protobuf runtimes get a private copy. Encoding copies a tensor's bytes once into the message.
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Sequence

import torch
from google.protobuf.internal import api_implementation
from google.protobuf.message import DecodeError

from fedpipe.compress import lowbit
from fedpipe.config.codecs import (
    CODECS,
    GROUP_SIZES,
    LOW_BIT,
    OUTLIER_COUNTS,
    check_codec,
    codec_base,
    codec_group,
    codec_name,
    codec_outliers,
    codec_token_groups,
)
from fedpipe.errors import TensorFormatError
from fedpipe.proto import stage_pb2 as pb

__all__ = [
    "CODECS",
    "MAX_NDIM",
    "bytes_per_value",
    "codec_from_proto",
    "decode_wire",
    "codec_to_proto",
    "encoded_nbytes",
    "payload_nbytes",
    "labels_from_proto",
    "labels_to_proto",
    "tensor_from_bytes",
    "tensor_from_proto",
    "tensor_to_bytes",
    "tensor_to_proto",
    "tensor_to_wire",
    "wire_buffer",
]

if sys.byteorder != "little":  # the wire is little-endian and the codec reinterprets bytes in place
    raise ImportError("fedpipe.wire.tensors supports little-endian hosts only")

MAX_NDIM = 64  # more dimensions than any real activation; bounds work spent on hostile shapes
# Bound on the product of a shape's dims with zeros counted as ones: torch computes strides that
# way even for empty tensors and overflows int64 on hostile shapes such as (2**62, 2**62, 0).
_MAX_SPAN = 2**48

_TO_PROTO: dict[str, pb.Codec] = {
    "fp32": pb.FP32,
    "bf16": pb.BF16,
    "fp16": pb.FP16,
    "int8": pb.INT8,
    "int4": pb.INT4,
    "int2": pb.INT2,
}
_FROM_PROTO: dict[int, str] = {v: k for k, v in _TO_PROTO.items()}
_WIRE_DTYPE: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "int8": torch.int8,
    "int4": torch.uint8,  # packed: two values per byte
    "int2": torch.uint8,  # packed: four values per byte
}
_LABEL_DTYPE = torch.int64
_SCALE_BYTES = 4  # one fp32 scale per int8 row
_GROUP_META_BYTES = 8  # low-bit codecs: one fp32 scale and one fp32 offset per group
_OUTLIER_BYTES = 6  # low-bit codecs' exact values: fp32 value + int16 position in the group
_INT8_MAX = 127.0
# upb (protobuf >= 4.21's default) returns a new bytes object on every read of a bytes field, so
# a decoded tensor may wrap it; the C++ and pure-Python runtimes return the message's own object.
_FRESH_BYTES = api_implementation.Type() == "upb"


# --- codec names ---------------------------------------------------------------------------------


def _check_codec(codec: str) -> str:
    return check_codec(codec)


def codec_to_proto(name: str) -> pb.Codec:
    """The ``fedpipe.proto.Codec`` value of a codec name such as ``"bf16"`` or ``"int4g128"``."""
    return _TO_PROTO[codec_base(name)]


def codec_from_proto(value: int) -> str:
    """The base codec name (``int4``, not ``int4g128``) of a ``Codec`` value from a peer."""
    name = _FROM_PROTO.get(value)
    if name is None:
        raise TensorFormatError(
            f"codec {_codec_label(value)} is not a tensor codec; expected one of "
            + ", ".join(f"{n.upper()} ({v})" for n, v in _TO_PROTO.items())
        )
    return name


def _codec_label(value: int) -> str:
    try:
        return f"{pb.Codec.Name(value)} ({value})"
    except ValueError:
        return f"<unknown> ({value})"


def bytes_per_value(codec: str) -> float:
    """Payload bytes per tensor element under ``codec`` (scales and offsets not included)."""
    base = codec_base(codec)
    if base in LOW_BIT:
        return LOW_BIT[base] / 8
    return _WIRE_DTYPE[base].itemsize


def encoded_nbytes(shape: Sequence[int], codec: str) -> int:
    """Payload bytes (``data`` plus ``scales``) of a tensor of ``shape`` encoded with ``codec``."""
    numel, base = math.prod(shape), codec_base(codec)
    if base in LOW_BIT:
        groups = lowbit.num_groups(numel, codec_group(codec))
        return lowbit.packed_nbytes(numel, LOW_BIT[base]) + groups * _group_meta_bytes(codec)
    nbytes = numel * _WIRE_DTYPE[base].itemsize
    if base == "int8":
        nbytes += _num_rows(shape) * _SCALE_BYTES
    return nbytes


def payload_nbytes(msg: pb.Tensor) -> int:
    """Payload bytes a tensor message declares, from its shape and codec (``data`` is not read).

    Reading ``data`` copies it, and ``ByteSize()`` re-serialises the message: this costs neither.
    Labels (codec unspecified) count 8 bytes per value; an unknown codec counts 4.
    """
    shape = tuple(msg.shape)
    if msg.codec == pb.CODEC_UNSPECIFIED:
        return math.prod(shape) * _LABEL_DTYPE.itemsize
    codec = _FROM_PROTO.get(msg.codec)
    if codec in LOW_BIT and msg.group_size in GROUP_SIZES and _known_outliers(msg):
        return encoded_nbytes(shape, codec_name(codec, msg.group_size, outliers=msg.outliers))
    return encoded_nbytes(shape, codec) if codec else math.prod(shape) * 4


def _group_meta_bytes(codec: str) -> int:
    """``scales`` bytes per group of a low-bit codec: scale, offset and exact outliers."""
    return _GROUP_META_BYTES + codec_outliers(codec) * _OUTLIER_BYTES


def _num_rows(shape: Sequence[int]) -> int:
    """Rows of a tensor for int8 scales: all dims but the last (a 0-d tensor is one row)."""
    return math.prod(shape[:-1]) if len(shape) > 0 else 1


# --- encoding ------------------------------------------------------------------------------------


def tensor_to_proto(t: torch.Tensor, codec: str, *, out: pb.Tensor | None = None) -> pb.Tensor:
    """Encode a float tensor of any float dtype, on any device, with ``codec``.

    Casting and quantization run on ``t``'s device; only the encoded bytes move to the CPU.
    ``out`` (e.g. a ``StageMessage``'s ``tensor`` field) is filled in place instead of a new
    message, which saves copying the payload again with ``CopyFrom``.
    """
    msg = pb.Tensor() if out is None else out
    msg.data = _to_bytes(tensor_to_wire(t, codec, msg))
    return msg


def tensor_to_bytes(t: torch.Tensor, codec: str) -> bytes:
    """``t`` encoded with ``codec`` as one serialised ``fedpipe.proto.Tensor`` (for a carrier
    other than the stage link, such as Flower's messages); :func:`tensor_from_bytes` reads it."""
    return tensor_to_proto(t, codec).SerializeToString()


def tensor_from_bytes(
    data: bytes, *, codec: str, expect_shape: Sequence[int], name: str = "tensor"
) -> torch.Tensor:
    """The fp32 tensor :func:`tensor_to_bytes` encoded, if it is in ``codec`` and of
    ``expect_shape``.

    Raises ``TensorFormatError`` for bytes that are no tensor message, another codec (its base:
    a low-bit message's group size and outliers are its own, and checked), another shape, or
    anything :func:`tensor_from_proto` refuses.
    """
    msg = pb.Tensor()
    try:
        msg.ParseFromString(data)
    except DecodeError as exc:
        raise TensorFormatError(f"{name}: not an encoded tensor ({exc})") from None
    got, want = _FROM_PROTO.get(msg.codec, _codec_label(msg.codec)), codec_base(codec)
    if got != want:
        raise TensorFormatError(f"{name}: encoded as {got}, expected {want}")
    return tensor_from_proto(
        msg, expect_shape=expect_shape, max_elements=math.prod(expect_shape), name=name
    )


def tensor_to_wire(
    t: torch.Tensor,
    codec: str,
    meta: pb.Tensor,
    *,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Fill ``meta``'s codec, shape and scales; return the values ``data`` must hold.

    The returned tensor is contiguous, on the CPU, in the codec's wire dtype: its raw bytes
    (see :func:`wire_buffer`) are the ``data`` field, so a framer can copy them only once.
    ``generator`` (on ``t``'s device) makes the low-bit codecs round stochastically.
    """
    base = codec_base(codec)
    if not t.is_floating_point():
        raise TypeError(
            f"tensor_to_proto encodes float tensors, got {t.dtype}; "
            "send integer tensors (labels, token ids) with labels_to_proto"
        )
    t = t.detach()
    meta.codec = _TO_PROTO[base]
    meta.shape[:] = t.shape
    if base == "int8":
        q, scales = _quantize_int8(t)
        meta.scales = _to_bytes(scales)
        return q.contiguous().cpu()
    if base in LOW_BIT:
        group, by_token = codec_group(codec), codec_token_groups(codec)
        values = _channel_major(t) if by_token else t
        k = codec_outliers(codec)
        packed, scales, offsets, exact = lowbit.quantize_outliers(
            values, LOW_BIT[base], group, k, generator=generator
        )
        meta.group_size = group
        meta.token_groups = by_token
        meta.outliers = k
        floats = torch.cat([scales, offsets, exact.values.reshape(-1)])
        meta.scales = _to_bytes(floats) + _to_bytes(exact.positions)
        return packed.cpu()
    return t.to(_WIRE_DTYPE[base]).contiguous().cpu()


def _channel_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as (rows, channels), transposed: (channels, rows), not yet contiguous."""
    channels = t.shape[-1] if t.dim() > 0 else 1
    return t.reshape(-1, channels).t() if channels > 0 else t


def decode_wire(meta: pb.Tensor, wire: torch.Tensor) -> torch.Tensor:
    """What the receiver decodes from ``meta`` and ``wire`` (from :func:`tensor_to_wire`), fp32.

    The sender's own copy of the receiver's view, bit for bit (the same code on the same
    bytes): error feedback and delta coding keep their state from it. Never aliases ``wire``.
    """
    out = tensor_from_proto(meta, data=wire_buffer(wire), name="sent tensor")
    return out.clone() if out.data_ptr() == wire.data_ptr() else out


def wire_buffer(t: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a contiguous CPU tensor, without a copy."""
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16; the bit pattern is what we send
        t = t.view(torch.int16)
    return t.numpy().reshape(-1).data.cast("B")


def _quantize_int8(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: returns (q int8 of t's shape, scales fp32 of shape (rows,))."""
    rows = _num_rows(t.shape)
    if t.numel() == 0:  # no values to scale; rows may still exist, e.g. shape (3, 0)
        return t.to(torch.int8), torch.zeros(rows, dtype=torch.float32, device=t.device)
    x = t.to(torch.float32).reshape(rows, -1)  # (rows, last)
    # max|x| from max and min: two reductions, no |x| temporary as large as the tensor.
    scales = torch.maximum(x.amax(dim=1), x.amin(dim=1).neg_()).div_(_INT8_MAX)  # (rows,)
    # An all-zero row has scale 0; dividing by 1 instead keeps it exactly zero.
    inv = torch.where(scales > 0, scales, torch.ones_like(scales)).reciprocal_()
    # One full-size temporary, then in place: fresh large buffers cost page faults on CPU.
    q = x.mul(inv[:, None]).round_().clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8)
    return q.reshape(t.shape), scales


def _to_bytes(t: torch.Tensor) -> bytes:
    """Raw little-endian bytes of ``t`` (row-major), via a numpy view of a CPU copy."""
    t = t.contiguous().cpu()
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16; the bit pattern is what we send
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def labels_to_proto(t: torch.Tensor, *, out: pb.Tensor | None = None) -> pb.Tensor:
    """Encode an integer tensor (labels, token ids) as little-endian int64, codec unspecified."""
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"labels_to_proto encodes integer tensors, got {t.dtype}")
    msg = pb.Tensor() if out is None else out
    msg.codec = pb.CODEC_UNSPECIFIED
    msg.shape[:] = t.shape
    msg.data = _to_bytes(t.detach().to(_LABEL_DTYPE))
    return msg


# --- decoding ------------------------------------------------------------------------------------


def tensor_from_proto(
    msg: pb.Tensor,
    *,
    expect_shape: Sequence[int | None] | None = None,
    dtype: torch.dtype = torch.float32,
    max_elements: int | None = None,
    name: str = "tensor",
    data: bytes | memoryview | None = None,
) -> torch.Tensor:
    """Decode and validate a float tensor; returns a contiguous, writable tensor of ``dtype``.

    ``data``, when given, stands for ``msg.data`` (a framer that kept the payload out of the
    message); the decoded tensor then wraps it without a copy.

    ``expect_shape`` pins the shape (``None`` in a dimension accepts any size there);
    ``max_elements`` bounds the element count; ``name`` (e.g. ``"ACTIVATION tensor"``) starts
    every error message. Raises ``TensorFormatError`` for anything a peer could have sent wrong,
    NaN and Inf values included.
    """
    if not dtype.is_floating_point:
        raise TypeError(f"tensor_from_proto decodes to a float dtype, got {dtype}")
    try:
        codec = codec_from_proto(msg.codec)
    except TensorFormatError as exc:
        raise TensorFormatError(f"{name}: {exc}") from None
    shape = _checked_shape(msg, name, expect_shape, max_elements)
    numel = math.prod(shape)
    scales = msg.scales  # each read of a bytes field copies it: read once
    if data is None:
        data = msg.data
    if codec in LOW_BIT:
        return _check_finite(_decode_low_bit(msg, data, scales, shape, dtype, name), name)
    if msg.group_size or msg.token_groups or msg.outliers:
        raise TensorFormatError(
            f"{name}: codec {codec.upper()} has no groups, got group_size {msg.group_size}, "
            f"token_groups {msg.token_groups} and outliers {msg.outliers}"
        )
    _check_nbytes(name, "data", len(data), numel * _WIRE_DTYPE[codec].itemsize, shape, codec)
    if codec == "int8":
        rows = _num_rows(shape)
        _check_nbytes(name, "scales", len(scales), rows * _SCALE_BYTES, shape, codec)
        return _check_finite(_dequantize_int8(data, scales, shape, dtype), name)
    if scales:
        raise TensorFormatError(
            f"{name}: codec {codec.upper()} carries no scales, got {len(scales)} scale bytes"
        )
    return _check_finite(_from_bytes(data, _WIRE_DTYPE[codec], shape).to(dtype), name)


def _check_finite(t: torch.Tensor, name: str) -> torch.Tensor:
    """Refuse NaN and Inf: one such value from one peer would poison every adapter it touches.

    A finite sum proves every value finite (NaN or Inf anywhere makes the sum NaN or Inf); only
    when the sum overflows or is not finite do we count the culprits.
    """
    if t.numel() == 0 or bool(torch.isfinite(t.sum())):
        return t
    bad = int((~torch.isfinite(t)).sum())
    if bad == 0:  # the sum overflowed, the values are fine
        return t
    raise TensorFormatError(
        f"{name}: {bad} of {t.numel()} values are NaN or Inf; the sender's computation "
        "diverged (lower its learning rate, or use bf16 instead of fp16 for large values)"
    )


def labels_from_proto(
    msg: pb.Tensor,
    *,
    expect_shape: Sequence[int | None] | None = None,
    max_elements: int | None = None,
    name: str = "labels",
) -> torch.Tensor:
    """Decode and validate an int64 tensor written by ``labels_to_proto``."""
    if msg.codec != pb.CODEC_UNSPECIFIED:
        raise TensorFormatError(
            f"{name}: expected codec CODEC_UNSPECIFIED (0) for int64 labels, "
            f"got {_codec_label(msg.codec)}"
        )
    shape = _checked_shape(msg, name, expect_shape, max_elements)
    itemsize = _LABEL_DTYPE.itemsize
    data = msg.data  # each read copies the field: read it once
    _check_nbytes(name, "data", len(data), math.prod(shape) * itemsize, shape, "int64")
    if msg.scales:
        raise TensorFormatError(f"{name}: labels carry no scales, got {len(msg.scales)} bytes")
    return _from_bytes(data, _LABEL_DTYPE, shape)


def _checked_shape(
    msg: pb.Tensor,
    name: str,
    expect_shape: Sequence[int | None] | None,
    max_elements: int | None,
) -> tuple[int, ...]:
    shape = tuple(msg.shape)
    if len(shape) > MAX_NDIM:
        raise TensorFormatError(f"{name}: {len(shape)} dimensions, at most {MAX_NDIM} allowed")
    if any(d < 0 for d in shape):
        raise TensorFormatError(f"{name}: shape {shape} has a negative dimension")
    if math.prod(max(d, 1) for d in shape) > _MAX_SPAN:
        raise TensorFormatError(
            f"{name}: shape {shape} is too large (over 2**48 elements, zero dimensions aside)"
        )
    if expect_shape is not None and not _shape_matches(shape, expect_shape):
        expected = "(" + ", ".join("*" if d is None else str(d) for d in expect_shape) + ")"
        if len(expect_shape) == 1:
            expected = expected[:-1] + ",)"
        raise TensorFormatError(f"{name}: expected shape {expected}, got {shape}")
    numel = math.prod(shape)
    if max_elements is not None and numel > max_elements:
        raise TensorFormatError(
            f"{name}: shape {shape} has {numel} elements, more than the limit of {max_elements}"
        )
    return shape


def _shape_matches(shape: tuple[int, ...], expect: Sequence[int | None]) -> bool:
    return len(shape) == len(expect) and all(
        e is None or e == d for d, e in zip(shape, expect, strict=True)
    )


def _check_nbytes(
    name: str, field: str, got: int, expected: int, shape: tuple[int, ...], codec: str
) -> None:
    if got != expected:
        raise TensorFormatError(
            f"{name}: {field} has {got} bytes, expected {expected} for shape {shape} as {codec}"
        )


def _from_bytes(
    data: bytes | memoryview, wire_dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor:
    """A tensor over ``data``, a fresh ``bytes`` only this tensor holds (no copy under upb).

    torch warns that ``bytes`` is read-only; nothing else sees these bytes, so writing is safe.
    Except one byte: CPython hands out one shared ``bytes`` object per byte value (so does
    upb for a 1-byte field), and writing through a tensor over it would change that byte
    everywhere in the process; it is copied. (torch.frombuffer rejects empty buffers.)
    """
    if len(data) == 0:
        return torch.zeros(shape, dtype=wire_dtype)
    if not _FRESH_BYTES or len(data) == 1:
        return torch.frombuffer(bytearray(data), dtype=wire_dtype).reshape(shape)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(data, dtype=wire_dtype).reshape(shape)


def _dequantize_int8(
    data: bytes | memoryview, scales: bytes, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    if math.prod(shape) == 0:
        return torch.zeros(shape, dtype=dtype)
    q = _from_bytes(data, torch.int8, shape).reshape(_num_rows(shape), -1)  # (rows, last)
    s = _from_bytes(scales, torch.float32, (_num_rows(shape),))  # (rows,)
    return q.to(torch.float32).mul_(s[:, None]).reshape(shape).to(dtype)


def _decode_low_bit(
    msg: pb.Tensor,
    data: bytes | memoryview,
    scales: bytes,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    name: str,
) -> torch.Tensor:
    """Check an int4/int2 message's group size and byte counts, then unpack and scale it."""
    base = _FROM_PROTO[msg.codec]
    group = msg.group_size
    if group not in GROUP_SIZES:
        raise TensorFormatError(
            f"{name}: {base.upper()} group_size {group} is not one of "
            f"{', '.join(map(str, GROUP_SIZES))}"
        )
    if not _known_outliers(msg):
        raise TensorFormatError(
            f"{name}: {base.upper()} outliers {msg.outliers} per group is not one of "
            f"0, {', '.join(map(str, OUTLIER_COUNTS))} below group_size {group}"
        )
    k = msg.outliers
    codec = codec_name(base, group, msg.token_groups, k)
    bits, numel = LOW_BIT[base], math.prod(shape)
    groups = lowbit.num_groups(numel, group)
    _check_nbytes(name, "data", len(data), lowbit.packed_nbytes(numel, bits), shape, codec)
    meta_nbytes = groups * _group_meta_bytes(codec)
    _check_nbytes(name, "scales", len(scales), meta_nbytes, shape, codec)
    if numel == 0:
        return torch.zeros(shape, dtype=dtype)
    packed = _from_bytes(data, torch.uint8, (len(data),))
    floats = (2 + k) * groups  # scales, offsets, then the outliers' values
    meta = _from_bytes(scales[: 4 * floats], torch.float32, (floats,))
    exact = _exact_values(scales[4 * floats :], meta[2 * groups :], groups, k, group, name)
    values = lowbit.dequantize(
        packed, meta[:groups], meta[groups : 2 * groups], bits, group, numel, exact
    )
    if msg.token_groups:  # channel-major on the wire: back to (rows, channels)
        channels = shape[-1] if shape else 1
        values = values.view(channels, -1).t()
    return values.reshape(shape).to(dtype).contiguous()


def _known_outliers(msg: pb.Tensor) -> bool:
    """Whether a low-bit message's ``outliers`` is 0 or an allowed count below its group."""
    k = msg.outliers
    return k == 0 or (k in OUTLIER_COUNTS and k < msg.group_size)


def _exact_values(
    raw: bytes, values: torch.Tensor, groups: int, k: int, group: int, name: str
) -> lowbit.Outliers | None:
    """The outliers a peer sent, their positions checked to lie inside their group."""
    if k == 0:
        return None
    positions = _from_bytes(raw, torch.int16, (groups, k))
    bad = int(((positions < 0) | (positions >= group)).sum())
    if bad:
        raise TensorFormatError(
            f"{name}: {bad} outlier positions lie outside [0, {group}) (group_size {group})"
        )
    return lowbit.Outliers(values.view(groups, k), positions)
