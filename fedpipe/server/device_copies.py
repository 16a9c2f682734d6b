"""Host <-> device copies of the StageServer's messages, off the compute stream.

On a GPU, every message the transport decodes is a CPU tensor and every reply must come back
to the host to be encoded. Done naively (``tensor.to("cuda")`` on the worker, ``.cpu()`` in the
encoder) each copy runs on the compute stream, from pageable memory, and stalls the GPU between
calls. :class:`DeviceCopies` moves them aside:

- **Upload (prefetch).** The reader thread that decoded a message calls :meth:`prefetch`: the
  tensor is copied into a pinned host buffer from a bounded, reused :class:`PinnedPool`, then to
  the GPU with ``non_blocking=True`` on a side stream, and an event marks the copy done. This
  runs while the worker computes the current call, so the next call's inputs are already on the
  GPU when the worker takes them. At most ``max_staged_bytes`` wait on the GPU this way; a
  message past that budget is uploaded by the worker when it runs (the same path, later).
- **Use.** :meth:`to_device` on the worker makes the compute stream wait for that event (not
  the host, not the device) and records the tensor's use on the compute stream, so the caching
  allocator does not hand its memory to the side stream while compute still reads it.
- **Download.** :meth:`to_host` copies a call's replies into pinned host tensors on a second
  side stream after the compute stream's work, and waits on that one event: the host copies are
  then complete, and any check that needs values (NaN/Inf refusal) reads them there instead of
  synchronising the device.

On a CPU everything is a pass-through: ``to_device`` is ``tensor.to(device, dtype)``, nothing
is prefetched and replies are returned as they are, so results are bit-identical to a runtime
without this module. ``staged=True`` runs the staging bookkeeping on a CPU (plain buffers,
fences that are done at once), which is how the tests cover the pool, budget and ordering here.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

__all__ = ["CopyStats", "DeviceCopies", "Fence", "PinnedPool"]

log = logging.getLogger(__name__)

_MIN_BUFFER = 4096  # bytes: pool buffers are powers of two from here, so sizes reuse well


class Fence(Protocol):
    """Something that says when queued GPU work is done (a ``torch.cuda.Event``)."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class _Done:
    """The fence of work that is already finished (CPU copies are synchronous)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


@dataclass
class CopyStats:
    """What the copies did since the runtime started (for benches and tests)."""

    prefetched: int = 0  # uploads done ahead by a reader thread
    prefetch_hits: int = 0  # ... that the worker found staged and used
    uploads_on_worker: int = 0  # uploads the worker did itself (over budget, or not prefetched)
    over_budget: int = 0  # prefetches refused by max_staged_bytes
    downloads: int = 0  # reply tensors copied back
    pool_allocs: int = 0  # pinned buffers allocated
    pool_reuses: int = 0  # pinned buffers reused
    pool_waits: int = 0  # acquisitions that waited for a busy buffer's copy to finish


class PinnedPool:
    """A bounded set of reused host staging buffers (pinned on CUDA).

    A buffer is busy from :meth:`acquire` until the copy that reads it is done (the fence given
    to :meth:`release`); then it is reused for any request that fits. Sizes are rounded up to
    powers of two. At most ``max_bytes`` are ever allocated: past that, :meth:`acquire` waits
    for the oldest busy buffer's fence (one copy, never the whole device), frees idle buffers
    that are too small, or returns None for a request larger than the whole pool.
    """

    def __init__(self, max_bytes: int, allocate: Callable[[int], torch.Tensor]) -> None:
        if max_bytes < _MIN_BUFFER:
            raise ValueError(f"pinned pool of {max_bytes} bytes: give at least {_MIN_BUFFER}")
        self.max_bytes = max_bytes
        self._allocate = allocate  # nbytes -> a flat uint8 tensor of exactly nbytes
        self._free: list[torch.Tensor] = []
        self._busy: list[tuple[torch.Tensor, Fence]] = []  # oldest first
        self._lock = threading.Lock()
        self.stats = CopyStats()

    @property
    def allocated_bytes(self) -> int:
        with self._lock:
            return sum(b.numel() for b in self._free) + sum(b.numel() for b, _ in self._busy)

    def acquire(self, nbytes: int) -> torch.Tensor | None:
        """A flat uint8 buffer of at least ``nbytes`` (None: larger than the whole pool)."""
        size = _bucket(nbytes)
        if size > self.max_bytes:
            return None
        while True:
            with self._lock:
                self._reclaim()
                buffer = self._take_free(size)
                if buffer is None:
                    buffer = self._grow(size)
                if buffer is not None:
                    return buffer
                oldest = self._busy[0][1] if self._busy else None
            if oldest is None:  # every buffer is free but none fits: _grow dropped some; retry
                continue
            self.stats.pool_waits += 1
            oldest.synchronize()

    def release(self, buffer: torch.Tensor, fence: Fence) -> None:
        """``buffer`` is free again once ``fence`` is done."""
        with self._lock:
            self._busy.append((buffer, fence))

    def _reclaim(self) -> None:
        still = []
        for buffer, fence in self._busy:
            (self._free.append(buffer) if fence.query() else still.append((buffer, fence)))
        self._busy = still

    def _take_free(self, size: int) -> torch.Tensor | None:
        fits = [i for i, b in enumerate(self._free) if b.numel() >= size]
        if not fits:
            return None
        best = min(fits, key=lambda i: self._free[i].numel())  # the smallest that fits
        buffer = self._free.pop(best)  # by index: tensors' == is elementwise
        self.stats.pool_reuses += 1
        return buffer

    def _grow(self, size: int) -> torch.Tensor | None:
        """A new buffer if the bound allows, dropping idle smaller buffers to make room."""
        held = sum(b.numel() for b in self._free) + sum(b.numel() for b, _ in self._busy)
        while held + size > self.max_bytes and self._free:
            held -= self._free.pop(0).numel()  # idle and too small for this request
        if held + size > self.max_bytes:
            return None
        self.stats.pool_allocs += 1
        return self._allocate(size)


@dataclass
class _Staged:
    """One prefetched upload: the GPU copy and the event that says it has landed."""

    source: weakref.ref[torch.Tensor]
    copy: torch.Tensor
    fence: Fence
    nbytes: int


class DeviceCopies:
    """Uploads of decoded messages and downloads of replies for one stage device."""

    def __init__(
        self,
        device: torch.device,
        *,
        max_staged_bytes: int = 256 * 2**20,
        pool_bytes: int = 64 * 2**20,
        staged: bool | None = None,
    ) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.staged = self.cuda if staged is None else staged
        if self.staged and not self.cuda and device.type != "cpu":
            raise ValueError(f"staged copies run on cuda or (for tests) cpu, not {device}")
        self.max_staged_bytes = max_staged_bytes
        self.pool = PinnedPool(pool_bytes, self._allocate)
        self.stats = self.pool.stats
        # Two side streams: a download waits for the compute stream, and an upload queued
        # behind it on the same stream would wait too (and lose its overlap with compute).
        self._up = torch.cuda.Stream(device) if self.cuda else None
        self._down = torch.cuda.Stream(device) if self.cuda else None
        self._staged: dict[int, _Staged] = {}  # id(source tensor) -> its upload
        self._staged_bytes = 0
        self._lock = threading.RLock()  # weakref callbacks may fire inside a locked region

    @property
    def staged_bytes(self) -> int:
        """Bytes of prefetched uploads waiting on the device for the worker."""
        with self._lock:
            return self._staged_bytes

    # -- upload ------------------------------------------------------------------------------
    def prefetch(self, tensor: torch.Tensor | None) -> bool:
        """Start ``tensor``'s upload now, if staging is on and the budget allows (True: started).

        Call it from the thread that decoded the message, before the worker can take it.
        """
        if tensor is None or not self.staged or tensor.device.type != "cpu":
            return False
        nbytes = tensor.numel() * tensor.element_size()
        with self._lock:
            if id(tensor) in self._staged:
                return True
            if self._staged_bytes + nbytes > self.max_staged_bytes:
                self.stats.over_budget += 1
                return False
            self._staged_bytes += nbytes  # reserved before the copy, so threads cannot overrun
        try:
            copy, fence = self._upload(tensor)
        except BaseException:
            with self._lock:
                self._staged_bytes -= nbytes
            raise
        key = id(tensor)
        source = weakref.ref(tensor, lambda _: self._forget(key))
        with self._lock:
            self._staged[key] = _Staged(source, copy, fence, nbytes)
            self.stats.prefetched += 1
        return True

    def to_device(self, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``tensor`` on the stage's device in ``dtype``, ready for the compute stream to read.

        On a CPU without staging: exactly ``tensor.to(device, dtype)``.
        """
        if not self.staged or tensor.device.type != "cpu":
            return tensor.to(self.device, dtype) if dtype else tensor.to(self.device)
        staged = self._claim(tensor)
        if staged is None:
            self.stats.uploads_on_worker += 1
            copy, fence = self._upload(tensor)
        else:
            self.stats.prefetch_hits += 1
            copy, fence = staged.copy, staged.fence
        self._wait_on_compute(copy, fence)
        return copy.to(dtype) if dtype else copy

    def _claim(self, tensor: torch.Tensor) -> _Staged | None:
        """The prefetched upload of ``tensor`` (removed from the staged set), if any."""
        with self._lock:
            staged = self._staged.get(id(tensor))
            if staged is None or staged.source() is not tensor:
                return None
            del self._staged[id(tensor)]
            self._staged_bytes -= staged.nbytes
            return staged

    def _forget(self, key: int) -> None:
        """The message was dropped before the worker took it: free its staged copy."""
        with self._lock:
            staged = self._staged.get(key)
            if staged is not None and staged.source() is None:
                del self._staged[key]
                self._staged_bytes -= staged.nbytes

    def _upload(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Fence]:
        """A device copy of ``tensor`` through a pool buffer; the fence of that copy."""
        source = tensor.contiguous()
        nbytes = source.numel() * source.element_size()
        buffer = self.pool.acquire(nbytes)
        if buffer is None:  # larger than the whole pool: a plain (synchronous) copy
            log.debug("a %d-byte tensor is larger than the pinned pool: copied plainly", nbytes)
            return source.to(self.device), _Done()
        host = _view(buffer, source)
        host.copy_(source)  # pageable -> pinned, on this thread's CPU
        if not self.cuda:
            self.pool.release(buffer, _Done())
            return host.clone(), _Done()
        assert self._up is not None
        with torch.cuda.stream(self._up):
            copy = torch.empty_like(source, device=self.device)  # allocated on the side stream
            copy.copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._up)
        self.pool.release(buffer, event)  # reusable once the copy has read it
        return copy, event

    def _wait_on_compute(self, copy: torch.Tensor, fence: Fence) -> None:
        """The compute stream waits for the copy; the allocator learns who reads the memory."""
        if not self.cuda or isinstance(fence, _Done):
            return
        assert isinstance(fence, torch.cuda.Event)
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(fence)
        copy.record_stream(compute)

    # -- download ----------------------------------------------------------------------------
    def to_host(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Host copies of a call's reply tensors, complete on return (one event waited on).

        On a CPU the tensors themselves (copies when ``staged``). On CUDA the copies run on
        the side stream after the compute stream's work so far, into pinned tensors (torch's
        caching host allocator reuses them once the encoder has let go), and only this thread
        waits for them.
        """
        if not self.cuda:  # staged on a CPU (tests): copies, as the GPU path hands back
            hosts = [t.clone() for t in tensors] if self.staged else list(tensors)
            self.stats.downloads += len(hosts) if self.staged else 0
            return hosts
        if not tensors:
            return []
        assert self._down is not None
        compute = torch.cuda.current_stream(self.device)
        self._down.wait_stream(compute)  # after the work that computes the replies
        hosts = []
        with torch.cuda.stream(self._down):
            for t in tensors:
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                t.record_stream(self._down)  # freed by compute, still read by this copy
                hosts.append(host)
            done = torch.cuda.Event()
            done.record(self._down)
        done.synchronize()  # this call's copies only: not the device, not other streams
        self.stats.downloads += len(hosts)
        return hosts

    def _allocate(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.cuda)


def _bucket(nbytes: int) -> int:
    """``nbytes`` rounded up to a power of two (at least ``_MIN_BUFFER``)."""
    return max(_MIN_BUFFER, 1 << max(0, nbytes - 1).bit_length())


def _view(buffer: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The first bytes of ``buffer`` as a tensor of ``like``'s dtype and shape."""
    nbytes = like.numel() * like.element_size()
    return buffer[:nbytes].view(like.dtype).view(like.shape)
