"""What travels between the device runtime and the server runtime, independent of the wire.

The transport turns these into protobuf (``fedpipe.proto.stage_pb2.StageMessage``) and back;
the runtimes only ever see tensors and explicit ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import torch

__all__ = ["END", "Kind", "StageMsg"]

# The last "reply" of a stream: the device half-closed and everything it sent was answered.
END = object()


class Kind(IntEnum):
    """Message kinds, numbered as in ``protos/fedpipe/proto/stage.proto``."""

    ACTIVATION = 1  # device -> server: head output
    OUTPUT = 2  # server -> device: middle output (U-shaped split)
    OUTPUT_GRAD = 3  # device -> server: gradient w.r.t. OUTPUT
    INPUT_GRAD = 4  # server -> device: gradient w.r.t. ACTIVATION
    STEP_END = 5  # device -> server: apply the optimizer for this step
    STEP_DONE = 6  # server -> device: optimizer applied
    ERROR = 7  # server -> device: the message could not be processed
    ECHO = 8  # both ways: a link probe answered by the server's transport (see stage.proto)


@dataclass
class StageMsg:
    """One message of a session's stream, keyed by ``(step, microbatch, kind)``."""

    kind: Kind
    step: int
    microbatch: int = 0
    tensor: torch.Tensor | None = None
    labels: torch.Tensor | None = None  # two-part split: labels go up with the activation
    loss_scale: float = 0.0  # two-part split: 1 / tokens in the whole step
    loss_sum: float = 0.0  # two-part split: summed token loss of the microbatch
    tokens: int = 0
    compute_s: float = 0.0  # server compute seconds spent producing this reply
    error: str = ""
    forward_only: bool = False  # evaluation: no graph kept, no gradient follows
    wire_bytes: int = field(default=0, compare=False)  # encoded size, filled by the transport
    # Delta coding (ACTIVATION): one key per row, see fedpipe.compress.delta. ``inputs`` are
    # the microbatch's token ids, which the device's transport hashes into keys; never sent.
    sample_keys: tuple[int, ...] = ()
    inputs: torch.Tensor | None = field(default=None, compare=False, repr=False)
    # Packed rows (ACTIVATION): (B, T) segment ids, each token attending within its own
    # example (fedpipe.split.packing); the wire carries each row's segment lengths.
    segments: torch.Tensor | None = field(default=None, compare=False, repr=False)

    @property
    def key(self) -> tuple[int, int, int]:
        return (int(self.kind), self.step, self.microbatch)

    def __str__(self) -> str:
        shape = tuple(self.tensor.shape) if self.tensor is not None else ()
        return f"{self.kind.name}(step={self.step}, mb={self.microbatch}, shape={shape})"
