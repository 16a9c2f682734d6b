"""make_strategy builds the real Flower 1.42 strategies with fedpipe's defaults."""

from __future__ import annotations

import pytest
from flwr.app import ArrayRecord, ConfigRecord
from flwr.serverapp.strategy import FedAdam, FedAvg, FedAvgM, FedProx, FedYogi

from fedpipe.fl.strategies import STRATEGIES, make_strategy


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("fedavg", FedAvg),
        ("FedProx", FedProx),
        ("fedadam", FedAdam),
        ("fedyogi", FedYogi),
        ("fedavgm", FedAvgM),
    ],
)
def test_builds_each_strategy(name: str, cls: type) -> None:
    strategy = make_strategy(name, min_train_nodes=2, min_available_nodes=3)
    assert type(strategy) is cls
    assert (strategy.min_train_nodes, strategy.min_available_nodes) == (2, 3)
    assert strategy.fraction_evaluate == 0.0


def test_unknown_name_lists_choices() -> None:
    with pytest.raises(ValueError, match="fedavg, fedprox"):
        make_strategy("fedsgd")


def test_fedprox_sends_proximal_mu_in_train_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """FedProx's only client-facing change: ``proximal-mu`` in the train ConfigRecord."""
    seen: list[ConfigRecord] = []
    # FedAvg.configure_train samples nodes from a live grid; record its config instead.
    monkeypatch.setattr(
        FedAvg, "configure_train", lambda self, rnd, arrays, config, grid: seen.append(config) or []
    )
    make_strategy("fedprox", proximal_mu=0.3).configure_train(
        1, ArrayRecord(), ConfigRecord(), None
    )  # type: ignore[arg-type]
    assert seen[0]["proximal-mu"] == 0.3


def test_server_lr_maps_to_each_strategy_argument() -> None:
    assert make_strategy("fedadam", server_lr=0.05).eta == 0.05
    assert make_strategy("fedyogi", server_lr=0.02).eta == 0.02
    assert make_strategy("fedavgm", server_lr=0.5, server_momentum=0.9).server_learning_rate == 0.5
    with pytest.raises(ValueError, match="no server learning rate"):
        make_strategy("fedavg", server_lr=0.1)


def test_bad_options_and_sampling_are_rejected() -> None:
    with pytest.raises(ValueError, match="bad option"):
        make_strategy("fedavg", not_an_option=1)
    with pytest.raises(ValueError, match="fraction_train"):
        make_strategy("fedavg", fraction_train=0.0)
    with pytest.raises(ValueError, match="min_available_nodes"):
        make_strategy("fedavg", min_train_nodes=4, min_available_nodes=2)


def test_registry_names_are_lowercase() -> None:
    assert all(name == name.lower() for name in STRATEGIES)
