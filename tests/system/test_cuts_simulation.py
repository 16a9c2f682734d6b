"""`fedpipe simulate` with two devices on different cuts, end to end.

The server offers cuts 1+1 and 2+1 of the 4-block tiny model; partition 0 runs 1+1 (the
server runs blocks 1..2 for it), partition 1 runs 2+1 (block 2). After round 1 both sides'
global adapters are, per block, the weighted means over the devices that held that block:
a block one device held is that device's own adapter. The summary names each device's cut.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from harness.close import assert_close_to_scale
from harness.stage import stage_server
from safetensors.torch import load_file

from fedpipe.config import FedpipeConfig, load_config
from fedpipe.launch.run import simulate
from fedpipe.lora.aggregation import adapter_block

SETTINGS = {
    "model.name": "tiny-llama",
    "model.cuts": "2+1",
    "federated.device_cuts": "1+1,2+1",
    "federated.num_devices": 2,
    "federated.rounds": 1,
    "federated.profiles": "loopback",
    "train.local_steps": 2,
    "train.seq_len": 32,
    "train.batch_size": 4,
    "pipeline.microbatches": 2,
}


def _replay_round_one(config: FedpipeConfig) -> tuple[dict, dict]:  # type: ignore[type-arg]
    """Each partition's round-1 adapters on both sides, recomputed on a private StageServer
    (training depends only on seed, partition and round)."""
    from fedpipe.fl.device_work import DeviceWork

    device_side, server_side = {}, {}
    with stage_server(config, grace=1.0) as server:
        for p in range(2):
            work = DeviceWork(config, device_id=f"replay-{p}", partition=p, num_partitions=2)
            work.train(server.address, round_=1, token="")
            device_side[p] = work.trainer.adapters()
        sessions = {s.device_id: s.session_id for s in server.runtime.sessions()}
        for p in range(2):
            server_side[p] = server.runtime.bank.state_dict(sessions[f"replay-{p}"])
    return device_side, server_side


def _check_per_block(
    got: dict[str, torch.Tensor], held: dict[int, dict[str, torch.Tensor]], blocks: dict
) -> None:  # type: ignore[type-arg]
    """Each key is the equal-weight mean (8 examples each) of the partitions whose cut ran it."""
    for key, value in got.items():
        if key.endswith(".base_delta"):
            continue
        holders = [p for p in held if adapter_block(key) in blocks[p]]
        assert holders, key
        want = sum(held[p][key] for p in holders) / len(holders)
        assert_close_to_scale(value, want, atol=1e-6, rel=0, msg=key)


def test_two_devices_on_different_cuts_complete_a_round(tmp_path: Path) -> None:
    config = load_config(None, SETTINGS)
    summary = simulate(config, name="cuts", runs_dir=tmp_path)
    assert summary["flower_run"]["status"] == "finished:completed"
    rounds = {entry["round"]: entry for entry in summary["rounds"]}
    assert sorted(rounds) == [0, 1] and math.isfinite(rounds[1]["eval_loss"])
    assert rounds[1]["merged"] == 2 and rounds[1]["devices_trained"] == 2, rounds[1]
    assert summary["cuts"] == {"0": "1+1", "1": "2+1"}

    devices, servers = _replay_round_one(config)
    folder = tmp_path / "cuts" / "checkpoints" / "round-0001"
    device_blocks = {0: {0, 3}, 1: {0, 1, 3}}
    server_blocks = {0: {1, 2}, 1: {2}}
    _check_per_block(load_file(str(folder / "device.safetensors")), devices, device_blocks)
    _check_per_block(load_file(str(folder / "server.safetensors")), servers, server_blocks)
