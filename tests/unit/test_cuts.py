"""Devices of one run on different cuts: one server stage holds the union of their blocks.

Each session runs exactly the blocks its cut leaves to the server. Its numbers in a batched
call (outputs or loss, input gradients, adapter gradients) must equal a solo run on a stage
built for its cut alone, at fp32 tolerance; and a round's merge averages each block's adapter
over the sessions that ran it, the weights renormalised per block.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from flwr.app import ArrayRecord, MetricRecord, RecordDict
from harness.close import FLOAT32_ATOL, FLOAT32_REL, assert_close_to_scale

from fedpipe.config import FedpipeConfig, ModelConfig, parse_cuts
from fedpipe.errors import SplitMismatchError
from fedpipe.lora import AdapterBank, BatchedAdapterBank, Group, LoraSettings
from fedpipe.lora.aggregation import adapter_block, aggregate_adapters, aggregate_held
from fedpipe.models import load_config, resolve_model
from fedpipe.split import SplitTerms, build_stage, check_agreement, split_layout

torch.set_num_threads(1)
SETTINGS = LoraSettings(r=4, alpha=8, seed=3)
TOL = {"atol": 1e-5, "rel": 1e-5}
# (session, cut (head, tail), rows, tokens) on a 4-block model; the stage holds blocks 1..2.
U_SESSIONS = [("a", (1, 1), 2, 9), ("b", (2, 1), 3, 12), ("c", (1, 2), 1, 5), ("d", (2, 1), 2, 4)]
TWO_SESSIONS = [("a", (1, 0), 2, 9), ("b", (2, 0), 3, 12), ("c", (3, 0), 1, 5)]


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-gpt2"])
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return resolve_model(request.param, cache_dir=tmp_path_factory.mktemp("cache"))


def _random_adapter(template: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=gen) * 0.1 for k, v in template.items()}


def _server_blocks(cut: tuple[int, int], num_layers: int) -> tuple[int, ...]:
    return tuple(range(cut[0], num_layers - cut[1]))


def _union_bank(folder: Path, mode: str) -> AdapterBank | BatchedAdapterBank:
    """The server's bank over the union stage (blocks 1.. of 4): batched where it can be."""
    plan = split_layout(load_config(folder), head_layers=1, tail_layers=1, mode=mode)  # type: ignore[arg-type]
    stage = build_stage(folder, plan, "middle" if mode == "u" else "server_loss")
    if getattr(stage, "family", "") == "llama":
        return BatchedAdapterBank(stage, SETTINGS, family="llama")
    return AdapterBank(stage, SETTINGS, family="gpt2")


def _solo_bank(folder: Path, cut: tuple[int, int], mode: str, state: dict) -> AdapterBank:  # type: ignore[type-arg]
    """peft's bank on a stage built for ``cut`` alone, holding adapter "s" = ``state``'s part."""
    config = load_config(folder)
    plan = split_layout(config, head_layers=cut[0], tail_layers=cut[1], mode=mode)  # type: ignore[arg-type]
    stage = build_stage(folder, plan, "middle" if mode == "u" else "server_loss")
    bank = AdapterBank(stage, SETTINGS, family=getattr(stage, "family"))  # noqa: B009
    held = plan.server_blocks
    bank.add("s", init={k: v for k, v in state.items() if adapter_block(k) in held})
    return bank


def _grads(params: dict[str, torch.nn.Parameter]) -> dict[str, torch.Tensor | None]:
    out = {k: None if p.grad is None else p.grad.clone() for k, p in params.items()}
    for p in params.values():
        p.grad = None
    return out


def _check_grads(got: dict, want: dict) -> None:  # type: ignore[type-arg]
    """Keys of the session's blocks equal the solo ones; the other blocks got no gradient."""
    for key, grad in got.items():
        if key in want:
            assert_close_to_scale(grad, want[key], **TOL)
        else:
            assert grad is None, f"{key}: a block outside the session's cut got a gradient"


def _inputs(sessions, width: int, vocab: int, seed: int):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(b, t, width, generator=gen), torch.randint(0, vocab, (b, t), generator=gen))
        for _, _, b, t in sessions
    ]


