"""What a waiting microbatch keeps for its backward, where it keeps it, and how many bytes.

Between a session's ACTIVATION and its OUTPUT_GRAD (a link round trip, 100 ms and more) the
server holds what the microbatch's backward needs: the peft bank's autograd graph (its saved
tensors) or the batched bank's :class:`~fedpipe.lora.batched_blocks.Tape`. With many devices
this stash, not compute, is what fills a GPU. With ``server.offload = "auto"`` (PipeOffload)
it waits in host memory instead:

- **peft bank**: the forward of each microbatch runs under
  ``torch.autograd.graph.saved_tensors_hooks`` (:class:`SavedTensors`); every tensor autograd
  saves goes to the host at once, except the stage's own weights and the received input, which
  stay where they are; the backward brings them back (all started before it runs).
- **batched bank**: after the forward call, its tapes go to the host (:meth:`Stash.put_tapes`);
  the backward brings them back a block at a time as its walk reads them, the next block's
  copies started while a block computes (:meth:`Stash.fetch_tapes`).

A copy moves a tensor's whole storage and rebuilds the tensor as a view at its own offset and
strides, each storage once, so tensors that shared a storage still do (the joined rows of one
batched call stay adjacent) and the backward reads the same values in the same layout: the
same losses and gradients to the bit. On CUDA the host memory is pinned and the copies run on
a side stream (the compute stream waits on an event; the caching allocator is told who reads
what); on a CPU the host copy is a second buffer in the same memory, which saves nothing there
but runs the same path (the tests' exactness check).

:class:`StashMeter` counts the bytes of the distinct storages that stashes hold, on the stage's
device and offloaded, and their peaks (``fedpipe bench server``: ``peak_stash_bytes``).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from fedpipe.lora.batched_blocks import BlockTape, Tape

__all__ = ["HostCopies", "SavedTensors", "Stash", "StashMeter"]

# Where a counted storage lives: waiting on the stage's device, waiting in host memory, or
# back on the device for the backward that runs now.
DEVICE, HOST, FETCHED = "device", "host", "fetched"


class StashMeter:
    """Bytes of the distinct storages stashes hold, on the device and offloaded, with peaks.

    Off by default (``enabled``): a bench turns it on. A storage is counted once however many
    stashes hold it (the tapes of one batched call share theirs), for as long as any does.
    On the device means waiting there (``DEVICE``) or brought back for a backward that runs
    (``FETCHED``); the device's peak is of the two together.
    """

    def __init__(self) -> None:
        self.enabled = False
        self._lock = threading.Lock()
        self._held: dict[tuple[str, int], list[int]] = {}  # (where, data_ptr) -> [nbytes, refs]
        self.bytes = {DEVICE: 0, HOST: 0, FETCHED: 0}
        self.peak = {DEVICE: 0, HOST: 0, FETCHED: 0, "on_device": 0}

    def hold(self, owner: object, where: str, tensors: Iterable[Tensor]) -> None:
        """Count the storages of ``tensors`` (in ``where``) until ``owner`` is collected."""
        if not self.enabled:
            return
        sizes = {_ptr(t): t.untyped_storage().nbytes() for t in tensors}
        keys = [(where, ptr) for ptr in sizes]
        with self._lock:
            for key in keys:
                held = self._held.setdefault(key, [sizes[key[1]], 0])
                held[1] += 1
                if held[1] == 1:
                    self.bytes[where] += held[0]
                    self._peaks()
        weakref.finalize(owner, self._release, keys)

    def _release(self, keys: list[tuple[str, int]]) -> None:
        with self._lock:
            for key in keys:
                held = self._held[key]
                held[1] -= 1
                if held[1] == 0:
                    self.bytes[key[0]] -= held[0]
                    del self._held[key]

    def _peaks(self) -> None:
        for where, now in self.bytes.items():
            self.peak[where] = max(self.peak[where], now)
        self.peak["on_device"] = max(
            self.peak["on_device"], self.bytes[DEVICE] + self.bytes[FETCHED]
        )

    def snapshot(self, *, reset: bool = False) -> dict[str, int]:
        """Bytes now and peaks since the last reset (``reset``: the peaks restart from now).

        ``peak_stash_bytes``: on the stage's device, waiting or brought back for a backward;
        ``peak_waiting_bytes``: waiting there only; ``peak_offloaded_bytes``: in host memory.
        """
        with self._lock:
            out = {
                "stash_bytes": self.bytes[DEVICE] + self.bytes[FETCHED],
                "offloaded_bytes": self.bytes[HOST],
                "peak_stash_bytes": self.peak["on_device"],
                "peak_waiting_bytes": self.peak[DEVICE],
                "peak_offloaded_bytes": self.peak[HOST],
            }
            if reset:
                self.peak = dict(self.bytes)
                self.peak["on_device"] = self.bytes[DEVICE] + self.bytes[FETCHED]
            return out


class HostCopies:
    """Whole storages to host memory and back: pinned and on a side stream on CUDA.

    One side stream carries both directions, so a storage's way back is queued after its way
    out without events to match them.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._side = torch.cuda.Stream(device) if self.cuda else None

    def to_host(self, storage: Tensor) -> Tensor:
        """A host copy of ``storage`` (a flat uint8 tensor over a whole storage)."""
        host = torch.empty(storage.numel(), dtype=torch.uint8, pin_memory=self.cuda)
        if self._side is None:
            host.copy_(storage)
            return host
        self._side.wait_stream(torch.cuda.current_stream(self.device))  # after its producer
        with torch.cuda.stream(self._side):
            host.copy_(storage, non_blocking=True)
        storage.record_stream(self._side)  # not reused before the copy has read it
        return host

    def to_device(self, hosts: Sequence[Tensor]) -> list[Tensor]:
        """Device copies of ``hosts``, ready for the compute stream (which waits for them).

        On a CPU the host copies themselves: they are in the stage's memory already.
        """
        copies, ready = self.start_to_device(hosts)
        ready()
        return copies

    def start_to_device(self, hosts: Sequence[Tensor]) -> tuple[list[Tensor], Callable[[], None]]:
        """Device copies of ``hosts``, started on the side stream, and what makes the compute
        stream wait for them: call it before the compute stream reads them (not before, so
        that the copies overlap the compute queued until then)."""
        if self._side is None:
            return list(hosts), _nothing
        with torch.cuda.stream(self._side):
            copies = [torch.empty_like(h, device=self.device) for h in hosts]
            for copy, host in zip(copies, hosts, strict=True):
                copy.copy_(host, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._side)

        waited: list[bool] = []

        def ready() -> None:
            if waited:
                return
            waited.append(True)
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(done)
            for copy in copies:
                copy.record_stream(compute)  # allocated on the side stream, read by compute

        return copies, ready


