"""Every family fedpipe splits trains federated rounds: two devices, two rounds through the
ServerApp's own rounds (:class:`fedpipe.fl.rounds.FedpipeStrategy`: Flower's FedAvg, the reply
checks, the StageServer's counts and commit, held-out evaluation over the stage link), the
devices answering as the ClientApp does (``fedpipe_bench.local_devices``) on a real StageServer
over loopback gRPC, each on a tiny random model of the family saved as a Hugging Face folder
(with tiny-llama's byte tokenizer). The held-out loss falls and both sides' adapters moved.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from fedpipe_bench.families import tiny_family_folder
from fedpipe_bench.local_devices import LocalDevices
from fedpipe_bench.local_grid import LocalGrid
from flwr.app import ArrayRecord, MetricRecord

from fedpipe.config import load_config
from fedpipe.fl.device_work import DeviceWork, RunSettings, evaluate_split
from fedpipe.fl.rounds import FedpipeStrategy
from fedpipe.fl.server_app import seeded_adapters
from fedpipe.models.families import FAMILIES
from fedpipe.server.build import build_stage_server
from fedpipe.wire.control_client import StageControlClient

ROUNDS = 2


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_two_rounds_of_two_devices_lower_the_held_out_loss(tmp_path: Path, model_type: str) -> None:
    folder = tiny_family_folder(tmp_path, model_type)
    cfg = load_config(
        None,
        {
            "model.name": str(folder),
            "model.head_layers": 1,
            "model.tail_layers": 1,
            "train.batch_size": 2,
            "train.seq_len": 32,
            "train.local_steps": 3,
            "train.lr": 1e-2,
            "pipeline.microbatches": 2,
            "federated.num_devices": 2,
            "federated.rounds": ROUNDS,
            "federated.profiles": "loopback",
        },
    )
    server = build_stage_server(cfg, port=0).start()
    control = StageControlClient(server.address, "")
    try:
        control.reset_adapter()
        run = RunSettings(stage_address=server.address, run_id=f"family-{model_type}")
        evaluator = DeviceWork(cfg, device_id="evaluator", partition=-1, num_partitions=2)
        initial = seeded_adapters(cfg, evaluator)
        records: list[dict[str, Any]] = []
        devices = LocalDevices(cfg)
        grid = LocalGrid(devices.nodes())
        hooks = FedpipeStrategy(cfg, control, run, grid, initial=dict(initial), log=records.append)
        evals: dict[int, float] = {}

        def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
            state = arrays.to_torch_state_dict()
            evals[server_round] = evaluate_split(evaluator, state, run, server_round)[0]
            return MetricRecord({"eval_loss": evals[server_round]})

        result = hooks.run(initial, num_rounds=ROUNDS, evaluate_fn=evaluate)
        server_adapter = control.get_adapter()
    finally:
        control.close()
        server.stop(grace=None)
    assert [r for r in records if r["event"] == "failure"] == []
    assert sorted(evals) == list(range(ROUNDS + 1))
    assert evals[ROUNDS] < evals[0], evals
    trains = [r for r in records if r["event"] == "train"]
    assert len(trains) == 2 * ROUNDS  # both devices merged in both rounds
    device = result.arrays.to_torch_state_dict()
    assert any(not torch.equal(device[k], initial[k]) for k in initial)
    assert any(v.abs().sum() > 0 for k, v in server_adapter.items() if "lora_B" in k)
