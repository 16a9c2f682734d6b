"""StageServer replicas under the ServerApp's round control, over real loopback gRPC.

Two StageServers (port 0, with a secret) serve as replicas of one run, driven by
:class:`~fedpipe.fl.replica_control.ReplicaControl` exactly as the ServerApp drives them; real
:class:`DeviceTrainer` devices (tiny-llama) train a round on the replica they are assigned.
The merged server adapter and the held-out loss are compared with one StageServer that served
the same devices. A replica lost mid-round (its server stopped) and started again at the same
address, empty, as Ray restarts one: its devices are named lost, it is loaded at the next
round. Where the replicas run (Ray actors) is tested in ``test_replica_set.py``.
"""

from __future__ import annotations

import grpc
import pytest
import torch
from harness.batches import random_batches
from harness.close import assert_close_to_scale

from fedpipe.auth.tokens import issue_token
from fedpipe.config import FedpipeConfig
from fedpipe.edge.trainer import DeviceTrainer, split_terms
from fedpipe.fl.device_work import DeviceWork, RunSettings, evaluate_split
from fedpipe.fl.replica_control import ReplicaControl
from fedpipe.lora.robust import AggregationRule
from fedpipe.models import resolve_model
from fedpipe.proto import stage_pb2 as pb
from fedpipe.proto import stage_pb2_grpc as pb_grpc
from fedpipe.server.build import build_stage_server
from fedpipe.server.stage_server import StageServer
from fedpipe.wire.backend import SessionRequest
from fedpipe.wire.control_client import StageControlClient
from fedpipe.wire.link_client import StageClient

SECRET = "a-secret-for-replica-tests-only"
DEVICES = ["11", "12", "13", "14"]
BATCH, SEQ = 4, 16


def _config(mode: str = "separate") -> FedpipeConfig:
    return FedpipeConfig().with_overrides(
        {
            "model.name": "tiny-llama",
            "model.head_layers": 1,
            "model.tail_layers": 1,
            "train.batch_size": BATCH,
            "train.seq_len": SEQ,
            "train.lr": 1e-2,  # far enough from the init that exact's residual is visible
            "pipeline.microbatches": 2,
            "pipeline.timeout_s": 30.0,
            "federated.aggregation": mode,
            "federated.num_devices": len(DEVICES),
        }
    )


def _batches(device: str, n: int = 2) -> list[dict[str, torch.Tensor]]:
    return random_batches(n, BATCH, SEQ, seed=int(device))


def _train(cfg: FedpipeConfig, device: str, address: str, run_id: str, round_: int = 1) -> None:
    """One device's round of two steps on the StageServer at ``address``."""
    trainer = DeviceTrainer(cfg, device_id=device, folder=resolve_model(cfg.model.name))
    token = issue_token(SECRET, run_id=run_id, round=round_, device_id=device)
    with StageClient(address) as client:
        report = trainer.train_round(client, _batches(device), round_=round_, token=token)
    assert len(report.steps) == 2


def _held_out(cfg: FedpipeConfig, address: str, run_id: str, round_: int) -> float:
    work = DeviceWork(cfg, device_id="evaluator", partition=-1, num_partitions=len(DEVICES))
    run = RunSettings(stage_address=address, secret=SECRET, run_id=run_id)
    return evaluate_split(work, work.trainer.adapters(), run, round_)[0]


def _servers(cfg: FedpipeConfig, n: int) -> list[StageServer]:
    return [build_stage_server(cfg, secret=SECRET, port=0).start() for _ in range(n)]


def _stop(servers: list[StageServer]) -> None:
    for server in servers:
        server.stop(grace=None)


def _replica_control(cfg: FedpipeConfig, servers: list[StageServer]) -> ReplicaControl:
    scale = cfg.model.lora_alpha / cfg.model.lora_r
    return ReplicaControl(
        [s.address for s in servers], SECRET, run_id="run", lora_scale=scale, wait_s=10.0
    )


def _weights() -> dict[str, float]:
    return {d: float(BATCH * 2 + i) for i, d in enumerate(DEVICES)}  # unequal, to be seen


MEDIAN = AggregationRule("median", norm_bound=0.05).text()  # a robust rule, updates clipped


@pytest.mark.parametrize(("mode", "rule"), [("separate", ""), ("exact", ""), ("separate", MEDIAN)])
def test_two_replicas_merge_as_one_stage_server(mode: str, rule: str) -> None:
    cfg = _config(mode)
    one, *pair = _servers(cfg, 3)
    single = StageControlClient(one.address, SECRET, run_id="run")
    control = _replica_control(cfg, pair)
    try:
        single.reset_adapter()
        single.begin_round(1, "run", mode, rule)
        for device in DEVICES:
            _train(cfg, device, one.address, "run")
        assert single.commit_round(1, _weights()).merged == len(DEVICES)
        expected = single.get_adapter()
        expected_loss = _held_out(cfg, one.address, "run", 1)

        control.reset_adapter()
        control.begin_round(1, "run", mode, rule)
        routes = control.routes(DEVICES)
        assert {r.replica for r in routes.values()} == {0, 1}  # both replicas hold devices
        for device, route in routes.items():
            _train(cfg, device, route.address, route.run_id)
        assert control.collect(1, _weights()) == {}
        assert control.commit_round(1, _weights()).merged == len(DEVICES)
        merged = control.get_adapter()
        loaded = [
            StageControlClient(s.address, SECRET, run_id=f"run/r{k}") for k, s in enumerate(pair)
        ]
        held = [c.get_adapter() for c in loaded]
        route = control.evaluator()
        loss = _held_out(cfg, route.address, route.run_id, 1)
    finally:
        single.close()
        control.close()
        _stop([one, *pair])

    assert set(merged) == set(expected)
    if mode == "exact":
        assert any(k.endswith(".base_delta") for k in merged)
    for key, value in expected.items():
        assert_close_to_scale(merged[key], value, rel=0, atol=1e-6, msg=key)
        for state in held:  # every replica holds the merged global adapter
            assert torch.equal(state[key], merged[key]), key
    assert loss == pytest.approx(expected_loss, abs=1e-6)
    assert control.round_figures()["sessions_per_replica"] == [
        sum(r.replica == k for r in routes.values()) for k in (0, 1)
    ]


