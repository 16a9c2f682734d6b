"""Faults injected into fedpipe's own ClientApp: a device that dies mid-round, one that goes silent.

The product carries no fault hooks. A simulation picks this module's ``client_app``
(``simulate(..., client_app=CLIENT_APP)``): a ClientApp whose train function is fedpipe's
ClientApp itself, wrapped in a Flower mod that injects the faults that the test wrote into
the environment (:func:`faults_env`), which the simulation's processes inherit:

- ``kill`` ``(partition, round)``: that device drops its stage-link stream after one step and
  fails with :class:`DeviceFailure`, as a device that vanishes mid-round would;
- ``hang`` ``(partition, round, seconds)``: that device stops answering for so long before
  it trains.

:func:`device_dies_after` is the same death for a device a test drives in its own process.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast
from unittest import mock

from flwr.app import ConfigRecord, Context, Message
from flwr.clientapp import ClientApp

from fedpipe.edge.trainer import DeviceTrainer
from fedpipe.fl.client_app import client_app as fedpipe_client_app

__all__ = [
    "CLIENT_APP",
    "DeviceFailure",
    "Faults",
    "client_app",
    "device_dies_after",
    "injected",
]

log = logging.getLogger(__name__)

CLIENT_APP = "harness.faults:client_app"
FAULTS_ENV = "FEDPIPE_TEST_FAULTS"


class DeviceFailure(RuntimeError):
    """A device that stopped mid-round (injected)."""


@dataclass(frozen=True)
class Faults:
    """Which device fails in which round, and how."""

    kill: tuple[tuple[int, int], ...] = ()  # (partition, round)
    hang: tuple[tuple[int, int, float], ...] = ()  # (partition, round, seconds)

    def env(self) -> dict[str, str]:
        """The environment variable that carries these faults to the ClientApp processes."""
        return {FAULTS_ENV: json.dumps({"kill": self.kill, "hang": self.hang})}

    @classmethod
    def from_env(cls) -> Faults:
        raw = json.loads(os.environ.get(FAULTS_ENV, "{}"))
        return cls(
            kill=tuple((int(p), int(r)) for p, r in raw.get("kill", ())),
            hang=tuple((int(p), int(r), float(s)) for p, r, s in raw.get("hang", ())),
        )


@contextmanager
def injected(faults: Faults) -> Iterator[str]:
    """Simulations started in the block inject ``faults``; yields the ClientApp to run there.

    ``simulate(..., client_app=app)``: the faults travel in this process's environment, which
    the simulation's processes (SuperLink, Ray workers) inherit.
    """
    with mock.patch.dict(os.environ, faults.env()):
        yield CLIENT_APP


@contextmanager
def device_dies_after(steps: int) -> Iterator[None]:
    """Every device that trains inside the block vanishes after ``steps`` steps of its round.

    Before step ``steps`` it aborts its session (the stream breaks, as when a device dies) and
    raises :class:`DeviceFailure`; the steps before it ran as usual.
    """
    connect = DeviceTrainer.connect

    def connect_then_die(trainer: DeviceTrainer, *args: Any, **kwargs: Any) -> Any:
        session, runtime = connect(trainer, *args, **kwargs)
        train_step, round_ = runtime.train_step, kwargs.get("round_", 0)

        def step_or_die(batch: Any, *, step: int) -> Any:
            if step >= steps:
                session.abort()
                raise DeviceFailure(
                    f"device {trainer.device_id} vanished in round {round_} (injected)"
                )
            return train_step(batch, step=step)

        runtime.train_step = step_or_die  # type: ignore[method-assign]
        return session, runtime

    with mock.patch.object(DeviceTrainer, "connect", connect_then_die):
        yield


def _inject(msg: Message, context: Context, call_next: Any) -> Message:
    """A Flower mod: this device's faults for this round, then the app it wraps."""
    faults = Faults.from_env()
    partition = int(cast(int, context.node_config.get("partition-id", 0)))
    config = cast(ConfigRecord, msg.content["config"])
    round_ = int(cast(int, config.get("fedpipe-round", -1)))
    for p, r, seconds in faults.hang:
        if (p, r) == (partition, round_):
            log.warning("[partition %d] hanging in round %d (injected)", partition, round_)
            time.sleep(seconds)
    if (partition, round_) in faults.kill:
        with device_dies_after(1):
            return cast(Message, call_next(msg, context))
    return cast(Message, call_next(msg, context))


client_app = ClientApp(mods=[_inject])


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    """fedpipe's ClientApp, mods and all."""
    return fedpipe_client_app(msg, context)
