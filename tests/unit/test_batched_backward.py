"""The batched backward over sessions' tapes equals each session's solo autograd run.

The reference is peft's AdapterBank through the HF decoder layers, one session at a time. The
batched bank records a tape per group in one forward call (or several) and runs the backward of
any set of them in one call: input gradients and every adapter's A and B gradients must agree at
fp32 tolerance, for groups of different rows and lengths, subsets, the banded mask of a sliding
window, GQA, groups with their own block range, and frozen heads; on tiny-llama and on a tiny
random stage of every other family the batched bank computes (:mod:`harness.tiny_families`).
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from harness.close import assert_close_to_scale
from harness.tiny_families import CASES, lora_targets, tiny_stage
from transformers import MistralConfig

from fedpipe.lora import AdapterBank, BatchedAdapterBank, Group, LoraSettings
from fedpipe.lora.batched_blocks import Tape
from fedpipe.models import load_config
from fedpipe.models.families import FAMILIES
from fedpipe.split import MiddleStage, build_stage, split_layout

torch.set_num_threads(1)
SETTINGS = LoraSettings(r=4, alpha=8, seed=3, targets=("q_proj", "v_proj", "o_proj", "up_proj"))
TOL = {"rel": 1e-5, "atol": 1e-5}  # harness.close: relative to the scale


# (adapter, rows, tokens): different sizes and lengths, adapter "a" twice.
SHAPES = [("a", 1, 7), ("b", 3, 12), ("c", 2, 4), ("a", 2, 12), ("b", 1, 4)]
Grads = list[torch.Tensor | None]
FAMILY_CASES = ["tiny-llama", *CASES]  # tiny-llama, then each other family batched


def _banks(
    stage: torch.nn.Module, settings: LoraSettings = SETTINGS
) -> tuple[AdapterBank, BatchedAdapterBank]:
    """The same stage under peft's bank and the batched one, with the same three adapters."""
    solo = AdapterBank(copy.deepcopy(stage), settings, family="llama")
    batched = BatchedAdapterBank(stage, settings, family="llama")
    for seed, name in enumerate("abc", start=1):
        gen = torch.Generator().manual_seed(seed)
        state = {
            k: torch.randn(v.shape, generator=gen) * 0.1 for k, v in batched.global_state().items()
        }
        solo.add(name, init=state)
        batched.add(name, init=state)
    return solo, batched


def _family_banks(family: str, folder: Path) -> tuple[AdapterBank, BatchedAdapterBank]:
    """Both banks over ``family``'s middle stage, SETTINGS' targets in its linears' names."""
    if family == "tiny-llama":
        return _banks(build_stage(folder, split_layout(load_config(folder)), "middle"))
    targets = lora_targets(family, SETTINGS.targets or ())
    return _banks(tiny_stage(family), dataclasses.replace(SETTINGS, targets=targets))


def _cases(width: int, seed: int = 0) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(adapter, input, output gradient) per group of SHAPES."""
    gen = torch.Generator().manual_seed(seed)
    return [
        (n, torch.randn(b, t, width, generator=gen), torch.randn(b, t, width, generator=gen))
        for n, b, t in SHAPES
    ]


def _take(bank: AdapterBank | BatchedAdapterBank, name: str) -> Grads:
    out = [None if p.grad is None else p.grad.clone() for p in bank.parameters(name)]
    for p in bank.parameters(name):
        p.grad = None
    return out


def _close(got: Grads, want: Grads) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert (g is None) == (w is None)
        if g is not None:
            assert_close_to_scale(g, w, **TOL)


def _solo(
    solo: AdapterBank, cases: list[tuple[str, torch.Tensor, torch.Tensor]], picked: list[int]
) -> tuple[list[torch.Tensor], dict[str, Grads]]:
    """Input gradients of the picked groups and each adapter's summed gradients, one by one."""
    dxs = []
    for i in picked:
        name, x, g = cases[i]
        x = x.clone().requires_grad_(True)
        solo.run([Group(name, x)])[0].backward(g)
        assert x.grad is not None
        dxs.append(x.grad)
    return dxs, {name: _take(solo, name) for name in "abc"}


def _check(
    solo: AdapterBank,
    batched: BatchedAdapterBank,
    cases: list[tuple[str, torch.Tensor, torch.Tensor]],
    picked: list[int],
    got: list[torch.Tensor | None],
) -> None:
    want, grads = _solo(solo, cases, picked)
    for g, w in zip(got, want, strict=True):
        assert g is not None
        assert_close_to_scale(g, w, **TOL)
    for name in "abc":
        _close(_take(batched, name), grads[name])


def _forward(
    batched: BatchedAdapterBank, cases: list[tuple[str, torch.Tensor, torch.Tensor]]
) -> list[tuple[torch.Tensor, Tape]]:
    return batched.run_taped([Group(n, x) for n, x, _ in cases])


