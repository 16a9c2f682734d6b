"""Errors fedpipe raises across layers; the transport maps each to a gRPC status code. And
`one_line`, how a reason from elsewhere (Ray, Flower, a device) is put in a one-line report."""

from __future__ import annotations

__all__ = [
    "AuthError",
    "CorruptMessageError",
    "FedpipeError",
    "IdleTimeoutError",
    "InvalidRequestError",
    "MessageTooLargeError",
    "ModelFileError",
    "RunStateError",
    "SessionStateError",
    "SettingsError",
    "SplitMismatchError",
    "StageCapacityError",
    "StageLinkError",
    "StreamReplacedError",
    "TensorFormatError",
    "UnknownSessionError",
    "one_line",
]


def one_line(text: str, limit: int) -> str:
    """``text`` on one line (whitespace runs collapsed) of at most ``limit`` characters, cut
    with ``...``: reasons from Ray, Flower or a device can run over many lines."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


class FedpipeError(Exception):
    """Base class of fedpipe's own errors."""


class UnknownSessionError(FedpipeError, LookupError):
    """A message or call names a session the StageServer does not hold (NOT_FOUND)."""


class AuthError(FedpipeError, PermissionError):
    """A session token or control secret was missing, forged or for another round."""


class InvalidRequestError(FedpipeError, ValueError):
    """A request asks for what the server does not allow: a setting out of its bounds, a tensor
    that does not fit what the session declared, labels outside the vocabulary (INVALID_ARGUMENT).
    """


class SettingsError(FedpipeError, ValueError):
    """A setting that cannot work (the command line's checks); its message is one line saying
    what to change."""


class SessionStateError(FedpipeError):
    """A message arrived out of order: wrong step, duplicate or unknown microbatch."""


class MessageTooLargeError(FedpipeError):
    """A message is larger than the configured limit (RESOURCE_EXHAUSTED)."""


class StageCapacityError(FedpipeError):
    """The StageServer is full: too many sessions or microbatches in flight."""


class StreamReplacedError(FedpipeError):
    """A newer Exchange stream of the same session took over; this one ends (ABORTED)."""


class IdleTimeoutError(FedpipeError, TimeoutError):
    """A stream sent nothing for longer than the server's idle deadline (DEADLINE_EXCEEDED)."""


class StageLinkError(FedpipeError, ConnectionError):
    """The stage link failed on the device side: the server aborted or the stream broke."""


class ModelFileError(FedpipeError, ValueError):
    """A model file is missing, truncated or corrupt; the message names the file (one line)."""


class RunStateError(FedpipeError):
    """A round-control call the StageServer cannot serve: it lacks the run's state (it restarted
    mid-run) or the round was not begun on it (FAILED_PRECONDITION)."""


class SplitMismatchError(FedpipeError):
    """Device and StageServer hold different models or cuts (FAILED_PRECONDITION)."""


class TensorFormatError(ValueError):
    """A tensor message that cannot be decoded as expected (bad codec, shape, or byte count)."""


class CorruptMessageError(TensorFormatError):
    """A stage-link message whose bytes do not match the checksum its sender set: it was
    corrupted between the sender's encoder and this receiver (DATA_LOSS), not computed wrong."""
