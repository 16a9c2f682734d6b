"""Toy ClientApp: adds ``increment`` to every array and reports what its node saw."""

from __future__ import annotations

import json
from pathlib import Path

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Add ``increment`` to the arrays; weight the reply by ``10 * (partition-id + 1)``."""
    arrays = msg.content["arrays"].to_numpy_ndarrays()
    increment = float(msg.content["config"]["increment"])
    partition_id = int(context.node_config.get("partition-id", 0))
    _record_node(context, partition_id)
    reply = RecordDict(
        {
            "arrays": ArrayRecord([a + increment for a in arrays]),
            "metrics": MetricRecord(
                {"num-examples": 10 * (partition_id + 1), "partition-id": float(partition_id)}
            ),
        }
    )
    return Message(reply, reply_to=msg)


def _record_node(context: Context, partition_id: int) -> None:
    """Write the node and run config this ClientApp saw, so tests can check the plumbing."""
    out = Path(str(context.run_config["out-dir"]))
    out.mkdir(parents=True, exist_ok=True)
    seen = {"node_config": dict(context.node_config), "run_config": dict(context.run_config)}
    (out / f"node-{partition_id}.json").write_text(json.dumps(seen, indent=2))