@pytest.mark.parametrize("family", FAMILY_CASES)
def test_one_backward_over_every_session_equals_solo(folder: Path, family: str) -> None:
    solo, batched = _family_banks(family, folder)
    cases = _cases(64)
    taped = _forward(batched, cases)
    for (y, _), (name, x, _) in zip(taped, cases, strict=True):
        assert_close_to_scale(y, solo.run([Group(name, x)])[0].detach(), **TOL)
    got = batched.backward([(tape, g) for (_, tape), (_, _, g) in zip(taped, cases, strict=True)])
    _check(solo, batched, cases, list(range(len(cases))), got)


@pytest.mark.parametrize("family", FAMILY_CASES)
@pytest.mark.parametrize("chunk_rows", [None, 30])
def test_subsets_from_several_forward_calls_equal_solo(
    folder: Path, chunk_rows: int | None, family: str
) -> None:
    """Tapes of two forward calls, backward in two calls that mix them (and run by chunks)."""
    solo, batched = _family_banks(family, folder)
    batched._runner.cpu_chunk_rows = chunk_rows
    cases = _cases(64, seed=1)
    tapes = [t for _, t in _forward(batched, cases[:3])] + [
        t for _, t in _forward(batched, cases[3:])
    ]
    for picked in ([4, 0, 2], [1, 3]):
        got = batched.backward([(tapes[i], cases[i][2]) for i in picked])
        _check(solo, batched, cases, picked, got)


@pytest.mark.parametrize("fused", [True, False])
def test_sliding_window_and_gqa_equal_the_hf_layers(fused: bool) -> None:
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
    solo, batched = _banks(MiddleStage(config, [1, 2]))
    batched._runner.fused_attention = fused  # False: the backward recomputes under autograd
    cases = _cases(64, seed=2)  # lengths 4, 7, 12: shorter and longer than the window
    taped = _forward(batched, cases)
    assert all((t.blocks[1].lse is not None) == fused for _, t in taped)
    got = batched.backward([(tape, g) for (_, tape), (_, _, g) in zip(taped, cases, strict=True)])
    _check(solo, batched, cases, list(range(len(cases))), got)


@pytest.mark.parametrize("family", list(CASES))
@pytest.mark.parametrize("fused", [True, False])
def test_each_family_with_and_without_the_fused_attention_kernel(family: str, fused: bool) -> None:
    """Attention's backward from the fused CPU kernel's log-sum-exp, or recomputed (Gemma 2's
    soft-capped eager attention always recomputes), and frozen heads on a tape."""
    solo, batched = _family_banks(family, Path())
    batched._runner.fused_attention = fused
    cases = _cases(64, seed=2)
    taped = batched.run_taped([Group(n, x) for n, x, _ in cases], [True, False, True, True, True])
    capped = batched._runner.softcap is not None
    assert all((t.blocks[1].lse is not None) == (fused and not capped) for _, t in taped)
    got = batched.backward([(tape, g) for (_, tape), (_, _, g) in zip(taped, cases, strict=True)])
    assert got[1] is None
    want, grads = _solo(solo, cases, list(range(len(cases))))
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if i != 1:
            assert_close_to_scale(g, w, **TOL)
    for name in "abc":
        _close(_take(batched, name), grads[name])


# (family, layout field, value): without it the batched numbers are not the family's.
_WITHOUT = [
    ("qwen3", "qk_norm", "none"),
    ("smollm3", "rope_layers", None),
    ("granite", "residual_multiplier", None),
    ("olmo2", "attn_post_norm", None),
    ("olmo2", "mlp_post_norm", None),
    ("gemma2", "softcap", None),
    ("gemma2", "norm_offset", 0.0),
    ("gemma3", "qk_norm", "none"),
]


