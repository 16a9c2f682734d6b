"""What the compute worker sees of its queue: items as lanes, tokens and ages for the policy.

The queue is a :class:`~fedpipe.server.fair_queue.FairQueue` of each session's messages (and
markers); the policy (:func:`~fedpipe.server.batch_policy.choose_batch`) is a pure function of a
:class:`~fedpipe.server.batch_policy.QueueView`. This module turns one into the other, and a
computed call into its trace event.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from fedpipe.messages import Kind, StageMsg
from fedpipe.server.batch_policy import BatchChoice, Item, Lane, QueueView, SessionView
from fedpipe.server.fair_queue import Snapshot
from fedpipe.server.streams import RESET, StreamHandle

__all__ = ["RESET", "TRACE_NAMES", "QueueItem", "policy_item", "queue_view", "trace_args"]

# (the stream it came on, or None for a marker; a StageMsg, END or RESET)
QueueItem = tuple[StreamHandle | None, object]
# Trace event names by lane: optimizer steps (O), server backwards (Sb) and forwards (Sf)
TRACE_NAMES = {Lane.CONTROL: "O", Lane.BACKWARD: "Sb", Lane.EVAL: "Sf", Lane.FORWARD: "Sf"}


def policy_item(item: QueueItem, waited_s: float) -> Item:
    """A queued message as the policy sees it: its lane, tokens and age."""
    msg = item[1]
    if not isinstance(msg, StageMsg) or msg.kind is Kind.STEP_END:
        return Item(Lane.CONTROL, 0, waited_s)
    tokens = _tokens(msg.tensor)
    if msg.kind is Kind.OUTPUT_GRAD:
        return Item(Lane.BACKWARD, tokens, waited_s)
    return Item(Lane.EVAL if msg.forward_only else Lane.FORWARD, tokens, waited_s)


def queue_view(snap: Snapshot[str, QueueItem], mid_step: set[str], call_s: float) -> QueueView:
    """The policy's view of the queue; ``mid_step``: sessions whose next message is on its way."""
    ring = tuple(
        SessionView(key, tuple(policy_item(item, waited) for item, waited in items))
        for key, items in snap.ring
    )
    queued = {key for key, _ in snap.ring}
    return QueueView(ring, snap.served, snap.skipped, len(mid_step - queued), call_s)


def trace_args(
    taken: Sequence[tuple[str, QueueItem]], plan: BatchChoice, device_of: Callable[[str], str]
) -> dict[str, object]:
    """The trace event's arguments for one call: its sessions, devices, messages and size."""
    msgs = [item for _, (_, item) in taken if isinstance(item, StageMsg)]
    return {
        "kind": plan.lane.name.lower(),
        "sessions": sorted({key[:8] for key, _ in taken}),  # id prefixes, as logged
        "devices": sorted({device_of(key) for key, _ in taken}),
        "messages": len(msgs),
        "rows": sum(_rows(m.tensor) for m in msgs),
        "tokens": plan.tokens,
    }


def _tokens(tensor: torch.Tensor | None) -> int:
    """Rows x sequence length of a (B, T, C) tensor; any other shape counts its elements."""
    if tensor is None:
        return 0
    return int(tensor.shape[0] * tensor.shape[1]) if tensor.dim() >= 2 else tensor.numel()


def _rows(tensor: torch.Tensor | None) -> int:
    return int(tensor.shape[0]) if tensor is not None and tensor.dim() >= 1 else 0
