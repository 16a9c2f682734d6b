"""federated.mode = async through real rounds: the run's :class:`~fedpipe.fl.rounds.FedpipeStrategy`
in buffered mode (:mod:`fedpipe.fl.buffered`) over a real StageServer on 127.0.0.1, with devices
that answer as the ClientApp does, each in a thread of its own (``ThreadedGrid``).

- A slow device (emulated 10x slower, its first reply held) holds nobody: the others' updates
  are aggregated, version after version, while it computes.
- A device whose reply never comes (killed mid-update) delays nothing: it fails at its deadline
  and its session on the StageServer is gone.
- An update staler than max_staleness is refused and counted; a second reply for one version is
  refused and counted, never aggregated twice.
- K = 1 and K = N run; K = N with every device at one version is sync's FedAvg on both halves.
- A resumed run goes on from its version.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from fedpipe_bench.local_devices import LocalDevices
from fedpipe_bench.local_grid import LocalGrid, ThreadedGrid
from fedpipe_bench.quality import QUICK_SIZE
from harness.close import assert_close_to_scale

from fedpipe.config import FedpipeConfig
from fedpipe.fl.device_work import DeviceWork, RunSettings
from fedpipe.fl.rounds import FedpipeStrategy, Resumed
from fedpipe.fl.server_app import seeded_adapters
from fedpipe.lora.aggregation import split_deltas
from fedpipe.server.stage_server import StageServer
from fedpipe.wire.control_client import StageControlClient

State = dict[str, torch.Tensor]
SLOW = "bw=inf,rtt=0ms,slowdown=10"


def _config(devices: int = 3, **extra: Any) -> FedpipeConfig:
    return FedpipeConfig().with_overrides(
        {
            **QUICK_SIZE,
            "federated.num_devices": devices,
            "federated.profiles": "loopback",
            "federated.mode": "async",
            "federated.buffer": 1,
            "federated.rounds": 3,
            "federated.round_deadline_s": 120.0,
            "train.lr": 1e-2,
            **extra,
        }
    )


def _run(
    cfg: FedpipeConfig,
    serve: Callable[..., StageServer],
    *,
    grid_of: Callable[[LocalDevices], LocalGrid] | None = None,
    resumed: Resumed | None = None,
    arrays: State | None = None,
    evaluated: list[int] | None = None,
) -> dict[str, Any]:
    """The run's versions over a real StageServer; its records, result, grid and server."""
    server = serve(cfg)
    control = StageControlClient(f"127.0.0.1:{server.port}", "")
    devices = LocalDevices(cfg)
    grid = grid_of(devices) if grid_of else ThreadedGrid(devices.nodes())
    try:
        control.reset_adapter()
        run = RunSettings(stage_address=f"127.0.0.1:{server.port}", run_id="async")
        fed = cfg.federated
        evaluator = DeviceWork(
            cfg, device_id="evaluator", partition=-1, num_partitions=fed.num_devices
        )
        initial = seeded_adapters(cfg, evaluator)
        records: list[dict[str, Any]] = []
        rounds = FedpipeStrategy(
            cfg, control, run, grid, initial=dict(initial), log=records.append, resumed=resumed
        )
        rounds.begin_on_server()
        start = time.monotonic()

        def evaluate(server_round: int, _: Any) -> None:
            if evaluated is not None:
                evaluated.append(rounds.number_of(server_round))

        result = rounds.run(arrays or initial, num_rounds=fed.rounds, evaluate_fn=evaluate)
        return {
            "records": records,
            "device": result.arrays.to_torch_state_dict(),
            "server": split_deltas(control.get_adapter())[0],
            "wall_s": time.monotonic() - start,
            "grid": grid,
            "stage": server,
            "rounds": rounds,
        }
    finally:
        if isinstance(grid, ThreadedGrid):
            grid.close()
        control.close()


