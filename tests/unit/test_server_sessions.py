"""The sessions room and the commits room, on a real adapter bank (tiny-llama's middle blocks).

The SessionTable opens, looks up, closes and drops sessions; Commits merges or collects their
adapters into the global one and keeps async rounds' versions. No worker, no stream traffic.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from fedpipe.errors import InvalidRequestError, StageCapacityError, UnknownSessionError
from fedpipe.lora import BatchedAdapterBank, LoraSettings
from fedpipe.models import load_config, resolve_model
from fedpipe.server.budget import ByteBudget
from fedpipe.server.commit import Commits
from fedpipe.server.executor import StageExecutor
from fedpipe.server.session_table import SessionTable
from fedpipe.server.sessions import RuntimeLimits, SessionInfo, adamw
from fedpipe.server.streams import StreamLedger
from fedpipe.split import build_stage, split_layout
from fedpipe.wire.backend import SessionRequest

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def stage(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    folder: Path = resolve_model("tiny-llama", cache_dir=tmp_path_factory.mktemp("cache"))
    return build_stage(folder, split_layout(load_config(folder)), "middle")


@dataclass
class Rooms:
    bank: BatchedAdapterBank
    budget: ByteBudget
    sessions: SessionTable
    commits: Commits
    inbox: list[tuple[str, object]]

    def open(self, device: str, round_: int = 1) -> SessionInfo:
        commits = self.commits
        session_id = self.sessions.open(
            SessionRequest(device_id=device, round=round_, microbatch_size=2, seq_len=8),
            blocks=None,
            start=commits.start_of,
            per_version=commits.asynchronous,
            frozen_below=commits.frozen_below,
        )
        return self.sessions.session(session_id)


class _Inbox:
    def __init__(self, items: list[tuple[str, object]]) -> None:
        self.items = items

    def put(self, key: str, item: tuple[object, object]) -> None:
        self.items.append((key, item[1]))

    def clear(self, key: str) -> None:
        self.items[:] = [(k, i) for k, i in self.items if k != key]


@pytest.fixture
def rooms(stage: torch.nn.Module) -> Iterator[Rooms]:
    bank = BatchedAdapterBank(copy.deepcopy(stage), LoraSettings(r=4, alpha=8, seed=3))
    lock, bank_lock = threading.RLock(), threading.RLock()
    limits, budget, items = RuntimeLimits(max_sessions=3), ByteBudget(2**30), []
    inbox = _Inbox(items)
    executor = StageExecutor(
        bank, mode="u", hidden_size=64, device=CPU, dtype=torch.float32, max_in_flight=8
    )
    streams = StreamLedger(
        lock, budget, limits, inbox=inbox, prefetch=lambda t: None, hidden_size=64, grace_s=1
    )
    sessions = SessionTable(
        bank,
        executor=executor,
        streams=streams,
        inbox=inbox,
        budget=budget,
        limits=limits,
        max_seq_len=128,
        optimizer_factory=adamw,
        lock=lock,
        bank_lock=bank_lock,
    )
    commits = Commits(bank, sessions, lock=lock, bank_lock=bank_lock)
    yield Rooms(bank, budget, sessions, commits, items)


def _trained(rooms: Rooms, info: SessionInfo, value: float) -> None:
    """As if the session had completed a step that set its adapter to ``value``."""
    with torch.no_grad():
        for p in rooms.bank.parameters(info.session_id):
            p.fill_(value)
    info.steps_done = 1


# -- sessions ---------------------------------------------------------------------------------
def test_a_session_opens_on_its_own_adapter_and_replaces_the_devices_old_one(rooms: Rooms) -> None:
    first = rooms.open("a")
    assert rooms.sessions.session(first.session_id) is first
    assert first.session_id in rooms.bank.names()
    dropped: list[str] = []
    rooms.sessions.on_drop(lambda info: dropped.append(info.session_id))
    second = rooms.open("a", round_=2)
    assert rooms.sessions.all() == [second] and first.dropped and dropped == [first.session_id]
    assert first.session_id not in rooms.bank.names()
    with pytest.raises(UnknownSessionError, match="unknown session"):
        rooms.sessions.session(first.session_id)


def test_past_max_sessions_an_open_is_refused(rooms: Rooms) -> None:
    for device in "abc":
        rooms.open(device)
    with pytest.raises(StageCapacityError, match="server.max_sessions"):
        rooms.open("d")


def test_settings_outside_the_limits_are_refused_at_open(rooms: Rooms) -> None:
    with pytest.raises(InvalidRequestError, match="learning rate"):
        rooms.sessions.open(
            SessionRequest(device_id="a", round=1, learning_rate=1.0),
            blocks=None,
            start=lambda r: None,
            per_version=lambda: False,
            frozen_below=0,
        )
    assert rooms.sessions.all() == []


def test_a_session_closed_without_a_step_is_dropped_one_with_a_step_waits(rooms: Rooms) -> None:
    idle, trained = rooms.open("a"), rooms.open("b")
    _trained(rooms, trained, 0.5)
    assert rooms.sessions.close(idle.session_id) == 0 and idle.dropped
    assert rooms.sessions.close(trained.session_id) == 1 and trained.closed
    assert rooms.sessions.all() == [trained]


def test_what_a_session_holds_goes_back_when_it_is_discarded(rooms: Rooms) -> None:
    info = rooms.open("a")
    rooms.sessions.hold(info.session_id, 1000, "a delta cache")
    assert rooms.budget.used == 1000
    rooms.sessions.discard(info.session_id, reason="no room")
    assert rooms.budget.used == 0 and info.dropped


# -- commits ----------------------------------------------------------------------------------
def test_a_commit_merges_the_finished_and_drops_the_rest_and_a_retry_gets_its_answer(
    rooms: Rooms,
) -> None:
    a, b, late = rooms.open("a"), rooms.open("b"), rooms.open("c", round_=2)
    _trained(rooms, a, 0.25)
    _trained(rooms, b, 0.75)
    before = rooms.commits.global_state()
    result = rooms.commits.commit_round(1, {"a": 1.0})
    assert (result.merged, result.discarded, result.dropped) == (1, 1, {})
    assert a.dropped and b.dropped and rooms.sessions.all() == [late]
    after = rooms.commits.global_state()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert rooms.commits.commit_round(1, {"a": 1.0, "b": 1.0}) is result


def test_an_adapter_holding_nan_is_never_merged(rooms: Rooms) -> None:
    a = rooms.open("a")
    _trained(rooms, a, float("nan"))
    before = rooms.commits.global_state()
    result = rooms.commits.commit_round(1, {"a": 1.0})
    assert result.merged == 0 and "NaN or Inf" in result.dropped["a"]
    after = rooms.commits.global_state()
    assert all(torch.equal(before[k], after[k]) for k in before)
    with pytest.raises(InvalidRequestError, match="NaN or Inf"):
        rooms.commits.load_global_state({k: v * float("nan") for k, v in before.items()})


def test_a_collect_hands_the_adapters_over_and_leaves_the_global_one(rooms: Rooms) -> None:
    a, b = rooms.open("a"), rooms.open("b")
    _trained(rooms, a, 0.5)
    before = rooms.commits.global_state()
    got = rooms.commits.collect_round(1, {"a": 2.0, "b": 1.0})
    assert got.devices == ["a"] and got.weights == [2.0] and got.discarded == 1
    assert all(torch.all(v == 0.5) for v in got.states[0].values())
    assert a.dropped and b.dropped and rooms.sessions.all() == []
    assert all(torch.equal(before[k], v) for k, v in rooms.commits.global_state().items())


def test_async_versions_open_from_their_own_global_and_merge_as_updates(rooms: Rooms) -> None:
    rooms.commits.begin_version(1, window=2)
    assert rooms.commits.asynchronous() and rooms.commits.start_of(1) is not None
    old = rooms.open("a", round_=1)
    rooms.commits.begin_version(2, window=2)
    new = rooms.open("a", round_=2)  # async: the device's older version stays
    assert {s.session_id for s in rooms.sessions.all()} == {old.session_id, new.session_id}
    _trained(rooms, old, 0.5)
    result = rooms.commits.commit_updates(2, [("a", 1, 1.0)], [("a", 2)])
    assert (result.merged, result.discarded) == (1, 1) and rooms.sessions.all() == []
    assert rooms.commits.commit_updates(2, [("a", 1, 1.0)], []) is result  # a retry
    rooms.commits.begin_version(3, window=0)
    assert not rooms.commits.asynchronous() and rooms.commits.start_of(1) is None


def test_frozen_blocks_are_the_commits_rooms_setting_for_sessions_opened_later(
    rooms: Rooms,
) -> None:
    before = rooms.open("a")
    rooms.commits.freeze_below(99)
    after = rooms.open("b")
    assert (before.frozen_below, after.frozen_below) == (0, 99)