@pytest.mark.parametrize(("family", "field", "value"), _WITHOUT)
def test_each_layout_field_changes_the_numbers(
    family: str, field: str, value: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tests above would see a layout detail missed: each field moves an output or a
    gradient beyond their tolerance."""
    model_type = CASES[family][0]
    spec = FAMILIES[model_type]
    plain = dataclasses.replace(spec, block=dataclasses.replace(spec.block, **{field: value}))
    solo, _ = _family_banks(family, Path())
    monkeypatch.setitem(FAMILIES, model_type, plain)
    batched = BatchedAdapterBank(tiny_stage(family), solo.settings, family="llama")
    batched.add("a", init=solo.state_dict("a"))
    name, x, g = _cases(64, seed=5)[1]
    x = x.clone().requires_grad_(True)
    y = solo.run([Group("a", x)])[0]
    y.backward(g)
    ((got, tape),) = batched.run_taped([Group("a", x.detach())])
    (dx,) = batched.backward([(tape, g)])
    assert dx is not None and x.grad is not None
    # a negative check (some element differs), per element as it was
    apart = {"rtol": 1e-5, "atol": 1e-5}
    differs = not torch.allclose(got, y.detach(), **apart) or not torch.allclose(
        dx, x.grad, **apart
    )
    assert differs, f"{family} without {field} computes the same numbers"


def test_a_group_with_its_own_block_range_skips_the_others_in_backward(folder: Path) -> None:
    stage = build_stage(folder, split_layout(load_config(folder)), "middle")
    held = stage.block_indices
    _, batched = _banks(stage)
    short = MiddleStage(stage.config, held[1:])
    short.load_state_dict(stage.state_dict(), strict=False)  # the same weights, fewer blocks
    reference = BatchedAdapterBank(short, SETTINGS, family="llama")
    state = batched.state_dict("a")
    reference.add("a", init={k: state[k] for k in reference.global_state()})
    x, gx = torch.randn(2, 6, 64), torch.randn(2, 6, 64)
    other, go = torch.randn(1, 9, 64), torch.randn(1, 9, 64)
    (_, ta), (_, tb) = batched.run_taped([Group("a", x, blocks=tuple(held[1:])), Group("b", other)])
    assert sorted(ta.blocks) == list(held[1:])
    (dx, _) = batched.backward([(ta, gx), (tb, go)])
    ((_, tr),) = reference.run_taped([Group("a", x)])
    (want,) = reference.backward([(tr, gx)])
    assert_close_to_scale(dx, want, **TOL)
    got = batched.named_parameters("a")
    for key, p in reference.named_parameters("a").items():
        assert p.grad is not None
        assert_close_to_scale(got[key].grad, p.grad, **TOL)
    skipped = [p for k, p in got.items() if k.startswith(f"layers.{held[0]}.")]
    assert skipped and all(p.grad is None for p in skipped)


def test_frozen_heads_get_no_input_gradient_and_the_same_adapter_gradients(folder: Path) -> None:
    solo, batched = _banks(build_stage(folder, split_layout(load_config(folder)), "middle"))
    cases = _cases(64, seed=3)[:3]
    groups = [Group(n, x) for n, x, _ in cases]
    taped = batched.run_taped(groups, need_input_grad=[False, True, False])
    got = batched.backward([(tape, g) for (_, tape), (_, _, g) in zip(taped, cases, strict=True)])
    assert got[0] is None and got[2] is None and got[1] is not None
    want, grads = _solo(solo, cases, [0, 1, 2])
    assert_close_to_scale(got[1], want[1], **TOL)
    for name in "abc":
        _close(_take(batched, name), grads[name])


def test_a_frozen_lora_a_gets_no_gradient(folder: Path) -> None:
    """FFA-LoRA trains B only: the backward leaves A's gradient as autograd would (None)."""
    _, batched = _banks(build_stage(folder, split_layout(load_config(folder)), "middle"))
    params = batched.named_parameters("a")
    for key, p in params.items():
        if ".lora_A." in key:
            p.requires_grad_(False)
    ((_, tape),) = batched.run_taped([Group("a", torch.randn(1, 5, 64))])
    batched.backward([(tape, torch.randn(1, 5, 64))])
    for key, p in params.items():
        assert (p.grad is None) == (".lora_A." in key), key


def test_a_wrong_gradient_shape_raises_and_accumulates_nothing(folder: Path) -> None:
    _, batched = _banks(build_stage(folder, split_layout(load_config(folder)), "middle"))
    (_, ta), (_, tb) = batched.run_taped(
        [Group("a", torch.randn(1, 5, 64)), Group("b", torch.randn(2, 3, 64))]
    )
    with pytest.raises(ValueError, match=r"shape \(2, 4, 64\).*\(2, 3, 64\)"):
        batched.backward([(ta, torch.randn(1, 5, 64)), (tb, torch.randn(2, 4, 64))])
    assert all(p.grad is None for n in "ab" for p in batched.parameters(n))


def test_a_tape_is_freed_when_its_session_drops_it(folder: Path) -> None:
    _, batched = _banks(build_stage(folder, split_layout(load_config(folder)), "middle"))
    (_, ta), (_, tb) = batched.run_taped(
        [Group("a", torch.randn(1, 5, 64)), Group("b", torch.randn(2, 8, 64))]
    )
    probe = weakref.ref(ta)
    record = weakref.ref(next(iter(ta.blocks.values())))
    del ta
    gc.collect()
    assert probe() is None and record() is None, "session a's tape outlived its last reference"
    batched.backward([(tb, torch.ones(2, 8, 64))])  # b's tape is intact
    assert all(p.grad is not None for p in batched.parameters("b"))
    assert all(p.grad is None for p in batched.parameters("a"))
