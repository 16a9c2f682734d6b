"""The train order: what the ServerApp writes is what a device reads, and a device dials the
address its order and its own flags say."""

from __future__ import annotations

import pytest
from flwr.app import ConfigRecord

from fedpipe.errors import InvalidRequestError
from fedpipe.fl.orders import TrainOrder


def test_an_order_reads_back_as_written_beside_the_strategys_keys() -> None:
    order = TrainOrder(7, "10.0.0.2:50051", "v2.tok", replica=1, frozen_below=3)
    config = order.write(ConfigRecord({"proximal-mu": 0.25, "codec": "fp32"}))
    assert config["codec"] == "fp32"  # the strategy's and codecs' keys stay
    assert TrainOrder.read(config) == TrainOrder(
        7, "10.0.0.2:50051", "v2.tok", replica=1, frozen_below=3, proximal_mu=0.25
    )
    plain = TrainOrder.read(TrainOrder(0, "a:1", "").write(ConfigRecord()))
    assert (plain.replica, plain.frozen_below, plain.proximal_mu) == (None, 0, 0.0)


def test_an_order_without_fedpipes_keys_is_refused_naming_them() -> None:
    with pytest.raises(InvalidRequestError, match="lacks fedpipe-round, token"):
        TrainOrder.read(ConfigRecord({"stage-address": "a:1"}))


def test_a_device_dials_its_replica_else_its_own_flag_else_the_servers_address() -> None:
    replicated = TrainOrder(1, "replica-1:50051", "t", replica=1)
    assert replicated.address_for("lan:50051", "fallback:1") == "replica-1:50051"
    single = TrainOrder(1, "server:50051", "t")
    assert single.address_for("lan:50051", "fallback:1") == "lan:50051"
    assert single.address_for("", "fallback:1") == "server:50051"
    assert TrainOrder(1, "", "t").address_for("", "fallback:1") == "fallback:1"
