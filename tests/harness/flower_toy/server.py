"""Toy ServerApp: FedAvg over two tiny arrays; writes ``result.json`` into ``out-dir``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run ``num-server-rounds`` FedAvg rounds on every connected node."""
    cfg = context.run_config
    num_nodes = int(cfg["min-nodes"])
    strategy = FedAvg(
        fraction_evaluate=0.0,
        min_train_nodes=num_nodes,
        min_available_nodes=num_nodes,
    )
    initial = ArrayRecord([np.zeros(3, np.float32), np.zeros(1, np.float32)])
    result = strategy.start(
        grid=grid,
        initial_arrays=initial,
        num_rounds=int(cfg["num-server-rounds"]),
        timeout=float(cfg["round-timeout"]),
        train_config=ConfigRecord({"increment": float(cfg["increment"])}),
    )
    summary = {
        "arrays": [a.tolist() for a in result.arrays.to_numpy_ndarrays()],
        "train_metrics": {
            str(rnd): dict(metrics) for rnd, metrics in result.train_metrics_clientapp.items()
        },
        "run_config": dict(cfg),
    }
    out = Path(str(cfg["out-dir"]))
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(summary, indent=2))