def test_u_sessions_of_different_cuts_in_one_call_equal_their_solo_runs(folder: Path) -> None:
    config = load_config(folder)
    bank = _union_bank(folder, "u")
    states = {}
    for i, (name, _, _, _) in enumerate(U_SESSIONS[:3]):
        states[name] = _random_adapter(bank.global_state(), seed=i + 1)
        bank.add(name, init=states[name])
    states["d"] = states["b"]  # "d" is a second microbatch of session "b"
    inputs = _inputs(U_SESSIONS, config.hidden_size, config.vocab_size, seed=0)
    gen = torch.Generator().manual_seed(5)
    out_grads = [torch.randn(x.shape, generator=gen) for x, _ in inputs]
    xs = [x.clone().requires_grad_(True) for x, _ in inputs]
    groups = [
        Group("b" if name == "d" else name, x, blocks=_server_blocks(cut, 4))
        for (name, cut, _, _), x in zip(U_SESSIONS, xs, strict=True)
    ]
    ys = bank.run(groups)
    for i, (name, cut, _, _) in enumerate(U_SESSIONS):
        solo = _solo_bank(folder, cut, "u", states[name])
        x = inputs[i][0].clone().requires_grad_(True)
        want = solo.run([Group("s", x)])[0]
        want.backward(out_grads[i])
        assert_close_to_scale(ys[i], want, **TOL)
        ys[i].backward(out_grads[i])  # one session's backward at a time
        assert_close_to_scale(xs[i].grad, x.grad, **TOL)
        if name in ("a", "c"):  # "b" and "d" share an adapter: their sum is checked apart
            _check_grads(_grads(bank.named_parameters(name)), _grads(solo.named_parameters("s")))


def test_two_mode_sessions_of_different_heads_equal_their_solo_losses(folder: Path) -> None:
    config = load_config(folder)
    bank = _union_bank(folder, "two")
    states = {}
    for i, (name, _, _, _) in enumerate(TWO_SESSIONS):
        states[name] = _random_adapter(bank.global_state(), seed=10 + i)
        bank.add(name, init=states[name])
    inputs = _inputs(TWO_SESSIONS, config.hidden_size, config.vocab_size, seed=3)
    xs = [x.clone().requires_grad_(True) for x, _ in inputs]
    groups = [
        Group(name, x, labels, blocks=_server_blocks(cut, 4))
        for (name, cut, _, _), x, (_, labels) in zip(TWO_SESSIONS, xs, inputs, strict=True)
    ]
    results = bank.run_loss(groups)
    torch.autograd.backward([loss for loss, _ in results])  # all sessions' backward at once
    for i, (name, cut, _, _) in enumerate(TWO_SESSIONS):
        solo = _solo_bank(folder, cut, "two", states[name])
        x = inputs[i][0].clone().requires_grad_(True)
        loss, tokens = solo.run_loss([Group("s", x, inputs[i][1])])[0]
        loss.backward()
        assert_close_to_scale(results[i][0].detach(), loss.detach(), **TOL)
        assert results[i][1] == tokens
        assert_close_to_scale(xs[i].grad, x.grad, **TOL)
        _check_grads(_grads(bank.named_parameters(name)), _grads(solo.named_parameters("s")))


def test_a_loss_group_must_end_at_the_stage_s_last_block(folder: Path) -> None:
    bank = _union_bank(folder, "two")
    bank.add("a")
    x, labels = torch.randn(1, 4, load_config(folder).hidden_size), torch.zeros(1, 4).long()
    with pytest.raises(ValueError, match="loss follows the stage's last block 3"):
        bank.run_loss([Group("a", x, labels, blocks=(1, 2))])


def _known(bank: AdapterBank | BatchedAdapterBank, value: float) -> dict[str, torch.Tensor]:
    return {k: torch.full_like(v, value) for k, v in bank.global_state().items()}


@pytest.mark.parametrize("mode", ["separate", "ffa", "exact", "stack"])
def test_merge_averages_each_block_over_the_sessions_that_ran_it(folder: Path, mode: str) -> None:
    bank = _union_bank(folder, "u")
    bank.set_aggregation(mode)
    before = bank.global_state()
    ran = {"a": None, "b": (2,), "c": (2,)}  # cuts 1+1, 2+1, 2+1: nobody else ran block 1
    states = {}
    for i, name in enumerate(ran):
        states[name] = _random_adapter(before, seed=20 + i)
        bank.add(name, init=states[name])
    weights = {"a": 1.0, "b": 3.0, "c": 4.0}
    merged = bank.merge(weights, blocks=ran)
    scale = SETTINGS.alpha / SETTINGS.r
    initial = bank._initial
    block1 = {k: v for k, v in before.items() if adapter_block(k) == 1}
    block2 = {k: v for k, v in before.items() if adapter_block(k) == 2}
    want1, deltas1 = aggregate_adapters(  # block 1: "a" alone
        [{k: states["a"][k] for k in block1}],
        [1.0],
        mode,
        scale=scale,
        initial={k: initial[k] for k in block1},
    )
    want2, deltas2 = aggregate_adapters(  # block 2: all three, weights 1:3:4
        [{k: states[n][k] for k in block2} for n in ran],
        [1.0, 3.0, 4.0],
        mode,
        scale=scale,
        initial={k: initial[k] for k in block2},
    )
    for key, value in {**want1, **want2}.items():
        torch.testing.assert_close(merged[key], value, atol=0, rtol=0)
        torch.testing.assert_close(bank.global_state()[key], value, atol=0, rtol=0)
    folded = {k.removesuffix(".base_delta"): v for k, v in bank.fold.state().items()}
    assert set(folded) == set(deltas1) | set(deltas2)
    for name, delta in {**deltas1, **deltas2}.items():
        assert_close_to_scale(folded[name], delta, rel=FLOAT32_REL, atol=FLOAT32_ATOL, msg=name)


