"""Compressed adapter rounds on Flower's simulation engine: the ClientApp's own mod, with each
device's residuals in the ``context.state`` Flower keeps across rounds, gives the held-out loss
and stage-link bytes of ``fedpipe bench quality``'s devices, which keep a context per device
for the run. int4 both ways leaves residuals large enough that a device starting a round
without its last residual would end elsewhere."""

from __future__ import annotations

from pathlib import Path

import pytest
from fedpipe_bench.quality import COMMON, QUICK_SIZE, run_quality_bench

from fedpipe.config import FedpipeConfig
from fedpipe.launch.run import simulate

SMALL = {
    "federated.num_devices": 2,
    "federated.rounds": 2,
    "federated.strategy": "fedavgm",
    "federated.adapter_codec": "int4",
    "federated.adapter_downlink_codec": "int4",
}


def test_simulate_and_bench_quality_give_the_same_loss_with_int4_adapters(tmp_path: Path) -> None:
    cfg = FedpipeConfig().with_overrides({**COMMON, **QUICK_SIZE, **SMALL})
    summary = simulate(cfg, name="int4-adapters", runs_dir=tmp_path, progress=False)
    assert summary["ok"], summary["problems"]
    last = summary["rounds"][-1]
    assert last["round"] == 2 and last["devices_trained"] == 2 and last["devices_failed"] == 0

    report = run_quality_bench(quick=True, names=["lossless"], overrides=SMALL)
    row = report["runs"][0]
    assert (row["adapter_codec"], row["adapter_downlink_codec"]) == ("int4", "int4")
    assert row["eval_loss"] == pytest.approx(last["eval_loss"], abs=1e-6)
    trained = [r for r in summary["rounds"] if r["round"] > 0]
    assert row["bytes_up"] == sum(r["bytes_up"] for r in trained)
