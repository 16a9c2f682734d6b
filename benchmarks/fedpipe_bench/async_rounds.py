"""`fedpipe bench async`: a phone ten times slower, synchronous rounds against buffered
asynchronous versions (``federated.mode = async``), side by side in one run.

The devices are the demo's four (``jetson-ethernet``, ``laptop-wifi``, ``rpi-wifi``,
``phone-lte``) and a fifth on the phone's link that computes ten times slower than the phone
(compute slowdown 30 where ``phone-lte`` has 3). Both modes train the same model from the same
seeded adapters on the same partitions, with the ServerApp's own round code
(:class:`fedpipe.fl.rounds.FedpipeStrategy`: Flower's FedAvg in rounds, or
:class:`~fedpipe.fl.buffered.BufferedRounds` in versions) over a real StageServer on
127.0.0.1 (a fresh one per mode). As in ``fedpipe bench quality``, only the transport of
Flower's messages differs from a deployment: every device answers in a thread of its own
(:class:`~fedpipe_bench.local_grid.ThreadedGrid`), so devices run side by side and the sync
round's wait for its slowest device is real. Emulated slowdowns and links are sleeps (as
everywhere in fedpipe), so the slow phone costs wall time, not this machine's two cores.

Each mode evaluates the held-out loss as the ServerApp does, with ``federated.eval_every = 3``
(the seeded model, every third round or version, the last); the clock starts after the
evaluation of the seeded model and includes the evaluations after it (async makes more of
them, and pays for them: evaluating every version took 64% of its clock in the first
record). The sync run trains ``federated.rounds`` rounds;
its final held-out loss is the target. The async run goes on until its clock passes the sync
run's (or the version cap), and is stopped there: the bench's evaluation ends it by raising
:class:`_Enough` (the one thing the bench does that a run does not), the updates still being
computed are counted in bytes, not aggregated.

Figures per mode: the clock at each evaluation and its loss, the time to reach the target
(sync's final loss), the loss at the sync run's wall time, updates aggregated (and refused as
stale or second replies), stage-link and adapter bytes, and each device's idle fraction (the
share of the window in which it had no update to compute). The goal beside the ratio: async's
time to the target at most 0.6 of sync's.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from flwr.app import ArrayRecord, MetricRecord

from fedpipe.config import FedpipeConfig
from fedpipe.config.profile_spec import parse_device_profile
from fedpipe.fl.device_work import DeviceWork, RunSettings, evaluate_split
from fedpipe.fl.rounds import FedpipeStrategy
from fedpipe.fl.server_app import seeded_adapters
from fedpipe.server.build import build_stage_server
from fedpipe.wire.control_client import StageControlClient
from fedpipe_bench.local_devices import FIRST_NODE, LocalDevices
from fedpipe_bench.local_grid import ThreadedGrid

__all__ = ["GOAL", "PROFILES", "device_idle", "run_async_bench", "wall_to"]

log = logging.getLogger(__name__)

GOAL = 0.6  # async's time to sync's final loss, as a share of sync's (issue 43)
SLOW_PHONE = "up=10,down=30,rtt=60ms,jitter=5ms,slowdown=30,name=phone-lte-10x"
PROFILES = ("jetson-ethernet", "laptop-wifi", "rpi-wifi", "phone-lte", SLOW_PHONE)

COMMON: dict[str, Any] = {
    "federated.num_devices": len(PROFILES),
    "federated.profiles": "; ".join(PROFILES),
    "federated.partition": "iid",
    "federated.strategy": "fedavg",
    "federated.buffer": 2,
    "federated.max_staleness": 4,
    "federated.staleness": "poly:0.5",
    "federated.eval_every": 3,  # versions come often; evaluating each is half async's clock
    "pipeline.schedule": "greedy",
}
# Minutes on 2 cores: SmolLM2-135M (real, pretrained), 2 + 2 blocks on each device.
DEFAULT_SIZE: dict[str, Any] = {
    "model.name": "default",
    "model.head_layers": 2,
    "model.tail_layers": 2,
    "train.batch_size": 4,
    "train.seq_len": 64,
    "train.local_steps": 2,
    "train.lr": 3e-3,
    "train.eval_batches": 4,
    "federated.rounds": 4,
    "pipeline.microbatches": 2,
}
# Seconds: a tiny random Llama, for CI (says nothing about speed or quality).
QUICK_SIZE: dict[str, Any] = {
    "model.name": "tiny-llama",
    "model.head_layers": 1,
    "model.tail_layers": 1,
    "train.batch_size": 2,
    "train.seq_len": 32,
    "train.local_steps": 2,
    "train.lr": 1e-2,
    "train.eval_batches": 2,
    "federated.rounds": 2,
    "pipeline.microbatches": 1,
}
MAX_VERSIONS_PER_ROUND = 20  # the async run's cap: this many versions per sync round


class _Enough(Exception):
    """The async run has passed the sync run's wall time: the bench stops it here."""