def _events(records: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [r for r in records if r["event"] == name]


def test_a_slow_device_holds_nobody(serve: Callable[..., StageServer]) -> None:
    """The slow device (emulated 10x slower) also keeps its first reply until the other two
    have answered three times, so that the order does not depend on how loaded the machine is
    (CI: a 10x throttle on the device's compute alone was not always 3 fast answers' worth).
    Were a version to wait for it, the fast devices would answer once each and the hold would
    run out at 60 s with two answers before its own."""
    cfg = _config(3, **{"federated.profiles": f"loopback; loopback; {SLOW}", "federated.rounds": 4})
    held: dict[str, ThreadedGrid] = {}

    def holding(devices: LocalDevices) -> LocalGrid:
        nodes = devices.nodes()
        slow, inner = max(nodes), nodes[max(nodes)]  # partition 2 is the last node

        def slow_node(msg: Any) -> Any:
            reply = inner(msg)
            end = time.monotonic() + 60.0
            while time.monotonic() < end and _fast_answers(held["grid"], slow) < 3:
                time.sleep(0.01)
            return reply

        held["grid"] = ThreadedGrid({**nodes, slow: slow_node})
        return held["grid"]

    got = _run(cfg, serve, grid_of=holding)
    grid: ThreadedGrid = got["grid"]
    slow = max(grid.nodes)
    versions = _events(got["records"], "version")
    assert [v["round"] for v in versions] == [1, 2, 3, 4]
    answers = [(t, n) for t, n, _ in grid.answered]
    first_slow = min((t for t, n in answers if n == slow), default=float("inf"))
    before = [t for t, n in answers if n != slow and t < first_slow]
    assert len(before) >= 3  # 3 versions aggregated (K = 1) while it computed its first


def _fast_answers(grid: ThreadedGrid, slow: int) -> int:
    with grid._lock:
        return sum(1 for _, n, _ in grid.answered if n != slow)


def test_a_device_that_never_replies_delays_nothing_and_loses_its_session(
    serve: Callable[..., StageServer],
) -> None:
    """The versions are done long before the silent device's deadline (120 s), which only a
    synchronous round would wait out; the session it trained on is not left behind. (Its
    failure at the deadline itself: tests/unit/test_buffered.py.)"""
    cfg = _config(3, **{"federated.buffer": 2, "federated.rounds": 3})

    def dropping(devices: LocalDevices) -> LocalGrid:
        return ThreadedGrid(devices.nodes(), drop=[max(devices.works)])

    got = _run(cfg, serve, grid_of=dropping)
    versions = _events(got["records"], "version")
    assert [v["updates"] for v in versions] == [2, 2, 2]
    assert got["wall_s"] < cfg.federated.round_deadline_s / 2
    dropped = max(got["grid"].nodes)
    assert all(r["node_id"] != dropped for r in _events(got["records"], "train"))
    assert any(n == dropped for _, n, _ in got["grid"].pushed)  # it was given work
    assert all(s.device_id != str(dropped) for s in got["stage"].runtime.sessions())


def test_an_update_staler_than_the_bound_is_refused_and_counted(
    serve: Callable[..., StageServer],
) -> None:
    cfg = _config(
        2,
        **{
            "federated.profiles": f"loopback; {SLOW}",
            "federated.max_staleness": 0,
            "federated.rounds": 4,
        },
    )
    got = _run(cfg, serve)
    refused = _events(got["records"], "refused")
    assert refused and {r["kind"] for r in refused} == {"stale"}
    assert all("more than federated.max_staleness=0" in r["reason"] for r in refused)
    versions = _events(got["records"], "version")
    assert versions[-1]["stale_refused"] == len(
        [r for r in refused if r["round"] <= versions[-1]["round"]]
    )
    assert all(max(v["staleness"]) == 0 for v in versions)


def test_a_second_reply_for_one_version_is_refused_never_aggregated_twice(
    serve: Callable[..., StageServer],
) -> None:
    cfg = _config(2, **{"federated.rounds": 2})

    def echoing(devices: LocalDevices) -> LocalGrid:
        return ThreadedGrid(devices.nodes(), twice=[min(devices.works)])

    got = _run(cfg, serve, grid_of=echoing)
    refused = _events(got["records"], "refused")
    assert refused and {r["kind"] for r in refused} == {"duplicate"}
    merged = [(r["node_id"], r["round"]) for r in _events(got["records"], "train")]
    assert len(merged) == len(set(merged))


def test_k_equal_n_at_one_version_is_fedavg_on_both_halves(
    serve: Callable[..., StageServer],
) -> None:
    """Every device replies for version v before v is aggregated (K = N, one at a time): each
    version is a synchronous round, and both sides end where sync FedAvg ends."""
    extra = {"federated.rounds": 2, "federated.staleness": "constant"}
    evaluated: list[int] = []  # sync through Flower's loop, evaluating every second round
    sync = _run(
        _config(2, **extra, **{"federated.mode": "sync", "federated.eval_every": 2}),
        serve,
        grid_of=lambda d: LocalGrid(d.nodes()),
        evaluated=evaluated,
    )
    assert evaluated == [0, 2]
    buffered = _run(_config(2, **extra, **{"federated.buffer": 2}), serve)
    versions = _events(buffered["records"], "version")
    assert [v["staleness"] for v in versions] == [[0, 0], [0, 0]]
    for side in ("device", "server"):
        for key, value in sync[side].items():
            # relative to the tensor's scale: the async devices run side by side, so the server
            # batches their microbatches together where sync's ran one device at a time
            assert_close_to_scale(buffered[side][key], value, rel=1e-3, msg=f"{side} {key}")


@pytest.mark.parametrize("buffer", [1, 3])
def test_k_1_and_k_n_run_and_train(serve: Callable[..., StageServer], buffer: int) -> None:
    cfg = _config(3, **{"federated.buffer": buffer, "federated.rounds": 2})
    got = _run(cfg, serve)
    versions = _events(got["records"], "version")
    assert [v["updates"] for v in versions] == [buffer, buffer]
    seeded = _config(3)
    evaluator = DeviceWork(seeded, device_id="evaluator", partition=-1, num_partitions=3)
    initial = split_deltas(seeded_adapters(seeded, evaluator))[0]
    assert any(not torch.equal(got["device"][k], v) for k, v in initial.items())


def test_a_resumed_async_run_goes_on_from_its_version_evaluating_every_second(
    serve: Callable[..., StageServer],
) -> None:
    cfg = _config(2, **{"federated.rounds": 3, "federated.eval_every": 2})
    evaluated: list[int] = []
    got = _run(cfg, serve, resumed=Resumed(5), evaluated=evaluated)
    versions = [v["round"] for v in _events(got["records"], "version")]
    assert versions == [6, 7, 8]
    assert {r["round"] for r in _events(got["records"], "train")} <= {6, 7, 8}
    assert evaluated == [5, 7, 8]  # the resumed global, every second version, the last
