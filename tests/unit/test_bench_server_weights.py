"""`fedpipe bench memory --server-weights`: each setting's row, built and stepped in one run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from fedpipe_bench.server_weights import server_weights_report

from fedpipe.config import FedpipeConfig
from fedpipe.models import resolve_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)


def test_each_setting_reports_its_bytes_steps_and_distance_from_fp32(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    folder: Path = resolve_model("tiny-llama", cache_dir=tmp_path_factory.mktemp("cache"))
    config = FedpipeConfig().with_overrides({"model.name": str(folder)})
    report = server_weights_report(
        config, folder, ("fp32", "int8"), sessions=2, batch_size=1, seq_len=8, steps=2, warmup=0
    )
    fp32, int8 = report["rows"]
    assert (fp32["weights"], int8["weights"]) == ("fp32", "int8")
    assert int8["server_param_bytes"] < 0.3 * fp32["server_param_bytes"]
    assert int8["adapter_bytes_per_session"] == fp32["adapter_bytes_per_session"] > 0
    assert fp32["output_rel_error"] == 0.0 and 0 < int8["output_rel_error"] < 0.1
    for row in (fp32, int8):
        assert len(row["step_s_all"]) == 2 and row["step_s_min"] <= row["step_s"]
    assert (report["sessions"], report["seq_len"], report["split"]) == (2, 8, "1+1")
