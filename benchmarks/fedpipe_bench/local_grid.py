"""A Flower ``Grid`` whose nodes are functions in this process, answered as they are pushed.

``fedpipe bench quality`` runs the ServerApp's rounds (:class:`fedpipe.fl.rounds.FedpipeStrategy`:
the configured strategy, fedpipe's round hooks and round policy) over this grid instead of a
SuperLink: a message pushed to node ``n`` is handed to ``nodes[n]`` at once and its reply is
kept for the pull that follows. Devices therefore train one after another, in the order the
strategy sampled them; no deadline or straggler cut can apply (every reply is in before the
round policy starts to wait).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from uuid import uuid4

from flwr.app import Message, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

__all__ = ["LocalGrid", "Node", "ThreadedGrid"]

Node = Callable[[Message], Message]  # a pushed message -> its reply


class LocalGrid(Grid):
    """Flower's grid over in-process nodes (node id -> the function that answers it)."""

    def __init__(self, nodes: dict[int, Node], *, run_id: int = 1) -> None:
        if SUPERLINK_NODE_ID in nodes:
            raise ValueError(
                f"node id {SUPERLINK_NODE_ID} is the SuperLink's; number devices apart"
            )
        self.nodes = nodes
        self._replies: dict[str, Message] = {}
        self._run = Run.create_empty(run_id=run_id)
        # The identity Flower's runtime gives a ServerApp's process before the app runs (as
        # its compat start_grid does): new messages take their run and sender from it.
        TaskIdentity.task_id = 1
        TaskIdentity.run_id = run_id
        TaskIdentity.node_id = SUPERLINK_NODE_ID

    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        return Message(
            content, dst_node_id=dst_node_id, message_type=message_type, ttl=ttl, group_id=group_id
        )

    def get_node_ids(self) -> Iterable[int]:
        return list(self.nodes)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Answer each message now; its id (as a SuperLink would give it) finds the reply."""
        ids = []
        for msg in messages:
            # Flower's own in-memory grid names a message the same way before storing it.
            msg.metadata.__dict__["_message_id"] = str(uuid4())
            self._replies[msg.metadata.message_id] = self.nodes[msg.metadata.dst_node_id](msg)
            ids.append(msg.metadata.message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self._replies.pop(i) for i in message_ids if i in self._replies]

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        return self.pull_messages(self.push_messages(messages))


class ThreadedGrid(LocalGrid):
    """:class:`LocalGrid` whose nodes answer at once, each in a thread of its own, as devices
    of their own would: a pushed message is computed in its node's thread and its reply is
    there for a later pull (asynchronous rounds need devices that run side by side).

    ``drop`` names nodes that train on their messages but whose replies never come (a device
    killed mid-update, as the ServerApp sees it: its session on the StageServer was trained
    on, no reply arrives); ``twice`` names nodes whose every reply arrives a second time (a
    hostile device).
    """

    def __init__(
        self,
        nodes: dict[int, Node],
        *,
        run_id: int = 1,
        drop: Iterable[int] = (),
        twice: Iterable[int] = (),
    ) -> None:
        super().__init__(nodes, run_id=run_id)
        self.drop, self.twice = set(drop), set(twice)
        self._lock = threading.Lock()
        self._pools = {
            node: ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"node-{node}")
            for node in nodes
        }
        self._running: dict[str, tuple[int, Future[Message]]] = {}
        self.pushed: list[tuple[float, int, str]] = []  # (time.monotonic(), node, message id)
        self.answered: list[tuple[float, int, str]] = []

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = str(uuid4())
            node, msg_id = msg.metadata.dst_node_id, msg.metadata.message_id
            with self._lock:
                self.pushed.append((time.monotonic(), node, msg_id))
            self._running[msg_id] = (node, self._pools[node].submit(self._answer, node, msg))
            ids.append(msg_id)
        return ids

    def _answer(self, node: int, msg: Message) -> Message:
        reply = self.nodes[node](msg)
        with self._lock:
            self.answered.append((time.monotonic(), node, msg.metadata.message_id))
        return reply

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        replies = []
        for msg_id in message_ids:
            node, future = self._running.get(msg_id, (-1, None))
            if future is None or not future.done() or node in self.drop:
                continue
            del self._running[msg_id]
            reply = future.result()  # a node's exception is a bug of the bench's devices
            replies += [reply, reply] if node in self.twice else [reply]
        return replies

    def close(self) -> None:
        """Wait for the nodes' threads (their last messages) and end them."""
        for pool in self._pools.values():
            pool.shutdown(wait=True, cancel_futures=True)
