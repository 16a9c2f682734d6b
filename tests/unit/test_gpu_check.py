"""benchmarks/gpu_check.py: skips cleanly without CUDA; its measuring loop runs (on a CPU here)."""

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


def test_the_loop_measures_both_columns_at_every_n_on_a_cpu() -> None:
    report = _gpu_check().run([1, 2], 1, models=("tiny-llama",), device=torch.device("cpu"))
    assert [r["devices"] for r in report["results"]] == [1, 2]
    for row in report["results"]:
        for column in ("batched", "unbatched", "batched-looped"):
            figures = row[column]
            assert figures["tokens_per_s"] > 0 and figures["mean_batch"] >= 1.0
            assert 0 < figures["busy_host"] <= 1.0
            assert figures["peak_gpu_mb"] is None and figures["idle"] is None  # no GPU here
            assert figures["copies"]["downloads"] == 0  # a CPU stage: no copies at all
    assert isinstance(report["batching_available"], bool)
    assert "bfloat16" in report["grouped_lora"]  # says why the kernel did not run here (fp32)


def test_rows_past_the_time_budget_are_reported_as_skipped() -> None:
    report = _gpu_check().run(
        [1, 2], 1, models=("tiny-llama",), device=torch.device("cpu"), budget_s=1e-9
    )
    assert [r["devices"] for r in report["results"]] == [1, 2]
    assert all("time budget" in r["skipped"] for r in report["results"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_memory_and_idle_fraction_are_measured() -> None:
    report = _gpu_check().run([1, 8], 1, models=("llama-1b-random",))
    for row in report["results"]:
        for column in ("batched", "unbatched"):
            figures = row[column]
            assert figures["peak_gpu_mb"] > 0 and 0.0 <= figures["idle"] <= 1.0
            uploads = figures["copies"]["prefetch_hits"] + figures["copies"]["uploads_on_worker"]
            messages = row["devices"] * 2 * 2  # 1 step x 2 microbatches x (forward, backward)
            assert uploads == messages and figures["copies"]["downloads"] == messages
