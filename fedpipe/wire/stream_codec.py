"""One side of a session's stream: which codec each message gets, and the state kept per stream.

Each end of the stage link encodes what it sends with a :class:`StreamEncoder` and decodes
what it receives with a :class:`StreamDecoder`; both live as long as the session's stream,
so that state carried from one message to the next stays with its session:

- **codec per message**: gradients (``OUTPUT_GRAD`` up, ``INPUT_GRAD`` down) may have their
  own codec, everything else takes the direction's (``codec_for``);
- **error feedback** (gradients, both directions; :mod:`fedpipe.compress.feedback`): the
  device for the output gradients it sends up, the server for the input gradients it sends
  down;
- **delta coding** (activations, device to server; :mod:`fedpipe.compress.delta`): the
  device's encoder and the server's decoder keep mirrored caches of decoded rows. Those two
  may outlive the stream: the device passes its long-lived encoder in, the server a cache
  it resumed from its :class:`~fedpipe.server.delta_store.DeltaStore`.

Codecs stay plain names (``"int4"``), so a planner can choose them per link.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, replace

import torch

from fedpipe.compress.delta import DeltaCache, DeltaDecoder, DeltaEncoder
from fedpipe.compress.feedback import ErrorFeedback
from fedpipe.messages import Kind, StageMsg
from fedpipe.proto import stage_pb2 as pb
from fedpipe.wire.serde import MessageBounds, codec_for, msg_from_wire, msg_to_wire
from fedpipe.wire.tensors import decode_wire, tensor_to_wire

__all__ = ["StreamCodecs", "StreamDecoder", "StreamEncoder", "rounding_seed"]

_GRADIENTS = (Kind.OUTPUT_GRAD, Kind.INPUT_GRAD)


@dataclass(frozen=True)
class StreamCodecs:
    """How one side encodes what it sends on a session's stream."""

    codec: str = "fp32"  # the direction's codec
    gradient_codec: str = ""  # "" = the direction's codec
    error_feedback: bool = False  # keep gradients' quantisation residuals (lossy codecs only)
    delta_cache_bytes: int = 0  # > 0: delta-code activations that carry their token ids
    # An ACTIVATION whose rows all go as differences takes this codec ("" = the direction's):
    # differences span a small range, so fewer bits keep the same error (AQ-SGD).
    delta_codec: str = ""
    stochastic: bool = False  # gradients round stochastically (int4/int2 only; unbiased)
    seed: int | None = None  # of the stochastic rounding (None: from the OS)


def rounding_seed(device_id: str, round_: int, side: str) -> int:
    """The stochastic-rounding seed of one side (``device`` or ``server``) of a session:
    stable across processes (not Python's salted ``hash``), so a seeded run repeats."""
    return zlib.crc32(f"{side}/{device_id}/{round_}".encode())


class StreamEncoder:
    """Turns a side's outgoing messages into frames, with the state the settings ask for."""

    def __init__(
        self, codecs: StreamCodecs, *, session_id: str, delta: DeltaEncoder | None = None
    ) -> None:
        """``delta``: the device's encoder kept across sessions (None: one for this stream)."""
        self.codecs = codecs
        self.session_id = session_id
        self.feedback = ErrorFeedback()
        self.delta: DeltaEncoder | None = None
        if codecs.delta_cache_bytes:
            self.delta = delta or DeltaEncoder(codecs.delta_cache_bytes)
        self._generator: torch.Generator | None = None
        if codecs.stochastic:
            self._generator = torch.Generator()
            if codecs.seed is None:
                self._generator.seed()
            else:
                self._generator.manual_seed(codecs.seed)

    def encode(self, msg: StageMsg) -> bytes:
        """``msg`` as one frame of the stream."""
        c = self.codecs
        codec = codec_for(msg.kind, c.codec, c.gradient_codec)
        tensor = msg.tensor
        gradient = msg.kind in _GRADIENTS
        feedback = gradient and c.error_feedback and codec != "fp32"
        delta = self.delta is not None and msg.kind is Kind.ACTIVATION and msg.inputs is not None
        if tensor is None or not (feedback or delta or (gradient and c.stochastic)):
            return msg_to_wire(msg, session_id=self.session_id, codec=codec)
        role = (int(msg.kind), msg.microbatch)
        x = self.feedback.compensate(role, tensor) if feedback else tensor
        plan = None
        if delta:
            assert self.delta is not None and msg.inputs is not None
            x, plan = self.delta.prepare(x, msg.inputs)
            if c.delta_codec and len(plan.bases) == len(plan.keys):
                codec = c.delta_codec  # every row is a difference
        meta = pb.Tensor()
        generator = self._generator if gradient and x.device.type == "cpu" else None
        values = tensor_to_wire(x, codec, meta, generator=generator)
        if feedback or plan is not None:
            decoded = decode_wire(meta, values)  # what the receiver will decode, bit for bit
            if feedback:
                self.feedback.remember(role, x, decoded)
            if plan is not None:
                assert self.delta is not None
                self.delta.commit(plan, decoded)
                msg = replace(msg, sample_keys=plan.wire_keys)
        return msg_to_wire(msg, session_id=self.session_id, codec=codec, encoded=(meta, values))


class StreamDecoder:
    """Turns a side's incoming frames into messages; rebuilds delta-coded activations."""

    def __init__(
        self,
        *,
        delta_cache_bytes: int = 0,
        delta_cache: DeltaCache | None = None,
        bounds: MessageBounds | None = None,
        max_elements: int | None = None,
    ) -> None:
        """``delta_cache``: a cache resumed from an earlier session (None: a new one)."""
        self.delta = DeltaDecoder(delta_cache_bytes, cache=delta_cache)
        self.bounds = bounds
        self.max_elements = max_elements

    def decode(self, frame: bytes) -> StageMsg:
        msg = msg_from_wire(frame, bounds=self.bounds, max_elements=self.max_elements)
        self.delta.apply(msg)
        return msg
