"""`fedpipe simulate` with devices storing their frozen weights differently (device.weights
"int4,fp32" dealt over two devices): the round completes against the unchanged StageServer,
and the run's train records and summary.json name each device's storage."""

from __future__ import annotations

import json
import math
from pathlib import Path

from fedpipe.config import load_config
from fedpipe.launch.run import simulate

SETTINGS = {
    "model.name": "tiny-llama",
    "device.weights": "int4,fp32",
    "federated.num_devices": 2,
    "federated.rounds": 1,
    "federated.profiles": "loopback",
    "train.local_steps": 2,
    "train.seq_len": 32,
    "train.batch_size": 4,
    "pipeline.microbatches": 2,
}


def test_devices_storing_int4_and_fp32_complete_a_round(tmp_path: Path) -> None:
    summary = simulate(load_config(None, SETTINGS), name="weights", runs_dir=tmp_path)
    assert summary["flower_run"]["status"] == "finished:completed"
    rounds = {entry["round"]: entry for entry in summary["rounds"]}
    assert rounds[1]["merged"] == 2 and rounds[1]["devices_trained"] == 2, rounds[1]
    assert math.isfinite(rounds[1]["eval_loss"])
    assert summary["weights"] == {"0": "int4", "1": "fp32"}
    assert rounds[1]["weights"] == {"0": "int4", "1": "fp32"}
    records = [json.loads(line) for line in (tmp_path / "weights" / "metrics.jsonl").open()]
    trained = {r["partition"]: r["weights"] for r in records if r.get("event") == "train"}
    assert trained == {0: "int4", 1: "fp32"}
