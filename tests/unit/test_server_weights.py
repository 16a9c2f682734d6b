"""server.weights: the server's frozen block linears stored in bf16, int8 or int4.

The same formats as device.weights (fedpipe.split.quant). A stored middle's outputs and
gradients stay near fp32's (bounds below, measured on tiny-llama's random weights); peft's bank
and the batched bank give the same numbers on one stored base; the server built from settings
stores its blocks so, with offload, and still trains (its loss falls); the agreement it sends
devices is fp32's (the base, not its storage); its parameter bytes drop ~2x / ~4x / ~7x;
folding base deltas into a stored base and a mistyped value are refused in one line.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from harness.close import assert_close_to_scale

from fedpipe.config import SERVER_WEIGHTS, FedpipeConfig, load_config
from fedpipe.lora import AdapterBank, BatchedAdapterBank, Group, LoraSettings
from fedpipe.messages import Kind, StageMsg
from fedpipe.models import load_config as load_hf_config
from fedpipe.server.build import build_runtime
from fedpipe.server.sessions import SessionInfo
from fedpipe.split import build_stage, split_layout
from fedpipe.split.quant import StoredLinear, storage_of

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)
SETTINGS = LoraSettings(r=4, alpha=8, seed=3)
# Relative errors against fp32 (||got - fp32|| / ||fp32||) of the middle's output, its input
# gradient and the largest over the LoRA gradients, measured on tiny-llama (4 blocks, width 64):
# bf16 1.0e-4, 1.6e-4, 1.8e-3; int8 3.2e-4, 5.1e-4, 7.7e-3; int4 5.8e-3, 8.4e-3, 0.15.
BOUNDS = {
    "bf16": (1e-3, 1e-3, 1e-2),
    "int8": (2e-3, 3e-3, 4e-2),
    "int4": (3e-2, 4e-2, 0.5),
}
STORED = tuple(BOUNDS)


def _bank(folder: Path, weights: str, *, batched: bool) -> AdapterBank | BatchedAdapterBank:
    """A bank over the whole middle (1 + 1 cut) with adapter "a" at fixed random values."""
    stage = build_stage(
        folder, split_layout(load_hf_config(folder), mode="u"), "middle", weights=weights
    )
    bank = (BatchedAdapterBank if batched else AdapterBank)(stage, SETTINGS, family="llama")
    gen = torch.Generator().manual_seed(1)
    state = bank.global_state()
    bank.add("a", init={k: torch.randn(state[k].shape, generator=gen) * 0.1 for k in sorted(state)})
    bank.add("b", init={k: torch.randn(state[k].shape, generator=gen) * 0.1 for k in sorted(state)})
    return bank


def _through(bank: AdapterBank | BatchedAdapterBank) -> list[torch.Tensor]:
    """Output, input gradient and LoRA gradients of adapter "a" beside adapter "b" in one call
    (the batched bank joins their rows), for a fixed input and a fixed loss."""
    gen = torch.Generator().manual_seed(7)
    xa = torch.randn(2, 9, 64, generator=gen).requires_grad_(True)
    xb = torch.randn(1, 5, 64, generator=gen).requires_grad_(True)
    ya, yb = bank.run([Group("a", xa), Group("b", xb)])
    (ya.pow(2).sum() + yb.pow(2).sum()).backward()
    assert xa.grad is not None
    return [ya.detach(), xa.grad, *[p.grad for p in bank.parameters("a") if p.grad is not None]]


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


@pytest.mark.parametrize("weights", STORED)
def test_a_stored_middle_stays_near_fp32_and_both_banks_agree(folder: Path, weights: str) -> None:
    reference = _through(_bank(folder, "fp32", batched=True))
    batched = _through(_bank(folder, weights, batched=True))
    peft = _through(_bank(folder, weights, batched=False))
    out_bound, dx_bound, lora_bound = BOUNDS[weights]
    assert len(batched) == len(peft) == len(reference) == 2 + 2 * 2 * 4  # A, B of 4 x 2 blocks
    assert _relative(batched[0], reference[0]) < out_bound
    assert _relative(batched[1], reference[1]) < dx_bound
    assert (
        max(_relative(g, w) for g, w in zip(batched[2:], reference[2:], strict=True)) < lora_bound
    )
    assert 0 < _relative(batched[0], reference[0])  # it is stored rounded, not fp32 again
    for got, want in zip(peft, batched, strict=True):  # one base, two banks: fp32 rounding
        assert_close_to_scale(got, want, rel=1e-5, atol=1e-6)


def test_a_lone_sessions_batched_backward_on_a_stored_base_equals_peft(folder: Path) -> None:
    """The executor's path with one session (its rows are the whole joined tensor, under grad
    mode): run_taped and one backward give peft's input and LoRA gradients."""
    gen = torch.Generator().manual_seed(9)
    x, dy = torch.randn(2, 6, 64, generator=gen), torch.randn(2, 6, 64, generator=gen)
    batched = _bank(folder, "int8", batched=True)
    assert isinstance(batched, BatchedAdapterBank)
    ((_, tape),) = batched.run_taped([Group("a", x)])
    (dx,) = batched.backward([(tape, dy)])
    peft = _bank(folder, "int8", batched=False)
    xp = x.clone().requires_grad_(True)
    peft.run([Group("a", xp)])[0].backward(dy)
    assert dx is not None and xp.grad is not None
    assert_close_to_scale(dx, xp.grad, rel=1e-5, atol=1e-6)
    for got, want in zip(batched.parameters("a"), peft.parameters("a"), strict=True):
        assert got.grad is not None and want.grad is not None
        assert_close_to_scale(got.grad, want.grad, rel=1e-5, atol=1e-6)


