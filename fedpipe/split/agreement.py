"""Device and StageServer agree on the model and the cut before any step runs.

A device whose cut differs from the server's trains silently wrong (a block runs twice, or is
skipped), and so does one that loaded other weights. So the device states what it built (its
:class:`SplitTerms`) when it opens a session, and the server refuses any difference with an error
that names both sides' values and the setting to change.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from fedpipe.errors import SplitMismatchError
from fedpipe.split.layout import SplitLayout

__all__ = ["SplitInfo", "SplitLike", "SplitTerms", "check_agreement"]


class SplitLike(Protocol):
    """Anything with the agreed fields: :class:`SplitTerms`, the server's SplitInfo, the proto."""

    @property
    def fingerprint(self) -> str: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def head_layers(self) -> int: ...
    @property
    def tail_layers(self) -> int: ...
    @property
    def mode(self) -> str: ...
    @property
    def hidden_size(self) -> int: ...


@dataclass(frozen=True)
class SplitTerms:
    """What one side built: the model (fingerprint, width, depth) and where it is cut."""

    fingerprint: str
    num_layers: int
    head_layers: int
    tail_layers: int
    mode: str
    hidden_size: int

    @classmethod
    def of(cls, layout: SplitLayout, *, fingerprint: str, hidden_size: int) -> SplitTerms:
        return cls(
            fingerprint=fingerprint,
            num_layers=layout.num_layers,
            head_layers=layout.head_layers,
            tail_layers=layout.tail_layers,
            mode=layout.mode,
            hidden_size=hidden_size,
        )


@dataclass(frozen=True)
class SplitInfo:
    """What devices must know of the server's half (sent back on OpenSession)."""

    model: str
    num_layers: int
    head_layers: int
    tail_layers: int
    mode: str
    hidden_size: int
    dtype: str
    fingerprint: str = ""  # sha256 over the model's config and base weights
    max_positions: int = 0  # longest sequence the model's positions cover (0: unknown)
    vocab_size: int = 0
    cuts: tuple[tuple[int, int], ...] = ()  # (head, tail) cuts offered; () = only the one above

    def offered(self) -> tuple[tuple[int, int], ...]:
        """The cuts a device may open a session with (the server's own cut at least)."""
        return self.cuts or ((self.head_layers, self.tail_layers),)

    def session_blocks(self, head: int, tail: int) -> tuple[int, ...] | None:
        """The server blocks a session of cut (head, tail) runs; None when it is all of them."""
        lowest = min(h for h, _ in self.offered())
        stage_tail = 0 if self.mode == "two" else min(t for _, t in self.offered())
        if (head, tail) == (lowest, stage_tail):
            return None
        return tuple(range(head, self.num_layers - (0 if self.mode == "two" else tail)))


def check_agreement(
    device: SplitLike | None,
    server: SplitLike,
    *,
    model: str = "",
    offered: Sequence[tuple[int, int]] = (),
) -> None:
    """Raise :class:`SplitMismatchError` unless ``device`` built what ``server`` serves.

    ``offered`` lists the (head, tail) cuts the server accepts (``model.cuts``); empty means
    only the server's own ``head_layers``/``tail_layers``.

    ``device`` is None (or has no fingerprint) when an older client sent no split; that is
    refused too, since nothing then proves the two halves fit. ``model`` is the server's model
    spec, named in the messages so the user knows what to load on the device.
    """
    if device is None or not device.fingerprint:
        raise SplitMismatchError(
            "the device sent no split (model fingerprint and cut) on OpenSession, so the server "
            f"cannot check that both halves fit; the server holds {_describe(server, model)}: "
            "upgrade fedpipe on the device (it sends its split since this version) and start it "
            "with the same model and cut"
        )
    problems = [_model_problem(device, server, model), _cut_problem(device, server, offered)]
    if any(problems):
        raise SplitMismatchError("; ".join(p for p in problems if p))


def _model_problem(device: SplitLike, server: SplitLike, model: str) -> str:
    if (device.fingerprint, device.hidden_size, device.num_layers) == (
        server.fingerprint,
        server.hidden_size,
        server.num_layers,
    ):
        return ""
    return (
        f"device model fingerprint {device.fingerprint[:12]} (hidden {device.hidden_size}, "
        f"{device.num_layers} blocks), server model fingerprint {server.fingerprint[:12]} "
        f"(hidden {server.hidden_size}, {server.num_layers} blocks): the two sides loaded "
        "different models or weights; start the device with the server's model"
        + (f" (model.name {model!r} on the server)" if model else "")
    )


def _cut_problem(
    device: SplitLike, server: SplitLike, offered: Sequence[tuple[int, int]] = ()
) -> str:
    cut = (device.head_layers, device.tail_layers)
    if device.mode == server.mode and cut in offered:
        return ""
    if (device.head_layers, device.tail_layers, device.mode) == (
        server.head_layers,
        server.tail_layers,
        server.mode,
    ):
        return ""
    if len(offered) > 1:
        listed = ", ".join(f"{h}+{t}" for h, t in offered)
        return (
            f"device cut head={device.head_layers} tail={device.tail_layers} "
            f"mode={device.mode} is not offered: the server offers {listed} (head+tail, "
            f"mode={server.mode}); start the device with one of them (--set "
            "model.head_layers=H --set model.tail_layers=T), or add it to the server's "
            "model.cuts"
        )
    return (
        f"device cut head={device.head_layers} tail={device.tail_layers} mode={device.mode}, "
        f"server holds head={server.head_layers} tail={server.tail_layers} "
        f"mode={server.mode}: start the device with --set model.head_layers="
        f"{server.head_layers} --set model.tail_layers={server.tail_layers} "
        f"--set model.split={server.mode}"
    )


def _describe(split: SplitLike, model: str) -> str:
    name = f"model {model!r} " if model else "a model "
    return (
        f"{name}(fingerprint {split.fingerprint[:12] or '(none)'}, {split.num_layers} blocks) "
        f"cut head={split.head_layers} tail={split.tail_layers} mode={split.mode}"
    )
