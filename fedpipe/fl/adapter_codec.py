"""Device adapters through Flower in a stage-link codec: the function pair both apps call.

``federated.adapter_codec`` (device to server) and ``federated.adapter_downlink_codec`` (the
global adapters to the devices) are both ``fp32`` by default, and then nothing here runs: each
device sends its whole adapters and receives the global ones as they are. With any other
codec on either side, a round's adapters travel as updates:

- the ServerApp sends the round's global adapters encoded with the downlink codec
  (:func:`encode_adapters`; as they are when it is fp32, and the folded base deltas of
  ``exact`` and ``stack`` aggregation always) and the two codec names in the round's config;
- the device (:func:`adapter_codec_mod`, the ClientApp's outer mod) decodes them
  (:func:`decode_adapters`) and trains from what it decoded. It sends its update, its adapters
  minus what it decoded, encoded with the uplink codec; what the encoding dropped (the residual)
  is added to its next round's update (error feedback, :class:`ErrorFeedback`), kept in Flower's
  ``context.state``, which Flower keeps per node across a run's rounds in simulation and in
  deployment (where each round's ClientApp is a new process);
- the ServerApp decodes each reply against the round's exact global adapters
  (:func:`decode_reply`) before its reply checks and aggregation, which see whole adapters as
  before. A reply that does not decode is that device's failure, as any bad reply is.

The global adapters on the server stay exact: a device's error in what it received moves only
the point it trained from, and its update is added to the exact global adapters.

Each encoded tensor is one serialised ``fedpipe.proto.Tensor`` (:mod:`fedpipe.wire.tensors`, the
stage link's codecs) in a Flower ``Array`` of stype :data:`ENCODED`, whose shape is the
adapter's and whose dtype is what it decodes to. The values are taken flat: low-bit codecs group
``G`` consecutive values; int8 scales each row of :data:`INT8_ROW` values (zero-padded), so a
LoRA B matrix (out x r) pays one scale per 64 values, not one per ``r``.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message
from flwr.clientapp.typing import ClientAppCallable

from fedpipe.compress.feedback import ErrorFeedback
from fedpipe.config import FederatedConfig
from fedpipe.config.codecs import codec_base
from fedpipe.errors import TensorFormatError
from fedpipe.lora.aggregation import DELTA_SUFFIX
from fedpipe.wire.tensors import tensor_from_bytes, tensor_to_bytes

__all__ = [
    "ENCODED",
    "FEEDBACK_KEY",
    "INT8_ROW",
    "AdapterCodecs",
    "AdapterFormatError",
    "adapter_codec_mod",
    "adapter_nbytes",
    "decode_adapters",
    "decode_reply",
    "encode_adapters",
]

ENCODED = "fedpipe.proto.Tensor"  # an Array's stype: its data is one serialised tensor message
INT8_ROW = 64  # values per int8 scale
FEEDBACK_KEY = "adapter-feedback"  # context.state: the device's residuals between rounds
_UP, _DOWN = "adapter-codec", "adapter-downlink-codec"  # the round config's keys


@dataclass(frozen=True)
class AdapterCodecs:
    """The codecs of a run's adapters: ``up`` (devices' updates), ``down`` (global adapters)."""

    up: str = "fp32"
    down: str = "fp32"

    @property
    def plain(self) -> bool:
        """fp32 both ways: whole adapters travel as they are, and nothing is encoded."""
        return self.up == "fp32" and self.down == "fp32"

    @classmethod
    def of(cls, fed: FederatedConfig) -> AdapterCodecs:
        return cls(fed.adapter_codec, fed.adapter_downlink_codec)

    def to_config(self) -> dict[str, str]:
        """What a round's config carries to the devices (nothing when plain)."""
        return {} if self.plain else {_UP: self.up, _DOWN: self.down}

    @classmethod
    def from_config(cls, config: ConfigRecord | None) -> AdapterCodecs:
        config = config or ConfigRecord()
        return cls(str(config.get(_UP, "fp32")), str(config.get(_DOWN, "fp32")))


class AdapterFormatError(ValueError):
    """An encoded adapter record that does not decode to what the round holds."""


# -- the pair -----------------------------------------------------------------------------------
def encode_adapters(
    state: Mapping[str, torch.Tensor],
    codec: str,
    *,
    reference: Mapping[str, torch.Tensor] | None = None,
    feedback: ErrorFeedback | None = None,
) -> ArrayRecord:
    """``state`` (minus ``reference``: an update) encoded with ``codec``, tensor by tensor.

    ``feedback`` adds each tensor's residual from its last encoding and keeps the new one
    (what the receiver will not see). Base deltas (``*.base_delta``) go as they are.
    """
    arrays: dict[str, Array] = {}
    for key, value in state.items():
        if key.endswith(DELTA_SUFFIX):
            arrays[key] = Array(value.detach().cpu().contiguous())
            continue
        x = value.detach().to(torch.float32)
        if reference is not None:
            x = x - reference[key].to(torch.float32)
        if feedback is not None:
            x = feedback.compensate(key, x)
        data = tensor_to_bytes(_flat(x, codec), codec)
        if feedback is not None:
            feedback.remember(key, x, _decode(data, codec, tuple(x.shape), key))
        arrays[key] = Array(dtype="float32", shape=tuple(x.shape), stype=ENCODED, data=data)
    return ArrayRecord(arrays)