def test_fp32_builds_the_plain_stage_as_before(folder: Path) -> None:
    plan = split_layout(load_hf_config(folder), mode="u")
    plain, fp32 = (
        build_stage(folder, plan, "middle"),
        build_stage(folder, plan, "middle", weights="fp32"),
    )
    assert storage_of(fp32) == "fp32" and not any(
        isinstance(m, StoredLinear) for m in fp32.modules()
    )
    want = plain.state_dict()
    assert all(torch.equal(t, want[k]) for k, t in fp32.state_dict().items())
    assert FedpipeConfig().server.weights == "fp32"


def test_the_stored_middles_parameters_take_fewer_bytes(folder: Path) -> None:
    """Parameter bytes of the middle (2 blocks of width 64; norms stay fp32): measured 0.50,
    0.27, 0.14 of fp32's at bf16, int8, int4."""
    plan = split_layout(load_hf_config(folder), mode="u")

    def nbytes(weights: str) -> int:
        stage = build_stage(folder, plan, "middle", weights=weights)
        return sum(p.numel() * p.element_size() for p in stage.parameters())

    fp32 = nbytes("fp32")
    ratios = {w: nbytes(w) / fp32 for w in STORED}
    assert ratios["bf16"] < 0.51 and ratios["int8"] < 0.28 and ratios["int4"] < 0.16, ratios


def _config(folder: Path, **flat: object) -> FedpipeConfig:
    return FedpipeConfig().with_overrides(
        {"model.name": str(folder), "model.lora_r": 4, "model.lora_alpha": 8, **flat}
    )


