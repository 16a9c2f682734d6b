"""fedpipe's ServerApp: it drives the rounds.

Flower carries only what is aggregated once per round (the device-side LoRA adapters) and
metrics; per-step traffic goes over fedpipe's stage link. Each round the ServerApp tells the
StageServer which round it is, gives every sampled device a token for it, aggregates the
device adapters with the strategy, asks the StageServer to merge the server-side adapters of
the devices whose replies arrived (same weights) and to drop the rest, evaluates the split
model on held-out text, and checkpoints both sides. While a round's replies are out it records
every few seconds how many steps each device has done, as the StageServer counts them
(:mod:`fedpipe.fl.progress`).

The rounds themselves (:class:`~fedpipe.fl.rounds.FedpipeStrategy`: the configured Flower
strategy wrapped in fedpipe's round and its round policy) do not depend on where the devices
run: ``fedpipe bench quality`` drives the same object over a grid of its own.

With StageServer replicas (``run.stage-address`` lists several), round control goes through
:class:`~fedpipe.fl.replica_control.ReplicaControl`: each device is told its replica's address and
gets a token for that replica's run id; before the strategy aggregates, every replica hands
over its part of the round, and a device whose replica was lost fails the round; the server
adapters are merged here and loaded back into every replica.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from fedpipe import GRPC_FORK_SETTING_LATE
from fedpipe.config import FedpipeConfig
from fedpipe.edge.trainer import initial_device_adapters
from fedpipe.fl.deadline_grid import StopRun
from fedpipe.fl.device_work import DeviceWork, RunSettings, evaluate_split, server_run_settings
from fedpipe.fl.eval_generate import generation_record
from fedpipe.fl.freeze import FreezeState
from fedpipe.fl.replica_control import ReplicaControl, stage_addresses
from fedpipe.fl.rounds import FedpipeStrategy, Resumed, StageControl
from fedpipe.runs.folder import FINGERPRINT_KEY, RunFolder
from fedpipe.runs.tensorboard import Board
from fedpipe.wire.control_client import StageControlClient

__all__ = ["seeded_adapters", "server_app", "stage_control"]

log = logging.getLogger(__name__)

server_app = ServerApp()


def _make_evaluate(
    work: DeviceWork,
    rounds: FedpipeStrategy,
    run: RunSettings,
    folder: RunFolder,
    *,
    resumed: bool,
) -> Callable[[int, ArrayRecord], MetricRecord]:
    """Flower's ``evaluate_fn``: held-out loss, the round's record and its checkpoint.

    The round's record (``event: eval``) holds its own duration (``wall_s``, from the start
    of the round to its checkpoint), the run's ``elapsed_s`` and the round's device counts.
    """
    control = rounds.control

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        round_ = rounds.number_of(server_round)
        if server_round == 0 and resumed:
            return MetricRecord({})
        state = arrays.to_torch_state_dict()
        where = run
        if rounds.replicas is not None:  # on a replica that holds the global adapter
            route = rounds.replicas.evaluator()
            where = replace(run, stage_address=route.address, run_id=route.run_id)
        loss, tokens = evaluate_split(work, state, where, round_)
        record: dict[str, Any] = {
            "round": round_,
            "eval_loss": loss,
            "eval_ppl": math.exp(min(loss, 50.0)),
            "eval_tokens": tokens,
        }
        if server_round > 0:
            merged, discarded = rounds.last_commit
            record |= {**rounds.stats, "merged": merged, "discarded": discarded}
            folder.save_checkpoint(
                round_,
                device=state,
                server=control.get_adapter(),
                state=_checkpoint_state(
                    round_, run, rounds.freeze, fingerprint=work.trainer.split.fingerprint
                ),
            )
        if work.questions:  # federated.eval_generate: greedy answers, scored
            record |= generation_record(
                work.questions, work.trainer.folder, folder.path, round_, base=server_round == 0
            )
        if rounds.policy.mode == "async":  # each record is a version's
            record["unit"] = "version"
        now = time.time()
        record |= {"wall_s": now - rounds.round_started, "elapsed_s": now - rounds.started}
        rounds.log({"event": "eval", **record})
        log.info("round %d: eval loss %.4f (ppl %.2f)", round_, loss, record["eval_ppl"])
        # per replica (with replicas): lists, as MetricRecord holds them
        values = {
            k: v if isinstance(v, list) else float(v)
            for k, v in record.items()
            if not isinstance(v, str)
        }
        return MetricRecord(values)  # type: ignore[arg-type]

    return evaluate


def _checkpoint_state(
    round_: int, run: RunSettings, freeze: FreezeState | None, *, fingerprint: str = ""
) -> dict[str, Any]:
    """The round state a checkpoint keeps beside both sides' adapters, and the fingerprint of
    the base model they were trained on (what `fedpipe export` checks a base model against)."""
    state: dict[str, Any] = {"round": round_, "run_id": run.run_id}
    if fingerprint:
        state[FINGERPRINT_KEY] = fingerprint
    if freeze is not None:  # a resumed run goes on from this decision
        state["freeze"] = freeze.to_json()
    return state


def stage_control(cfg: FedpipeConfig, run: RunSettings) -> StageControl:
    """Round control of the run's StageServer, or of its replicas when there are several."""
    chain, key = cfg.server.client_identity()
    addresses = stage_addresses(run.stage_address)
    if len(addresses) > 1:
        return ReplicaControl(
            addresses,
            run.secret,
            run_id=run.run_id,
            lora_scale=cfg.model.lora_alpha / cfg.model.lora_r,
            wait_s=cfg.server.replica_start_s,
            root_certificates=cfg.server.root_certificates(),
            certificate_chain=chain,
            private_key=key,
        )
    return StageControlClient(
        run.stage_address,
        run.secret,
        run_id=run.run_id,
        root_certificates=cfg.server.root_certificates(),
        certificate_chain=chain,
        private_key=key,
    )


