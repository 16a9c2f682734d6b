"""The executor's batched calls: every session's replies and update equal its solo run.

The solo reference is the executor on peft's AdapterBank, one message at a time (the server
before batching); the batched executor gets the same sessions' messages in shared calls.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from harness.close import assert_close_to_scale

from fedpipe.errors import InvalidRequestError, SessionStateError, StageCapacityError
from fedpipe.lora import AdapterBank, BatchedAdapterBank, LoraSettings
from fedpipe.messages import Kind, StageMsg
from fedpipe.models import load_config
from fedpipe.server.executor import StageExecutor
from fedpipe.server.sessions import SessionInfo
from fedpipe.split import build_stage, split_layout

torch.set_num_threads(1)
SETTINGS = LoraSettings(r=4, alpha=8, seed=3)
TOL = {"atol": 1e-5, "rel": 1e-5}
SHAPES = {"a": (1, 7), "b": (3, 12), "c": (2, 4)}  # rows, tokens per session


class Side:
    """An executor over one bank, with sessions a, b, c on the same random adapters."""

    def __init__(self, bank: AdapterBank | BatchedAdapterBank, mode: str) -> None:
        self.bank = bank
        self.ex = StageExecutor(
            bank,
            mode=mode,
            hidden_size=64,
            device=torch.device("cpu"),
            dtype=torch.float32,
            max_in_flight=2,
        )
        self.infos: dict[str, SessionInfo] = {}
        for seed, name in enumerate(SHAPES, start=1):
            gen = torch.Generator().manual_seed(seed)
            state = {
                k: torch.randn(v.shape, generator=gen) * 0.1 for k, v in bank.global_state().items()
            }
            bank.add(name, init=state)
            opt = torch.optim.AdamW(bank.parameters(name), lr=1e-2)
            self.infos[name] = SessionInfo(name, f"dev-{name}", 1, opt, 4, 16)

    def batch(self, msgs: list[tuple[str, StageMsg]]) -> list[StageMsg | Exception]:
        return self.ex.compute_batch([(self.infos[n], copy.copy(m)) for n, m in msgs])

    def solo(self, msgs: list[tuple[str, StageMsg]]) -> list[StageMsg | Exception]:
        return [r for n, m in msgs for r in self.ex.compute_batch([(self.infos[n], m)])]


def _sides(folder: Path, mode: str) -> tuple[Side, Side]:
    plan = split_layout(load_config(folder), mode=mode)  # type: ignore[arg-type]
    stage = build_stage(folder, plan, "middle" if mode == "u" else "server_loss")
    solo = Side(AdapterBank(copy.deepcopy(stage), SETTINGS, family="llama"), mode)
    return solo, Side(BatchedAdapterBank(stage, SETTINGS, family="llama"), mode)


def _act(name: str, mb: int, seed: int, *, mode: str, eval_: bool = False) -> StageMsg:
    rows, tokens = SHAPES[name]
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, tokens, 64, generator=gen)
    labels = torch.randint(0, 200, (rows, tokens), generator=gen) if mode == "two" else None
    return StageMsg(
        Kind.ACTIVATION, 0, mb, tensor=x, labels=labels, loss_scale=0.01, forward_only=eval_
    )


def _grad(name: str, mb: int, seed: int) -> StageMsg:
    rows, tokens = SHAPES[name]
    g = torch.randn(rows, tokens, 64, generator=torch.Generator().manual_seed(seed))
    return StageMsg(Kind.OUTPUT_GRAD, 0, mb, tensor=g)


def _same(got: list[StageMsg | Exception], want: list[StageMsg | Exception]) -> None:
    for g, w in zip(got, want, strict=True):
        assert isinstance(g, StageMsg) and isinstance(w, StageMsg), (g, w)
        assert (g.kind, g.step, g.microbatch, g.tokens) == (w.kind, w.step, w.microbatch, w.tokens)
        assert g.loss_sum == pytest.approx(w.loss_sum, rel=1e-5)
        assert (g.tensor is None) == (w.tensor is None)
        if g.tensor is not None:
            assert_close_to_scale(g.tensor, w.tensor, **TOL)


def _same_adapters(a: Side, b: Side) -> None:
    for name in SHAPES:
        for key, value in a.bank.state_dict(name).items():
            assert_close_to_scale(b.bank.state_dict(name)[key], value, **TOL)


@pytest.mark.parametrize("mode", ["u", "two"])
def test_batched_calls_equal_solo_runs(folder: Path, mode: str) -> None:
    solo, batched = _sides(folder, mode)
    forwards = [
        ("a", _act("a", 0, 1, mode=mode)),
        ("b", _act("b", 0, 2, mode=mode)),
        ("c", _act("c", 5, 3, mode=mode, eval_=True)),  # evaluation shares the call
        ("a", _act("a", 1, 4, mode=mode)),
    ]
    _same(batched.batch(forwards), solo.solo(forwards))
    if mode == "u":
        backwards = [("b", _grad("b", 0, 5)), ("a", _grad("a", 0, 6)), ("a", _grad("a", 1, 7))]
        _same(batched.batch(backwards), solo.solo(backwards))
    steps = [(n, StageMsg(Kind.STEP_END, 0)) for n in ("a", "b")]
    _same(batched.batch(steps), solo.solo(steps))
    _same_adapters(solo, batched)
    assert batched.infos["a"].step == 1 and batched.infos["c"].step == 0


def test_lone_backward_while_another_forward_waits(folder: Path) -> None:
    solo, batched = _sides(folder, "u")
    forwards = [("a", _act("a", 0, 1, mode="u")), ("b", _act("b", 0, 2, mode="u"))]
    _same(batched.batch(forwards), solo.solo(forwards))
    late = [("a", _grad("a", 0, 3)), ("a", StageMsg(Kind.STEP_END, 0))]
    _same(batched.batch(late), solo.solo(late))  # b's gradient has not arrived
    assert list(batched.infos["b"].cache) == [0]
    rest = [("b", _grad("b", 0, 4)), ("b", StageMsg(Kind.STEP_END, 0))]
    _same(batched.batch(rest), solo.solo(rest))
    _same_adapters(solo, batched)


def test_a_failed_message_fails_alone(folder: Path) -> None:
    solo, batched = _sides(folder, "u")
    bad_shape = StageMsg(Kind.ACTIVATION, 0, 0, tensor=torch.randn(1, 3, 32))
    poisoned = _act("c", 0, 3, mode="u")
    assert poisoned.tensor is not None
    poisoned.tensor[0, 0, 0] = float("inf")
    replies = batched.batch(
        [
            ("a", bad_shape),
            ("b", _act("b", 0, 2, mode="u")),
            ("b", _act("b", 0, 2, mode="u")),  # duplicate microbatch in the same call
            ("b", _act("b", 1, 2, mode="u")),
            ("b", _act("b", 2, 2, mode="u")),  # past max_in_flight = 2
            ("c", poisoned),
        ]
    )
    assert isinstance(replies[0], InvalidRequestError) and "got (1, 3, 32)" in str(replies[0])
    assert isinstance(replies[2], SessionStateError) and "duplicate" in str(replies[2])
    assert isinstance(replies[4], StageCapacityError) and "max_in_flight = 2" in str(replies[4])
    assert isinstance(replies[5], InvalidRequestError) and "NaN or Inf" in str(replies[5])
    want = solo.solo([("b", _act("b", 0, 2, mode="u")), ("b", _act("b", 1, 2, mode="u"))])
    _same([replies[1], replies[3]], want)
    early = batched.batch([("a", StageMsg(Kind.STEP_END, 0))])
    assert isinstance(early[0], StageMsg)
    pending = batched.batch([("b", StageMsg(Kind.STEP_END, 0))])
    assert isinstance(pending[0], SessionStateError) and "await gradients" in str(pending[0])


def test_frozen_head_sessions_get_no_input_gradient(folder: Path) -> None:
    _, batched = _sides(folder, "u")
    batched.infos["a"].frozen_head = True  # type: ignore[attr-defined]  # another branch's field
    out = batched.batch([("a", _act("a", 0, 1, mode="u")), ("b", _act("b", 0, 2, mode="u"))])
    assert all(isinstance(r, StageMsg) and r.tensor is not None for r in out)
    grads = batched.batch([("a", _grad("a", 0, 3)), ("b", _grad("b", 0, 4))])
    assert isinstance(grads[0], StageMsg) and grads[0].tensor is None
    assert isinstance(grads[1], StageMsg) and grads[1].tensor is not None
    assert all(p.grad is not None for p in batched.bank.parameters("a"))


def test_backwards_of_several_forward_calls_share_one_call(folder: Path) -> None:
    """Gradients of microbatches forwarded in different calls run in one batched backward."""
    solo, batched = _sides(folder, "u")
    first = [("a", _act("a", 0, 1, mode="u")), ("b", _act("b", 0, 2, mode="u"))]
    second = [("c", _act("c", 0, 3, mode="u")), ("a", _act("a", 1, 4, mode="u"))]
    for msgs in (first, second):
        _same(batched.batch(msgs), solo.solo(msgs))
    grads = [("c", _grad("c", 0, 5)), ("a", _grad("a", 1, 6)), ("b", _grad("b", 0, 7))]
    _same(batched.batch(grads), solo.solo(grads))
    assert list(batched.infos["a"].cache) == [0] and not batched.infos["b"].cache
    rest = [("a", _grad("a", 0, 8))] + [(n, StageMsg(Kind.STEP_END, 0)) for n in SHAPES]
    _same(batched.batch(rest), solo.solo(rest))
    _same_adapters(solo, batched)


def test_a_bad_gradient_fails_alone_in_a_batched_backward(folder: Path) -> None:
    solo, batched = _sides(folder, "u")
    forwards = [(n, _act(n, 0, i, mode="u")) for i, n in enumerate(SHAPES)]
    _same(batched.batch(forwards), solo.solo(forwards))
    wrong = StageMsg(Kind.OUTPUT_GRAD, 0, 0, tensor=torch.randn(3, 11, 64))  # b's is (3, 12)
    replies = batched.batch(
        [
            ("a", _grad("a", 0, 4)),
            ("b", wrong),
            ("c", _grad("c", 0, 5)),
            ("a", _grad("a", 0, 6)),  # a second gradient for a's microbatch 0
            ("c", _grad("c", 3, 7)),  # no such forward
        ]
    )
    assert isinstance(replies[1], InvalidRequestError) and "(3, 11, 64)" in str(replies[1])
    assert isinstance(replies[3], SessionStateError) and "without its ACTIVATION" in str(replies[3])
    assert isinstance(replies[4], SessionStateError) and "without its ACTIVATION" in str(replies[4])
    want = solo.solo([("a", _grad("a", 0, 4)), ("c", _grad("c", 0, 5))])
    _same([replies[0], replies[2]], want)
    assert list(batched.infos["b"].cache) == [0]  # b's tape waits for a right gradient
    late = [("b", _grad("b", 0, 8))] + [(n, StageMsg(Kind.STEP_END, 0)) for n in SHAPES]
    _same(batched.batch(late), solo.solo(late))
    _same_adapters(solo, batched)
