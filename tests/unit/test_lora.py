"""LoRA on stages: global keys, identical init, split == unsplit loss and grads, the bank."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from harness.close import (
    FLOAT32_ATOL,
    FLOAT32_REL,
    assert_close_to_scale,
    assert_states_close_to_scale,
)

from fedpipe.lora import (
    AdapterBank,
    LoraSettings,
    apply_lora,
    average_state_dicts,
    load_lora_state_dict,
    lora_state_dict,
)
from fedpipe.lora.base import lora_layers
from fedpipe.models import load_causal_lm, load_config, resolve_model
from fedpipe.split import build_device_stages, build_stage, split_layout

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)
FAMILY = {"tiny-llama": "llama", "tiny-gpt2": "gpt2"}
SETTINGS = LoraSettings(r=4, alpha=8, seed=3)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    cache = tmp_path_factory.mktemp("cache")
    return {name: resolve_model(name, cache_dir=cache) for name in FAMILY}


def random_adapter(template: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=gen) * 0.1 for k, v in sorted(template.items())}


def lora_grads(module: torch.nn.Module, adapter: str = "default") -> dict[str, torch.Tensor]:
    out = {}
    for name, layer in lora_layers(module).items():
        out[f"{name}.lora_A.weight"] = layer.lora_A[adapter].weight.grad
        out[f"{name}.lora_B.weight"] = layer.lora_B[adapter].weight.grad
    return out


def u_stages(folder: Path, **plan_kwargs):
    plan = split_layout(load_config(folder), **plan_kwargs)
    head, tail = build_device_stages(folder, plan)
    middle = build_stage(folder, plan, "middle")
    return [
        apply_lora(m, SETTINGS, FAMILY[folder.name.rsplit("-", 1)[0]]) for m in (head, middle, tail)
    ]


@pytest.mark.parametrize("mode", ["u", "two"])
@pytest.mark.parametrize("name", list(FAMILY))
def test_lora_split_loss_and_grads_equal_unsplit(
    folders: dict[str, Path], name: str, mode: str
) -> None:
    folder, family = folders[name], FAMILY[name]
    whole = apply_lora(load_causal_lm(folder), SETTINGS, family)
    adapter = random_adapter(lora_state_dict(whole), seed=7)  # nonzero B: the adapters matter
    load_lora_state_dict(whole, adapter)
    plan = split_layout(load_config(folder), head_layers=1, tail_layers=1, mode=mode)
    parts = ["head", "middle", "tail"] if mode == "u" else ["head", "server_loss"]
    stages = [apply_lora(build_stage(folder, plan, p), SETTINGS, family) for p in parts]
    for stage in stages:
        load_lora_state_dict(stage, {k: adapter[k] for k in lora_state_dict(stage)})

    ids = torch.randint(0, 258, (2, 10), generator=torch.Generator().manual_seed(0))
    reference = whole(ids, labels=ids).loss
    reference.backward()
    hidden = ids
    for stage in stages[:-1]:
        hidden = stage(hidden)
    loss_sum, count = stages[-1](hidden, ids)
    (loss_sum / count).backward()

    assert_close_to_scale(loss_sum / count, reference, rel=1e-6, atol=1e-6)
    assert reference.item() != pytest.approx(load_causal_lm(folder)(ids, labels=ids).loss.item())
    expected = lora_grads(whole)
    got = {k: v for s in stages for k, v in lora_grads(s).items()}
    assert got.keys() == expected.keys()
    for key in expected:
        assert_close_to_scale(got[key], expected[key], rel=1e-4, atol=1e-6, msg=key)


@pytest.mark.parametrize("name", list(FAMILY))
def test_init_is_identical_and_keys_are_global(folders: dict[str, Path], name: str) -> None:
    folder = folders[name]
    whole = lora_state_dict(apply_lora(load_causal_lm(folder), SETTINGS, FAMILY[name]))
    union = {k: v for s in u_stages(folder) for k, v in lora_state_dict(s).items()}
    assert union.keys() == whole.keys()
    assert all(torch.equal(union[k], whole[k]) for k in whole)
    assert all(not v.any() for k, v in whole.items() if "lora_B" in k)
    assert all(v.abs().sum() > 0 for k, v in whole.items() if "lora_A" in k)
    first = "layers.0.self_attn.q_proj" if name == "tiny-llama" else "h.0.attn.c_attn"
    assert f"{first}.lora_A.weight" in whole
    if name == "tiny-gpt2":  # attention only by default
        assert not any(".mlp." in k for k in whole)
        assert len(whole) == 4 * 2 * 2
    else:
        assert len(whole) == 4 * 4 * 2
    other = lora_state_dict(
        apply_lora(load_causal_lm(folder), LoraSettings(r=4, seed=4), FAMILY[name])
    )
    assert not torch.equal(other[f"{first}.lora_A.weight"], whole[f"{first}.lora_A.weight"])


def test_only_adapters_train(folders: dict[str, Path]) -> None:
    head, middle, tail = u_stages(folders["tiny-llama"])
    for stage in (head, middle, tail):
        trainable = [n for n, p in stage.named_parameters() if p.requires_grad]
        assert trainable and all(".lora_" in n for n in trainable)
    assert tail.lm_head.weight is head.embedding.weight  # still shared after wrapping


def test_no_blocks_means_no_adapters(folders: dict[str, Path]) -> None:
    folder = folders["tiny-llama"]
    plan = split_layout(load_config(folder), head_layers=0, tail_layers=1)
    head = apply_lora(build_stage(folder, plan, "head"), SETTINGS, "llama")
    assert lora_state_dict(head) == {}
    assert head(torch.tensor([[1, 2, 3]])).shape == (1, 3, 64)


def test_load_is_strict(folders: dict[str, Path]) -> None:
    _, middle, _ = u_stages(folders["tiny-llama"])
    sd = lora_state_dict(middle)
    extra = {**sd, "layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 64)}
    with pytest.raises(KeyError, match=r"unexpected \[layers.0.self_attn.q_proj.lora_A.weight\]"):
        load_lora_state_dict(middle, extra)
    missing = dict(sd)
    missing.pop("layers.1.self_attn.v_proj.lora_B.weight")
    with pytest.raises(KeyError, match=r"missing \[layers.1.self_attn.v_proj.lora_B.weight\]"):
        load_lora_state_dict(middle, missing)


def test_average_state_dicts() -> None:
    a, b = {"x": torch.tensor([0.0, 4.0])}, {"x": torch.tensor([4.0, 0.0])}
    assert_close_to_scale(
        average_state_dicts([a, b], [1, 3])["x"],
        torch.tensor([3.0, 1.0]),
        rel=FLOAT32_REL,
        atol=FLOAT32_ATOL,
    )
    with pytest.raises(ValueError, match="one weight per state dict"):
        average_state_dicts([a, b], [1.0])
    with pytest.raises(KeyError, match="different keys"):
        average_state_dicts([a, {"y": torch.zeros(2)}], [1, 1])


@pytest.fixture()
def bank(folders: dict[str, Path]) -> AdapterBank:
    folder = folders["tiny-llama"]
    return AdapterBank(build_stage(folder, split_layout(load_config(folder)), "middle"), SETTINGS)


def test_bank_add_activate_remove(bank: AdapterBank) -> None:
    x = torch.randn(1, 6, 64, generator=torch.Generator().manual_seed(0))
    base = bank.stage(x)
    bank.add("dev0")
    bank.add("dev1", init=random_adapter(bank.global_state(), seed=1))
    assert bank.names() == ["dev0", "dev1"]
    assert all(torch.equal(bank.state_dict("dev0")[k], v) for k, v in bank.global_state().items())
    bank.activate("dev1")
    assert not torch.allclose(bank.stage(x), base)
    bank.activate("dev0")
    assert_close_to_scale(
        bank.stage(x), base, rel=FLOAT32_REL, atol=FLOAT32_ATOL
    )  # B == 0 like the global adapter
    assert all(p.requires_grad for p in bank.parameters("dev1"))
    assert not any(p.requires_grad for p in bank.parameters("global"))
    with pytest.raises(ValueError, match="already exists"):
        bank.add("dev0")
    bank.remove("dev0")
    assert bank.names() == ["dev1"] and bank.active == "global"
    with pytest.raises(KeyError, match="no adapter 'dev0'"):
        bank.activate("dev0")


def test_bank_interleaved_microbatches_train_their_own_adapter(bank: AdapterBank) -> None:
    for name, seed in (("a", 1), ("b", 2)):
        bank.add(name, init=random_adapter(bank.global_state(), seed))
    x = torch.randn(1, 5, 64)
    bank.activate("a")
    out_a = bank.stage(x)
    bank.activate("b")  # another device's forward between a's forward and backward
    out_b = bank.stage(x)
    out_a.sum().backward()
    assert all(p.grad is not None for p in bank.parameters("a"))
    assert all(p.grad is None for p in bank.parameters("b"))
    out_b.sum().backward()
    assert all(p.grad is not None for p in bank.parameters("b"))


def test_bank_merge_is_the_weighted_average(bank: AdapterBank) -> None:
    states = {n: random_adapter(bank.global_state(), seed) for seed, n in enumerate("abc")}
    for name, state in states.items():
        bank.add(name, init=state)
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
    assert_states_close_to_scale(
        bank.state_dict("d"), merged, rel=FLOAT32_REL, atol=FLOAT32_ATOL
    )  # new adapters start from the merge
