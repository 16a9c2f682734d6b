"""Batched multi-adapter compute: each session's numbers in a batch equal its solo run.

The reference is peft's AdapterBank running the HF decoder layers (``run_blocks``) one session at
a time; the batched bank runs several sessions' microbatches of different sizes and lengths in
one call. Outputs, input gradients and adapter gradients must agree at fp32 tolerance, for
tiny-llama and for a tiny random stage of every other family the batched bank computes
(:mod:`harness.tiny_families`: q/k norms, post-norms, fused projections, multipliers, ...).
"""

from __future__ import annotations

import copy
import gc
import weakref
from pathlib import Path

import pytest
import torch
from harness.close import (
    FLOAT32_ATOL,
    FLOAT32_REL,
    assert_close_to_scale,
    assert_states_close_to_scale,
)
from harness.tiny_families import CASES, tiny_stage
from transformers import MistralConfig

from fedpipe.lora import (
    AdapterBank,
    BatchedAdapterBank,
    Group,
    LoraSettings,
    adapter_bank,
    batchable,
)
from fedpipe.models import load_config, resolve_model
from fedpipe.split import MiddleStage, build_stage, split_layout

torch.set_num_threads(1)
SETTINGS = LoraSettings(r=4, alpha=8, seed=3)
TOL = {"atol": 1e-5, "rel": 1e-5}
# (adapter, rows, tokens): different sizes and lengths in one call, one adapter twice.
SHAPES = [("a", 1, 7), ("b", 3, 12), ("c", 2, 4), ("a", 2, 12)]
# tiny-llama, then a tiny random stage of each other family the batched bank computes.
FAMILY_CASES = ["tiny-llama", *CASES]


def _stage(family: str, folder: Path, mode: str = "u") -> torch.nn.Module:
    """The server's stage of ``family`` in split ``mode``: tiny-llama's from its folder, the
    others' tiny random blocks 1 and 2 (the loss stage in mode "two")."""
    if family == "tiny-llama":
        plan = split_layout(load_config(folder), mode=mode)
        return build_stage(folder, plan, "middle" if mode == "u" else "server_loss")
    return tiny_stage(family, "middle" if mode == "u" else "loss")


def _random_adapter(template: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=gen) * 0.1 for k, v in template.items()}


def _banks(stage: torch.nn.Module) -> tuple[AdapterBank, BatchedAdapterBank]:
    """The same stage under peft's bank and the batched one, with the same three adapters."""
    solo = AdapterBank(copy.deepcopy(stage), SETTINGS, family="llama")
    batched = BatchedAdapterBank(stage, SETTINGS, family="llama")
    for seed, name in enumerate("abc", start=1):
        state = _random_adapter(batched.global_state(), seed)
        solo.add(name, init=state)
        batched.add(name, init=state)
    return solo, batched


def _inputs(seed: int = 0) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (name, torch.randn(b, t, 64, generator=gen), torch.randint(0, 200, (b, t), generator=gen))
        for name, b, t in SHAPES
    ]


def _grads(bank: AdapterBank | BatchedAdapterBank, name: str) -> list[torch.Tensor | None]:
    out = [None if p.grad is None else p.grad.clone() for p in bank.parameters(name)]
    for p in bank.parameters(name):
        p.grad = None
    return out