def test_a_block_no_session_ran_keeps_its_global_value(folder: Path) -> None:
    bank = _union_bank(folder, "u")
    bank.set_global_state(_known(bank, 0.5))
    bank.add("b", init=_known(bank, 2.0))
    bank.merge({"b": 7.0}, blocks={"b": (2,)})
    for key, value in bank.global_state().items():
        assert float(value.flatten()[0]) == (2.0 if adapter_block(key) == 2 else 0.5), key


def test_aggregate_held_renormalises_weights_per_key() -> None:
    one, two, three = torch.tensor([1.0]), torch.tensor([2.0]), torch.tensor([4.0])
    states = [{"h.0.x": one, "h.1.x": one}, {"h.1.x": two}, {"h.1.x": three, "h.2.x": three}]
    merged, _ = aggregate_held(states, [1.0, 1.0, 2.0], "separate", scale=1.0, initial={})
    assert merged["h.0.x"].item() == 1.0  # the one holder
    assert merged["h.1.x"].item() == pytest.approx((1 + 2 + 8) / 4)
    assert merged["h.2.x"].item() == 4.0
    same = [{"h.1.x": one}, {"h.1.x": three}]
    assert torch.equal(
        aggregate_held(same, [1.0, 3.0], "separate", scale=1.0, initial={})[0]["h.1.x"],
        aggregate_adapters(same, [1.0, 3.0], "separate", scale=1.0, initial={})[0]["h.1.x"],
    )


def test_cut_settings_are_validated_with_the_key_named() -> None:
    assert parse_cuts(" 1+1, 2+0 ,3", "model.cuts") == ((1, 1), (2, 0), (3, 0))
    with pytest.raises(ValueError, match="model.cuts: 'x' is not a cut"):
        ModelConfig(cuts="1+1,x")
    with pytest.raises(ValueError, match="model.cuts: cut '0\\+1' needs head >= 1"):
        ModelConfig(cuts="0+1")
    assert ModelConfig(cuts="2+1,1+1").offered_cuts == ((1, 1), (2, 1))
    with pytest.raises(ValueError, match="federated.device_cuts names \\['3\\+1'\\]"):
        FedpipeConfig().with_overrides({"federated.device_cuts": "1+1,3+1"})
    cfg = FedpipeConfig().with_overrides({"model.cuts": "2+1", "federated.device_cuts": "1+1,2+1"})
    assert [cfg.device_cut(p) for p in (-1, 0, 1, 2)] == [(1, 1), (1, 1), (2, 1), (1, 1)]
    assert cfg.with_cut((2, 1)).model.head_layers == 2
    with pytest.raises(ValueError, match="privacy.adapter_dp = 'server' does not account"):
        FedpipeConfig().with_overrides({"model.cuts": "2+1", "privacy.adapter_dp": "server"})
    with pytest.raises(ValueError, match="model.cuts \\['2\\+1'\\] keep tail blocks"):
        FedpipeConfig().with_overrides(
            {"model.split": "two", "model.tail_layers": 0, "model.cuts": "2+1"}
        )


def _terms(head: int, tail: int) -> SplitTerms:
    return SplitTerms("f" * 64, 4, head, tail, "u", 64)


def test_the_server_accepts_offered_cuts_and_names_them_when_it_refuses() -> None:
    server = _terms(1, 1)
    offered = [(1, 1), (2, 1)]
    check_agreement(_terms(2, 1), server, offered=offered)
    with pytest.raises(SplitMismatchError) as err:
        check_agreement(_terms(1, 2), server, offered=offered)
    text = str(err.value)
    assert "head=1 tail=2" in text and "offers 1+1, 2+1" in text and "\n" not in text
    with pytest.raises(SplitMismatchError, match="server holds head=1 tail=1"):
        check_agreement(_terms(2, 1), server)  # no offer: today's message


