"""fedpipe_bench.step_memory: the device's training steps and the whole model's, measured."""

from __future__ import annotations

import pytest
import torch
from fedpipe_bench import step_memory
from fedpipe_bench.step_memory import StepSpec

torch.set_num_threads(1)  # tiny products: two threads on a busy machine wait ~20 ms each

TINY = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 300,
    "max_position_embeddings": 128,
}


def _spec(what: str, loss_chunk: int = 32) -> StepSpec:
    return StepSpec(
        model="tiny",
        what=what,
        loss_chunk=loss_chunk,
        head_layers=1,
        tail_layers=1,
        batch_size=4,
        seq_len=40,
        microbatches=2,
        steps=2,
    )


@pytest.fixture(autouse=True)
def _tiny_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(step_memory.MODEL_SHAPES, "tiny", TINY)


def test_the_device_trains_its_adapters_through_the_echo_server() -> None:
    spec = _spec("device")
    head, tail = step_memory._device_stages(spec, step_memory.model_config(spec))
    assert tail.lm_head.weight is head.embedding.weight
    assert tail.loss_chunk == 32
    trained = [(n, p) for s in (head, tail) for n, p in s.named_parameters() if p.requires_grad]
    assert trained and all(".lora_" in n for n, _ in trained)
    losses = step_memory._device_steps(spec, head, tail, vocab=300)
    assert len(losses) == 2 and all(5.0 < loss < 6.5 for loss in losses)  # ln(300) = 5.7
    lora_b = [p for n, p in trained if "lora_B" in n]
    assert all(p.abs().sum() > 0 for p in lora_b)  # zero at the start: the optimizer stepped


def test_a_child_reports_its_params_and_its_memory() -> None:
    device = step_memory._child(_spec("device"))
    whole = step_memory._child(_spec("whole"))
    embedding = 300 * 32 * 4
    block = 4 * (2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 64 + 2 * 32)  # attention, MLP, norms
    # The device's two blocks and the whole model's four, one tied embedding each, plus LoRA.
    assert embedding + 2 * block < device["param_bytes"] < embedding + 3 * block
    assert embedding + 4 * block < whole["param_bytes"] < embedding + 5 * block
    for result in (device, whole):  # in this process the peak is pytest's own: only > 0
        assert result["peak_bytes"] > 0 and result["baseline_rss_bytes"] > 0


@pytest.mark.parametrize("weights", ["bf16", "int8", "int4"])
def test_a_stored_device_is_packed_from_random_rows_and_trains(weights: str) -> None:
    from fedpipe.split.quant import StoredEmbedding, StoredLinear

    spec = StepSpec(**{**_spec("device").__dict__, "weights": weights})
    head, tail = step_memory._device_stages(spec, step_memory.model_config(spec))
    embedding, lm_head = head.embedding, tail.lm_head
    assert isinstance(embedding, StoredEmbedding) and isinstance(lm_head, StoredLinear)
    assert lm_head.qweight is embedding.qweight  # tied: stored once
    assert not any(t.is_meta for s in (head, tail) for t in (*s.parameters(), *s.buffers()))
    losses = step_memory._device_steps(spec, head, tail, vocab=300)
    assert len(losses) == 2 and all(5.0 < loss < 6.5 for loss in losses)
    stored = step_memory._child(spec)
    embedding = 300 * 32 * 4
    block = 4 * (2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 64 + 2 * 32)
    assert stored["param_bytes"] < embedding + 2 * block  # fp32 holds more (the test above)
    assert stored["steps_s"] > 0


def test_the_report_has_a_row_per_model_and_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """The JSON contract: per model and weights, the device's figures beside the whole
    model's (measured once per model), the full logits at fp32 only."""
    measured: list[StepSpec] = []

    def fake(spec: StepSpec) -> dict[str, object]:
        measured.append(spec)
        base = {"fp32": 8, "bf16": 4, "int8": 2, "int4": 1}[spec.weights]
        peak = 100 if spec.what == "whole" else base * (2 if spec.loss_chunk == 0 else 1)
        return {"param_bytes": base, "peak_bytes": peak, "baseline_rss_bytes": 1,
                "steps_s": 0.5}  # fmt: skip

    monkeypatch.setattr(step_memory, "_measure", fake)
    monkeypatch.setitem(step_memory.MODEL_SHAPES, "other", TINY)
    specs = [_spec("device"), StepSpec(**{**_spec("device").__dict__, "model": "other"})]
    report = step_memory.step_memory_report(specs, loss_chunk=32)
    rows = report["rows"]
    assert [(r["model"], r["weights"]) for r in rows] == [
        (m, w) for m in ("tiny", "other") for w in ("fp32", "bf16", "int8", "int4")
    ]
    for row in rows:
        assert {"model", "weights", "device_param_bytes", "device_step_peak_bytes",
                "whole_lora_step_peak_bytes"} <= set(row)  # fmt: skip
        assert row["whole_lora_step_peak_bytes"] == 100
        assert row["device_step_peak_full_logits_bytes"] == (
            16 if row["weights"] == "fp32" else None
        )
    int4 = rows[3]
    assert int4["device_param_bytes"] == 1 and int4["device_step_peak_bytes"] == 1
    assert sum(s.what == "whole" for s in measured) == 2  # once per model
    only = step_memory.step_memory_report(specs[:1], loss_chunk=32, weights=("int4",))
    assert [r["weights"] for r in only["rows"]] == ["int4"]
    assert only["rows"][0]["device_step_peak_full_logits_bytes"] is None


def test_the_echo_server_answers_each_message_with_its_reply() -> None:
    from fedpipe.messages import Kind, StageMsg

    server = step_memory._EchoServer()
    sent = torch.ones(2, 3)
    server.send(StageMsg(Kind.ACTIVATION, 5, 1, tensor=sent))
    server.send(StageMsg(Kind.STEP_END, 5))
    assert server.ready(Kind.OUTPUT, 5, 1) and server.ready(Kind.STEP_DONE, 5, 0)
    reply = server.receive(Kind.OUTPUT, 5, 1)
    assert reply.tensor is not None and torch.equal(reply.tensor, sent)
    assert reply.tensor.data_ptr() != sent.data_ptr()  # a fresh tensor, as received
    assert not server.ready(Kind.OUTPUT, 5, 1)
