"""benchmarks/gpu_check.py --offload: its CPU path runs, and the devices-at-memory fit.

The figure itself needs a GPU (peak GPU memory); here the column and its stash figures are
measured on a CPU, and the fit is checked on known numbers.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


def _gpu_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_offload_column_runs_on_a_cpu_beside_the_batched_one() -> None:
    report = _gpu_check().run(
        [1, 2], 1, models=("tiny-llama",), device=torch.device("cpu"), offload=True
    )
    for row in report["results"]:
        for column in ("batched", "batched-offload"):
            figures = row[column]
            assert figures["tokens_per_s"] > 0 and figures["peak_stash_mb"] > 0
        assert "peak_stash_mb" not in row["unbatched"]  # counted on the batched columns only
    figures = report["offload"]["tiny-llama"]
    assert set(figures["step_s_offload_over_batched"]) == {"1", "2"}
    assert all(v > 0 for v in figures["step_s_offload_over_batched"].values())
    # No GPU memory on a CPU: nothing to fit
    assert figures["devices_at_memory"] == {"batched": None, "batched-offload": None}


def test_devices_at_memory_solves_the_fitted_line_for_the_budget() -> None:
    fit = _gpu_check().devices_at_memory([(1, 1100.0), (8, 1800.0), (32, 4200.0)], 16 * 1024)
    assert fit["base_mb"] == pytest.approx(1000.0)
    assert fit["per_device_mb"] == pytest.approx(100.0)
    assert fit["devices"] == (16 * 1024 - 1000) // 100
    assert _gpu_check().devices_at_memory([(8, 1800.0)], 1024.0) is None
