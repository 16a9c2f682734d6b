"""pipeline.freeze across StageServer replicas, over real loopback gRPC: BeginRound carries the
round's frozen blocks to every replica, each replica's collected part leaves them out, and the
merged server adapter keeps them bit for bit while it equals one StageServer's commit of the
same devices (tiny-llama: the server holds blocks 1 and 2; block 1 frozen here)."""

from __future__ import annotations

import torch
from harness.close import assert_close_to_scale

from fedpipe.auth.tokens import issue_token
from fedpipe.config import FedpipeConfig
from fedpipe.edge.trainer import DeviceTrainer
from fedpipe.fl.replica_control import ReplicaControl
from fedpipe.lora.aggregation import adapter_block
from fedpipe.models import resolve_model
from fedpipe.server.build import build_stage_server
from fedpipe.wire.control_client import StageControlClient
from fedpipe.wire.link_client import StageClient

SECRET = "a-secret-for-freeze-tests-only"
DEVICES = ["11", "12", "13", "14"]
BATCH, SEQ, FROZEN_BELOW = 4, 16, 2


def _config() -> FedpipeConfig:
    return FedpipeConfig().with_overrides(
        {
            "model.name": "tiny-llama",
            "model.head_layers": 1,
            "model.tail_layers": 1,
            "train.batch_size": BATCH,
            "train.seq_len": SEQ,
            "train.lr": 1e-2,
            "pipeline.microbatches": 2,
            "pipeline.timeout_s": 30.0,
            "pipeline.freeze": "progressive",
            "federated.num_devices": len(DEVICES),
        }
    )


def _train(cfg: FedpipeConfig, device: str, address: str, run_id: str) -> None:
    """One device's round of two steps, its head frozen as the round's config says."""
    trainer = DeviceTrainer(cfg, device_id=device, folder=resolve_model(cfg.model.name))
    trainer.freeze_below(FROZEN_BELOW)
    assert trainer.frozen  # its only head block is frozen: forward only
    gen = torch.Generator().manual_seed(int(device))
    ids = [torch.randint(0, 256, (BATCH, SEQ), generator=gen) for _ in range(2)]
    batches = [{"input_ids": x, "labels": x.clone()} for x in ids]
    token = issue_token(SECRET, run_id=run_id, round=1, device_id=device)
    with StageClient(address) as client:
        trainer.train_round(client, batches, round_=1, token=token)


def _weights() -> dict[str, float]:
    return {d: float(BATCH * 2 + i) for i, d in enumerate(DEVICES)}


def test_replicas_keep_frozen_server_blocks_and_merge_as_one_stage_server() -> None:
    cfg = _config()
    servers = [build_stage_server(cfg, secret=SECRET, port=0).start() for _ in range(3)]
    one, *pair = servers
    single = StageControlClient(one.address, SECRET, run_id="run")
    scale = cfg.model.lora_alpha / cfg.model.lora_r
    control = ReplicaControl(
        [s.address for s in pair], SECRET, run_id="run", lora_scale=scale, wait_s=10.0
    )
    try:
        single.reset_adapter()
        single.begin_round(1, "run", "separate", frozen_below=FROZEN_BELOW)
        before = single.get_adapter()
        for device in DEVICES:
            _train(cfg, device, one.address, "run")
        assert single.commit_round(1, _weights()).merged == len(DEVICES)
        expected = single.get_adapter()

        control.reset_adapter()
        control.begin_round(1, "run", "separate", frozen_below=FROZEN_BELOW)
        routes = control.routes(DEVICES)
        assert {r.replica for r in routes.values()} == {0, 1}
        for device, route in routes.items():
            _train(cfg, device, route.address, route.run_id)
        assert control.collect(1, _weights()) == {}
        parts = control.round.collected.values()
        assert all(adapter_block(k) == 2 for part in parts for s in part.states for k in s)
        assert control.commit_round(1, _weights()).merged == len(DEVICES)
        merged = control.get_adapter()
    finally:
        single.close()
        control.close()
        for server in servers:
            server.stop(grace=None)
    assert set(merged) == set(expected) == set(before)
    for key in before:
        if adapter_block(key) == 1:  # frozen: as it was, on one server and across replicas
            assert torch.equal(expected[key], before[key]) and torch.equal(merged[key], before[key])
        else:
            assert_close_to_scale(merged[key], expected[key], rel=1e-5, atol=1e-6, msg=key)
    assert any(not torch.equal(merged[k], before[k]) for k in before if adapter_block(k) == 2)