def _flower_reply(state: dict[str, torch.Tensor], examples: int) -> Any:
    """What a device's reply looks like to a strategy: its adapters and its metrics."""
    content = RecordDict(
        {"arrays": ArrayRecord(state), "metrics": MetricRecord({"num-examples": examples})}
    )
    return SimpleNamespace(content=content, has_error=lambda: False, metadata=SimpleNamespace())


def _layer(block: int) -> str:
    return f"model.layers.{block}.self_attn.q_proj"


def test_device_adapters_of_different_cuts_average_per_block(tmp_path: Path) -> None:
    """Flower's FedAvg over the padded replies, and fedpipe's exact, average each block over
    the devices whose cut holds it; a block no device holds keeps its global value."""
    from flwr.serverapp.strategy import FedAvg

    from fedpipe.fl.aggregate import ExactState, pad_to_union
    from fedpipe.fl.aggregate import held as held_by

    gen = torch.Generator().manual_seed(0)

    def layer_state(block: int) -> dict[str, torch.Tensor]:
        return {
            f"{_layer(block)}.lora_A.weight": torch.randn(2, 6, generator=gen),
            f"{_layer(block)}.lora_B.weight": torch.randn(5, 2, generator=gen),
        }

    global_state = {k: v for b in range(5) for k, v in layer_state(b).items()}
    device_a = {k: v for b in (0, 1, 3) for k, v in layer_state(b).items()}  # cut 2+1
    device_b = {k: v for b in (0, 2, 3) for k, v in layer_state(b).items()}  # cut 1+2
    for mode in ("separate", "exact"):
        replies = [_flower_reply(device_a, 1), _flower_reply(device_b, 3)]
        held = held_by(replies)  # type: ignore[arg-type]
        pad_to_union(replies, held, global_state)  # type: ignore[arg-type]
        arrays, _ = FedAvg().aggregate_train(1, replies)  # type: ignore[arg-type]
        state = ExactState(mode, 2.0, device_initial=global_state, device_global=global_state)
        arrays, _ = state.fold(held, (arrays, None))
        got = arrays.to_torch_state_dict()  # type: ignore[union-attr]
        for key, value in global_state.items():
            block = adapter_block(key)
            if block == 4:  # nobody holds it
                want = value
            elif block in (1, 2):  # one holder: its own values, whatever the other weighs
                want = (device_a if block == 1 else device_b)[key]
            else:  # both: weights 1 and 3, renormalised over the holders
                want = 0.25 * device_a[key] + 0.75 * device_b[key]
            assert_close_to_scale(got[key], want, atol=1e-6, rel=1e-6, msg=key)
        deltas = {k for k in got if k.endswith(".base_delta")}
        if mode == "exact":  # the residual of each layer held; zero where one device held it
            assert deltas == {f"{_layer(b)}.base_delta" for b in range(4)}
            for b in (1, 2):
                assert float(got[f"{_layer(b)}.base_delta"].abs().max()) < 1e-6
        else:
            assert not deltas


def test_fedpipe_client_cut_flag_reaches_the_node_config_and_is_checked() -> None:
    from fedpipe.cli.client import client_setup as _client_setup
    from fedpipe.cli.client import node_config as _node_config
    from fedpipe.cli.parser import build_parser
    from fedpipe.cli.preflight import SettingsError, check_client

    args = build_parser().parse_args(["client", "--superlink", "127.0.0.1:9", "--cut", "2+1"])
    assert _node_config(_client_setup(args))["cut"] == "2+1"
    args = build_parser().parse_args(["client", "--superlink", "127.0.0.1:9", "--cut", "1+1,2+1"])
    with pytest.raises(SettingsError, match="--cut '1\\+1,2\\+1': a device runs one cut"):
        check_client(_client_setup(args))
    args = build_parser().parse_args(["client", "--superlink", "127.0.0.1:9", "--cut", "two"])
    with pytest.raises(SettingsError, match="--cut: 'two' is not a cut"):
        check_client(_client_setup(args))


def test_the_server_refuses_an_offered_cut_that_leaves_it_no_block(folder: Path) -> None:
    from fedpipe.server.build import build_runtime

    config = FedpipeConfig().with_overrides({"model.cuts": "3+1"})
    with pytest.raises(ValueError, match="model.cuts: cut 3\\+1 does not fit: .* leave 0 of 4"):
        build_runtime(config, folder=folder)