def decode_adapters(
    record: ArrayRecord,
    codec: str,
    *,
    reference: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """What :func:`encode_adapters` encoded, plus ``reference`` (the update's base) if given.

    With a ``reference`` (the ServerApp's view of a device's reply) every tensor must be
    encoded, with ``codec``, under a key and shape the reference holds; else (a device's view
    of the global adapters) a tensor not encoded is taken as it is (an fp32 downlink sends the
    global adapters so, and base deltas always go so). Raises
    :class:`AdapterFormatError` naming the tensor and what is wrong.
    """
    out: dict[str, torch.Tensor] = {}
    for key in record.keys():
        array = record[key]
        if array.stype != ENCODED:
            if reference is None:  # the server's: an fp32 downlink, or a base delta
                out[key] = torch.from_numpy(array.numpy())
                continue
            raise AdapterFormatError(f"{key} is not encoded as {codec} (stype {array.stype!r})")
        if reference is None:
            out[key] = _decode(array.data, codec, tuple(array.shape), key)
            continue
        if key not in reference:
            raise AdapterFormatError(f"it sends an update of {key}, which no global adapter holds")
        shape = tuple(reference[key].shape)
        if tuple(array.shape) != shape:
            raise AdapterFormatError(
                f"the update of {key} has shape {tuple(array.shape)}, the global adapter {shape}"
            )
        out[key] = reference[key].to(torch.float32) + _decode(array.data, codec, shape, key)
    return out


def adapter_nbytes(record: ArrayRecord) -> int:
    """The payload bytes of a record's tensors as they travel: an encoded tensor's message, a
    plain tensor's values (its serialisation's header not counted)."""
    total = 0
    for key in record.keys():
        array = record[key]
        if array.stype == ENCODED:
            total += len(array.data)
        else:
            total += math.prod(array.shape) * np.dtype(array.dtype).itemsize
    return total


# -- the apps' sides ----------------------------------------------------------------------------
def adapter_codec_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """The ClientApp's side: the round's global adapters decoded before training, the device's
    update encoded after it (with its residuals carried in ``context.state``); with fp32 both
    ways (the round's config names no codec), the message and reply pass as they are."""
    config = msg.content.get("config")
    codecs = AdapterCodecs.from_config(config if isinstance(config, ConfigRecord) else None)
    if codecs.plain:
        return call_next(msg, context)
    received = decode_adapters(cast(ArrayRecord, msg.content["arrays"]), codecs.down)
    msg.content["arrays"] = ArrayRecord({k: v.contiguous() for k, v in received.items()})
    reply = call_next(msg, context)
    if reply.has_error():
        return reply
    feedback = ErrorFeedback(_residuals(context))
    trained = cast(ArrayRecord, reply.content["arrays"]).to_torch_state_dict()
    reply.content["arrays"] = encode_adapters(
        trained, codecs.up, reference=received, feedback=feedback
    )
    context.state[FEEDBACK_KEY] = ArrayRecord(
        {str(k): v.contiguous() for k, v in feedback.residuals().items()}
    )
    return reply


def decode_reply(
    reply: Message, reference: Mapping[str, torch.Tensor], codecs: AdapterCodecs
) -> str:
    """The ServerApp's side: a device's encoded update replaced by its whole adapters (the
    round's global ``reference`` plus the update), or why it cannot be, as one line ("" when
    decoded, and when the run's adapters are plain: the reply is then left as it is)."""
    arrays = reply.content.get("arrays")
    if codecs.plain or not isinstance(arrays, ArrayRecord):
        return ""  # plain, or no adapters at all: the reply checks say what is wrong
    try:
        state = decode_adapters(arrays, codecs.up, reference=reference)
    except AdapterFormatError as exc:
        return f"reply not aggregated: its adapter update does not decode: {exc}"
    reply.content["arrays"] = ArrayRecord({k: v.contiguous() for k, v in state.items()})
    return ""


# -- helpers ------------------------------------------------------------------------------------
def _flat(x: torch.Tensor, codec: str) -> torch.Tensor:
    """``x``'s values as the codec takes them: rows of :data:`INT8_ROW` for int8, else 1-D."""
    flat = x.reshape(-1)
    if codec_base(codec) != "int8":
        return flat
    pad = -flat.numel() % INT8_ROW
    if pad:  # zeros change no row's largest magnitude, so no value's scale
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, INT8_ROW)


def _layout(shape: tuple[int, ...], codec: str) -> tuple[int, ...]:
    """The shape :func:`_flat` gives a tensor of ``shape``."""
    n = math.prod(shape)
    return (-(-n // INT8_ROW), INT8_ROW) if codec_base(codec) == "int8" else (n,)


def _decode(data: bytes, codec: str, shape: tuple[int, ...], key: str) -> torch.Tensor:
    """The fp32 tensor of ``shape`` that ``data`` encodes with ``codec``."""
    try:
        flat = tensor_from_bytes(data, codec=codec, expect_shape=_layout(shape, codec), name=key)
    except TensorFormatError as exc:
        raise AdapterFormatError(str(exc)) from None
    return flat.reshape(-1)[: math.prod(shape)].reshape(shape).contiguous()


def _residuals(context: Context) -> dict[Hashable, torch.Tensor]:
    """The residuals the device's last round left (none before its first)."""
    record = context.state.get(FEEDBACK_KEY)
    if not isinstance(record, ArrayRecord):
        return {}
    return {key: value for key, value in record.to_torch_state_dict().items()}
