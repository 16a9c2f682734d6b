"""Delta caches that outlive a round: resumed over real gRPC only when both sides' histories match.

Each test trains tiny-llama devices for a few steps per session against a StageServer on
127.0.0.1 port 0. A session stands for a round: the device's trainer (and its delta
encoder) lives on, the server keeps the device's cache between sessions in its DeltaStore.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager

import pytest
import torch
from fedpipe_bench.quality import EXTRA_RUNS
from harness.batches import random_batches
from harness.faults import DeviceFailure, device_dies_after
from harness.stage import stage_server

from fedpipe.compress.delta import DeltaCache, DeltaEncoder
from fedpipe.config import FedpipeConfig, PipelineConfig, ServerConfig, TrainConfig
from fedpipe.edge.trainer import DeviceTrainer, TrainReport
from fedpipe.runs.report import report_lines
from fedpipe.runs.summary import build_summary
from fedpipe.server.delta_store import DeltaStore
from fedpipe.server.stage_server import StageServer
from fedpipe.wire.control_client import StageControlClient
from fedpipe.wire.link_client import StageClient

BATCH, SEQ = 4, 16
ROWS_PER_SESSION = 2 * BATCH  # two steps of four samples


def _config(**pipeline: object) -> FedpipeConfig:
    settings: dict[str, object] = {
        "microbatches": 2,
        "schedule": "gpipe",
        "timeout_s": 20.0,
        "uplink_codec": "int8",
        "delta": True,
        "delta_codec": "int2",
        "delta_cache_mb": 1.0,
        **pipeline,
    }
    return FedpipeConfig(
        pipeline=PipelineConfig(**settings),  # type: ignore[arg-type]
        train=TrainConfig(batch_size=BATCH, seq_len=SEQ, lr=1e-2),
    )


def _serving(folder, **server: object) -> AbstractContextManager[StageServer]:  # type: ignore[no-untyped-def]
    """A StageServer with these ``server.*`` settings, stopped when the block ends."""
    config = FedpipeConfig(server=ServerConfig(**server))  # type: ignore[arg-type]
    return stage_server(config, folder=folder)


@pytest.fixture
def server(folder) -> Iterator[StageServer]:  # type: ignore[no-untyped-def]
    with _serving(folder) as served:
        yield served


def _batches() -> list[dict[str, torch.Tensor]]:
    """The device's whole data set: two batches, which every session (round) sees again."""
    return random_batches(2, BATCH, SEQ)


def _device(folder, device_id: str = "d1", **pipeline: object) -> DeviceTrainer:  # type: ignore[no-untyped-def]
    return DeviceTrainer(_config(**pipeline), device_id=device_id, folder=folder)


def _round(
    server: StageServer, trainer: DeviceTrainer, round_: int = 1, **kw: object
) -> TrainReport:
    with StageClient(server.address) as client:
        return trainer.train_round(client, _batches(), round_=round_, **kw)  # type: ignore[arg-type]


def _assert_mirrored(trainer: DeviceTrainer, server: StageServer) -> None:
    """The server's kept cache holds, bit for bit, the rows the device meant it to decode."""
    assert trainer.delta is not None
    mine, theirs = trainer.delta.cache, server.delta_store.get(trainer.device_id)
    assert theirs is not None
    assert mine.identity == theirs.identity
    assert list(mine._rows) == list(theirs._rows)
    for key, row in mine._rows.items():
        assert torch.equal(row, theirs._rows[key])


def test_a_resumed_cache_mirrors_the_device_bit_for_bit_and_sends_fewer_bytes(
    server: StageServer, folder
) -> None:  # type: ignore[no-untyped-def]
    trainer = _device(folder)
    cold = _round(server, trainer, 1)
    assert cold.delta_resumed is False  # nothing to resume yet
    assert cold.delta_rows == (0, ROWS_PER_SESSION)
    _assert_mirrored(trainer, server)
    warm = _round(server, trainer, 2)
    assert warm.delta_resumed is True
    assert warm.delta_rows == (ROWS_PER_SESSION, 0)  # every row a difference, in int2
    _assert_mirrored(trainer, server)  # the server rebuilt exactly what the device meant
    assert warm.bytes_up < cold.bytes_up * 0.75  # activations in int2 instead of int8
    assert warm.metrics()["delta-hit-rate"] == 1.0 and warm.metrics()["delta-resumed"] == 1
    assert len(server.delta_store) == 1


