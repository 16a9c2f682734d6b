"""What the ServerApp's train order tells a device, as one typed record.

A train order is a Flower ``ConfigRecord`` (beside the adapters' ``ArrayRecord``). The
configured strategy writes its own keys there (FedProx's ``proximal-mu``), the adapter codecs
theirs (:class:`fedpipe.fl.adapter_codec.AdapterCodecs`), and fedpipe these: the round as the
run counts it, the stage link's address and the device's session token for it, the replica
that serves the device (when the StageServer is replicated), and the blocks frozen this round.
:class:`TrainOrder` writes them (the ServerApp) and reads them back (the ClientApp and the
benches' in-process devices), so a key is spelt in one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from flwr.app import ConfigRecord

from fedpipe.errors import InvalidRequestError

__all__ = ["TrainOrder"]

_ROUND, _ADDRESS, _TOKEN = "fedpipe-round", "stage-address", "token"
_REPLICA, _FROZEN, _MU = "stage-replica", "fedpipe-frozen-below", "proximal-mu"


@dataclass(frozen=True)
class TrainOrder:
    """One device's orders for one round (``round`` is the run's, resumed rounds included).

    ``stage_address`` is the StageServer (or replica) the ServerApp knows; ``replica`` names
    the replica it assigned (None: not replicated). ``token`` is empty on an unauthenticated
    StageServer. ``proximal_mu`` is FedProx's, 0 for other strategies.
    """

    round: int
    stage_address: str
    token: str
    replica: int | None = None
    frozen_below: int = 0
    proximal_mu: float = 0.0

    def write(self, config: ConfigRecord) -> ConfigRecord:
        """``config`` (the strategy's record) with this order's keys set; returned."""
        config[_ROUND] = self.round
        config[_ADDRESS] = self.stage_address
        config[_TOKEN] = self.token
        if self.replica is not None:
            config[_REPLICA] = self.replica
        if self.frozen_below:
            config[_FROZEN] = self.frozen_below
        return config

    @classmethod
    def read(cls, config: ConfigRecord) -> TrainOrder:
        """The order in a train message's ``config``; a missing key is one line naming it."""
        missing = [key for key in (_ROUND, _ADDRESS, _TOKEN) if key not in config]
        if missing:
            raise InvalidRequestError(
                f"the train order lacks {', '.join(missing)}: it was not sent by fedpipe's "
                "ServerApp (or by one of another fedpipe version)"
            )
        replica = config.get(_REPLICA)
        return cls(
            round=int(cast(int, config[_ROUND])),
            stage_address=str(config[_ADDRESS]),
            token=str(config[_TOKEN]),
            replica=None if replica is None else int(cast(int, replica)),
            frozen_below=int(cast(int, config.get(_FROZEN, 0))),
            proximal_mu=float(cast(float, config.get(_MU, 0.0))),
        )

    def address_for(self, device_flag: str, fallback: str) -> str:
        """The address a device dials: its replica's when it has one (its token is valid there
        only), else the device's own ``--stage-address`` (the server as its network sees it),
        else the ServerApp's, else ``fallback``."""
        if self.replica is not None:
            return self.stage_address
        return device_flag or self.stage_address or fallback
