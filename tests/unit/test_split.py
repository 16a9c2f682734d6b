"""fedpipe.split: plans, stages holding only their weights, exactness against the unsplit model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from harness.close import assert_close_to_scale

from fedpipe.models import load_causal_lm, load_config, resolve_model
from fedpipe.split import (
    IGNORE_INDEX,
    SplitLayout,
    build_device_stages,
    build_stage,
    split_layout,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)
MODELS = ["tiny-llama", "tiny-gpt2"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    cache = tmp_path_factory.mktemp("cache")
    return {name: resolve_model(name, cache_dir=cache) for name in MODELS}


def split_loss(folder: Path, plan: SplitLayout, ids: torch.Tensor, labels: torch.Tensor):
    if plan.mode == "u":
        head, tail = build_device_stages(folder, plan)
        return tail(build_stage(folder, plan, "middle")(head(ids)), labels)
    head = build_stage(folder, plan, "head")
    return build_stage(folder, plan, "server_loss")(head(ids), labels)


@pytest.mark.parametrize("mode", ["u", "two"])
@pytest.mark.parametrize("name", MODELS)
def test_split_loss_equals_unsplit(folders: dict[str, Path], name: str, mode: str) -> None:
    folder = folders[name]
    ids = torch.randint(0, 258, (2, 16), generator=torch.Generator().manual_seed(0))
    reference = load_causal_lm(folder)(ids, labels=ids).loss
    plan = split_layout(load_config(folder), head_layers=1, tail_layers=2, mode=mode)
    loss_sum, count = split_loss(folder, plan, ids, ids)
    assert count == 2 * 15
    assert_close_to_scale(loss_sum / count, reference, rel=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", MODELS)
def test_right_padding_is_ignored_in_the_loss(folders: dict[str, Path], name: str) -> None:
    folder = folders[name]
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[1, 7:] = IGNORE_INDEX  # row 1 is 7 tokens then pads
    reference = load_causal_lm(folder)(ids, labels=labels).loss
    loss_sum, count = split_loss(folder, split_layout(load_config(folder)), ids, labels)
    assert count == 11 + 6
    assert_close_to_scale(loss_sum / count, reference, rel=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", MODELS)
def test_tail_logits_match_unsplit(folders: dict[str, Path], name: str) -> None:
    folder = folders[name]
    ids = torch.randint(0, 258, (1, 9), generator=torch.Generator().manual_seed(2))
    plan = split_layout(load_config(folder), head_layers=2, tail_layers=1)
    head, tail = build_device_stages(folder, plan)
    assert tail is not None
    logits = tail.logits(build_stage(folder, plan, "middle")(head(ids)))
    assert_close_to_scale(logits, load_causal_lm(folder)(ids).logits, rel=1e-5, atol=1e-5)


def _whole_params(folder: Path) -> dict[str, torch.Tensor]:
    return dict(load_causal_lm(folder).named_parameters())  # tied weights appear once


@pytest.mark.parametrize("name", MODELS)
def test_each_stage_holds_only_its_blocks(folders: dict[str, Path], name: str) -> None:
    folder = folders[name]
    plan = split_layout(load_config(folder), head_layers=1, tail_layers=1)
    whole = _whole_params(folder)
    blocks = "model.layers." if name == "tiny-llama" else "transformer.h."

    def block_numel(indices: range) -> int:
        return sum(p.numel() for n, p in whole.items() for i in indices if f"{blocks}{i}." in n)

    middle = build_stage(folder, plan, "middle")
    assert sum(p.numel() for p in middle.parameters()) == block_numel(plan.server_blocks)
    assert sorted(middle.blocks) == ["1", "2"]
    assert any(n.startswith(("layers.2.", "h.2.")) for n, _ in middle.named_parameters())
    head, tail = build_device_stages(folder, plan)
    assert tail is not None
    embed = head.embedding.weight.numel()
    positions = head.wpe.weight.numel() if name == "tiny-gpt2" else 0
    assert (
        sum(p.numel() for p in head.parameters())
        == block_numel(plan.head_blocks) + embed + positions
    )
    norm = sum(p.numel() for p in tail.final_norm.parameters())
    # The tail's LM head is the head's embedding (tied): counted on the head side only.
    assert tail.lm_head.weight is head.embedding.weight
    tail_own = sum(p.numel() for n, p in tail.named_parameters() if n != "lm_head.weight")
    assert tail_own == block_numel(plan.tail_blocks) + norm
    total = sum(p.numel() for p in whole.values())
    assert total == sum(p.numel() for p in head.parameters()) + tail_own + sum(
        p.numel() for p in middle.parameters()
    )


def test_base_weights_are_frozen_and_tail_alone_loads_tied_head(folders: dict[str, Path]) -> None:
    folder = folders["tiny-llama"]
    plan = split_layout(load_config(folder))
    tail = build_stage(folder, plan, "tail")
    head = build_stage(folder, plan, "head")
    assert not any(p.requires_grad for p in tail.parameters())
    assert torch.equal(tail.lm_head.weight, head.embedding.weight)
    assert tail.lm_head.weight is not head.embedding.weight  # separate builds, separate copies
    assert all(p.device.type == "cpu" for p in tail.parameters())


def test_stage_dtype(folders: dict[str, Path]) -> None:
    folder = folders["tiny-llama"]
    middle = build_stage(folder, split_layout(load_config(folder)), "middle", dtype=torch.bfloat16)
    assert {p.dtype for p in middle.parameters()} == {torch.bfloat16}
    out = middle(torch.randn(1, 5, 64, dtype=torch.bfloat16))
    assert out.shape == (1, 5, 64) and out.dtype == torch.bfloat16


def test_plan_ranges() -> None:
    plan = SplitLayout(num_layers=6, head_layers=2, tail_layers=1)
    assert (plan.head_blocks, plan.server_blocks, plan.tail_blocks) == (
        range(0, 2),
        range(2, 5),
        range(5, 6),
    )
    two = SplitLayout(num_layers=6, head_layers=2, tail_layers=0, mode="two")
    assert two.server_blocks == range(2, 6) and len(two.tail_blocks) == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_layers": 4, "head_layers": 2, "tail_layers": 2}, "0 of 4 blocks.*<= 3"),
        (
            {"num_layers": 4, "head_layers": 1, "tail_layers": 1, "mode": "two"},
            "tail_layers must be 0",
        ),
        ({"num_layers": 4, "head_layers": -1, "tail_layers": 1}, ">= 0"),
        ({"num_layers": 0, "head_layers": 0, "tail_layers": 0}, "num_layers must be >= 1"),
        ({"num_layers": 4, "head_layers": 1, "tail_layers": 1, "mode": "x"}, "mode"),
    ],
)
def test_plan_validation_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SplitLayout(**kwargs)


def test_split_layout_and_part_errors(folders: dict[str, Path]) -> None:
    folder = folders["tiny-llama"]
    config = load_config(folder)
    assert split_layout(config, mode="two") == SplitLayout(4, 1, 0, "two")
    with pytest.raises(ValueError, match="does not exist in mode 'two'"):
        build_stage(folder, split_layout(config, mode="two"), "middle")
    with pytest.raises(ValueError, match="layout is for 6 blocks.*has 4"):
        build_stage(folder, SplitLayout(6, 1, 1), "head")


# -- sliding-window attention (Mistral; Qwen2 with use_sliding_window) -----------------------------
def _save_windowed(kind: str, out: Path, window: int) -> Path:
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=258,
        max_position_embeddings=64,
        sliding_window=window,
    )
    if kind == "mistral":
        config, cls = MistralConfig(**common), MistralForCausalLM
    else:  # blocks 2 and 3 slide, 0 and 1 attend to everything
        config = Qwen2Config(**common, use_sliding_window=True, max_window_layers=2)
        cls = Qwen2ForCausalLM
    torch.manual_seed(0)
    cls(config).save_pretrained(out)
    return out


@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
def test_sliding_window_shorter_than_the_sequence_is_computed_exactly(
    kind: str, tmp_path: Path
) -> None:
    folder = _save_windowed(kind, tmp_path / kind, window=4)
    ids = torch.randint(0, 258, (2, 16), generator=torch.Generator().manual_seed(4))
    whole = load_causal_lm(folder)
    reference = whole(ids, labels=ids).loss
    plan = split_layout(load_config(folder), head_layers=1, tail_layers=1)
    loss_sum, count = split_loss(folder, plan, ids, ids)
    assert_close_to_scale(loss_sum / count, reference, rel=1e-6, atol=1e-6)
    # The window matters here: ignoring it (a window as long as the sequence) changes the loss.
    whole.config.sliding_window = 64
    assert not torch.allclose(whole(ids, labels=ids).loss, reference, atol=1e-4)


def test_sliding_window_per_block() -> None:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    from fedpipe.split import sliding_window

    qwen = Qwen2Config(
        num_hidden_layers=4, sliding_window=8, use_sliding_window=True, max_window_layers=2
    )
    assert [sliding_window(qwen, i) for i in range(4)] == [None, None, 8, 8]
    assert sliding_window(Qwen2Config(num_hidden_layers=4, sliding_window=8), 3) is None
    assert sliding_window(MistralConfig(sliding_window=8), 0) == 8
    assert sliding_window(MistralConfig(sliding_window=None), 0) is None
    assert sliding_window(LlamaConfig(), 0) is None
    chunked = MistralConfig(sliding_window=8)
    chunked.layer_types = ["chunked_attention"] * 4
    with pytest.raises(ValueError, match="block 1 has attention type 'chunked_attention'"):
        sliding_window(chunked, 1)