def test_a_session_only_cache_is_never_kept(server: StageServer, folder) -> None:  # type: ignore[no-untyped-def]
    trainer = _device(folder, delta_resume=False)
    first = _round(server, trainer, 1)
    second = _round(server, trainer, 2)
    assert trainer.delta is None and len(server.delta_store) == 0
    assert (first.delta_rows, second.delta_rows) == ((0, 8), (0, 8))
    assert second.delta_resumed is False


def _resets(
    server: StageServer, trainer: DeviceTrainer, reason: str, round_: int = 2
) -> TrainReport:
    """A session that must start both caches empty (for ``reason``), train and stay mirrored."""
    report = _round(server, trainer, round_)
    assert report.delta_resumed is False
    assert reason in report.delta_reset_reason
    assert report.delta_rows == (0, ROWS_PER_SESSION)  # sent whole: no stale base used
    assert len(report.steps) == 2
    _assert_mirrored(trainer, server)
    return report


def test_a_restarted_server_holds_no_cache(folder) -> None:  # type: ignore[no-untyped-def]
    trainer = _device(folder)
    with _serving(folder) as first:
        _round(first, trainer, 1)
    with _serving(folder) as second:
        _resets(second, trainer, "holds no cache")


def test_a_restarted_device_gets_no_stale_cache(server: StageServer, folder) -> None:  # type: ignore[no-untyped-def]
    _round(server, _device(folder), 1)
    again = _device(folder)  # the same device id, a new process: a new cache id, empty
    _resets(server, again, "the device's cache is empty")


def test_a_digest_mismatch_resets_both_sides(server: StageServer, folder) -> None:  # type: ignore[no-untyped-def]
    trainer = _device(folder)
    _round(server, trainer, 1)
    assert trainer.delta is not None
    # The device committed a row the server never decoded (a send lost on the way).
    trainer.delta.cache.put(12345, torch.zeros(SEQ, 64))
    _resets(server, trainer, "histories differ (9 rows on the device, 8 on the server")
    # As many rows on both sides, but one differs: only the digest tells.
    trainer.delta.cache.put(next(iter(trainer.delta.cache._rows)), torch.zeros(SEQ, 64))
    server.delta_store.get("d1").put(12345, torch.zeros(SEQ, 64))  # type: ignore[union-attr]
    _resets(server, trainer, "digests differ after 9 rows", round_=3)


def test_a_failed_session_is_not_resumed(server: StageServer, folder) -> None:  # type: ignore[no-untyped-def]
    trainer = _device(folder)
    _round(server, trainer, 1)
    with device_dies_after(1), pytest.raises(DeviceFailure):
        _round(server, trainer, 2)
    _resets(server, trainer, "holds no cache", 3)


def test_a_stream_read_to_its_end_without_close_session_is_not_resumed(
    server: StageServer, folder
) -> None:  # type: ignore[no-untyped-def]
    """A stream the device cancelled can end on the server like a clean half-close; only the
    device's CloseSession says the session ended well. Without it the kept cache does not
    resume, whatever the stream's end looked like (deterministic: the stream here half-closes
    cleanly and only the CloseSession is missing)."""
    trainer = _device(folder)
    _round(server, trainer, 1)
    with StageClient(server.address) as client:
        client.stub.CloseSession = lambda *a, **k: None  # type: ignore[method-assign]
        trainer.train_round(client, _batches(), round_=2)
    report = _resets(server, trainer, "ended without CloseSession", 3)
    assert "holds no cache" in report.delta_reset_reason
    warm = _round(server, trainer, 4)  # round 3 was closed: round 4 resumes it
    assert warm.delta_resumed is True


def test_the_store_resumes_a_session_only_once_it_is_confirmed_closed() -> None:
    store = DeltaStore(1 << 20)
    store.begin_run("r")
    cache = DeltaCache(1 << 16, cache_id="c1")
    cache.put(1, torch.ones(2, 4))
    store.keep("d1", cache, codec="int8", run_id="r", session_id="s1")
    got = store.take("d1", cache.identity, max_bytes=1 << 16, codec="int8")
    assert not got.resumed and "without CloseSession" in got.reason
    store.keep("d1", cache, codec="int8", run_id="r", session_id="s2")
    assert not store.confirm("s1")  # another session's close confirms nothing
    assert store.confirm("s2")
    assert store.take("d1", cache.identity, max_bytes=1 << 16, codec="int8").resumed