def _nothing() -> None:
    """What a CPU's copies wait for."""


def _whole(t: Tensor) -> Tensor:
    """The whole storage under ``t`` as a flat uint8 tensor."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


Geometry = tuple[torch.dtype, int, tuple[int, ...], tuple[int, ...]]  # dtype, offset, size, stride


def _geometry(t: Tensor) -> Geometry:
    return t.dtype, int(t.storage_offset()), tuple(t.shape), t.stride()


def _view(storage: Tensor, geometry: Geometry) -> Tensor:
    """A tensor of ``geometry`` over ``storage`` (another copy of the storage it came from)."""
    dtype, offset, size, stride = geometry
    out = torch.empty(0, dtype=dtype, device=storage.device)
    return out.set_(storage.untyped_storage(), offset, size, stride)


def _moved(storages: dict[int, Tensor]) -> Any:
    """A tensor -> the same tensor over its storage's copy in ``storages`` (by data_ptr)."""
    return lambda t: _view(storages[_ptr(t)], _geometry(t))


def _ptr(t: Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _Owner:
    """Something for the meter to outlive: what a microbatch's stash is counted against."""


class _Saved:
    """What a saved tensor became: its own tensor (kept in place), or a place in its
    microbatch's host storages. Holding it keeps the microbatch's :class:`SavedTensors`."""

    __slots__ = ("owner", "tensor", "key", "geometry")

    def __init__(
        self,
        owner: SavedTensors,
        tensor: Tensor | None,
        key: tuple[int, int] = (0, 0),
        geometry: Geometry | None = None,
    ) -> None:
        self.owner, self.tensor, self.key, self.geometry = owner, tensor, key, geometry


class SavedTensors:
    """One microbatch's autograd saved tensors (peft bank), held in host memory.

    Use :meth:`hooks` around the microbatch's forward and :meth:`on_device` around its
    backward. Storages of ``keep`` stay where they are (the stage's weights, the received
    input). Without ``offload`` nothing moves: the saved tensors are only counted.
    """

    def __init__(self, stash: Stash, keep: set[int], *, offload: bool) -> None:
        self._stash = stash
        self._keep = keep  # storage data_ptrs
        self._offload = offload
        # (storage ptr, version) -> its host copy. Each source is held until the forward
        # ends, so that no new tensor gets its address (and its key) while packing goes on.
        self._host: dict[tuple[int, int], Tensor] = {}
        self._sources: list[Tensor] = []
        self._kept: dict[int, Tensor] = {}  # stays in place, counted at the end of the forward
        self._device: dict[tuple[int, int], Tensor] = {}  # brought back for the backward

    @contextmanager
    def hooks(self) -> Iterator[SavedTensors]:
        """Autograd's saved tensors of the forward run inside go through this object."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield self
        meter = self._stash.meter
        meter.hold(self, HOST, self._host.values())
        meter.hold(self, DEVICE, [t for p, t in self._kept.items() if p not in self._keep])
        self._sources, self._kept = [], {}

    @contextmanager
    def on_device(self) -> Iterator[None]:
        """The offloaded storages back on the device (every copy started at once) while the
        backward runs; let go after it."""
        keys = list(self._host)
        owner = _Owner()
        if keys:
            copies = self._stash.copies.to_device([self._host[k] for k in keys])
            self._device = dict(zip(keys, copies, strict=True))
            self._stash.meter.hold(owner, FETCHED, copies)
        try:
            yield
        finally:
            self._device = {}

    def _pack(self, t: Tensor) -> _Saved:
        ptr = _ptr(t)
        if ptr in self._keep or not self._offload:
            self._kept.setdefault(ptr, t)
            return _Saved(self, t.detach())  # detached: no cycle through an output's grad_fn
        key = (ptr, t._version)
        if key not in self._host:
            self._sources.append(t)
            self._host[key] = self._stash.copies.to_host(_whole(t))
        return _Saved(self, None, key, _geometry(t))

    def _unpack(self, saved: _Saved) -> Tensor:
        if saved.tensor is not None:
            return saved.tensor
        assert saved.geometry is not None
        storage = self._device.get(saved.key)
        if storage is None:  # unpacked outside on_device (a caller's own backward): copy now
            storage = self._stash.copies.to_device([self._host[saved.key]])[0]
        return _view(storage, saved.geometry)


class Stash:
    """The executor's stashes: offloaded with ``offload``, counted when the meter is on."""

    def __init__(self, device: torch.device, *, offload: bool = False) -> None:
        self.offload = offload
        self.copies = HostCopies(device)
        self.meter = StashMeter()

    @property
    def hooked(self) -> bool:
        """Whether the peft bank's forwards run under saved-tensor hooks."""
        return self.offload or self.meter.enabled

    def saving(self, stage: torch.nn.Module, x: Tensor) -> SavedTensors:
        """One microbatch's saved tensors for the peft bank (:class:`SavedTensors`): the
        stage's weights and buffers and the input ``x`` stay in place."""
        keep = {_ptr(t) for t in (*stage.parameters(), *stage.buffers(), x)}
        return SavedTensors(self, keep, offload=self.offload)

    def put_tapes(self, tapes: Sequence[Tape], inputs: Sequence[Tensor]) -> list[Tape]:
        """The tapes of one forward call, in host memory with ``offload`` (each storage once);
        counted with the ``inputs`` the executor keeps beside them (not offloaded)."""
        if not self.offload:
            for tape, x in zip(tapes, inputs, strict=True):
                self.meter.hold(tape, DEVICE, [*tape.tensors(), x])
            return list(tapes)
        hosts: dict[int, Tensor] = {}
        for tape in tapes:
            for t in tape.tensors():
                if _ptr(t) not in hosts:
                    hosts[_ptr(t)] = self.copies.to_host(_whole(t))
        moved = [tape.map(_moved(hosts)) for tape in tapes]
        for tape, x in zip(moved, inputs, strict=True):
            self.meter.hold(tape, HOST, tape.tensors())
            self.meter.hold(tape, DEVICE, [x])
        return moved

    def fetch_tapes(self, tapes: Sequence[Tape]) -> list[Tape]:
        """The tapes as one backward reads them: each block's records back on the device when
        the walk first reads them, the next block's copies started then (:class:`_Blocks`)."""
        if not self.offload:
            return list(tapes)
        blocks = _Blocks(self, tapes)
        return [
            Tape(
                tape.shape,
                tape.adapter,
                tape.need_input_grad,
                _FetchedBlocks(blocks, i, tape),
                tape.segments,
            )
            for i, tape in enumerate(tapes)
        ]


class _Blocks:
    """The block records of one backward's tapes, brought back a block at a time.

    The backward walks the blocks from the last down. A block's records of every tape come
    back together, each storage once (tapes of one forward call share theirs); reading block
    ``i`` starts the copies of the next block down and lets go of the blocks above, so the
    device holds about two blocks of the call's records, not all of them.
    """

    def __init__(self, stash: Stash, tapes: Sequence[Tape]) -> None:
        self._stash = stash
        self._tapes = list(tapes)
        order = sorted({i for tape in tapes for i in tape.blocks}, reverse=True)
        self._below = dict(zip(order, order[1:], strict=False))
        # block index -> (its records per tape, what makes the compute stream wait for them)
        self._fetched: dict[int, tuple[list[BlockTape | None], Callable[[], None]]] = {}

    def record(self, position: int, index: int) -> BlockTape:
        """Tape ``position``'s record of block ``index``, on the device."""
        if index not in self._fetched:
            self._fetched[index] = self._fetch(index)
        for above in [i for i in self._fetched if i > index]:
            del self._fetched[above]
        below = self._below.get(index)
        if below is not None and below not in self._fetched:
            self._fetched[below] = self._fetch(below)  # copies while this block computes
        records, ready = self._fetched[index]
        ready()
        record = records[position]
        assert record is not None, f"tape {position} has no block {index}"
        return record

    def _fetch(self, index: int) -> tuple[list[BlockTape | None], Callable[[], None]]:
        hosts: dict[int, Tensor] = {}
        for tape in self._tapes:
            if index in tape.blocks:
                for t in tape.blocks[index].tensors():
                    hosts.setdefault(_ptr(t), t)
        copies, ready = self._stash.copies.start_to_device([_whole(t) for t in hosts.values()])
        moved = _moved(dict(zip(hosts, copies, strict=True)))
        records = [
            tape.blocks[index].map(moved) if index in tape.blocks else None for tape in self._tapes
        ]
        for record in records:
            if record is not None:
                self._stash.meter.hold(record, FETCHED, record.tensors())
        return records, ready


class _FetchedBlocks(dict[int, BlockTape]):
    """A tape's blocks as the backward reads them: ``blocks[i]`` is block ``i``'s record back
    on the device (:class:`_Blocks`); which blocks there are, as in host memory."""

    def __init__(self, blocks: _Blocks, position: int, tape: Tape) -> None:
        super().__init__(tape.blocks)  # the keys (and the host records, for nothing else)
        self._blocks = blocks
        self._position = position

    def __getitem__(self, index: int) -> BlockTape:
        if index not in self:
            raise KeyError(index)
        return self._blocks.record(self._position, index)
