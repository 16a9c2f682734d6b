"""The quality bench's devices: this process's DeviceWorks, answering the ServerApp's messages.

Each node answers a train message as fedpipe's ClientApp does (:mod:`fedpipe.fl.client_app`):
the ClientApp's mods first, outermost first (the adapter codec's, when
``federated.adapter_codec`` or ``adapter_downlink_codec`` is not fp32: the global adapters
decoded and the device's update encoded, its residuals kept in the node's ``context.state``
across rounds as Flower keeps it; then Flower's client-side clipping, when
``privacy.adapter_dp = client`` puts a clipping norm in the round's config), then the
ClientApp's own device round (:func:`fedpipe.fl.device_round.train_round`). A node's device id
is its node id, as a Flower node's is, so the ServerApp's commit names the sessions it trained
on the StageServer. Left out, as a simulation's devices do not use them: a device's own data
and TLS files, test fault injection, and a delta cache kept on disk (each device's stays in
memory for the run, as its DeviceWork does).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from functools import partial
from typing import cast

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

from fedpipe.config import FedpipeConfig
from fedpipe.edge.trainer import TrainReport
from fedpipe.fl.adapter_codec import adapter_codec_mod, adapter_nbytes
from fedpipe.fl.adapter_dp import adapter_clipping_mod
from fedpipe.fl.device_round import train_round
from fedpipe.fl.device_work import DeviceWork
from fedpipe.fl.orders import TrainOrder
from fedpipe_bench.local_grid import Node

__all__ = ["FIRST_NODE", "LocalDevices", "Traffic"]

FIRST_NODE = 1001  # device i is node FIRST_NODE + i (Flower's SuperLink is node 1)


@dataclass
class Traffic:
    """What a federated run moved: stage-link bytes, Flower-side adapter bytes (as they travel:
    encoded, with an adapter codec), tokens."""

    up: int = 0
    down: int = 0
    adapters_up: int = 0
    adapters_down: int = 0
    tokens: int = 0


class LocalDevices:
    """``federated.num_devices`` devices (partitions 0..N-1) and their tallies."""

    def __init__(self, cfg: FedpipeConfig) -> None:
        fed = cfg.federated
        self.cfg = cfg
        nodes = {FIRST_NODE + i: i for i in range(fed.num_devices)}
        self.works = {
            node: DeviceWork(cfg, device_id=str(node), partition=i, num_partitions=fed.num_devices)
            for node, i in nodes.items()
        }
        self.reports: dict[int, list[TrainReport]] = {}  # by round, in the order they trained
        self.traffic = Traffic()
        self._lock = threading.Lock()  # the tallies, when nodes answer in threads (ThreadedGrid)
        # Flower's per-node state across a run's rounds (the adapter codec's residuals)
        self.contexts = {
            node: Context(run_id=0, node_id=node, node_config={}, state=RecordDict(), run_config={})
            for node in self.works
        }

    def nodes(self) -> dict[int, Node]:
        """Node id -> the function that answers its messages (for :class:`LocalGrid`)."""
        return {node: partial(self._answer, node) for node in self.works}

    def _answer(self, node: int, msg: Message) -> Message:
        down = adapter_nbytes(cast(ArrayRecord, msg.content["arrays"]))
        reply = adapter_codec_mod(
            msg,
            self.contexts[node],
            lambda m, c: adapter_clipping_mod(m, c, lambda m2, _: self._train(node, m2)),
        )
        if not reply.has_error():
            up = adapter_nbytes(cast(ArrayRecord, reply.content["arrays"]))
            with self._lock:
                self.traffic.adapters_down += down
                self.traffic.adapters_up += up
        return reply

    def _train(self, node: int, msg: Message) -> Message:
        reply, report = train_round(self.works[node], msg)
        self._count(TrainOrder.read(cast(ConfigRecord, msg.content["config"])).round, report)
        return reply

    def _count(self, round_: int, report: TrainReport) -> None:
        """A device's round: its stage-link bytes and tokens."""
        with self._lock:
            self.reports.setdefault(round_, []).append(report)
            self.traffic.up += report.bytes_up
            self.traffic.down += report.bytes_down
            self.traffic.tokens += sum(s.tokens for s in report.steps)
