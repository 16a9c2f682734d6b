"""One device's round, as a train message and its reply: the ClientApp's and the benches'.

The round's order (:class:`~fedpipe.fl.orders.TrainOrder`) and global adapters come in the
message; the device loads the adapters, runs its local steps over the stage link with the
order's token (FedProx's ``proximal-mu`` under ``fedprox``, the order's frozen blocks under
``pipeline.freeze``) and answers with its adapters and a
:class:`~fedpipe.fl.replies.TrainReply`. Where the device runs (a Flower ClientApp, or the
benches' in-process devices) decides only the address it dials and where traces go.
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

from flwr.app import ArrayRecord, ConfigRecord, Message

from fedpipe.config import format_cut
from fedpipe.edge.trainer import TrainReport
from fedpipe.fl.device_work import DeviceWork
from fedpipe.fl.orders import TrainOrder
from fedpipe.fl.replies import TrainReply

__all__ = ["train_round"]


def train_round(
    work: DeviceWork,
    msg: Message,
    *,
    device_address: str = "",
    fallback_address: str = "",
    trace_dir: Path | None = None,
) -> tuple[Message, TrainReport]:
    """``work``'s round for the train message ``msg``: the reply, and what the device did.

    ``device_address`` is the device's own ``--stage-address`` (the StageServer as its network
    sees it), ``fallback_address`` the run's; the order's replica, when it names one, wins
    (:meth:`TrainOrder.address_for`).
    """
    order = TrainOrder.read(cast(ConfigRecord, msg.content["config"]))
    work.trainer.load_adapters(cast(ArrayRecord, msg.content["arrays"]).to_torch_state_dict())
    fedprox = work.cfg.federated.strategy == "fedprox"
    report = work.train(
        order.address_for(device_address, fallback_address),
        round_=order.round,
        token=order.token,
        proximal_mu=order.proximal_mu if fedprox else 0.0,
        trace_dir=trace_dir,
        frozen_below=order.frozen_below,
    )
    reply = TrainReply.of(
        report, work.partition, format_cut(work.trainer.cut), weights=work.trainer.weights
    )
    content = reply.write(work.trainer.adapters())
    return Message(content=content, reply_to=msg), report
