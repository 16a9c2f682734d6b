"""fedpipe's Flower apps: the ServerApp drives rounds, each ClientApp trains one device.

Flower carries only what is aggregated once per round (the device-side LoRA adapters) and
metrics; per-step traffic goes over fedpipe's stage link. Each round the ServerApp tells the
StageServer which round it is, gives every sampled device a token for it, aggregates the
device adapters with the strategy, asks the StageServer to merge the server-side adapters of
the devices whose replies arrived (same weights) and to drop the rest, evaluates the split
model on held-out text, and checkpoints both sides.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable
from pathlib import Path
from typing import cast

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from fedpipe.federated.control import StageControlClient
from fedpipe.federated.local import (
    DeviceWork,
    RunSettings,
    evaluate_split,
    run_settings,
    server_run_settings,
)
from fedpipe.federated.runfolder import RunFolder
from fedpipe.federated.strategies import make_strategy
from fedpipe.federated.tokens import issue_token

__all__ = ["client_app", "server_app"]

log = logging.getLogger(__name__)

server_app = ServerApp()
client_app = ClientApp()


# -- ServerApp --------------------------------------------------------------------------------
class _Rounds:
    """Per-round hooks around a Flower strategy: tokens, commit, and the round offset on resume."""

    def __init__(
        self, control: StageControlClient, folder: RunFolder, run: RunSettings, offset: int
    ) -> None:
        self.control, self.folder, self.offset = control, folder, offset
        self.secret, self.run_id = run.secret, run.run_id
        self.stage_address, self.token_ttl_s = run.stage_address, run.round_timeout_s
        self.last_commit: tuple[int, int] = (0, 0)
        self.finished: dict[str, float] = {}

    def configure(self, server_round: int, messages: Iterable[Message]) -> list[Message]:
        round_ = self.offset + server_round
        self.control.begin_round(round_, self.run_id)
        out = []
        for msg in messages:
            node = str(msg.metadata.dst_node_id)
            config = ConfigRecord(dict(cast(ConfigRecord, msg.content["config"])))
            config["fedpipe-round"] = round_
            # All a device needs for the stage link comes here (its CA is its own file).
            config["stage-address"] = self.stage_address
            config["token"] = (
                issue_token(
                    self.secret,
                    run_id=self.run_id,
                    round=round_,
                    device_id=node,
                    ttl_s=self.token_ttl_s,
                )
                if self.secret
                else ""
            )
            content = RecordDict({"arrays": msg.content["arrays"], "config": config})
            out.append(
                Message(
                    content=content,
                    message_type=msg.metadata.message_type,
                    dst_node_id=msg.metadata.dst_node_id,
                )
            )
        return out

    def commit(self, server_round: int, replies: list[Message]) -> None:
        ok = [r for r in replies if not r.has_error()]
        self.finished = {
            str(r.metadata.src_node_id): float(cast(int, r.content["metrics"]["num-examples"]))
            for r in ok
        }
        self.last_commit = self.control.commit_round(self.offset + server_round, self.finished)
        for reply in ok:
            metrics = {k: v for k, v in reply.content["metrics"].items()}
            self.folder.log_metrics(
                {"event": "train", "round": self.offset + server_round, **metrics}
            )
        failed = len(replies) - len(ok)
        if failed:
            self.folder.log_metrics(
                {"event": "failed", "round": self.offset + server_round, "devices": failed}
            )
        log.info(
            "round %d: %d devices merged, %d failed", self.offset + server_round, len(ok), failed
        )


def _wrap_strategy(strategy, rounds: _Rounds):  # type: ignore[no-untyped-def]
    base = type(strategy)

    class FedpipeStrategy(base):  # type: ignore[misc, valid-type]
        def configure_train(self, server_round, arrays, config, grid):  # type: ignore[no-untyped-def]
            return rounds.configure(
                server_round, super().configure_train(server_round, arrays, config, grid)
            )

        def aggregate_train(self, server_round, replies):  # type: ignore[no-untyped-def]
            replies = list(replies)
            result = super().aggregate_train(server_round, replies)
            rounds.commit(server_round, replies)
            return result

    strategy.__class__ = FedpipeStrategy
    return strategy


@server_app.main()
def server_main(grid: Grid, context: Context) -> None:
    cfg, run = server_run_settings(context.run_config)  # the only reader of the secret
    folder = RunFolder.open(Path(run.dir).parent, Path(run.dir).name, resume=run.resume)
    chain, key = cfg.server.client_identity()
    control = StageControlClient(
        run.stage_address,
        run.secret,
        root_certificates=cfg.server.root_certificates(),
        certificate_chain=chain,
        private_key=key,
    )
    work = DeviceWork(
        cfg, device_id="evaluator", partition=-1, num_partitions=cfg.federated.num_devices
    )
    arrays, offset = work.trainer.adapters(), 0
    checkpoint = folder.latest_checkpoint() if run.resume else None
    if checkpoint is not None:
        arrays, offset = checkpoint.device, checkpoint.round
        control.load_adapter(checkpoint.server)
        log.info("resuming after round %d", offset)
    else:
        control.reset_adapter()  # a long-lived StageServer may hold an earlier run's adapter
    remaining = cfg.federated.rounds - offset
    if remaining <= 0:
        log.info("all %d rounds are done already", cfg.federated.rounds)
        return
    rounds = _Rounds(control, folder, run, offset)
    control.begin_round(offset, run.run_id)
    strategy = _wrap_strategy(
        make_strategy(
            cfg.federated.strategy,
            fraction_train=cfg.federated.fraction_train,
            min_available_nodes=cfg.federated.num_devices
            if cfg.federated.fraction_train >= 1
            else 1,
            min_train_nodes=1,
            proximal_mu=cfg.federated.proximal_mu,
            server_lr=cfg.federated.server_lr
            if cfg.federated.strategy in ("fedadam", "fedyogi", "fedadagrad", "fedavgm")
            else None,
        ),
        rounds,
    )
    started = time.time()

    def evaluate(server_round: int, arrays_: ArrayRecord) -> MetricRecord:
        round_ = offset + server_round
        if server_round == 0 and checkpoint is not None:
            return MetricRecord({})
        state = arrays_.to_torch_state_dict()
        loss, tokens = evaluate_split(work, state, run, round_)
        record = {
            "round": round_,
            "eval_loss": loss,
            "eval_ppl": math.exp(min(loss, 50.0)),
            "eval_tokens": tokens,
            "wall_s": time.time() - started,
        }
        if server_round > 0:
            merged, discarded = rounds.last_commit
            record |= {
                "merged": merged,
                "discarded": discarded,
                "finished_devices": len(rounds.finished),
            }
            folder.save_checkpoint(
                round_,
                device=state,
                server=control.get_adapter(),
                state={"round": round_, "run_id": run.run_id},
            )
        folder.log_metrics({"event": "eval", **record})
        log.info("round %d: eval loss %.4f (ppl %.2f)", round_, loss, record["eval_ppl"])
        return MetricRecord({k: float(v) for k, v in record.items()})

    strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(arrays),
        num_rounds=remaining,
        timeout=run.round_timeout_s,
        train_config=ConfigRecord({"proximal-mu": cfg.federated.proximal_mu}),
        evaluate_fn=evaluate,
    )


# -- ClientApp --------------------------------------------------------------------------------
@client_app.train()
def client_train(msg: Message, context: Context) -> Message:
    cfg, run = run_settings(context.run_config)
    node = context.node_config
    partition = int(node.get("partition-id", 0))
    num_partitions = int(node.get("num-partitions", cfg.federated.num_devices))
    work = DeviceWork.cached(
        cfg,
        device_id=str(context.node_id),
        partition=partition,
        num_partitions=num_partitions,
        profile=str(node.get("profile", "")) or None,
        data=str(node.get("data", "")) or None,
        stage_ca=str(node.get("stage-ca", "")),
        stage_cert=str(node.get("stage-cert", "")),
        stage_key=str(node.get("stage-key", "")),
    )
    config = cast(ConfigRecord, msg.content["config"])
    round_ = int(cast(int, config["fedpipe-round"]))
    work.trainer.load_adapters(cast(ArrayRecord, msg.content["arrays"]).to_torch_state_dict())
    # The device's own flag first (the server's address as seen from the device's network),
    # else the one the ServerApp sent.
    address = str(node.get("stage-address", "")) or str(config.get("stage-address", ""))
    address = address or run.stage_address
    fail = run.kill_partition == partition and run.kill_round == round_
    report = work.train(
        address,
        round_=round_,
        token=str(config["token"]),
        proximal_mu=float(cast(float, config.get("proximal-mu", 0.0)))
        if cfg.federated.strategy == "fedprox"
        else 0.0,
        fail_after_steps=1 if fail else None,
        trace_dir=Path(run.dir) / "traces" if run.dir else None,
    )
    metrics: dict[str, int | float | list[int] | list[float]] = {
        **report.metrics(),
        "partition-id": partition,
    }
    content = RecordDict(
        {"arrays": ArrayRecord(work.trainer.adapters()), "metrics": MetricRecord(metrics)}
    )
    return Message(content=content, reply_to=msg)
