"""server.offload in the executor: shared calls of several sessions, replies and updates to the bit.

Two executors get the same calls, one with ``offload``; calls join several sessions' forwards
(their tapes share the call's storages) and backwards (tapes of several forward calls), on the
batched bank and on peft's, and a forward of a later microbatch comes between two backwards.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from fedpipe.lora import AdapterBank, BatchedAdapterBank, Group, LoraSettings
from fedpipe.messages import Kind, StageMsg
from fedpipe.models import load_config
from fedpipe.server.executor import StageExecutor
from fedpipe.server.sessions import SessionInfo
from fedpipe.server.stash import FETCHED, Stash
from fedpipe.split import build_stage, split_layout

torch.set_num_threads(1)
SETTINGS = LoraSettings(r=4, alpha=8, seed=3)
SHAPES = {"a": (1, 7), "b": (3, 12), "c": (2, 4)}  # rows, tokens per session


class Side:
    """An executor with sessions a, b, c on the same random adapters."""

    def __init__(self, folder: Path, *, batched: bool, offload: bool) -> None:
        stage = build_stage(folder, split_layout(load_config(folder), mode="u"), "middle")
        bank_type = BatchedAdapterBank if batched else AdapterBank
        self.bank = bank_type(stage, SETTINGS, family="llama")
        self.ex = StageExecutor(
            self.bank,
            mode="u",
            hidden_size=64,
            device=torch.device("cpu"),
            dtype=torch.float32,
            max_in_flight=4,
            offload=offload,
        )
        self.ex.stash.meter.enabled = offload  # the default path as it runs, untouched
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


def _x(name: str, seed: int) -> torch.Tensor:
    rows, tokens = SHAPES[name]
    return torch.randn(rows, tokens, 64, generator=torch.Generator().manual_seed(seed))


def _act(name: str, step: int, mb: int) -> tuple[str, StageMsg]:
    return name, StageMsg(Kind.ACTIVATION, step, mb, tensor=_x(name, 100 * step + mb))


def _grad(name: str, step: int, mb: int) -> tuple[str, StageMsg]:
    return name, StageMsg(Kind.OUTPUT_GRAD, step, mb, tensor=_x(name, 100 * step + 50 + mb))


def _calls(step: int) -> list[list[tuple[str, StageMsg]]]:
    return [
        [_act("a", step, 0), _act("b", step, 0), _act("c", step, 0)],  # one call, one storage
        [_act("a", step, 1), _act("b", step, 1)],
        [_grad("b", step, 0), _grad("a", step, 1)],  # tapes of two forward calls
        [_act("c", step, 1)],
        [_grad("a", step, 0), _grad("c", step, 0), _grad("b", step, 1), _grad("c", step, 1)],
        [(n, StageMsg(Kind.STEP_END, step)) for n in SHAPES],
    ]


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "peft"])
def test_offload_replies_and_updates_are_bit_identical(folder: Path, batched: bool) -> None:
    plain = Side(folder, batched=batched, offload=False)
    off = Side(folder, batched=batched, offload=True)
    for step in range(2):
        for call in _calls(step):
            want, got = plain.call(call), off.call(call)
            for g, w in zip(got, want, strict=True):
                assert isinstance(g, StageMsg) and isinstance(w, StageMsg), (g, w)
                assert (g.kind, g.microbatch) == (w.kind, w.microbatch)
                assert (g.tensor is None) == (w.tensor is None)
                if w.tensor is not None:
                    assert g.tensor is not None and torch.equal(g.tensor, w.tensor)
    for name in SHAPES:
        for key, value in plain.bank.state_dict(name).items():
            assert torch.equal(off.bank.state_dict(name)[key], value), (name, key)
    snap = off.ex.stash.meter.snapshot()
    # in host memory while waiting; on the device only the batched bank's received inputs
    assert snap["peak_offloaded_bytes"] > 0
    assert snap["peak_waiting_bytes"] < snap["peak_offloaded_bytes"] / 2
    assert snap["stash_bytes"] == snap["offloaded_bytes"] == 0  # all let go after the steps


def test_a_backward_brings_the_tapes_back_a_block_at_a_time(folder: Path) -> None:
    """Three middle blocks, two sessions' tapes of one call: the backward's gradients equal
    those from the tapes that never left, and at most two blocks' records (the one computing,
    the next one's copies) are back on the device at once."""
    plan = split_layout(load_config(folder), head_layers=1, tail_layers=0, mode="u")
    stage = build_stage(folder, plan, "middle")
    bank = BatchedAdapterBank(stage, SETTINGS, family="llama")
    gen = torch.Generator().manual_seed(5)
    for name in "ab":
        bank.add(
            name,
            init={
                k: torch.randn(v.shape, generator=gen) * 0.1 for k, v in bank.global_state().items()
            },
        )
    xs = [torch.randn(2, 9, 64, generator=gen), torch.randn(1, 5, 64, generator=gen)]
    taped = bank.run_taped([Group("a", xs[0]), Group("b", xs[1])])
    dys = [torch.randn(y.shape, generator=gen) for y, _ in taped]
    params = [p for n in "ab" for p in bank.parameters(n)]
    want = bank.backward([(tape, dy) for (_, tape), dy in zip(taped, dys, strict=True)])
    want_grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    stash = Stash(torch.device("cpu"), offload=True)
    stash.meter.enabled = True
    host = stash.put_tapes([tape for _, tape in taped], xs)
    offloaded = stash.meter.snapshot()["offloaded_bytes"]
    got = bank.backward(list(zip(stash.fetch_tapes(host), dys, strict=True)))
    for g, w in zip([*got, *(p.grad for p in params)], [*want, *want_grads], strict=True):
        assert g is not None and w is not None and torch.equal(g, w)
    fetched = stash.meter.peak[FETCHED]
    assert 0 < fetched <= offloaded * 2 / 3 * 1.01, (fetched, offloaded)