def wall_to(evals: list[dict[str, Any]], target: float) -> float | None:
    """The clock at the first evaluation whose loss is at or below ``target`` (None: never)."""
    return next((e["at_s"] for e in evals if e["eval_loss"] <= target), None)


def loss_at(evals: list[dict[str, Any]], wall_s: float) -> float | None:
    """The loss of the last evaluation made by the clock's ``wall_s`` (None: none by then)."""
    made = [e for e in evals if e["at_s"] <= wall_s + 1e-9]
    return made[-1]["eval_loss"] if made else None


def device_idle(
    pushed: list[tuple[float, int, str]],
    answered: list[tuple[float, int, str]],
    start: float,
    end: float,
) -> dict[int, float]:
    """Per node, the share of ``[start, end]`` in which it had no update to compute.

    A node computes one message at a time (its thread), from when it was pushed or its last
    one was answered (the later) until it is answered; a message still out at ``end`` counts
    as busy up to ``end``.
    """
    window = max(end - start, 1e-9)
    done = {msg: t for t, _, msg in answered}
    busy: dict[int, float] = {}
    free_at: dict[int, float] = {}
    for t, node, msg in sorted(pushed):
        begin = max(t, free_at.get(node, t), start)
        finish = min(done.get(msg, end), end)
        if finish > begin:
            busy[node] = busy.get(node, 0.0) + finish - begin
        free_at[node] = max(finish, begin)
    nodes = {node for _, node, _ in pushed}
    return {node: max(0.0, 1.0 - busy.get(node, 0.0) / window) for node in sorted(nodes)}


def _mode(cfg: FedpipeConfig, *, budget_s: float | None) -> dict[str, Any]:
    """One mode's run on a fresh StageServer: its row."""
    fed = cfg.federated
    server = build_stage_server(cfg, port=0).start()
    control = StageControlClient(f"127.0.0.1:{server.port}", "")
    devices = LocalDevices(cfg)
    grid = ThreadedGrid(devices.nodes())
    evals: list[dict[str, Any]] = []
    records: list[dict[str, Any]] = []
    clock: dict[str, float] = {}
    try:
        control.reset_adapter()
        address = f"127.0.0.1:{server.port}"
        run = RunSettings(stage_address=address, run_id=f"async-bench-{fed.mode}")
        evaluator = DeviceWork(
            cfg, device_id="evaluator", partition=-1, num_partitions=fed.num_devices
        )
        initial = seeded_adapters(cfg, evaluator)
        rounds = FedpipeStrategy(cfg, control, run, grid, initial=dict(initial), log=records.append)
        rounds.begin_on_server()

        def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
            made = time.monotonic()
            number = rounds.number_of(server_round)
            loss, _ = evaluate_split(evaluator, arrays.to_torch_state_dict(), run, number)
            if server_round == 0:
                clock["start"] = time.monotonic()  # the clock starts after the seeded model's
                clock["eval_s"] = 0.0
                evals.append({"round": 0, "at_s": 0.0, "eval_loss": loss})
                return MetricRecord({})
            clock["eval_s"] += time.monotonic() - made
            at = made - clock["start"]
            evals.append({"round": number, "at_s": at, "eval_loss": loss})
            log.info("%s %d at %.1f s: eval loss %.4f", fed.mode, number, at, loss)
            clock["end"] = made
            if budget_s is not None and at >= budget_s:
                raise _Enough
            return MetricRecord({})

        cap = fed.rounds if budget_s is None else fed.rounds * MAX_VERSIONS_PER_ROUND
        try:
            rounds.run(dict(initial), num_rounds=cap, evaluate_fn=evaluate)
        except _Enough:
            pass
    finally:
        grid.close()  # waits for the updates still being computed (their bytes count)
        control.close()
        server.stop(grace=None)
    failures = [r for r in records if r["event"] == "failure"]
    if failures:
        raise RuntimeError(f"async bench ({fed.mode}): devices failed: {failures}")
    idle = device_idle(grid.pushed, grid.answered, clock["start"], clock["end"])
    names = {FIRST_NODE + i: parse_device_profile(p).name for i, p in enumerate(fed.profiles)}
    versions = [r for r in records if r["event"] == "version"]
    updates = (
        sum(v["updates"] for v in versions)
        if fed.mode == "async"
        else sum(1 for r in records if r["event"] == "train")
    )
    row: dict[str, Any] = {
        "mode": fed.mode,
        "wall_s": evals[-1]["at_s"],
        "final_eval_loss": evals[-1]["eval_loss"],
        "evals": evals,
        "eval_s": clock["eval_s"],
        "updates": updates,
        "bytes_up": devices.traffic.up,
        "bytes_down": devices.traffic.down,
        "adapter_bytes_up": devices.traffic.adapters_up,
        "adapter_bytes_down": devices.traffic.adapters_down,
        "device_idle": {names.get(n, str(n)): round(f, 4) for n, f in idle.items()},
        "device_idle_mean": sum(idle.values()) / max(len(idle), 1),
    }
    if fed.mode == "async":
        row |= {
            "versions": len(versions),
            "stale_refused": versions[-1]["stale_refused"] if versions else 0,
            "duplicates_refused": versions[-1]["duplicates_refused"] if versions else 0,
            "staleness_mean": (
                sum(s for v in versions for s in v["staleness"])
                / max(sum(len(v["staleness"]) for v in versions), 1)
            ),
            "staleness_max": max((s for v in versions for s in v["staleness"]), default=0),
        }
    else:
        row["rounds"] = len({r["round"] for r in records if r["event"] == "train"})
    return row


