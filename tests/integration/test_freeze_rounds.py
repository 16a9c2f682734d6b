"""pipeline.freeze = progressive through real rounds: the ServerApp's own rounds
(:class:`fedpipe.fl.rounds.FedpipeStrategy`, its Flower strategy and commit) with devices that
answer as the ClientApp does, over a real StageServer on 127.0.0.1 (tiny-llama: 4 blocks, the
head holds block 0, the server 1 and 2, the tail 3).

- A frozen block's adapter keeps its value, bit for bit, on the device side (the global adapter
  Flower aggregates) and on the server (the StageServer's committed adapter), while the others
  train; a device whose head is frozen gets no input gradient down.
- The decision itself, taken from the adapters' movement round after round, freezes the lowest
  blocks and they then stay as they were.
- ``progressive`` before anything freezes changes nothing: the same losses, bytes and adapters
  as ``off``, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from fedpipe_bench.local_devices import LocalDevices
from fedpipe_bench.local_grid import LocalGrid
from fedpipe_bench.quality import QUICK_SIZE

from fedpipe.config import FedpipeConfig
from fedpipe.fl.device_work import DeviceWork, RunSettings
from fedpipe.fl.freeze import FreezeState
from fedpipe.fl.rounds import FedpipeStrategy, Resumed
from fedpipe.fl.server_app import seeded_adapters
from fedpipe.lora.aggregation import adapter_block, split_deltas
from fedpipe.server.stage_server import StageServer
from fedpipe.wire.control_client import StageControlClient

State = dict[str, torch.Tensor]


def _config(rounds: int, **freeze: Any) -> FedpipeConfig:
    return FedpipeConfig().with_overrides(
        {
            **QUICK_SIZE,
            "federated.rounds": rounds,
            "federated.num_devices": 2,
            "federated.profiles": "loopback",
            "train.lr": 1e-2,
            **{f"pipeline.{k}": v for k, v in freeze.items()},
        }
    )


class _Watched(FedpipeStrategy):
    """The ServerApp's rounds, keeping each round's committed global adapters of both sides."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.globals: list[tuple[State, State]] = []

    def settle_freeze(self, result: Any) -> Any:
        result = super().settle_freeze(result)
        device = split_deltas(result[0].to_torch_state_dict())[0]
        self.globals.append((device, split_deltas(self.control.get_adapter())[0]))
        return result


def _run(
    cfg: FedpipeConfig, serve: Callable[..., StageServer], resumed: FreezeState | None = None
) -> dict[str, Any]:
    """``federated.rounds`` rounds; both sides' adapters before and after each round, the
    run's records and the devices' stage-link bytes."""
    server = serve(cfg)
    control = StageControlClient(f"127.0.0.1:{server.port}", "")
    try:
        control.reset_adapter()
        run = RunSettings(stage_address=f"127.0.0.1:{server.port}", run_id="freeze")
        devices = LocalDevices(cfg)
        evaluator = DeviceWork(cfg, device_id="evaluator", partition=-1, num_partitions=2)
        initial = seeded_adapters(cfg, evaluator)
        records: list[dict[str, Any]] = []
        grid = LocalGrid(devices.nodes())
        rounds = _Watched(  # as server_main builds it, from a checkpoint's decision if resumed
            cfg,
            control,
            run,
            grid,
            initial=dict(initial),
            log=records.append,
            resumed=Resumed(0, resumed) if resumed else None,
        )
        start = (split_deltas(initial)[0], split_deltas(control.get_adapter())[0])
        rounds.run(initial, num_rounds=cfg.federated.rounds)
        return {
            "globals": [start, *rounds.globals],
            "records": records,
            "traffic": devices.traffic,
            "reports": devices.reports,
        }
    finally:
        control.close()


def _blocks(state: State) -> set[int]:
    return {b for k in state if (b := adapter_block(k)) is not None}


def _moved(before: State, after: State) -> set[int]:
    """The blocks with a tensor that changed at all."""
    return {adapter_block(k) for k in before if not torch.equal(before[k], after[k])} - {None}


def test_frozen_blocks_keep_their_values_on_both_sides_and_the_others_train(
    serve: Callable[..., StageServer],
) -> None:
    # A resumed run whose checkpoint froze blocks 0 (the head) and 1 (the server's first); a
    # freeze_after beyond the run keeps the decision as it is.
    cfg = _config(2, freeze="progressive", freeze_after=50)
    frozen = _run(cfg, serve, FreezeState(frozen_below=2))
    (device0, server0), *after = frozen["globals"]
    assert _blocks(device0) == {0, 3} and _blocks(server0) == {1, 2}
    for device, server in after:
        assert _moved(device0, device) == {3}  # the head's block 0 stays as it was
        assert _moved(server0, server) == {2}  # so does the server's block 1
    assert [r["frozen_below"] for r in frozen["records"] if r["event"] == "freeze"] == [2, 2]
    # The frozen head gets no input gradient down: the downlink carries the outputs (and the
    # gradient replies' headers) only, about half of what the same rounds move unfrozen.
    trained = _run(_config(2), serve)
    assert frozen["traffic"].up == trained["traffic"].up
    assert trained["traffic"].down / 2 < frozen["traffic"].down < 0.51 * trained["traffic"].down


def test_the_decision_freezes_the_lowest_blocks_and_they_stay_frozen(
    serve: Callable[..., StageServer],
) -> None:
    # A lenient rule (a block has converged once its movement is below its peak) so that the
    # tiny model's blocks freeze within a few rounds.
    cfg = _config(5, freeze="progressive", freeze_after=1, freeze_ratio=0.99)
    out = _run(cfg, serve)
    decided = [r["frozen_below"] for r in out["records"] if r["event"] == "freeze"]
    assert decided == sorted(decided) and 0 < decided[-2] <= 2  # at most half of 4 blocks
    first = decided.index(decided[-2])  # the round (0-based) after which they froze
    device_at, server_at = out["globals"][first + 1]
    for device, server in out["globals"][first + 2 :]:
        moved = _moved(device_at, device) | _moved(server_at, server)
        assert all(b >= decided[-2] for b in moved) and 3 in moved


def test_progressive_before_anything_freezes_is_bit_identical_to_off(
    serve: Callable[..., StageServer],
) -> None:
    off = _run(_config(2), serve)
    waiting = _run(_config(2, freeze="progressive", freeze_after=50), serve)
    assert not any(r["event"] == "freeze" for r in off["records"])
    assert [r["frozen_below"] for r in waiting["records"] if r["event"] == "freeze"] == [0, 0]
    for (d_off, s_off), (d_wait, s_wait) in zip(off["globals"], waiting["globals"], strict=True):
        assert d_off.keys() == d_wait.keys() and s_off.keys() == s_wait.keys()
        assert all(torch.equal(d_off[k], d_wait[k]) for k in d_off)
        assert all(torch.equal(s_off[k], s_wait[k]) for k in s_off)
    assert off["traffic"] == waiting["traffic"]
    # Each round's train losses, per device (the devices reply in any order).
    losses = {
        name: [sorted(tuple(s.loss for s in r.steps) for r in out["reports"][n]) for n in (1, 2)]
        for name, out in (("off", off), ("waiting", waiting))
    }
    assert losses["off"] == losses["waiting"]
