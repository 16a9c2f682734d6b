"""The StageRuntime batching sessions: same replies and updates as one message at a time.

A real runtime (worker thread, fair queue, policy, executor, streams) on tiny-llama, and on a tiny
random model of every other family the batched bank computes (:mod:`harness.tiny_families`, each
with its default LoRA targets: Phi-3's fused ``qkv_proj``); the worker is held on the first
message so that the others queue up and the next call batches them.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from harness.close import assert_close_to_scale
from harness.stage import hold_compute
from harness.tiny_families import CASES, save_tiny
from harness.waits import wait_for

from fedpipe.config import FedpipeConfig, ServerConfig
from fedpipe.errors import InvalidRequestError
from fedpipe.lora import AdapterBank, BatchedAdapterBank
from fedpipe.messages import Kind, StageMsg
from fedpipe.models import resolve_model
from fedpipe.server.build import build_runtime
from fedpipe.server.streams import StreamHandle
from fedpipe.trace import Tracer
from fedpipe.wire.backend import SessionRequest

TIMEOUT = 30.0
SHAPES = {"a": (1, 9), "b": (3, 16), "c": (2, 5)}  # rows, tokens: they differ within a call


@pytest.fixture(scope="module", params=["tiny-llama", *CASES])
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if request.param == "tiny-llama":
        return resolve_model("tiny-llama")
    return save_tiny(request.param, tmp_path_factory.mktemp(request.param))


def _x(name: str, step: int, mb: int) -> torch.Tensor:
    rows, tokens = SHAPES[name]
    seed = 100 * step + 10 * mb + ord(name)
    return torch.randn(rows, tokens, 64, generator=torch.Generator().manual_seed(seed))


class Run:
    """Three sessions a, b, c through one runtime; every reply kept, per session."""

    def __init__(self, folder: Path, *, batching: bool) -> None:
        config = FedpipeConfig(server=ServerConfig(batching=batching))
        self.runtime, _ = build_runtime(config, folder=folder)
        self.runtime.tracer = Tracer()
        self.gate = threading.Event()
        self._held = hold_compute(self.runtime, self.gate, timeout=TIMEOUT)
        self._held.__enter__()  # the worker waits for the gate before each compute call
        self.ids = {
            n: self.runtime.open(SessionRequest(device_id=f"dev-{n}", round=1, learning_rate=5e-3))
            for n in SHAPES
        }
        self.streams: dict[str, StreamHandle] = {
            n: self.runtime.attach(sid) for n, sid in self.ids.items()
        }
        self.replies: dict[str, list[StageMsg | BaseException]] = {n: [] for n in SHAPES}

    def held(self, first: tuple[str, StageMsg], rest: list[tuple[str, StageMsg]]) -> None:
        """``first`` holds the worker while ``rest`` queues; then all run and are answered."""
        self.gate.clear()
        self.streams[first[0]].submit(first[1])
        wait_for(lambda: self.runtime.pending(self.ids[first[0]]) == 0, "the worker to hold")
        for name, msg in rest:
            self.streams[name].submit(msg)
        self.gate.set()
        failed: set[str] = set()
        for name, _ in [first, *rest]:
            if name in failed:
                continue  # a failed message ends its stream: the rest get no reply
            reply = self.streams[name].next_reply(TIMEOUT)
            if isinstance(reply, BaseException):
                failed.add(name)
            assert reply is not None, f"no reply for {name}"
            self.replies[name].append(reply)  # type: ignore[arg-type]

    def step(self, step: int, *, bad: str = "") -> None:
        acts = [
            (n, StageMsg(Kind.ACTIVATION, step, mb, tensor=_x(n, step, mb)))
            for mb in range(2)
            for n in SHAPES
        ]
        if bad:  # one session's microbatch of the wrong width, in the middle of the call
            i = next(i for i, (n, _) in enumerate(acts) if n == bad)
            acts[i] = (bad, StageMsg(Kind.ACTIVATION, step, 0, tensor=torch.randn(1, 4, 32)))
        self.held(acts[0], acts[1:])
        good = [n for n in SHAPES if n != bad]
        grads = [
            (n, StageMsg(Kind.OUTPUT_GRAD, step, mb, tensor=_x(n, step + 7, mb)))
            for mb in range(2)
            for n in good
        ]
        self.held(grads[0], grads[1:] + [(n, StageMsg(Kind.STEP_END, step)) for n in good])

    def stop(self) -> None:
        self._held.__exit__(None, None, None)  # opens the gate
        self.runtime.stop()


def _same(got: StageMsg | BaseException, want: StageMsg | BaseException) -> None:
    assert isinstance(got, StageMsg) and isinstance(want, StageMsg), (got, want)
    assert (got.kind, got.step, got.microbatch) == (want.kind, want.step, want.microbatch)
    if want.tensor is not None:
        assert got.tensor is not None
        assert_close_to_scale(got.tensor, want.tensor, atol=1e-5, rel=1e-5)


def test_batched_runtime_equals_one_at_a_time(folder: Path) -> None:
    batched, plain = Run(folder, batching=True), Run(folder, batching=False)
    try:
        assert isinstance(batched.runtime.bank, BatchedAdapterBank)
        assert isinstance(plain.runtime.bank, AdapterBank)
        for run in (batched, plain):
            run.step(0)
            run.step(1, bad="c")
        for name in SHAPES:
            assert len(batched.replies[name]) == len(plain.replies[name])
            for got, want in zip(batched.replies[name], plain.replies[name], strict=True):
                if name == "c" and isinstance(want, BaseException):
                    assert isinstance(got, InvalidRequestError) and isinstance(
                        want, InvalidRequestError
                    )
                    continue
                _same(got, want)
            sid_b, sid_p = batched.ids[name], plain.ids[name]
            for key, value in plain.runtime.bank.state_dict(sid_p).items():
                assert_close_to_scale(
                    batched.runtime.bank.state_dict(sid_b)[key], value, rel=1e-5, atol=1e-5, msg=key
                )
        assert batched.runtime.session(batched.ids["c"]).steps_done == 1  # its failed step undone
        assert batched.runtime.session(batched.ids["a"]).steps_done == 2
        calls = [e.args or {} for e in batched.runtime.tracer.events]  # type: ignore[union-attr]
        shared = [c for c in calls if c["kind"] == "forward" and len(c["sessions"]) == 3]
        assert any(c["devices"] == ["dev-a", "dev-b", "dev-c"] for c in shared), shared
        assert shared and max(c["messages"] for c in shared) >= 5, calls
        assert any(c["kind"] == "backward" and len(c["sessions"]) >= 2 for c in calls), calls
        single = [e.args or {} for e in plain.runtime.tracer.events]  # type: ignore[union-attr]
        assert all(c["messages"] <= 1 for c in single), single
        assert batched.runtime.calls < plain.runtime.calls
    finally:
        batched.stop()
        plain.stop()