def run_async_bench(
    *, quick: bool = False, overrides: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Sync rounds, then async versions for as long, on the same devices: the report."""
    torch.manual_seed(0)
    base = FedpipeConfig().with_overrides(
        {**COMMON, **(QUICK_SIZE if quick else DEFAULT_SIZE), **(overrides or {})}
    )
    sync_cfg = base.with_overrides({"federated.mode": "sync"})
    async_cfg = base.with_overrides({"federated.mode": "async"})  # checked before anything runs
    started = time.perf_counter()
    sync = _mode(sync_cfg, budget_s=None)
    asyn = _mode(async_cfg, budget_s=sync["wall_s"])
    target = sync["final_eval_loss"]
    sync["wall_to_target_s"] = sync["wall_s"]
    asyn["wall_to_target_s"] = wall_to(asyn["evals"], target)
    asyn["eval_loss_at_sync_wall"] = loss_at(asyn["evals"], sync["wall_s"])
    ratio = (
        asyn["wall_to_target_s"] / sync["wall_s"]
        if asyn["wall_to_target_s"] is not None and sync["wall_s"] > 0
        else None
    )
    fed, train = base.federated, base.train
    return {
        "model": base.model.name,
        "quick": quick,
        "settings": {
            "devices": fed.num_devices,
            "profiles": [parse_device_profile(p).name for p in fed.profiles],
            "slowdowns": [parse_device_profile(p).compute_slowdown for p in fed.profiles],
            "rounds": fed.rounds,
            "buffer": fed.buffer,
            "max_staleness": fed.max_staleness,
            "staleness": fed.staleness,
            "eval_every": fed.eval_every,
            "partition": fed.partition,
            "local_steps": train.local_steps,
            "batch_size": train.batch_size,
            "seq_len": train.seq_len,
            "lr": train.lr,
            "cut": f"{base.model.head_layers}+{base.model.tail_layers}",
        },
        "target_loss": target,
        "sync": sync,
        "async": asyn,
        "wall_to_target_ratio": ratio,
        "goal": GOAL,
        "reached_goal": ratio is not None and ratio <= GOAL,
        "loss_gain_at_sync_wall": (
            None
            if asyn["eval_loss_at_sync_wall"] is None
            else target - asyn["eval_loss_at_sync_wall"]
        ),
        "bench_wall_s": time.perf_counter() - started,
        "note": (
            "clock from the end of the seeded model's evaluation; evaluations after it count; "
            "async stopped at the first version past sync's wall time"
        ),
    }
