"""Build a Flower strategy (``flwr.serverapp.strategy``, Flower 1.42 API) by name.

Client-side contracts, checked in the installed Flower source:
- every strategy sends ``server-round`` in the train ConfigRecord and weights replies by
  ``num-examples`` (one ArrayRecord ``arrays`` and one MetricRecord per reply);
- ``fedprox`` only adds ``proximal-mu`` to that ConfigRecord; the ClientApp must add
  ``mu / 2 * ||w - w_global||^2`` to its loss itself (server side it is FedAvg);
- ``fedadam``/``fedyogi``/``fedadagrad`` apply a server-side optimizer with step
  ``eta`` (``server_lr``) to the averaged update; their ``eta_l`` is never sent to clients;
- ``fedavgm`` applies server momentum with ``server_learning_rate`` (``server_lr``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flwr.serverapp.strategy import (
    FedAdagrad,
    FedAdam,
    FedAvg,
    FedAvgM,
    FedMedian,
    FedProx,
    FedTrimmedAvg,
    FedYogi,
    Krum,
    MultiKrum,
)

from fedpipe.config import FederatedConfig
from fedpipe.lora.robust import AggregationRule

__all__ = ["STATEFUL", "STRATEGIES", "aggregation_rule", "make_strategy", "robust_options"]

# name -> (class, name of its server learning-rate argument, or None)
STRATEGIES: dict[str, tuple[Callable[..., FedAvg], str | None]] = {
    "fedavg": (FedAvg, None),
    "fedprox": (FedProx, None),
    "fedavgm": (FedAvgM, "server_learning_rate"),
    "fedadam": (FedAdam, "eta"),
    "fedyogi": (FedYogi, "eta"),
    "fedadagrad": (FedAdagrad, "eta"),
    # Robust to a hostile minority: per element, or by choosing the updates nearest the others.
    "fedmedian": (FedMedian, None),
    "fedtrimmedavg": (FedTrimmedAvg, None),
    "krum": (Krum, None),
    "multikrum": (MultiKrum, None),
}
# Strategies that keep state across rounds over the whole adapter (momentum, moments).
STATEFUL = frozenset({"fedavgm", "fedadam", "fedyogi", "fedadagrad"})
_RULES = {
    "fedmedian": "median",
    "fedtrimmedavg": "trimmed",
    "krum": "krum",
    "multikrum": "multikrum",
}


def aggregation_rule(fed: FederatedConfig) -> AggregationRule:
    """The rule the StageServer merges its adapters by: the device strategy's own."""
    return AggregationRule(
        _RULES.get(fed.strategy.strip().lower(), "mean"),
        beta=fed.trim_beta,
        malicious=fed.malicious_devices,
        select=fed.krum_select,
        norm_bound=fed.update_norm_bound,
    )


def robust_options(fed: FederatedConfig) -> dict[str, Any]:
    """The constructor options the configured robust strategy takes (none for the others)."""
    name = fed.strategy.strip().lower()
    if name == "fedtrimmedavg":
        return {"beta": fed.trim_beta}
    if name == "krum":
        return {"num_malicious_nodes": fed.malicious_devices}
    if name == "multikrum":
        return {
            "num_malicious_nodes": fed.malicious_devices,
            "num_nodes_to_select": fed.krum_select,
        }
    return {}


def make_strategy(
    name: str,
    *,
    fraction_train: float = 1.0,
    fraction_evaluate: float = 0.0,
    min_train_nodes: int = 1,
    min_evaluate_nodes: int = 1,
    min_available_nodes: int = 1,
    proximal_mu: float = 0.01,
    server_lr: float | None = None,
    **kw: Any,
) -> FedAvg:
    """Construct strategy ``name`` with fedpipe's sampling defaults.

    fedpipe evaluates centrally (``evaluate_fn``), so ``fraction_evaluate`` defaults to 0
    (Flower's default of 1.0 would send an evaluate message every ClientApp must handle).
    ``proximal_mu`` is used by ``fedprox`` only; ``server_lr`` by the server-optimizer
    strategies only (None keeps Flower's default). Other keywords go to the constructor
    (e.g. ``server_momentum``, ``beta_1``, ``tau``, ``weighted_by_key``).
    """
    key = name.strip().lower()
    if key not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; choose one of: {', '.join(STRATEGIES)}")
    _check_sampling(fraction_train, min_train_nodes, min_available_nodes)
    cls, lr_arg = STRATEGIES[key]
    args: dict[str, Any] = {
        "fraction_train": fraction_train,
        "fraction_evaluate": fraction_evaluate,
        "min_train_nodes": min_train_nodes,
        "min_evaluate_nodes": min_evaluate_nodes,
        "min_available_nodes": min_available_nodes,
    }
    if key == "fedprox":
        args["proximal_mu"] = proximal_mu
    if server_lr is not None:
        if lr_arg is None:
            raise ValueError(f"strategy {key!r} has no server learning rate; drop server_lr")
        args[lr_arg] = server_lr
    try:
        return cls(**args, **kw)
    except TypeError as err:
        raise ValueError(f"bad option for strategy {key!r}: {err}") from err


def _check_sampling(fraction_train: float, min_train_nodes: int, min_available: int) -> None:
    if not 0.0 < fraction_train <= 1.0:
        raise ValueError(f"fraction_train must be in (0, 1], got {fraction_train}")
    if min_train_nodes < 1 or min_available < min_train_nodes:
        raise ValueError(
            f"need 1 <= min_train_nodes ({min_train_nodes}) <= "
            f"min_available_nodes ({min_available})"
        )
