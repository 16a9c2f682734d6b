"""A run whose global adapter passes gRPC's message limits checkpoints and resumes.

Two Flower simulations. Under ``federated.aggregation = exact`` the global adapter
carries dense base deltas as large as the layers they change: on small-llama's middle blocks
6 MiB, past gRPC's default 4 MiB receive limit, and with ``server.max_message_mb = 1`` past the
StageServer's own limit too. Round control moves the adapter in pieces, so the first round
checkpoints both sides and a resumed run loads the server's side back and trains on.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from fedpipe.config import load_config
from fedpipe.launch.run import simulate

LARGE = {
    "model.name": "small-llama",
    "model.head_layers": 1,
    "model.tail_layers": 1,
    "train.local_steps": 1,
    "train.seq_len": 16,
    "train.batch_size": 2,
    "pipeline.microbatches": 1,
    "federated.profiles": "loopback",
    "federated.num_devices": 2,
    "federated.aggregation": "exact",
    "server.max_message_mb": 1,
}


@pytest.mark.timeout(1800)
def test_an_exact_run_past_every_message_limit_checkpoints_and_resumes(tmp_path: Path) -> None:
    first = simulate(
        load_config(None, {**LARGE, "federated.rounds": 1}), name="r", runs_dir=tmp_path
    )
    assert first["ok"], first["problems"]
    server = load_file(str(tmp_path / "r" / "checkpoints" / "round-0001" / "server.safetensors"))
    deltas = sum(v.numel() * 4 for k, v in server.items() if k.endswith(".base_delta"))
    assert deltas > 4 * 2**20  # past gRPC's default receive limit and server.max_message_mb
    resumed = simulate(
        load_config(None, {**LARGE, "federated.rounds": 2}),
        name="r",
        runs_dir=tmp_path,
        resume=True,
        explicit={"federated.rounds"},
    )
    assert resumed["ok"], resumed["problems"]
    assert (tmp_path / "r" / "checkpoints" / "round-0002" / "server.safetensors").is_file()