def test_replicas_resume_from_the_global_adapter_a_checkpoint_holds() -> None:
    """``--resume``: the checkpoint's global adapter (the coordinator's one copy) loaded into
    fresh replicas evaluates as it did, and the next round merges from it."""
    cfg = _config("exact")
    first, second = _servers(cfg, 2), _servers(cfg, 2)
    before = _replica_control(cfg, first)
    after = _replica_control(cfg, second)
    try:
        before.reset_adapter()
        before.begin_round(1, "run", "exact")
        for device, route in before.routes(DEVICES).items():
            _train(cfg, device, route.address, route.run_id)
        before.commit_round(1, _weights())
        saved = before.get_adapter()  # what a checkpoint holds: server.safetensors
        route = before.evaluator()
        loss = _held_out(cfg, route.address, route.run_id, 1)

        after.load_adapter(saved)
        after.begin_round(2, "run", "exact")
        resumed = _held_out(cfg, after.evaluator().address, after.evaluator().run_id, 2)
        for device, route in after.routes(DEVICES).items():
            _train(cfg, device, route.address, route.run_id, round_=2)
        merged = after.commit_round(2, _weights()).merged
    finally:
        before.close()
        after.close()
        _stop([*first, *second])
    assert any(k.endswith(".base_delta") for k in saved)
    assert resumed == pytest.approx(loss, abs=1e-6)
    assert merged == len(DEVICES)
    assert set(after.get_adapter()) == set(saved) and after.initial.keys() <= saved.keys()


def test_a_token_is_valid_on_its_own_replica_only() -> None:
    cfg = _config()
    pair = _servers(cfg, 2)
    control = _replica_control(cfg, pair)
    try:
        control.reset_adapter()
        control.begin_round(1, "run", "separate")
        routes = control.routes(DEVICES)
        device, route = next(iter(routes.items()))
        other = pair[1 - route.replica].address
        token = issue_token(SECRET, run_id=route.run_id, round=1, device_id=device)
        with StageClient(other) as client, pytest.raises(grpc.RpcError) as refused:
            client.open(
                SessionRequest(
                    device_id=device,
                    token=token,
                    round=1,
                    split=split_terms(cfg, resolve_model(cfg.model.name)),
                    learning_rate=1e-3,
                ),
                timeout_s=10.0,
            )
        _train(cfg, device, route.address, route.run_id)
        told = StageControlClient(route.address, SECRET, run_id=route.run_id).round_status(1)
        other_status = StageControlClient(other, SECRET, run_id="").round_status(1)
    finally:
        control.close()
        _stop(pair)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert f"session token is for run {route.run_id!r}" in str(refused.value.details())
    assert told is not None and [s.device_id for s in told] == [device]
    assert other_status == []  # the session is on the replica the device was told, only


def test_a_replica_lost_mid_round_fails_its_devices_and_is_loaded_when_back() -> None:
    cfg = _config()
    pair = _servers(cfg, 2)
    control = _replica_control(cfg, pair)
    restarted: StageServer | None = None
    try:
        control.reset_adapter()
        control.begin_round(1, "run", "separate")
        routes = control.routes(DEVICES)
        for device, route in routes.items():
            if route.replica == 0:
                _train(cfg, device, route.address, route.run_id)
        lost_port = pair[1].port
        pair[1].stop(grace=None)  # replica 1 dies with its devices' sessions
        lost = control.collect(1, _weights())
        committed = control.commit_round(1, _weights())
        # Ray restarts a replica at its port, empty: no run adapter
        restarted = build_stage_server(cfg, secret=SECRET, port=lost_port).start()
        control.begin_round(2, "run", "separate")
        back = StageControlClient(restarted.address, SECRET, run_id="run/r1").get_adapter()
        live = list(control.round.live)
    finally:
        control.close()
        _stop([pair[0], *([restarted] if restarted else [])])
    on_lost = sorted(d for d, r in routes.items() if r.replica == 1)
    assert sorted(lost) == on_lost
    assert all("replica 1" in why and "lost mid-round" in why for why in lost.values())
    assert committed.merged == len(DEVICES) - len(on_lost)
    assert live == [0, 1]  # found empty at BeginRound, loaded, and begun
    merged = control.get_adapter()
    assert all(torch.equal(back[k], merged[k]) for k in merged)


def test_a_replica_down_at_the_start_of_a_round_gets_no_device() -> None:
    cfg = _config()
    pair = _servers(cfg, 2)
    control = _replica_control(cfg, pair)
    try:
        control.reset_adapter()
        pair[1].stop(grace=None)
        control.begin_round(1, "run", "separate")
        routes = control.routes(DEVICES)
    finally:
        control.close()
        _stop(pair[:1])
    assert control.round.live == [0]
    assert {r.replica for r in routes.values()} == {0}


def test_unsigned_collect_round_is_refused() -> None:
    cfg = _config()
    (server,) = _servers(cfg, 1)
    try:
        with grpc.insecure_channel(server.address) as channel:
            with pytest.raises(grpc.RpcError) as info:
                next(
                    pb_grpc.StageControlStub(channel).CollectRound(pb.CollectRoundRequest(round=1))
                )
    finally:
        server.stop(grace=None)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