def test_a_changed_codec_resets(server: StageServer, folder) -> None:  # type: ignore[no-untyped-def]
    trainer = _device(folder)
    _round(server, trainer, 1)
    trainer.config = _config(uplink_codec="int4t")
    _resets(server, trainer, "uplink codec changed (INT8 -> INT4)")


def test_a_new_run_drops_every_cache(server: StageServer, folder) -> None:  # type: ignore[no-untyped-def]
    control = StageControlClient(server.address, "")
    try:
        control.reset_adapter()
        control.begin_round(1, "run-a")
        trainer = _device(folder)
        _round(server, trainer, 1)
        control.begin_round(2, "run-a")  # the same run: kept
        assert server.delta_store.get("d1") is not None
        control.begin_round(1, "run-b")
        assert len(server.delta_store) == 0
        _resets(server, trainer, "holds no cache")
    finally:
        control.close()


def test_the_total_cap_evicts_the_least_recent_device(folder) -> None:  # type: ignore[no-untyped-def]
    # One device's cache after a session: 8 rows of (16, 64) fp32 = 32 KiB; room for one.
    with _serving(folder, delta_store_mb=48 / 1024) as server:
        first, second = _device(folder, "d1"), _device(folder, "d2")
        _round(server, first, 1)
        _round(server, second, 1)
        assert server.delta_store.get("d1") is None and server.delta_store.get("d2") is not None
        assert server.delta_store.nbytes <= server.delta_store.max_bytes
        _resets(server, first, "holds no cache")
        assert _round(server, second, 2).delta_resumed is False  # evicted by d1 in turn


def test_a_device_cannot_resume_another_devices_cache(server: StageServer, folder) -> None:  # type: ignore[no-untyped-def]
    owner = _device(folder, "d1")
    _round(server, owner, 1)
    thief = _device(folder, "d2")
    thief.delta = owner.delta  # every secret of d1's cache: its id, digest, salt, rows
    _resets(server, thief, "holds no cache")
    assert thief.delta is not None and len(thief.delta.cache) == ROWS_PER_SESSION
    owner.delta = DeltaEncoder(thief.delta.cache.max_bytes)  # the owner's real cache is gone
    assert _round(server, owner, 3).delta_resumed is False


def test_a_device_process_per_round_resumes_from_its_file(
    server: StageServer, folder, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "d1.delta.safetensors"
    first = _device(folder)
    first.delta_path = path
    _round(server, first, 1)
    assert path.stat().st_mode & 0o777 == 0o600  # activations of the device's own data
    second = _device(folder)  # the next round's ClientApp: a new process, the same file
    second.delta_path = path
    report = _round(server, second, 2)
    assert report.delta_resumed is True and report.delta_rows == (ROWS_PER_SESSION, 0)
    _assert_mirrored(second, server)
    path.write_bytes(b"not a cache")  # unreadable: a new cache, never a wrong one
    third = _device(folder)
    third.delta_path = path
    _resets(server, third, "the device's cache is empty", round_=3)


def test_a_clientapp_keeps_its_cache_file_on_its_own_host(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from fedpipe.fl.client_app import _delta_dir
    from fedpipe.fl.device_work import RunSettings

    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "home"))
    assert _delta_dir({"delta-dir": "/d"}, RunSettings(dir=str(tmp_path))) == "/d"
    assert _delta_dir({}, RunSettings(dir=str(tmp_path))) == str(tmp_path / "delta-cache")
    elsewhere = RunSettings(dir="/no/such/run-folder")  # the server's path, not on this host
    assert _delta_dir({}, elsewhere) == str(tmp_path / "home" / "fedpipe-delta-cache")
    monkeypatch.delenv("FLWR_HOME")
    assert _delta_dir({}, elsewhere) == ""  # memory only


# -- the store alone ----------------------------------------------------------------------------
def _cache(rows: int, cache_id: str = "c") -> DeltaCache:
    cache = DeltaCache(1 << 20, cache_id=cache_id)
    for key in range(rows):
        cache.put(key, torch.full((4, 8), float(key)))  # 128 bytes a row
    return cache


