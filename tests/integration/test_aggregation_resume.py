"""Exact aggregation through the real StageServer, and a resume that carries what it folded.

A round under ``exact`` (and ``stack``) folds base deltas on both sides: the server's GetAdapter
holds them, a checkpoint written by the run folder keeps them, and a fresh StageServer given the
checkpoint evaluates exactly as the first one did. Without them it would not (checked, so the
test can fail).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from fedpipe_bench.quality import QUICK_SIZE, federated_rounds

from fedpipe.config import FedpipeConfig
from fedpipe.fl.device_work import DeviceWork, RunSettings, evaluate_split
from fedpipe.runs.folder import RunFolder
from fedpipe.server.stage_server import StageServer
from fedpipe.wire.control_client import StageControlClient


def _config(mode: str) -> FedpipeConfig:
    settings = {
        **QUICK_SIZE,
        "federated.rounds": 1,
        "federated.num_devices": 2,
        "federated.profiles": "loopback",
        "federated.partition": "by-source",
        "federated.aggregation": mode,
        "train.lr": 1e-2,  # far enough from the init that the residual is visible
    }
    return FedpipeConfig().with_overrides(settings)


def _held_out(cfg: FedpipeConfig, port: int, device: dict, state: dict | None) -> float:
    """Held-out loss through a StageServer at ``port`` after loading ``state`` (None: reset)."""
    control = StageControlClient(f"127.0.0.1:{port}", "")
    try:
        control.load_adapter(state) if state is not None else control.reset_adapter()
        control.begin_round(1, "quality", cfg.federated.aggregation)
        work = DeviceWork(cfg, device_id="evaluator", partition=-1, num_partitions=2)
        return evaluate_split(work, device, RunSettings(stage_address=f"127.0.0.1:{port}"), 1)[0]
    finally:
        control.close()


@pytest.mark.parametrize("mode", ["exact", "stack"])
def test_resume_carries_the_folded_base(
    tmp_path: Path, mode: str, serve: Callable[..., StageServer]
) -> None:
    cfg = _config(mode)
    first, second = serve(cfg), serve(cfg)
    control = StageControlClient(f"127.0.0.1:{first.port}", "")
    try:
        control.reset_adapter()
        row, device = federated_rounds(cfg, first.port, control)
        server = control.get_adapter()
        assert any(k.endswith(".base_delta") for k in server)
        assert any(k.endswith(".base_delta") for k in device)
        folder = RunFolder.open(tmp_path, "run")
        folder.save_checkpoint(1, device=device, server=server, state={"round": 1})
        saved = folder.latest_checkpoint()
        assert saved is not None and set(saved.server) == set(server)
        resumed = _held_out(cfg, second.port, saved.device, saved.server)
        assert resumed == pytest.approx(row["eval_loss"], abs=1e-6)
        without = {k: v for k, v in saved.server.items() if not k.endswith(".base_delta")}
        assert abs(_held_out(cfg, second.port, saved.device, without) - resumed) > 1e-6
    finally:
        control.close()
