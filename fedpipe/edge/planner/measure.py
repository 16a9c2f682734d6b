"""What the planner measures at session start: the device's compute and the stage link.

- Device compute (:func:`time_device_ops`): head forward, tail forward + loss + backward and
  head backward, back to back on slices of a real batch for every candidate microbatch size,
  a few repeats after a warm-up, median (timing ops one at a time after idle gaps inflates them
  on a shared machine: docs/design/pipeline-bound.md). The emulated device slowdown applies.
  The same pass counts the bytes autograd stashes per live microbatch (for the memory cap) and
  times each codec's encode + decode of one boundary tensor.
- The link (:func:`probe_link`): ECHO messages on the session's own stream, answered by the
  server's transport thread (stage.proto). Tiny echoes give the RTT; a large echo up with a tiny
  reply gives the uplink's rate, a tiny echo with a large reply the downlink's, each as the
  stage link delivers it (serialisation, framing and emulation included).
- The server's compute (:func:`server_times`): from the replies' ``compute_s`` on a real step
  (the trace's ``Sf``/``Sb``/``So`` spans), scaled to other microbatch sizes as the device's
  own blocks scale.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import replace

import torch
from torch import nn

from fedpipe.edge.planner.plan import LinkFigures, Measured, OpTimes
from fedpipe.messages import Kind, StageMsg
from fedpipe.trace import Event, Tracer
from fedpipe.wire.serde import msg_from_wire, msg_to_wire

__all__ = [
    "CodecFigures",
    "calibrate",
    "probe_link",
    "server_times",
    "time_block",
    "time_codecs",
    "time_device_ops",
]

Throttle = Callable[[], AbstractContextManager[object]]
CodecFigures = tuple[dict[tuple[str, int], int], dict[tuple[str, int], float]]


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else 0.0


@contextlib.contextmanager
def _stash_counter(total: list[int]) -> Iterator[None]:
    """Adds the bytes of every tensor autograd saves for backward to ``total[0]``."""

    def pack(t: torch.Tensor) -> torch.Tensor:
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


def _one_pass(
    head: nn.Module,
    tail: nn.Module | None,
    ids: torch.Tensor,
    labels: torch.Tensor,
    gen: torch.Generator,
    run: Throttle,
) -> tuple[float, float, float, int]:
    """Head forward, tail forward + loss + backward, head backward: seconds and stash bytes.

    A head that trains nothing (frozen) keeps no graph: its backward takes no time.
    """
    stash = [0]
    t0 = time.perf_counter()
    with run(), _stash_counter(stash):
        h = head(ids)  # (b, T, C)
    t1 = time.perf_counter()
    if tail is not None:
        x = torch.randn(h.shape, generator=gen).requires_grad_(True)  # the server's output
        with run():
            loss_sum, _ = tail(x, labels)
            loss_sum.backward()
    t2 = time.perf_counter()
    grad = torch.randn(h.shape, generator=gen) * 1e-3
    if h.requires_grad:
        with run():
            h.backward(grad)
    t3 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t2, stash[0] + h.numel() * h.element_size()


def time_device_ops(
    head: nn.Module,
    tail: nn.Module | None,
    batch: dict[str, torch.Tensor],
    rows: Sequence[int],
    *,
    repeats: int = 3,
    throttle: Throttle | None = None,
) -> tuple[dict[int, OpTimes], dict[int, int]]:
    """Median op times and stash bytes per microbatch size (``rows`` sequences of ``batch``).

    Gradients are cleared afterwards and no optimizer runs: the weights are not changed.
    """
    run: Throttle = throttle or contextlib.nullcontext
    gen = torch.Generator().manual_seed(0)
    times: dict[int, OpTimes] = {}
    stash: dict[int, int] = {}
    stages = [m for m in (head, tail) if m is not None]
    try:
        for b in rows:
            ids, labels = batch["input_ids"][:b], batch["labels"][:b]
            samples = [_one_pass(head, tail, ids, labels, gen, run) for _ in range(repeats + 1)]
            samples = samples[1:]  # the first pass warms caches and allocator
            times[b] = OpTimes(*(_median([s[i] for s in samples]) for i in range(3)))
            stash[b] = samples[-1][3]
    finally:
        for stage in stages:
            stage.zero_grad(set_to_none=True)
    return times, stash


def time_block(
    stage: nn.Module,
    shape: tuple[int, int],
    rows: Sequence[int],
    *,
    repeats: int = 3,
    throttle: Throttle | None = None,
) -> dict[int, tuple[float, float]]:
    """One of ``stage``'s blocks: median (forward, backward) seconds per microbatch size.

    What a cut that moves a block to or from this device changes in its compute (the
    planner's per-block figure). ``shape`` is (tokens, hidden); the weights are not changed.
    """
    run: Throttle = throttle or contextlib.nullcontext
    first = getattr(stage, "block_indices", ())[:1]
    if not first:
        return {}
    gen = torch.Generator().manual_seed(0)
    out: dict[int, tuple[float, float]] = {}
    try:
        for b in rows:
            x = torch.randn((b, *shape), generator=gen).requires_grad_(True)
            samples = []
            for _ in range(repeats + 1):  # the first warms caches and allocator
                t0 = time.perf_counter()
                with run():
                    y = stage.run_blocks(x, first)  # type: ignore[operator]
                t1 = time.perf_counter()
                with run():
                    y.backward(torch.ones_like(y) * 1e-3)
                samples.append((t1 - t0, time.perf_counter() - t1))
            samples = samples[1:]
            out[b] = (_median([f for f, _ in samples]), _median([g for _, g in samples]))
    finally:
        stage.zero_grad(set_to_none=True)
    return out


def time_codecs(
    shape: tuple[int, int, int], codecs: Sequence[str], rows: Sequence[int], *, repeats: int = 3
) -> CodecFigures:
    """Encoded bytes and encode + decode seconds of one boundary tensor per (codec, rows)."""
    nbytes: dict[tuple[str, int], int] = {}
    seconds: dict[tuple[str, int], float] = {}
    gen = torch.Generator().manual_seed(0)
    for b in rows:
        x = torch.randn((b, shape[1], shape[2]), generator=gen)
        for codec in codecs:
            samples = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                raw = msg_to_wire(
                    StageMsg(Kind.ACTIVATION, 0, tensor=x), session_id="", codec=codec
                )
                msg_from_wire(raw)
                samples.append(time.perf_counter() - t0)
            nbytes[codec, b] = len(raw)
            seconds[codec, b] = _median(samples)
    return nbytes, seconds


class _Echoes:
    """Numbered ECHO round trips on one session (each its own microbatch id)."""

    def __init__(self, session: object) -> None:
        self.session = session
        self.count = 0

    def round_trip(self, tensor: torch.Tensor | None, reply_rows: int) -> tuple[float, int]:
        """Seconds from send to reply, and the bytes that crossed the link both ways."""
        mb, self.count = self.count, self.count + 1
        msg = StageMsg(Kind.ECHO, 0, mb, tensor=tensor, tokens=reply_rows)
        start = time.perf_counter()
        self.session.send(msg)  # type: ignore[attr-defined]
        reply = self.session.receive(Kind.ECHO, 0, mb)  # type: ignore[attr-defined]
        return time.perf_counter() - start, reply.wire_bytes


def _rate(nbytes: int, seconds: float) -> float:
    """Mbit/s that move ``nbytes`` in ``seconds`` (infinite when too fast to see)."""
    return nbytes * 8 / seconds / 1e6 if seconds > 1e-5 else float("inf")


def probe_link(
    session: object, shape: tuple[int, int, int], *, small: int = 5, large: int = 3
) -> LinkFigures:
    """RTT and each direction's rate of ``session``'s stream, with echoes of ``shape``.

    ``shape`` (rows, tokens, hidden) must fit what the session declared; large echoes carry
    a zero tensor of it one way and nothing the other. Costs ``small`` tiny round trips and
    ``2 * large`` large ones (11 ECHOs, under the server's 64 per stream).
    """
    echo = _Echoes(session)
    # Minimums, not medians: a busy machine only ever adds delay to a round trip.
    rtt = min(echo.round_trip(None, 0)[0] for _ in range(small))
    padding = torch.zeros(shape)
    up_bytes = len(msg_to_wire(StageMsg(Kind.ECHO, 0, tensor=padding), session_id="", codec="fp32"))
    up = min(echo.round_trip(padding, 0)[0] for _ in range(large))
    down_runs = [echo.round_trip(None, shape[0]) for _ in range(large)]
    down = min(t for t, _ in down_runs)
    down_bytes = down_runs[-1][1]
    return LinkFigures(
        rtt_s=rtt,
        up_mbps=_rate(up_bytes, up - rtt),
        down_mbps=_rate(down_bytes, down - rtt),
    )


def server_times(
    tracer: Tracer, device: dict[int, OpTimes], rows: int
) -> tuple[dict[int, tuple[float, float]], float, float]:
    """The server's (forward, backward) per microbatch size, its and the device's optimizer step.

    Measured at ``rows`` from a real step's trace; other sizes scale as the device's own head
    forward and head backward do (the same kind of blocks, the same shapes).
    """
    s_f = _median(tracer.durations("Sf", "server"))
    s_b = _median(tracer.durations("Sb", "server"))
    s_opt = _median(tracer.durations("So", "server"))
    c_opt = _median(tracer.durations("O", "device"))
    base = device[rows]
    out = {}
    for b, ops in device.items():
        f = ops.head_forward / base.head_forward if base.head_forward > 0 else b / rows
        g = ops.head_backward / base.head_backward if base.head_backward > 0 else b / rows
        out[b] = (s_f * f, s_b * g)
    return out, s_opt, c_opt


def calibrate(figures: Measured, events: Sequence[Event], rows: int) -> Measured | None:
    """``figures`` rescaled to the compute timed inside real steps of ``rows``-row microbatches.

    A shared machine's speed drifts between planning and training (on the 2-core test machine
    the plan's compute ran 20-40% slower than when it was measured, while the model fed with
    the steps' own compute was within 3% of their time), so after each session the device
    scales every size's op times by the ratio seen at the size it ran. None without samples.
    """
    step = Tracer()
    step.events = list(events)
    seen = {name: _median(step.durations(name, lane)) for name, lane in _SPANS}
    if not seen["F"] or rows not in figures.device:
        return None
    ops, (s_f, s_b) = figures.device[rows], figures.server[rows]
    ratio = {
        "F": seen["F"] / ops.head_forward if ops.head_forward else 1.0,
        "T": seen["T"] / ops.tail if ops.tail else 1.0,
        "B": seen["B"] / ops.head_backward if ops.head_backward else 1.0,
        "Sf": seen["Sf"] / s_f if s_f and seen["Sf"] else 1.0,
        "Sb": seen["Sb"] / s_b if s_b and seen["Sb"] else 1.0,
    }
    device = {
        b: OpTimes(o.head_forward * ratio["F"], o.tail * ratio["T"], o.head_backward * ratio["B"])
        for b, o in figures.device.items()
    }
    server = {b: (f * ratio["Sf"], g * ratio["Sb"]) for b, (f, g) in figures.server.items()}
    return replace(
        figures,
        device=device,
        server=server,
        c_opt=seen["O"] or figures.c_opt,
        s_opt=seen["So"] or figures.s_opt,
    )


_SPANS = (
    ("F", "device"),
    ("T", "device"),
    ("B", "device"),
    ("O", "device"),
    ("Sf", "server"),
    ("Sb", "server"),
    ("So", "server"),
)
