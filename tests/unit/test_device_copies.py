"""The StageServer's host <-> device copies: pass-through on a CPU, staged logic, the GPU path.

On a CPU the staging bookkeeping (pool, budget, prefetch matching) runs with ``staged=True``
and plain buffers; the CUDA-only tests at the end check streams, events, pinned memory and bf16.
"""

from __future__ import annotations

import copy
import gc
from pathlib import Path

import pytest
import torch
from harness.close import assert_close_to_scale

from fedpipe.errors import InvalidRequestError
from fedpipe.lora import GLOBAL_ADAPTER, BatchedAdapterBank, Group, LoraSettings
from fedpipe.messages import Kind, StageMsg
from fedpipe.models import load_config
from fedpipe.server.device_copies import DeviceCopies, PinnedPool
from fedpipe.server.executor import StageExecutor
from fedpipe.server.runtime import StageRuntime, StageSettings
from fedpipe.server.sessions import RuntimeLimits
from fedpipe.split import build_stage, split_layout
from fedpipe.wire.backend import SessionRequest

CPU = torch.device("cpu")
SETTINGS = LoraSettings(r=4, alpha=8, seed=3)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class StepFence:
    """A copy that finishes when the test says so (or when someone waits for it)."""

    def __init__(self) -> None:
        self.done = False
        self.waited = 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited += 1
        self.done = True


def _pool(max_bytes: int) -> PinnedPool:
    return PinnedPool(max_bytes, lambda n: torch.empty(n, dtype=torch.uint8))


# -- pass-through on a CPU ------------------------------------------------------------------
def test_on_a_cpu_the_copies_are_a_pass_through() -> None:
    copies = DeviceCopies(CPU)
    x = torch.randn(2, 5, 8)
    assert not copies.prefetch(x)
    assert copies.to_device(x, torch.float32) is x  # what tensor.to(cpu, float32) gives
    assert torch.equal(copies.to_device(x, torch.bfloat16), x.to(CPU, torch.bfloat16))
    assert copies.to_host([x])[0] is x
    assert copies.pool.allocated_bytes == 0 and copies.staged_bytes == 0


def test_staged_copies_are_bit_identical_and_use_the_prefetch() -> None:
    copies = DeviceCopies(CPU, staged=True)
    xs = [torch.randn(3, 7, 16, dtype=torch.float32) for _ in range(4)]
    labels = torch.randint(0, 100, (3, 7))
    for t in (*xs, labels):
        assert copies.prefetch(t)
    for x in reversed(xs):  # taken in another order than prefetched: each gets its own copy
        got = copies.to_device(x, torch.bfloat16)
        assert got.dtype == torch.bfloat16 and torch.equal(got, x.to(torch.bfloat16))
    assert torch.equal(copies.to_device(labels), labels)
    y = torch.randn(4, 4)  # never prefetched: the worker uploads it itself
    assert torch.equal(copies.to_device(y, torch.float32), y)
    assert (copies.stats.prefetch_hits, copies.stats.uploads_on_worker) == (5, 1)
    assert copies.staged_bytes == 0  # every staged copy was claimed
    back = copies.to_host([y])
    assert back[0] is not y and torch.equal(back[0], y)


# -- the staging budget ----------------------------------------------------------------------
def test_prefetch_stops_at_the_budget_and_a_dropped_message_frees_its_copy() -> None:
    x = torch.randn(256)  # 1 KiB
    copies = DeviceCopies(CPU, staged=True, max_staged_bytes=2 * 1024)
    a, b, c = x.clone(), x.clone(), x.clone()
    assert copies.prefetch(a) and copies.prefetch(b)
    assert not copies.prefetch(c)  # the third would pass 2 KiB
    assert copies.stats.over_budget == 1 and copies.staged_bytes == 2048
    del a  # its message was refused or its session dropped before the worker took it
    gc.collect()
    assert copies.staged_bytes == 1024
    assert copies.prefetch(c) and copies.staged_bytes == 2048
    assert torch.equal(copies.to_device(c), x) and copies.staged_bytes == 1024


def test_a_new_tensor_at_a_dead_ones_address_gets_no_stale_copy() -> None:
    copies = DeviceCopies(CPU, staged=True)
    for _ in range(20):  # ids are reused as tensors die: every lookup must stay exact
        x = torch.randn(8)
        copies.prefetch(x)
        y = torch.randn(8)
        assert torch.equal(copies.to_device(y), y)
        assert torch.equal(copies.to_device(x), x)
        del x, y
    assert copies.staged_bytes == 0


