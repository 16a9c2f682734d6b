"""fedpipe_bench.step_memory: the device's training steps and the whole model's, measured."""

from __future__ import annotations

import pytest
import torch
from fedpipe_bench import step_memory
from fedpipe_bench.step_memory import StepSpec

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
