"""``fedpipe bench quality`` runs the ServerApp's own rounds, so its figures are the real path's.

- One small configuration gives the same held-out loss (and stage-link bytes) through
  ``fedpipe simulate``, on Flower's simulation engine, and through the bench. It uses FedAvgM
  with fedpipe's ``server_lr``: a bench with an aggregation of its own (plain FedAvg) gives a
  different loss there.
- The strategy's sampling (``fraction_train``) decides which devices train in a bench round,
  and Flower's adapter DP clips on the side ``privacy.adapter_dp`` names.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fedpipe_bench.quality import COMMON, QUICK_SIZE, run_quality_bench

from fedpipe.config import FedpipeConfig
from fedpipe.launch.run import simulate

SMALL = {
    "federated.num_devices": 2,
    "federated.rounds": 2,
    "federated.strategy": "fedavgm",  # server momentum with step federated.server_lr
}


def test_simulate_and_bench_quality_give_the_same_held_out_loss(tmp_path: Path) -> None:
    cfg = FedpipeConfig().with_overrides({**COMMON, **QUICK_SIZE, **SMALL})
    assert (cfg.train.local_steps, cfg.model.name) == (2, "tiny-llama")
    summary = simulate(cfg, name="same", runs_dir=tmp_path, progress=False)
    assert summary["ok"], summary["problems"]
    last = summary["rounds"][-1]
    assert last["round"] == 2 and last["devices_trained"] == 2

    report = run_quality_bench(quick=True, names=["lossless"], overrides=SMALL)
    row = report["runs"][0]
    assert (report["devices"], report["rounds"], row["strategy"]) == (2, 2, "fedavgm")
    # The same code on both paths: equal to the last digit when run; 1e-6 leaves room for
    # devices whose replies are summed in another order (not commutative past two in floats).
    assert row["eval_loss"] == pytest.approx(last["eval_loss"], abs=1e-6)
    trained = [r for r in summary["rounds"] if r["round"] > 0]  # round 0: the initial eval
    assert row["bytes_up"] == sum(r["bytes_up"] for r in trained)
    assert row["bytes_down"] == sum(r["bytes_down"] for r in trained)


def test_the_strategy_samples_the_devices_of_a_bench_round() -> None:
    report = run_quality_bench(
        quick=True,
        names=["lossless"],
        overrides={**SMALL, "federated.strategy": "fedavg", "federated.fraction_train": 0.5},
    )
    row = report["runs"][0]
    assert [r["devices"] for r in row["per_round"]] == [1, 1]  # one of two, each round
    steps, batch = QUICK_SIZE["train.local_steps"], QUICK_SIZE["train.batch_size"]
    seq = QUICK_SIZE["train.seq_len"]
    assert row["trained_tokens"] == 2 * steps * batch * (seq - 1)  # 2 rounds x 1 device


def test_adapter_dp_clips_the_bench_updates_on_either_side() -> None:
    """Flower's DP wrappers run in the bench: server-side through the ServerApp's strategy,
    client-side through the ClientApp's clipping mod. Clipped to ~0 and without noise, both
    leave the device adapters where they started; without DP they move."""
    loss = {}
    for side in ("off", "server", "client"):
        dp = {
            "privacy.adapter_dp": side,
            "privacy.adapter_noise": 0.0,
            "privacy.adapter_clip": 1e-9,
        }
        report = run_quality_bench(quick=True, names=["lossless"], overrides={**SMALL, **dp})
        loss[side] = report["runs"][0]["eval_loss"]
    assert loss["server"] == pytest.approx(loss["client"], abs=1e-6)
    assert abs(loss["off"] - loss["server"]) > 1e-3
