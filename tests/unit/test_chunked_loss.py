"""fedpipe.split.loss: the loss over chunks of tokens equals the loss over the full logits."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from harness.close import assert_close_to_scale
from torch import nn

from fedpipe.models import load_config, resolve_model
from fedpipe.split import IGNORE_INDEX, build_device_stages, split_layout
from fedpipe.split.loss import chunked_loss_sum, shifted_loss_sum

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)


def _labels(batch: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    """Random labels with pads: row 0 ignores a run longer than any chunk tested, row 1 its end."""
    labels = torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))
    labels[0, 3:60] = IGNORE_INDEX
    labels[1, -9:] = IGNORE_INDEX
    return labels


def _loss_and_grads(
    normed: torch.Tensor, labels: torch.Tensor, head: nn.Linear, chunk: int
) -> tuple[torch.Tensor, int, torch.Tensor, torch.Tensor]:
    """(loss sum, tokens, d loss / d normed, d loss / d head weight) of one loss."""
    x = normed.detach().requires_grad_(True)
    head.zero_grad(set_to_none=True)
    loss, tokens = chunked_loss_sum(x, labels, head, chunk=chunk)
    (loss * 0.37).backward()  # a scale like the runtime's 1 / total tokens
    assert x.grad is not None and head.weight.grad is not None
    return loss.detach(), tokens, x.grad, head.weight.grad.clone()


@pytest.mark.parametrize("chunk", [32, 45, 64, 100, 4096])
def test_chunked_loss_is_todays_to_the_last_digit(chunk: int) -> None:
    """Chunks of >= 12 rows, dividing B*(T-1) or not: the same loss bits and input gradient."""
    gen = torch.Generator().manual_seed(0)
    batch, length, width, vocab = 3, 70, 48, 517
    normed = torch.randn(batch, length, width, generator=gen)
    head = nn.Linear(width, vocab, bias=False)
    labels = _labels(batch, length, vocab, seed=1)
    ref_loss, ref_tokens, ref_dx, ref_dw = _loss_and_grads(normed, labels, head, chunk=0)
    loss, tokens, dx, dw = _loss_and_grads(normed, labels, head, chunk=chunk)
    assert tokens == ref_tokens == 3 * 69 - 57 - 9
    assert torch.equal(loss, ref_loss)
    assert torch.equal(dx, ref_dx)  # each row's gradient is its own row's
    # The LM head's gradient adds the chunks' products: equal to fp32 rounding.
    assert_close_to_scale(dw, ref_dw, rel=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk", [1, 5, 7])
def test_tiny_chunks_equal_to_fp32_rounding(chunk: int) -> None:
    gen = torch.Generator().manual_seed(2)
    normed = torch.randn(2, 70, 16, generator=gen)
    head = nn.Linear(16, 101, bias=False)
    labels = _labels(2, 70, 101, seed=3)
    ref_loss, ref_tokens, ref_dx, ref_dw = _loss_and_grads(normed, labels, head, chunk=0)
    loss, tokens, dx, dw = _loss_and_grads(normed, labels, head, chunk=chunk)
    assert tokens == ref_tokens
    assert_close_to_scale(loss, ref_loss, rel=1e-6, atol=1e-5)
    assert_close_to_scale(dx, ref_dx, rel=1e-5, atol=1e-6)
    assert_close_to_scale(dw, ref_dw, rel=1e-5, atol=1e-6)


def test_nothing_counted_gives_zero_and_zero_gradients() -> None:
    normed = torch.randn(2, 40, 8, generator=torch.Generator().manual_seed(4))
    head = nn.Linear(8, 33, bias=False)
    labels = torch.full((2, 40), IGNORE_INDEX)
    loss, tokens, dx, dw = _loss_and_grads(normed, labels, head, chunk=16)
    assert tokens == 0 and loss.item() == 0.0
    assert not dx.any() and not dw.any()


def test_tied_embedding_gets_both_gradients() -> None:
    """lm_head.weight is the embedding: its gradient sums the lookup's and every chunk's."""
    vocab, width = 211, 24
    ids = torch.randint(0, vocab, (2, 90), generator=torch.Generator().manual_seed(5))
    labels = ids.clone()
    labels[1, 50:] = IGNORE_INDEX
    grads, losses = [], []
    for chunk in (0, 40):
        torch.manual_seed(6)
        embedding = nn.Embedding(vocab, width)
        head = nn.Linear(width, vocab, bias=False)
        head.weight = embedding.weight  # tied
        normed = torch.tanh(embedding(ids))  # (B, T, C), a path through the embedding
        loss, _ = chunked_loss_sum(normed, labels, head, chunk=chunk)
        loss.backward()
        losses.append(loss.detach())
        grads.append(embedding.weight.grad)
    assert torch.equal(losses[0], losses[1])
    assert_close_to_scale(grads[1], grads[0], rel=1e-5, atol=1e-6)


def test_without_grad_the_same_loss() -> None:
    normed = torch.randn(2, 50, 8, generator=torch.Generator().manual_seed(7))
    head = nn.Linear(8, 64, bias=False)
    labels = _labels(2, 50, 64, seed=8)
    with torch.no_grad():
        loss, tokens = chunked_loss_sum(normed, labels, head, chunk=20)
    assert not loss.requires_grad
    assert torch.equal(loss, shifted_loss_sum(head(normed), labels)[0])
    assert tokens == shifted_loss_sum(head(normed), labels)[1]


def test_negative_chunk_is_refused() -> None:
    with pytest.raises(ValueError, match="chunk must be >= 0"):
        chunked_loss_sum(
            torch.zeros(1, 2, 4), torch.zeros(1, 2, dtype=torch.long), nn.Identity(), chunk=-1
        )


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return resolve_model("tiny-llama", cache_dir=tmp_path_factory.mktemp("cache"))


def test_tail_stage_loss_and_block_gradients_unchanged(tiny_llama: Path) -> None:
    """The tail's loss runs its LM head per chunk: the same loss bits, the same block gradients."""
    plan = split_layout(load_config(tiny_llama), head_layers=1, tail_layers=2)
    _, tail = build_device_stages(tiny_llama, plan)
    assert tail is not None
    for p in tail.parameters():
        p.requires_grad_(True)
    hidden = torch.randn(2, 40, tail.config.hidden_size, generator=torch.Generator().manual_seed(9))
    labels = _labels(2, 40, tail.config.vocab_size, seed=10)
    labels[0, :] = IGNORE_INDEX
    results = []
    for chunk in (0, 24):
        tail.loss_chunk = chunk
        tail.zero_grad(set_to_none=True)
        loss, tokens = tail(hidden, labels)
        loss.backward()
        results.append((loss.detach(), tokens, {n: p.grad for n, p in tail.named_parameters()}))
    (ref_loss, ref_tokens, ref_grads), (loss, tokens, grads) = results
    assert torch.equal(loss, ref_loss) and tokens == ref_tokens == 30
    for name, grad in grads.items():
        if name == "lm_head.weight":  # summed over chunks
            assert_close_to_scale(grad, ref_grads[name], rel=1e-5, atol=1e-6)
        else:
            assert torch.equal(grad, ref_grads[name]), name