@pytest.mark.parametrize("batching", [True, False], ids=["batched", "peft"])
def test_a_server_built_at_int8_with_offload_trains_and_agrees_as_fp32(
    folder: Path, batching: bool
) -> None:
    """build_runtime with server.weights = int8 and server.offload = auto: the stage is stored,
    the agreement devices check is fp32's, and three steps of two sessions (their outputs'
    squared distance to a target, AdamW) lower the loss of each."""
    flat = {"server.batching": batching, "server.offload": "auto"}
    runtime, split = build_runtime(
        _config(folder, **flat, **{"server.weights": "int8"}), folder=folder
    )
    _, fp32_split = build_runtime(_config(folder, **flat), folder=folder)
    assert split == fp32_split  # fingerprint, dtype, shapes: the base, not its storage
    bank, executor = runtime.bank, runtime.executor
    assert storage_of(bank.stage) == "int8" and executor.stash.offload
    infos = {}
    for name in ("a", "b"):
        bank.add(name)
        opt = torch.optim.AdamW(bank.parameters(name), lr=2e-2)
        infos[name] = SessionInfo(name, f"dev-{name}", 1, opt, 4, 16)
    gen = torch.Generator().manual_seed(3)
    x = {n: torch.randn(2, 8, 64, generator=gen) for n in infos}
    target = {n: torch.randn(2, 8, 64, generator=gen) for n in infos}
    losses: dict[str, list[float]] = {n: [] for n in infos}
    for step in range(4):
        acts = [(infos[n], StageMsg(Kind.ACTIVATION, step, 0, tensor=x[n].clone())) for n in infos]
        grads = []
        for (info, _), reply in zip(acts, executor.compute_batch(acts), strict=True):
            assert isinstance(reply, StageMsg) and reply.tensor is not None, reply
            y = reply.tensor.detach().requires_grad_(True)
            loss = (y - target[info.session_id]).pow(2).mean()
            loss.backward()
            losses[info.session_id].append(float(loss.detach()))
            grads.append((info, StageMsg(Kind.OUTPUT_GRAD, step, 0, tensor=y.grad)))
        for reply in executor.compute_batch(grads):
            assert isinstance(reply, StageMsg) and reply.tensor is not None, reply
        ends = executor.compute_batch([(i, StageMsg(Kind.STEP_END, step)) for i in infos.values()])
        assert all(isinstance(r, StageMsg) for r in ends), ends
    for name, seen in losses.items():
        assert seen[-1] < seen[0] * 0.98, (name, seen)
    assert executor.stash.meter.snapshot()["offloaded_bytes"] == 0  # all let go after the steps


# -- refusals -------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["exact", "stack"])
def test_folding_into_a_stored_base_is_refused_in_one_line(folder: Path, mode: str) -> None:
    with pytest.raises(ValueError) as info:
        load_config(None, {"server.weights": "int8", "federated.aggregation": mode})
    text = str(info.value)
    assert "\n" not in text and "server.weights = int8" in text
    assert f"federated.aggregation = {mode}" in text
    load_config(None, {"server.weights": "int8", "federated.aggregation": "ffa"})
    # a StageServer whose own settings allow it still refuses a run's BeginRound that folds
    for batched in (True, False):
        bank = _bank(folder, "int4", batched=batched)
        with pytest.raises(
            ValueError, match=f"aggregation = {mode} folds .* server.weights = int4"
        ):
            bank.set_aggregation(mode)
        bank.set_aggregation("ffa")
        deltas = {"layers.1.mlp.up_proj.base_delta": torch.zeros(128, 64)}
        with pytest.raises(ValueError, match="stored as int4 .* cannot hold them"):
            bank.set_global_state({**bank.global_state(), **deltas})
    _bank(folder, "fp32", batched=True).set_aggregation(mode)  # fp32 folds as it did


@pytest.mark.parametrize("value", ["int3", "fp16", "", "int8,fp32"])
def test_a_mistyped_server_weights_is_refused_naming_the_allowed(value: str) -> None:
    with pytest.raises(ValueError) as info:
        load_config(None, {"server.weights": value})
    text = str(info.value)
    assert "\n" not in text and text.startswith("server.weights ")
    assert ", ".join(SERVER_WEIGHTS) in text


def test_fedpipe_server_weights_flag_sets_the_setting(capsys: pytest.CaptureFixture[str]) -> None:
    from harness.cli import error_line

    from fedpipe.cli.parser import build_parser

    args = build_parser().parse_args(["server", "--weights", "int8"])
    assert args.weights == "int8"
    assert build_parser().parse_args(["server"]).weights is None  # the config's, fp32
    line = error_line(capsys, ["server", "--weights", "int3"])
    assert line.startswith("fedpipe: error: server.weights 'int3' unknown; choose one of fp32")