# -- the pinned pool -------------------------------------------------------------------------
def test_the_pool_reuses_a_buffer_only_once_its_copy_is_done() -> None:
    pool = _pool(1 << 20)
    first = pool.acquire(5000)
    assert first is not None and first.numel() == 8192  # rounded up to a power of two
    fence = StepFence()
    pool.release(first, fence)
    second = pool.acquire(5000)  # the first is still being read by its copy
    assert second is not None and second.data_ptr() != first.data_ptr()
    fence.done = True
    third = pool.acquire(6000)
    assert third is not None and third.data_ptr() == first.data_ptr()
    assert (pool.stats.pool_allocs, pool.stats.pool_reuses) == (2, 1)


def test_the_pool_never_holds_more_than_its_bound() -> None:
    pool = _pool(16 * 1024)
    fences = []
    for size in (4096, 8192, 4096, 16384, 4096, 8192):
        buffer = pool.acquire(size)
        assert buffer is not None
        assert pool.allocated_bytes <= 16 * 1024
        fences.append(StepFence())
        pool.release(buffer, fences[-1])
    assert sum(f.waited for f in fences) > 0  # full: it waited for a copy, one at a time
    assert pool.stats.pool_waits == sum(f.waited for f in fences)


def test_a_tensor_larger_than_the_pool_is_copied_plainly() -> None:
    copies = DeviceCopies(CPU, staged=True, pool_bytes=4096)
    assert copies.pool.acquire(4097) is None
    x = torch.randn(4096)  # 16 KiB
    assert torch.equal(copies.to_device(x), x) and copies.pool.allocated_bytes == 0


def test_bad_settings_are_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="at least 4096"):
        _pool(100)
    with pytest.raises(ValueError, match="cuda or"):
        DeviceCopies(torch.device("meta"), staged=True)


# -- through the runtime ---------------------------------------------------------------------
def _runtime(stage: torch.nn.Module, copies: DeviceCopies | None) -> StageRuntime:
    bank = BatchedAdapterBank(copy.deepcopy(stage), SETTINGS, family="llama")
    settings = StageSettings(
        mode="u",
        hidden_size=64,
        device=CPU,
        limits=RuntimeLimits(max_microbatch_size=4),
        max_positions=128,
    )
    return StageRuntime(bank, settings, copies=copies)


def _one_step(runtime: StageRuntime, seed: int) -> list[StageMsg]:
    """Two microbatches forward and backward, then the step end: every reply, in order."""
    handle = runtime.attach(
        runtime.open(SessionRequest(device_id="dev", round=1, microbatch_size=4, seq_len=16))
    )
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(2, 9, 64, generator=gen) for _ in range(2)]
    grads = [torch.randn(2, 9, 64, generator=gen) for _ in range(2)]
    replies = []
    for kind, tensors in ((Kind.ACTIVATION, xs), (Kind.OUTPUT_GRAD, grads)):
        for mb, t in enumerate(tensors):
            handle.submit(StageMsg(kind, 0, mb, tensor=t))
        for _ in tensors:
            reply = handle.next_reply(timeout=60)
            assert isinstance(reply, StageMsg), reply
            replies.append(reply)
    handle.submit(StageMsg(Kind.STEP_END, 0))
    done = handle.next_reply(timeout=60)
    assert isinstance(done, StageMsg) and done.kind is Kind.STEP_DONE
    return replies


def test_a_runtime_with_staged_copies_answers_bit_identically(folder: Path) -> None:
    plan = split_layout(load_config(folder))
    stage = build_stage(folder, plan, "middle")
    plain, staged = _runtime(stage, None), _runtime(stage, DeviceCopies(CPU, staged=True))
    try:
        want, got = _one_step(plain, 7), _one_step(staged, 7)
        for a, b in zip(want, got, strict=True):
            assert (a.kind, a.microbatch) == (b.kind, b.microbatch)
            assert a.tensor is not None and b.tensor is not None
            assert torch.equal(a.tensor, b.tensor)
        (sid_a,), (sid_b,) = plain.bank.names(), staged.bank.names()
        for k, v in plain.bank.state_dict(sid_a).items():
            assert torch.equal(v, staged.bank.state_dict(sid_b)[k]), k
        stats = staged.copies.stats
        assert stats.prefetch_hits + stats.uploads_on_worker == 4 and stats.downloads == 4
        assert stats.prefetch_hits >= 1  # the reader's prefetch was used
        assert staged.copies.staged_bytes == 0
    finally:
        plain.stop()
        staged.stop()


def test_a_non_finite_reply_is_refused_with_staged_copies(folder: Path) -> None:
    plan = split_layout(load_config(folder))
    runtime = _runtime(build_stage(folder, plan, "middle"), DeviceCopies(CPU, staged=True))
    try:
        handle = runtime.attach(
            runtime.open(SessionRequest(device_id="dev", round=1, microbatch_size=4, seq_len=16))
        )
        x = torch.randn(1, 4, 64)
        x[0, 1, 2] = float("inf")  # (the transport's decoder refuses this; the runtime must too)
        handle.submit(StageMsg(Kind.ACTIVATION, 0, 0, tensor=x))
        reply = handle.next_reply(timeout=60)
        assert isinstance(reply, Exception) and "NaN or Inf" in str(reply)
    finally:
        runtime.stop()