def test_the_store_is_bounded_in_bytes_and_by_run() -> None:
    store = DeltaStore(max_bytes=5 * 128)
    store.begin_run("r")
    for device in ("a", "b", "c"):
        store.keep(device, _cache(2), codec="INT8", run_id="r")
    assert store.get("a") is None and len(store) == 2 and store.nbytes == 4 * 128
    store.keep("big", _cache(6), codec="INT8", run_id="r")  # larger than the whole store
    assert store.get("big") is None and store.nbytes <= store.max_bytes
    store.keep("late", _cache(1), codec="INT8", run_id="an-earlier-run")
    assert store.get("late") is None
    store.keep("nameless", _cache(1, cache_id=""), codec="INT8", run_id="r")
    assert store.get("nameless") is None  # a session-only cache: nothing could resume it
    store.begin_run("r2")
    assert len(store) == 0 and store.nbytes == 0


def test_the_store_resumes_only_an_exact_match() -> None:
    store = DeltaStore(max_bytes=1 << 20)
    kept = _cache(3, "id-1")
    store.keep("a", kept, codec="INT8", run_id="")
    assert store.take("a", kept.identity, max_bytes=1 << 20, codec="INT8").resumed
    store.keep("a", kept, codec="INT8", run_id="")
    got = store.take("a", kept.identity, max_bytes=1 << 19, codec="INT8")
    assert not got.resumed and "size changed" in got.reason and len(got.cache) == 0
    assert got.cache.cache_id == "id-1"  # the fresh cache carries the device's id from now on
    assert store.get("a") is None  # a mismatch frees the kept cache too


@pytest.mark.parametrize(
    ("flat", "message"),
    [
        ({"server.delta_store_mb": -1}, r"server.delta_store_mb must be >= 0"),
        ({"pipeline.delta_codec": "int3"}, r"pipeline.delta_codec 'int3' unknown"),
        ({"pipeline.delta_resume": "maybe"}, r"pipeline.delta_resume"),
    ],
)
def test_invalid_settings_name_the_key(flat: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FedpipeConfig().with_overrides(flat)


def test_settings_round_trip() -> None:
    config = FedpipeConfig().with_overrides(
        {
            "server.delta_store_mb": "0.5",
            "pipeline.delta_codec": "int2tg32",
            "pipeline.delta_resume": "false",
        }
    )
    assert config.server.delta_store_mb == 0.5 and config.pipeline.delta_codec == "int2tg32"
    assert config.pipeline.delta_resume is False
    assert FedpipeConfig().with_overrides(config.to_flat()) == config
    defaults = FedpipeConfig()
    assert (defaults.pipeline.delta_resume, defaults.pipeline.delta_codec) == (True, "")


def test_the_bench_delta_runs_are_valid_settings() -> None:
    runs = {r["name"]: r for r in EXTRA_RUNS}
    for name in ("int8-delta", "int8-delta-session", "int4t-int2ef-delta"):
        config = FedpipeConfig().with_overrides(
            {k: v for k, v in runs[name].items() if k != "name"}
        )
        assert config.pipeline.delta
        assert config.pipeline.delta_resume == (name != "int8-delta-session")


# -- what a run reports -------------------------------------------------------------------------
def test_the_run_summary_says_per_device_whether_its_cache_was_resumed() -> None:
    def train(round_: int, partition: int, resumed: int, hits: float) -> dict[str, object]:
        return {
            "event": "train",
            "round": round_,
            "partition": partition,
            "profile": "loopback",
            "train_loss": 3.0,
            "delta_resumed": resumed,  # TrainReport.metrics(), snake_case as the ServerApp logs
            "delta_hit_rate": hits,
        }

    history = [train(1, 0, 0, 0.0), train(1, 1, 0, 0.0), train(2, 0, 1, 1.0), train(2, 1, 0, 0.0)]
    summary = build_summary(history, config={})
    assert summary["rounds"][1]["delta"] == {
        "0": {"resumed": True, "hit_rate": 1.0},
        "1": {"resumed": False, "hit_rate": 0.0},
    }
    assert report_lines(summary)[-2:] == [
        "partition 0 (loopback): delta cache resumed in 1 of 2 rounds; last round 100% of "
        "activation rows sent as differences",
        "partition 1 (loopback): delta cache resumed in 0 of 2 rounds; last round 0% of "
        "activation rows sent as differences",
    ]
