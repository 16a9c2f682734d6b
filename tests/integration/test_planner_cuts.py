"""``pipeline.plan = "auto"`` picks a cut among those the StageServer offers.

A device ten times slower than the server, on a near link, starts on cut 2+1 of the 4-block
tiny model; the server offers 1+1 and 2+1. Its first plan measures one head block and prices
every offered cut with the bound's model: the fewest device blocks win, the report says so,
and the next round's adapters load into stages built for 1+1, whose session then trains.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from harness.batches import random_batches
from harness.stage import stage_server

from fedpipe.config import FedpipeConfig, ModelConfig, PipelineConfig, TrainConfig
from fedpipe.edge.trainer import DeviceTrainer, initial_device_adapters
from fedpipe.emulation import DeviceProfile, LinkProfile
from fedpipe.models import resolve_model
from fedpipe.wire.link_client import StageClient

BATCH, SEQ = 4, 16
CONFIG = FedpipeConfig(
    model=ModelConfig(head_layers=2, tail_layers=1, cuts="1+1"),
    pipeline=PipelineConfig(microbatches=2, plan="auto", timeout_s=60.0),
    train=TrainConfig(batch_size=BATCH, seq_len=SEQ, lr=1e-2),
)


def _batches(seed: int) -> list[dict[str, torch.Tensor]]:
    return random_batches(3, BATCH, SEQ, seed=seed)


def test_a_slow_device_moves_to_the_cut_with_fewer_device_blocks() -> None:
    folder = resolve_model("tiny-llama")
    slow = DeviceProfile("slow", LinkProfile("near", 1000.0, 1000.0, rtt_s=0.001), 10.0)
    with stage_server(CONFIG, folder=folder) as server:
        trainer = DeviceTrainer(CONFIG, device_id="slow", folder=folder, profile=slow)
        state = initial_device_adapters(CONFIG, folder)
        trainer.load_adapters(state)
        with StageClient(server.address) as client:
            first = trainer.train_round(client, _batches(0), round_=0)
        assert first.plan["cut"] == "u:2+1"
        assert "u:1+1" in str(first.plan["next"]), first.plan
        assert trainer.cut == (2, 1), "the cut changes with the next round's adapters"
        trainer.load_adapters(state)
        assert trainer.cut == (1, 1) and trainer.layout.head_layers == 1
        with StageClient(server.address) as client:
            second = trainer.train_round(client, _batches(1), round_=1)
        assert all(math.isfinite(s.loss) for s in second.steps)
        assert second.plan["cut"] == "u:1+1"
        assert set(trainer.adapters()) < set(state)  # its blocks' adapters, of the union


def test_the_chosen_cut_outlives_the_process_that_chose_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A deployed device runs each round in a new process: the cut its planner chose in round
    0 must still apply in round 1's process, not only in the process that chose it."""
    folder = resolve_model("tiny-llama")
    slow = DeviceProfile("slow", LinkProfile("near", 1000.0, 1000.0, rtt_s=0.001), 10.0)
    path = tmp_path / "slow.cut.json"
    with stage_server(CONFIG, folder=folder) as server:
        first = DeviceTrainer(CONFIG, device_id="slow", folder=folder, profile=slow)
        first.cut_path = path
        state = initial_device_adapters(CONFIG, folder)
        first.load_adapters(state)
        with StageClient(server.address) as client:
            first.train_round(client, _batches(0), round_=0)
        assert json.loads(path.read_text())["cut"] == [1, 1]
        assert path.stat().st_mode & 0o077 == 0  # owner-only
        del first  # round 0's process ends
        second = DeviceTrainer(CONFIG, device_id="slow", folder=folder, profile=slow)
        second.cut_path = path
        second.recall_cut()
        assert second.cut == (2, 1)  # built at the configured cut ...
        second.load_adapters(state)
        assert second.cut == (1, 1)  # ... and round 1's adapters load at the chosen one
        with StageClient(server.address) as client:
            report = second.train_round(client, _batches(1), round_=1)
        assert report.plan["cut"] == "u:1+1"
    # A record for other offered cuts, or one that does not parse, is not taken up.
    for text in ('{"model": "tiny-llama", "cuts": [[2, 2]], "cut": [2, 2]}', "{not json"):
        path.write_text(text)
        other = DeviceTrainer(CONFIG, device_id="slow", folder=folder, profile=slow)
        other.cut_path = path
        with caplog.at_level("INFO", logger="fedpipe.edge.trainer"):
            other.recall_cut()
        assert other.planner is not None and other.planner.next_cut is None
    assert "ignoring" in caplog.text and "another run's cuts" in caplog.text


@pytest.mark.parametrize("slow_server", [False, True])
def test_figures_for_cut_move_compute_between_the_sides(slow_server: bool) -> None:
    from fedpipe.edge.planner.plan import (
        LinkFigures,
        Measured,
        OpTimes,
        Options,
        figures_for_cut,
        plan_step,
    )

    server = 0.5 if slow_server else 0.001  # seconds per block per row
    figures = Measured(
        batch_size=4,
        device={b: OpTimes(0.01 * b, 0.02 * b, 0.01 * b) for b in (1, 2, 4)},
        server={b: (2 * server * b, 4 * server * b) for b in (1, 2, 4)},  # 2 server blocks
        link=LinkFigures(0.001, 1000.0, 1000.0),
        message_bytes={("fp32", b): 1000 * b for b in (1, 2, 4)},
        stash_bytes={b: 100 * b for b in (1, 2, 4)},
    )
    block = {b: (0.01 * b, 0.02 * b) for b in (1, 2, 4)}
    cuts = {"u:1+1": (1, 1), "u:2+1": (2, 1), "u:1+2": (1, 2)}
    per_cut = {
        name: figures_for_cut(
            figures, current=(1, 1), cut=cut, num_layers=4, block=block, memory_budget_bytes=0
        )
        for name, cut in cuts.items()
    }
    moved = per_cut["u:2+1"]
    assert moved.device[2].head_forward == pytest.approx(0.02 + 0.02)
    assert moved.device[2].tail == pytest.approx(0.04)
    assert moved.server[2] == pytest.approx((server * 2, server * 4)), "half the blocks"
    plan = plan_step(per_cut, Options(microbatches=(1, 2, 4)))
    if slow_server:  # a block moved to the device (to its head or its tail) pays
        assert plan.cut in ("u:2+1", "u:1+2")
    else:
        assert plan.cut == "u:1+1"
    # The cap: one live microbatch of 4 rows stashes 400 bytes at 1+1, 600 with two head blocks.
    tight = {n: replace(f, memory_budget_bytes=400) for n, f in per_cut.items()}
    assert plan_step(tight, Options(microbatches=(1,))).cut != "u:2+1"