def _close(got: list[torch.Tensor | None], want: list[torch.Tensor | None]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert (g is None) == (w is None)
        if g is not None:
            assert_close_to_scale(g, w, **TOL)


@pytest.mark.parametrize("family", FAMILY_CASES)
def test_same_keys_init_and_state_as_the_peft_bank(folder: Path, family: str) -> None:
    solo, batched = _banks(_stage(family, folder))
    for name in ("global", "a"):
        want, got = solo.state_dict(name), batched.state_dict(name)
        assert list(got) == list(want)  # same keys, same order
        for key in want:
            assert torch.equal(got[key], want[key]), key
    assert [p.shape for p in batched.parameters("b")] == [p.shape for p in solo.parameters("b")]
    assert all(p.requires_grad for p in batched.parameters("b"))
    assert not any(p.requires_grad for p in batched.parameters("global"))


@pytest.mark.parametrize("family", FAMILY_CASES)
def test_u_mode_batched_equals_solo(folder: Path, family: str) -> None:
    solo, batched = _banks(_stage(family, folder))
    inputs = _inputs()
    gen = torch.Generator().manual_seed(9)
    out_grads = [torch.randn(x.shape, generator=gen) for _, x, _ in inputs]
    want = []
    for (name, x, _), g in zip(inputs, out_grads, strict=True):
        x = x.clone().requires_grad_(True)
        y = solo.run([Group(name, x)])[0]
        y.backward(g)
        want.append((y.detach(), x.grad, _grads(solo, name)))
    xs = [x.clone().requires_grad_(True) for _, x, _ in inputs]
    ys = batched.run([Group(name, x) for (name, _, _), x in zip(inputs, xs, strict=True)])
    for i, ((name, _, _), x, y, g) in enumerate(zip(inputs, xs, ys, out_grads, strict=True)):
        assert_close_to_scale(y, want[i][0], **TOL)
        y.backward(g)  # one at a time: each group's graph is its own
        assert_close_to_scale(x.grad, want[i][1], **TOL)
        _close(_grads(batched, name), want[i][2])


@pytest.mark.parametrize(
    ("family", "loss_chunk"),
    [*((f, None) for f in FAMILY_CASES), ("granite", 0), ("gemma2", 0)],
    ids=lambda v: "chunked" if v is None else "full-logits" if v == 0 else v,
)
def test_two_mode_loss_and_grads_equal_solo(
    folder: Path, family: str, loss_chunk: int | None
) -> None:
    """The loss over chunks of tokens, or over the full logits (``loss_chunk`` 0: each
    family's logits post-processing, Granite's scaling and Gemma's soft-capping, applies)."""
    stage = _stage(family, folder, mode="two")
    if loss_chunk is not None:
        stage.loss_chunk = loss_chunk
    solo, batched = _banks(stage)
    inputs = _inputs(seed=4)
    want = []
    for name, x, labels in inputs:
        x = x.clone().requires_grad_(True)
        loss, tokens = solo.run_loss([Group(name, x, labels)])[0]
        loss.backward()
        want.append((loss.detach(), tokens, x.grad, _grads(solo, name)))
    xs = [x.clone().requires_grad_(True) for _, x, _ in inputs]
    groups = [Group(n, x, labels) for (n, _, labels), x in zip(inputs, xs, strict=True)]
    results = batched.run_loss(groups)
    torch.autograd.backward([loss for loss, _ in results])  # several sessions' backward at once
    for (name, _, _), x, (loss, tokens), expected in zip(inputs, xs, results, want, strict=True):
        assert_close_to_scale(loss.detach(), expected[0], **TOL)
        assert tokens == expected[1]
        assert_close_to_scale(x.grad, expected[2], **TOL)
        if name != "a":  # "a" has two groups: its gradients are their sum, checked below
            _close(_grads(batched, name), expected[3])
    summed = [
        g1 + g2 for g1, g2 in zip(want[0][3], want[3][3], strict=True) if g1 is not None
    ]  # both groups of "a"
    _close(_grads(batched, "a"), summed)  # type: ignore[arg-type]


@pytest.mark.parametrize("family", FAMILY_CASES)
def test_optimizer_steps_leave_each_adapter_as_the_peft_bank_does(
    folder: Path, family: str
) -> None:
    """Two AdamW steps per session (the server's path: tapes, one backward over every
    session's gradients): every adapter ends where peft's bank, one session at a time, takes it."""
    solo, batched = _banks(_stage(family, folder))
    names = "abc"
    optimizers = {
        bank: {n: torch.optim.AdamW(bank.parameters(n), lr=1e-2) for n in names}
        for bank in (solo, batched)
    }
    for step in range(2):
        inputs = _inputs(seed=10 + step)
        gen = torch.Generator().manual_seed(20 + step)
        out_grads = [torch.randn(x.shape, generator=gen) for _, x, _ in inputs]
        for (name, x, _), g in zip(inputs, out_grads, strict=True):
            solo.run([Group(name, x)])[0].backward(g)
        taped = batched.run_taped([Group(name, x) for name, x, _ in inputs])
        batched.backward([(tape, g) for (_, tape), g in zip(taped, out_grads, strict=True)])
        for bank in (solo, batched):
            for optimizer in optimizers[bank].values():
                optimizer.step()
                optimizer.zero_grad()
    for name in names:
        want, got = solo.state_dict(name), batched.state_dict(name)
        assert list(got) == list(want)
        for key, value in want.items():
            assert not torch.equal(value, _random_adapter(want, names.index(name) + 1)[key])
            assert_close_to_scale(got[key], value, **TOL, msg=key)


def test_lone_backward_needs_and_costs_only_its_own_session(folder: Path) -> None:
    stage = build_stage(folder, split_layout(load_config(folder)), "middle")
    _, batched = _banks(stage)
    xa = torch.randn(1, 5, 64).requires_grad_(True)
    xb = torch.randn(2, 8, 64).requires_grad_(True)
    ya, yb = batched.run([Group("a", xa), Group("b", xb)])
    ya.backward(torch.ones_like(ya))  # b's gradient has not arrived
    assert xa.grad is not None and xb.grad is None
    assert all(p.grad is not None for p in batched.parameters("a"))
    assert all(p.grad is None for p in batched.parameters("b"))
    probe = weakref.ref(xa)  # a's graph holds its input: gone once a drops its output
    del ya, xa
    gc.collect()
    assert probe() is None, "session a's graph outlived its output"
    yb.backward(torch.ones_like(yb))  # b's graph is intact after a's backward
    assert xb.grad is not None and all(p.grad is not None for p in batched.parameters("b"))


def test_sliding_window_and_gqa_equal_the_hf_layers() -> None:
    config = MistralConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=5,
        vocab_size=300,
        max_position_embeddings=128,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    stage = MiddleStage(config, [1, 2])
    solo, batched = _banks(stage)
    for length in (4, 11):  # shorter and longer than the window
        x = torch.randn(2, length, 64)
        want = solo.run([Group("b", x)])[0]
        got = batched.run([Group("b", x), Group("c", torch.randn(1, 3, 64))])[0]
        assert_close_to_scale(got, want, **TOL)


def test_bank_api_add_remove_merge(folder: Path) -> None:
    stage = build_stage(folder, split_layout(load_config(folder)), "middle")
    bank = BatchedAdapterBank(stage, SETTINGS, family="llama")
    states = {n: _random_adapter(bank.global_state(), seed) for seed, n in enumerate("abc")}
    for name, state in states.items():
        bank.add(name, init=state)
    assert bank.names() == ["a", "b", "c"]
    with pytest.raises(ValueError, match="already exists"):
        bank.add("a")
    with pytest.raises(KeyError, match="does not fit"):
        bank.add("bad", init={"x": torch.zeros(1)})
    assert "bad" not in bank.names()
    merged = bank.merge({"a": 1.0, "b": 3.0})
    for key, value in merged.items():
        assert_close_to_scale(
            value,
            0.25 * states["a"][key] + 0.75 * states["b"][key],
            rel=FLOAT32_REL,
            atol=FLOAT32_ATOL,
        )
        assert_close_to_scale(
            bank.global_state()[key], value, rel=FLOAT32_REL, atol=FLOAT32_ATOL, msg=key
        )
    assert bank.names() == ["c"]
    bank.add("d")
    assert_states_close_to_scale(bank.state_dict("d"), merged, rel=FLOAT32_REL, atol=FLOAT32_ATOL)
    bank.reset_global_state()
    with pytest.raises(KeyError, match="no adapter 'a'"):
        bank.run([Group("a", torch.randn(1, 2, 64))])


def test_adapter_bank_falls_back_where_batching_cannot_run(tmp_path: Path) -> None:
    folder = resolve_model("tiny-gpt2", cache_dir=tmp_path)
    stage = build_stage(folder, split_layout(load_config(folder)), "middle")
    bank = adapter_bank(stage, SETTINGS, family="gpt2")
    assert isinstance(bank, AdapterBank)
    assert "gpt2 family has no batched forward (Llama-layout blocks only" in batchable(
        stage, SETTINGS, "gpt2"
    )
    bank.add("a")
    (y,) = bank.run([Group("a", torch.randn(1, 3, 64))])
    assert y.shape == (1, 3, 64)


def test_a_group_with_its_own_block_range_equals_a_stage_of_those_blocks(folder: Path) -> None:
    """Devices with other cuts in one call: each group runs only the blocks it names."""
    plan = split_layout(load_config(folder))
    stage = build_stage(folder, plan, "middle")
    held = stage.block_indices
    assert len(held) >= 2
    _, batched = _banks(stage)
    short = MiddleStage(stage.config, held[1:])
    short.load_state_dict(stage.state_dict(), strict=False)  # the same weights, fewer blocks
    reference = BatchedAdapterBank(short, SETTINGS, family="llama")
    state = batched.state_dict("a")
    reference.add("a", init={k: state[k] for k in reference.global_state()})  # a's, those blocks
    x, other = torch.randn(2, 6, 64), torch.randn(1, 9, 64)
    got, full = batched.run([Group("a", x, blocks=tuple(held[1:])), Group("b", other)])
    assert_close_to_scale(got, reference.run([Group("a", x)])[0], **TOL)
    assert_close_to_scale(full, batched.run([Group("b", other)])[0], **TOL)
    with pytest.raises(ValueError, match="a non-empty subset, in order"):
        batched.run([Group("a", x, blocks=(99,))])