def test_replies_are_checked_for_nan_on_their_host_copies(folder: Path) -> None:
    """The GPU path's check: a reply computed on the device is judged on its copy back."""
    plan = split_layout(load_config(folder))
    bank = BatchedAdapterBank(build_stage(folder, plan, "middle"), SETTINGS, family="llama")
    executor = StageExecutor(
        bank,
        mode="u",
        hidden_size=64,
        device=CPU,
        dtype=torch.float32,
        max_in_flight=2,
        copies=DeviceCopies(CPU, staged=True),
    )
    bad, good = torch.ones(1, 2, 64), torch.ones(1, 2, 64)
    bad[0, 0, 0] = float("nan")
    msgs = [StageMsg(Kind.ACTIVATION, 0, mb, tensor=torch.ones(1, 2, 64)) for mb in (0, 1)]
    results: list[StageMsg | Exception | None] = [
        StageMsg(Kind.OUTPUT, 0, 0, tensor=bad),
        StageMsg(Kind.OUTPUT, 0, 1, tensor=good),
    ]
    work = [(None, m) for m in msgs]
    executor._replies_to_host(work, results)  # type: ignore[arg-type]
    assert isinstance(results[0], InvalidRequestError) and "NaN or Inf" in str(results[0])
    assert isinstance(results[1], StageMsg) and results[1].tensor is not good  # a host copy
    assert results[1].tensor is not None and torch.equal(results[1].tensor, good)


# -- on a GPU --------------------------------------------------------------------------------
@needs_cuda
def test_cuda_uploads_go_through_pinned_buffers_on_a_side_stream() -> None:
    device = torch.device("cuda")
    copies = DeviceCopies(device)
    xs = [torch.randn(8, 128, 576) for _ in range(6)]
    for x in xs:
        assert copies.prefetch(x)
    assert all(b.is_pinned() for b in copies.pool._free + [b for b, _ in copies.pool._busy])
    outs = [copies.to_device(x, torch.bfloat16) * 2 for x in xs]  # used at once on compute
    for x, out in zip(xs, outs, strict=True):
        assert torch.equal(out.cpu(), x.to(torch.bfloat16) * 2)
    backs = copies.to_host(outs)
    assert all(b.is_pinned() and b.device.type == "cpu" for b in backs)
    for back, out in zip(backs, outs, strict=True):
        assert torch.equal(back, out.cpu())


@needs_cuda
def test_cuda_a_call_makes_no_synchronising_call(folder: Path) -> None:
    device = torch.device("cuda")
    plan = split_layout(load_config(folder))
    stage = build_stage(folder, plan, "middle", dtype=torch.bfloat16, device=device)
    bank = BatchedAdapterBank(stage, SETTINGS, family="llama")
    settings = StageSettings(
        mode="u", hidden_size=64, device=device, dtype=torch.bfloat16, max_positions=128
    )
    runtime = StageRuntime(bank, settings)
    try:
        handle = runtime.attach(
            runtime.open(SessionRequest(device_id="dev", round=1, microbatch_size=4, seq_len=16))
        )
        x = torch.randn(2, 9, 64)
        runtime.copies.prefetch(x)
        torch.cuda.set_sync_debug_mode("error")  # an .item(), .cpu() or pageable copy raises
        try:
            (info,) = runtime.sessions()
            out = runtime.executor.compute(info, StageMsg(Kind.ACTIVATION, 0, 0, tensor=x))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert out.tensor is not None and out.tensor.is_pinned()
        del handle
    finally:
        runtime.stop()


@needs_cuda
def test_cuda_bf16_outputs_stay_within_tolerance_of_fp32(folder: Path) -> None:
    plan = split_layout(load_config(folder))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 9, 64, generator=gen)
    outs = {}
    for name, device, dtype in (("fp32", CPU, torch.float32), ("bf16", None, torch.bfloat16)):
        device = device or torch.device("cuda")
        stage = build_stage(folder, plan, "middle", dtype=dtype, device=device)
        bank = BatchedAdapterBank(stage, SETTINGS, family="llama")
        copies = DeviceCopies(device)
        hidden = copies.to_device(x, dtype)
        (out,) = bank.run([Group(GLOBAL_ADAPTER, hidden)])
        outs[name] = copies.to_host([out.float()])[0]
    assert_close_to_scale(outs["bf16"], outs["fp32"], rel=0.05)
