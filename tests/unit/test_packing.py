"""Packed rows (data.packing) compute what the same examples compute one per padded row.

Whole split models (head, middle, tail with LoRA) and both server banks, for Llama, Gemma 3
(sliding and full blocks, a window shorter than the examples) and GPT-2 (absolute positions):
the loss and every LoRA gradient of a packed batch equal those of the examples right-padded
one per row, to fp32 rounding; the split on packed rows equals the unsplit Hugging Face model
given the packed positions (transformers builds the block-diagonal mask from them). Also: the
mask by hand, how examples are packed, and the settings that refuse packing.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from harness.close import assert_close_to_scale
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from fedpipe.config import DataConfig, FedpipeConfig, PrivacyConfig
from fedpipe.data import IGNORE_INDEX
from fedpipe.data.rows import pack_examples
from fedpipe.lora import (
    AdapterBank,
    Group,
    LoraSettings,
    adapter_bank,
    apply_lora,
    load_lora_state_dict,
    lora_parameters,
    lora_state_dict,
)
from fedpipe.lora.batched_bank import BatchedAdapterBank
from fedpipe.models import load_config, model_family
from fedpipe.split import build_device_stages, build_stage, split_layout
from fedpipe.split.packing import (
    segment_lengths,
    segment_mask,
    segment_positions,
    segments_from_lengths,
)

torch.set_num_threads(1)
VOCAB, SEQ, WINDOW = 96, 16, 4
LENGTHS = (5, 9, 3, 7, 4, 6, 11)  # packed first fit into rows of 16: 4 rows instead of 7
_TINY: dict[str, Any] = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=32,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    initializer_range=0.1,
)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "gemma3": (
        "gemma3_text",
        {
            "head_dim": 8,
            "query_pre_attn_scalar": 8,
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
        },
    ),
    "gpt2": ("gpt2", {"n_embd": 32, "n_layer": 4, "n_head": 4, "n_positions": 32}),
}


def test_the_mask_and_positions_of_packed_rows_are_those_built_by_hand() -> None:
    segments = torch.tensor([[0, 0, 1, 1, 1, 2]])
    allowed = [  # query i (row) may attend key j (column)
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 0, 1, 0, 0, 0],
        [0, 0, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],
    ]
    assert segment_mask(segments).squeeze().int().tolist() == allowed
    windowed = [row[:] for row in allowed]
    windowed[4][2] = 0  # a window of 2: token 4 no longer sees token 2
    assert segment_mask(segments, window=2).squeeze().int().tolist() == windowed
    assert segment_positions(segments).tolist() == [[0, 1, 0, 1, 2, 0]]
    assert segment_lengths(segments) == [[2, 3, 1]]
    assert torch.equal(segments_from_lengths([[2, 3, 1]], 6), segments)


def test_segment_lengths_that_do_not_cut_the_row_are_refused() -> None:
    with pytest.raises(ValueError, match="sum to the row's 6 tokens"):
        segments_from_lengths([[2, 3]], 6)
    with pytest.raises(ValueError, match=">= 1"):
        segments_from_lengths([[0, 6]], 6)


def _examples(seed: int = 1) -> list[tuple[list[int], list[int]]]:
    """Examples of LENGTHS tokens, each with a prompt out of the loss and an answer in it."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in LENGTHS:
        ids = torch.randint(3, VOCAB, (n,), generator=gen).tolist()
        prompt = max(1, n // 3)
        out.append((ids, [IGNORE_INDEX] * prompt + ids[prompt:]))
    return out


def _padded(examples: list[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.zeros(len(examples), SEQ, dtype=torch.long)
    labels = torch.full((len(examples), SEQ), IGNORE_INDEX, dtype=torch.long)
    for r, (i, lab) in enumerate(examples):
        ids[r, : len(i)], labels[r, : len(lab)] = torch.tensor(i), torch.tensor(lab)
    return ids, labels


def test_examples_are_packed_whole_with_no_loss_across_them() -> None:
    examples = _examples()
    rows = pack_examples(examples, SEQ, pad=0)
    assert rows.segments is not None and rows.counts.rows == rows.input_ids.shape[0] == 4
    found = []  # each example's (row, start) from the segments
    for r, lengths in enumerate(segment_lengths(rows.segments)):
        assert sum(lengths) == SEQ
        start = 0
        for n in lengths:
            found.append((r, start, n))
            start += n
    real = [(r, s, n) for r, s, n in found if rows.input_ids[r, s : s + n].ne(0).any()]
    assert sorted(n for _, _, n in real) == sorted(LENGTHS)  # every example once, uncut
    for ids, labels in examples:
        (r, s, n) = next(
            f for f in real if rows.input_ids[f[0], f[1] : f[1] + f[2]].tolist() == ids
        )
        assert rows.labels[r, s].item() == IGNORE_INDEX  # its first label: never predicted
        assert rows.labels[r, s + 1 : s + n].tolist() == labels[1:]
    with pytest.raises(ValueError, match="does not fit rows of 16 tokens"):
        pack_examples([([5] * 17, [5] * 17)], SEQ, pad=0)


def test_packing_settings_are_checked() -> None:
    assert DataConfig().packing is False  # one example per row unless asked
    with pytest.raises(ValueError, match="data.packing must be true or false, got 'yes'"):
        DataConfig(packing="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="data.packing = true cannot be combined"):
        FedpipeConfig(data=DataConfig(packing=True), privacy=PrivacyConfig(label_resample=0.1))
    cfg = FedpipeConfig().with_overrides({"data.packing": "true"})
    assert cfg.data.packing is True


# -- models ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("packing")
    folders = {}
    for name, (model_type, overrides) in CASES.items():
        torch.manual_seed(0)
        config = CONFIG_MAPPING[model_type](**{**_TINY, **overrides})
        model = AutoModelForCausalLM.from_config(config)
        with torch.no_grad():
            for key, param in model.named_parameters():
                if "norm" in key or "ln_" in key:
                    param.add_(torch.randn_like(param) * 0.1)
        model.save_pretrained(root / name)
        folders[name] = root / name
    return folders


SETTINGS = LoraSettings(r=4, alpha=8)


def _random_adapter(keys: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {k: torch.randn(v.shape, generator=gen) * 0.1 for k, v in keys.items()}


def _whole(folder: Path) -> nn.Module:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return apply_lora(model, SETTINGS, model_family(model.config))


def _stages(folder: Path, adapter: dict[str, torch.Tensor]) -> list[nn.Module]:
    plan = split_layout(load_config(folder), head_layers=1, tail_layers=1)
    head, tail = build_device_stages(folder, plan)
    assert tail is not None
    family = model_family(load_config(folder))
    stages = [
        apply_lora(s, SETTINGS, family) for s in (head, build_stage(folder, plan, "middle"), tail)
    ]
    for stage in stages:
        keys = set(lora_state_dict(stage))
        load_lora_state_dict(stage, {k: v for k, v in adapter.items() if k in keys})
    return stages


def _split_step(
    stages: list[nn.Module], ids: torch.Tensor, labels: torch.Tensor, segments: torch.Tensor | None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    for stage in stages:
        stage.zero_grad(set_to_none=True)
    hidden = stages[1](stages[0](ids, segments), segments=segments)
    loss_sum, count = stages[2](hidden, labels, segments=segments)
    loss = loss_sum / count
    loss.backward()
    grads = {k: p.grad.clone() for s in stages for k, p in lora_parameters(s).items()}
    return loss.detach(), grads


@pytest.mark.parametrize("name", list(CASES))
def test_a_packed_batch_trains_the_split_as_padded_rows_and_as_the_unsplit_model(
    saved: dict[str, Path], name: str
) -> None:
    folder = saved[name]
    whole = _whole(folder)
    adapter = _random_adapter(lora_state_dict(whole))
    load_lora_state_dict(whole, adapter)
    stages = _stages(folder, adapter)
    examples = _examples()
    padded_ids, padded_labels = _padded(examples)
    packed = pack_examples(examples, SEQ, pad=0)
    assert packed.segments is not None and packed.input_ids.shape[0] < padded_ids.shape[0]
    loss, grads = _split_step(stages, padded_ids, padded_labels, None)
    packed_loss, packed_grads = _split_step(
        stages, packed.input_ids, packed.labels, packed.segments
    )
    assert_close_to_scale(packed_loss, loss, rel=1e-6, atol=1e-6)
    assert set(packed_grads) == set(grads) and len(grads) > 0
    for key, grad in grads.items():
        assert_close_to_scale(packed_grads[key], grad, rel=1e-4, atol=1e-6, msg=key)
    # the unsplit model on the packed rows: transformers reads the packing from the positions
    positions = segment_positions(packed.segments)
    out = whole(
        input_ids=packed.input_ids, position_ids=positions, labels=packed.labels, use_cache=False
    )
    out.loss.backward()
    assert_close_to_scale(packed_loss, out.loss.detach(), rel=1e-6, atol=1e-6)
    for key, param in lora_parameters(whole).items():
        assert_close_to_scale(packed_grads[key], param.grad, rel=1e-4, atol=1e-6, msg=key)
    # and without packed positions the unsplit model attends across examples: not the same
    crossed = whole(input_ids=packed.input_ids, labels=packed.labels, use_cache=False).loss
    assert not torch.allclose(crossed, out.loss, atol=1e-4)


def _placed(
    rows: torch.Tensor, segments: torch.Tensor | None, examples: list[tuple[list[int], list[int]]]
) -> list[tuple[int, int, int]]:
    """(row, start, length) of each example in order: its own row (padded) or its segment."""
    if segments is None:
        return [(r, 0, len(ids)) for r, (ids, _) in enumerate(examples)]
    spans = []
    for r, lengths in enumerate(segment_lengths(segments)):
        start = 0
        for n in lengths:
            spans.append((r, start, n))
            start += n
    out = []
    for ids, _ in examples:
        out.append(next(s for s in spans if rows[s[0], s[1] : s[1] + s[2]].tolist() == ids))
    return out


def _bank_step(
    bank: AdapterBank | BatchedAdapterBank,
    hidden: torch.Tensor,
    segments: torch.Tensor | None,
    spans: list[tuple[int, int, int]],
    dys: list[torch.Tensor],
) -> tuple[list[torch.Tensor], list[torch.Tensor], dict[str, torch.Tensor]]:
    """Each example's output and input gradient, and the adapter's gradients, for an output
    gradient ``dys`` on each example's tokens (none on pads)."""
    for param in bank.named_parameters("a").values():
        param.grad = None
    x = hidden.clone().requires_grad_(True)
    (y,) = bank.run([Group("a", x, segments=segments)])
    dy = torch.zeros_like(y)
    for (r, s, n), d in zip(spans, dys, strict=True):
        dy[r, s : s + n] = d
    y.backward(dy)
    assert x.grad is not None
    outs = [y.detach()[r, s : s + n] for r, s, n in spans]
    dxs = [x.grad[r, s : s + n] for r, s, n in spans]
    grads = {k: p.grad.clone() for k, p in bank.named_parameters("a").items() if p.grad is not None}
    return outs, dxs, grads


@pytest.mark.parametrize(
    ("name", "batched"),
    [("llama", False), ("llama", True), ("gemma3", True), ("gemma3", False), ("gpt2", False)],
)
def test_both_server_banks_compute_packed_rows_as_padded_rows(
    saved: dict[str, Path], name: str, batched: bool
) -> None:
    folder = saved[name]
    plan = split_layout(load_config(folder), head_layers=1, tail_layers=1)
    middle = build_stage(folder, plan, "middle")
    family = model_family(load_config(folder))
    bank = adapter_bank(copy.deepcopy(middle), SETTINGS, family=family, batched=batched)
    assert isinstance(bank, BatchedAdapterBank) == batched
    gen = torch.Generator().manual_seed(2)
    state = {k: torch.randn(v.shape, generator=gen) * 0.1 for k, v in bank.global_state().items()}
    bank.add("a", init=state)
    examples = _examples()
    width = int(load_config(folder).hidden_size)
    tokens = [torch.randn(len(ids), width, generator=gen) for ids, _ in examples]
    dys = [torch.randn(len(ids), width, generator=gen) for ids, _ in examples]
    results = []
    padded_ids, _ = _padded(examples)
    packed = pack_examples(examples, SEQ, pad=0)
    for ids, segments in ((padded_ids, None), (packed.input_ids, packed.segments)):
        spans = _placed(ids, segments, examples)
        hidden = torch.randn(ids.shape[0], SEQ, width, generator=gen)  # pads: anything
        for (r, s, n), t in zip(spans, tokens, strict=True):
            hidden[r, s : s + n] = t
        results.append(_bank_step(bank, hidden, segments, spans, dys))
    (outs, dxs, grads), (p_outs, p_dxs, p_grads) = results
    for i, (a, b) in enumerate(zip(outs, p_outs, strict=True)):
        assert_close_to_scale(b, a, rel=1e-5, atol=1e-5, msg=f"output of example {i}")
    for i, (a, b) in enumerate(zip(dxs, p_dxs, strict=True)):
        assert_close_to_scale(b, a, rel=1e-5, atol=1e-5, msg=f"input grad of example {i}")
    assert set(p_grads) == set(grads) and len(grads) > 0
    for key, grad in grads.items():
        assert_close_to_scale(p_grads[key], grad, rel=1e-4, atol=1e-6, msg=key)
