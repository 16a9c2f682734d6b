"""fedpipe's ClientApp: each train message is one device's round of split training.

The device opens a session on the StageServer with the round's token, runs its local steps
as pipelined split training (:class:`~fedpipe.fl.device_work.DeviceWork`), and replies with
its adapters and metrics.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from fedpipe.config.flower_keys import NodeSettings
from fedpipe.fl.adapter_codec import adapter_codec_mod
from fedpipe.fl.adapter_dp import adapter_clipping_mod
from fedpipe.fl.device_round import train_round
from fedpipe.fl.device_work import DeviceWork, RunSettings, partition_profile, run_settings
from fedpipe.fl.replies import TrainReply

__all__ = ["client_app"]

log = logging.getLogger(__name__)

# Outermost first: adapters decoded (and the update encoded) only if the round names a codec,
# clipped only if the round asks.
client_app = ClientApp(mods=[adapter_codec_mod, adapter_clipping_mod])


_TrainFn = Callable[[Message, Context], Message]
# The profile a device is named by when the run's settings are refused (the error says why).
REFUSED = "settings refused"


def _device_profile_name(context: Context) -> tuple[int, str]:
    """This node's partition and profile name, as DeviceWork picks them: its own
    ``--profile``, else the run's ``federated.profiles`` dealt in turn, read from the typed
    settings (:func:`run_settings`: built once per run config, as the round builds them)."""
    node = NodeSettings.from_node_config(context.node_config)
    if node.profile:
        return node.partition_id, node.profile
    try:
        cfg, _ = run_settings(context.run_config)
    except ValueError:  # refused again, in full, when the round builds the device's settings
        return node.partition_id, REFUSED
    return node.partition_id, partition_profile(cfg.federated.profiles, node.partition_id)


def _says_who(train: _TrainFn) -> _TrainFn:
    """Name the device in its reply and in its errors, so the ServerApp can report them.

    Flower turns an exception into an error reply whose reason is the exception's text, and
    in deployment the SuperLink (not the device) answers for a node that vanished; the
    ``[partition P (profile)]`` prefix and the reply's ``device`` ConfigRecord tell the
    ServerApp which device it was.
    """

    def wrapped(msg: Message, context: Context) -> Message:
        partition, profile = _device_profile_name(context)
        try:
            reply = train(msg, context)
        except Exception as exc:
            raise RuntimeError(
                f"[partition {partition} ({profile})] {type(exc).__name__}: {exc}"
            ) from exc
        TrainReply.read(reply.content).named(profile).write_into(reply.content)
        return reply

    return wrapped


def _delta_dir(node: NodeSettings | Mapping[str, Any], run: RunSettings) -> str:
    """Where the device keeps its delta cache between rounds (each may be a new process).

    The node's ``delta-dir``; else the run folder's ``delta-cache`` where that folder is on
    this host (simulations); else its SuperNode's home (``FLWR_HOME``: `fedpipe client
    --workdir`, which lives as long as the device's process); else memory only ("").
    """
    if not isinstance(node, NodeSettings):
        node = NodeSettings.from_node_config(node)
    if node.delta_dir:
        return node.delta_dir
    if run.dir and Path(run.dir).is_dir():
        return str(Path(run.dir) / "delta-cache")
    home = os.environ.get("FLWR_HOME", "")
    return str(Path(home) / "fedpipe-delta-cache") if home else ""


@client_app.train()
@_says_who
def client_train(msg: Message, context: Context) -> Message:
    cfg, run = run_settings(context.run_config)  # built once per run, not per call
    node = NodeSettings.from_node_config(context.node_config)
    work = DeviceWork.cached(
        cfg,
        device_id=str(context.node_id),
        partition=node.partition_id,
        num_partitions=node.num_partitions or cfg.federated.num_devices,
        profile=node.profile or None,
        data=node.data or None,
        stage_ca=node.stage_ca,
        stage_cert=node.stage_cert,
        stage_key=node.stage_key,
        cut=node.cut,  # `fedpipe client --cut`; else federated.device_cuts
        delta_dir=_delta_dir(node, run),
        privacy=node.privacy,  # `fedpipe client --privacy`; else privacy.devices
        weights=node.weights,  # `fedpipe client --weights`; else device.weights
    )
    reply, _ = train_round(
        work,
        msg,
        device_address=node.stage_address,
        fallback_address=run.stage_address,
        trace_dir=Path(run.dir) / "traces" if run.dir else None,
    )
    return reply
