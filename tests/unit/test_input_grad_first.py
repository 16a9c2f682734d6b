"""The input gradient first (server.input_grad_first): the same replies and updates, to the bit.

Two executors on the batched bank (tiny-llama's middle stage) get the same calls; one computes
each backward's weight gradients together with its input gradients, the other records them and
computes them later. Backwards that serve several sessions and a step that ends before another
session's make the order matter: an adapter's gradient must still sum in its backwards' order.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from fedpipe.lora import BatchedAdapterBank, Group, LoraSettings
from fedpipe.messages import Kind, StageMsg
from fedpipe.models import load_config
from fedpipe.server.executor import StageExecutor
from fedpipe.server.sessions import SessionInfo
from fedpipe.split import build_stage, split_layout

torch.set_num_threads(1)
SETTINGS = LoraSettings(r=4, alpha=8, seed=3)
SHAPES = {"a": (1, 7), "b": (3, 12)}  # rows, tokens per session


class Side:
    """An executor on the batched bank with sessions a and b on the same random adapters."""

    def __init__(self, folder: Path, *, input_grad_first: bool) -> None:
        plan = split_layout(load_config(folder), mode="u")
        stage = build_stage(folder, plan, "middle")
        self.bank = BatchedAdapterBank(stage, SETTINGS, family="llama")
        self.ex = StageExecutor(
            self.bank,
            mode="u",
            hidden_size=64,
            device=torch.device("cpu"),
            dtype=torch.float32,
            max_in_flight=4,
            input_grad_first=input_grad_first,
        )
        self.infos: dict[str, SessionInfo] = {}
        for seed, name in enumerate(SHAPES, start=1):
            gen = torch.Generator().manual_seed(seed)
            state = {
                k: torch.randn(v.shape, generator=gen) * 0.1
                for k, v in self.bank.global_state().items()
            }
            self.bank.add(name, init=state)
            opt = torch.optim.AdamW(self.bank.parameters(name), lr=1e-2)
            self.infos[name] = SessionInfo(name, f"dev-{name}", 1, opt, 4, 16)

    def call(self, msgs: list[tuple[str, StageMsg]]) -> list[StageMsg | Exception]:
        return self.ex.compute_batch([(self.infos[n], copy.copy(m)) for n, m in msgs])

    def grads_of(self, name: str) -> list[torch.Tensor | None]:
        return [p.grad for p in self.bank.parameters(name)]


def _x(name: str, seed: int) -> torch.Tensor:
    rows, tokens = SHAPES[name]
    return torch.randn(rows, tokens, 64, generator=torch.Generator().manual_seed(seed))


def _act(name: str, step: int, mb: int) -> tuple[str, StageMsg]:
    return name, StageMsg(Kind.ACTIVATION, step, mb, tensor=_x(name, 100 * step + mb))


def _grad(name: str, step: int, mb: int) -> tuple[str, StageMsg]:
    return name, StageMsg(Kind.OUTPUT_GRAD, step, mb, tensor=_x(name, 100 * step + 50 + mb))


def _calls(step: int) -> list[list[tuple[str, StageMsg]]]:
    """b's backwards alone, then one backward of both, then a's step ends before b's."""
    return [
        [_act("a", step, 0), _act("b", step, 0), _act("b", step, 1), _act("b", step, 2)],
        [_grad("b", step, 0)],
        [_grad("b", step, 1)],
        [_grad("b", step, 2), _grad("a", step, 0)],
        [("a", StageMsg(Kind.STEP_END, step))],
        [("b", StageMsg(Kind.STEP_END, step))],
    ]


def _same(got: list[StageMsg | Exception], want: list[StageMsg | Exception]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert isinstance(g, StageMsg) and isinstance(w, StageMsg), (g, w)
        assert (g.kind, g.step, g.microbatch) == (w.kind, w.step, w.microbatch)
        if w.tensor is None:
            assert g.tensor is None
        else:
            assert g.tensor is not None and torch.equal(g.tensor, w.tensor)


def test_input_grad_first_replies_and_updates_are_bit_identical(folder: Path) -> None:
    together = Side(folder, input_grad_first=False)
    first = Side(folder, input_grad_first=True)
    for step in range(2):
        for call in _calls(step):
            want = together.call(call)
            if call[0][1].kind is Kind.STEP_END and call[0][0] == "a":
                # b's weight gradients are still to compute (or partly) on the deferring side
                assert first.ex.weights_pending
            got = first.call(call)
            _same(got, want)
            if call[0][1].kind is Kind.OUTPUT_GRAD:
                # replied before any weight gradient of these backwards was added
                assert all(g is None for g in first.grads_of(call[0][0]))
                assert all(g is not None for g in together.grads_of(call[0][0]))
        assert not first.ex.weights_pending  # b's STEP_END computed the rest
    for name in SHAPES:
        for key, value in together.bank.state_dict(name).items():
            assert torch.equal(first.bank.state_dict(name)[key], value), (name, key)


def test_idle_time_computes_what_backwards_left(folder: Path) -> None:
    side = Side(folder, input_grad_first=True)
    for call in _calls(0)[:4]:
        side.call(call)
    assert side.ex.weights_pending
    assert side.ex.compute_weight_grads() == 3  # three backwards, oldest first
    assert not side.ex.weights_pending
    assert all(g is not None for g in side.grads_of("a") + side.grads_of("b"))


ALL_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GROUP_SHAPES = [("a", 1, 7), ("b", 3, 12), ("a", 2, 12)]  # (adapter, rows, tokens)


def _bank_backward(folder: Path, grouped: str, *, deferred: bool) -> list[torch.Tensor]:
    """Input gradients and adapter gradients of one batched backward over three tapes."""
    settings = LoraSettings(r=8, alpha=16, seed=3, targets=ALL_LINEARS)
    stage = build_stage(folder, split_layout(load_config(folder), mode="u"), "middle")
    bank = BatchedAdapterBank(stage, settings, family="llama")
    bank._runner.grouped = grouped  # type: ignore[assignment]
    gen = torch.Generator().manual_seed(1)
    for name in "ab":
        init = {
            k: torch.randn(v.shape, generator=gen) * 0.1 for k, v in bank.global_state().items()
        }
        bank.add(name, init=init)
    xs = [torch.randn(b, t, 64, generator=gen) for _, b, t in GROUP_SHAPES]
    groups = [Group(name, x) for (name, _, _), x in zip(GROUP_SHAPES, xs, strict=True)]
    taped = bank.run_taped(groups)
    items = [(tape, torch.randn(y.shape, generator=gen)) for y, tape in taped]
    if deferred:
        dxs, weights = bank.backward_inputs(items)
        assert all(p.grad is None for n in "ab" for p in bank.parameters(n))
        bank.add_weight_grads(weights)
    else:
        dxs = bank.backward(items)
    grads = [p.grad for n in "ab" for p in bank.parameters(n)]
    assert all(g is not None for g in grads)
    return [*(dx for dx in dxs if dx is not None), *(g for g in grads if g is not None)]


@pytest.mark.parametrize("grouped", ["off", "force"])
def test_the_banks_deferred_weight_gradients_equal_its_backward_to_the_bit(
    folder: Path, grouped: str
) -> None:
    """The per-session loop and the grouped kernel (forced: the CPU runs grouped_mm in bf16)."""
    want = _bank_backward(folder, grouped, deferred=False)
    got = _bank_backward(folder, grouped, deferred=True)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