def test_no_call_of_the_lm_head_sees_more_than_a_chunk() -> None:
    seen: list[int] = []
    head = nn.Linear(8, 50, bias=False)

    def project(rows: torch.Tensor) -> torch.Tensor:
        seen.append(rows.shape[0])
        return head(rows)

    normed = torch.randn(4, 65, 8, generator=torch.Generator().manual_seed(11), requires_grad=True)
    labels = torch.randint(0, 50, (4, 65), generator=torch.Generator().manual_seed(12))
    loss, tokens = chunked_loss_sum(normed, labels, project, chunk=100)
    loss.backward()  # the backward computes each chunk's logits again
    assert tokens == 256
    assert seen == [86, 85, 85] + [85, 85, 86]  # forward, then the backward in reverse


@pytest.mark.parametrize("answer", [1, 5, 11])
def test_a_few_counted_tokens_keep_the_last_digit(answer: int) -> None:
    """Answers of a few tokens: the product still runs on enough rows to match the full one."""
    normed = torch.randn(2, 64, 48, generator=torch.Generator().manual_seed(13))
    head = nn.Linear(48, 300, bias=False)
    labels = torch.full((2, 64), IGNORE_INDEX)
    labels[1, 20 : 20 + answer] = torch.arange(answer)
    ref_loss, _, ref_dx, _ = _loss_and_grads(normed, labels, head, chunk=0)
    loss, tokens, dx, _ = _loss_and_grads(normed, labels, head, chunk=32)
    assert tokens == answer
    assert torch.equal(loss, ref_loss) and torch.equal(dx, ref_dx)


def test_the_sum_keeps_cross_entropys_order() -> None:
    """At 4 x 300 tokens a plain sum of the token losses misses cross-entropy's last digit."""
    normed = torch.randn(4, 300, 16, generator=torch.Generator().manual_seed(0)) * 3
    head = nn.Linear(16, 300, bias=False)
    labels = _labels(4, 300, 300, seed=1)
    full = shifted_loss_sum(head(normed), labels)[0]
    assert torch.equal(chunked_loss_sum(normed, labels, head, chunk=128)[0], full)
