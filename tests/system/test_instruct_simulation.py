"""`fedpipe simulate` on a chats JSONL (Flower's simulation engine, tiny-llama): the devices
train on masked rows, the held-out loss is the answer loss, summary.json holds each device's
example counts, and with federated.eval_generate each round's record scores greedy answers."""

from __future__ import annotations

import json
import math
from pathlib import Path

from harness.processes import assert_no_flower_under

from fedpipe.config import load_config
from fedpipe.launch.run import simulate


def _chats(path: Path, n: int = 40) -> Path:
    lines = []
    for i in range(n):
        chat = [
            {"role": "user", "content": f"What comes after {i}?" + " Think." * (i % 7 == 0) * 20},
            {"role": "assistant", "content": f"{i + 1}."},
        ]
        lines.append(json.dumps({"messages": chat}))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_simulate_on_chats_trains_on_the_answers(tmp_path: Path) -> None:
    config = load_config(
        None,
        {
            "model.name": "tiny-llama",
            "train.local_steps": 2,
            "train.seq_len": 64,
            "train.batch_size": 4,
            "pipeline.microbatches": 2,
            "federated.profiles": "loopback",
            "federated.num_devices": 2,
            "federated.rounds": 1,
            "federated.partition": "iid",
            "federated.data": str(_chats(tmp_path / "chats.jsonl")),
            "federated.eval_generate": 2,
        },
    )
    summary = simulate(config, name="chats", runs_dir=tmp_path / "runs", progress=False)
    assert_no_flower_under(tmp_path / "runs")
    assert summary["ok"], summary
    written = json.loads((tmp_path / "runs" / "chats" / "summary.json").read_text())
    examples = written["examples"]
    assert sorted(examples) == ["0", "1"]
    assert sum(e["rows"] for e in examples.values()) == 36  # 40 chats, 4 held out
    assert sum(e["truncated"] for e in examples.values()) > 0  # the long prompts, cut to 64
    losses = [r["eval_loss"] for r in written["rounds"]]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)
    for record in written["rounds"]:  # round 0: the base model; round 1: its checkpoint
        assert 0.0 <= record["eval_exact_match"] <= record["eval_contains"] <= 1.0, record
    lines = (tmp_path / "runs" / "chats" / "metrics.jsonl").read_text().splitlines()
    evals = [json.loads(line) for line in lines if '"event": "eval"' in line]
    assert [e["eval_answered"] for e in evals] == [2, 2]
