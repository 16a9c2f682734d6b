"""benchmarks/codec_bench.py measures codecs on a real head output, not on noise."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
import torch

from fedpipe.wire.tensors import CODECS


def _bench() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "codec_bench.py"
    spec = importlib.util.spec_from_file_location("codec_bench", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_codec_rows_on_a_real_head_output() -> None:
    bench = _bench()
    x = bench.head_output("tiny-llama", 1, 2, 16)  # corpus text through the head
    assert x.shape[:2] == (2, 16) and x.dtype == torch.float32
    rows = {r["codec"]: r for r in bench.codec_rows(x, repeats=1)}
    assert set(rows) == set(CODECS)
    assert rows["fp32"]["max_abs_err"] == 0.0
    assert 0.0 < rows["bf16"]["rms_err_rel"] < 1e-2  # 8 mantissa bits: about 2**-9 relative
    assert rows["int8"]["wire_mb"] < rows["bf16"]["wire_mb"] < rows["fp32"]["wire_mb"]


# tokenises the whole corpus to find it too short
def test_a_batch_larger_than_the_corpus_gives_a_clear_error() -> None:
    with pytest.raises(ValueError, match="lower --batch or --seq-len"):
        _bench().head_output("tiny-llama", 1, 10**6, 512)


def test_output_gradient_and_step_rows_on_a_real_backward() -> None:
    bench = _bench()
    m = bench.load_split("tiny-llama", 1, 2, 16)
    loss, grad = bench.output_gradient(m, m.ids)
    assert grad.shape == (2, 16, 64) and loss > 0 and grad.abs().max() > 0
    rows = {r["codec"]: r for r in bench.codec_rows(grad, 1, ("fp32", "int4", "int2"))}
    assert rows["fp32"]["rms_err_rel"] == 0.0
    assert 0 < rows["int4"]["rms_err_rel"] < rows["int2"]["rms_err_rel"] < 1
    assert rows["int4"]["bytes_per_value"] == 0.625  # 4 bits + 64 bits of scale per 64 values
    step = {r["codec"]: r for r in bench.step_rows(m, m.ids, ("fp32", "bf16", "int2"))}
    assert step["fp32"]["loss_rel_diff"] == 0.0
    assert abs(step["bf16"]["loss_rel_diff"]) < 1e-2 and step["bf16"]["input_grad_cos"] > 0.99
    assert step["int2"]["input_grad_rel_err"] > step["bf16"]["input_grad_rel_err"]