def seeded_adapters(cfg: FedpipeConfig, work: DeviceWork) -> dict[str, torch.Tensor]:
    """The global device adapters a run starts from: the seeded ones of every offered cut."""
    if len(cfg.model.offered_cuts) > 1:
        return initial_device_adapters(cfg, work.trainer.folder)
    return work.trainer.adapters()


@server_app.main()
def server_main(grid: Grid, context: Context) -> None:
    if GRPC_FORK_SETTING_LATE:  # a Flower started outside fedpipe's launcher
        log.warning(
            "this ServerApp's process imported grpc before fedpipe, with "
            "GRPC_ENABLE_FORK_SUPPORT unset: where Ray runs in it (Flower's simulation), its "
            "forks can break the stage link's streams; start the SuperLink with "
            "GRPC_ENABLE_FORK_SUPPORT=0 (fedpipe simulate and fedpipe run do)"
        )
    cfg, run = server_run_settings(context.run_config)  # the only reader of the secret
    folder = RunFolder.open(Path(run.dir).parent, Path(run.dir).name, resume=run.resume)
    control = stage_control(cfg, run)
    work = DeviceWork(
        cfg, device_id="evaluator", partition=-1, num_partitions=cfg.federated.num_devices
    )
    arrays = seeded_adapters(cfg, work)  # before any checkpoint is loaded
    initial = dict(arrays)
    checkpoint = folder.latest_checkpoint() if run.resume else None
    resumed = None
    if checkpoint is not None:
        kept = checkpoint.state.get("freeze")  # its freezing decision so far
        resumed = Resumed(checkpoint.round, FreezeState.from_json(kept) if kept else None)
        arrays = checkpoint.device
        control.load_adapter(checkpoint.server)
        log.info("resuming after round %d", checkpoint.round)
    else:
        control.reset_adapter()  # a long-lived StageServer may hold an earlier run's adapter
    remaining = cfg.federated.rounds - (resumed.round if resumed else 0)
    if remaining <= 0:
        log.info("all %d rounds are done already", cfg.federated.rounds)
        return
    board = Board(folder.path / "tensorboard")

    def record(entry: dict[str, Any]) -> None:
        """One metrics record: metrics.jsonl (read live by the CLI) and TensorBoard."""
        folder.log_metrics(entry)
        board.write(entry)

    rounds = FedpipeStrategy(cfg, control, run, grid, initial=initial, log=record, resumed=resumed)
    # Records of rounds after the checkpoint's from an earlier attempt (a crash between commit
    # and checkpoint) are superseded from here on; build_summary drops them.
    rounds.log({"event": "start", "round": rounds.number, "resumed": resumed is not None})
    rounds.begin_on_server()
    try:
        rounds.run(
            arrays,
            num_rounds=remaining,
            evaluate_fn=_make_evaluate(work, rounds, run, folder, resumed=resumed is not None),
        )
    except StopRun as stop:
        rounds.log({"event": "stop", "round": rounds.number, "reason": str(stop)})
        log.error("run stopped: %s", stop)
    finally:
        board.close()
