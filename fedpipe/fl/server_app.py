"""fedpipe's ServerApp: it drives the rounds.

Flower carries only what is aggregated once per round (the device-side LoRA adapters) and
metrics; per-step traffic goes over fedpipe's stage link. Each round the ServerApp tells the
StageServer which round it is, gives every sampled device a token for it, aggregates the
device adapters with the strategy, asks the StageServer to merge the server-side adapters of
the devices whose replies arrived (same weights) and to drop the rest, evaluates the split
model on held-out text, and checkpoints both sides. While a round's replies are out it records
every few seconds how many steps each device has done, as the StageServer counts them
(:mod:`fedpipe.fl.progress`).

The rounds themselves (:class:`RoundHooks` and :func:`run_rounds`: the configured Flower strategy
wrapped in fedpipe's round hooks and round policy) do not depend on where the devices run:
``fedpipe bench quality`` drives the same code over a grid of its own.

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
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Result, Strategy

from fedpipe import GRPC_FORK_SETTING_LATE
from fedpipe.auth.tokens import issue_token
from fedpipe.config import FedpipeConfig, format_cut
from fedpipe.edge.trainer import initial_device_adapters
from fedpipe.fl.adapter_codec import AdapterCodecs, decode_reply, encode_adapters
from fedpipe.fl.adapter_dp import with_adapter_dp
from fedpipe.fl.aggregate import (
    ExactState,
    aggregate_exactly,
    by_holders,
    clip_replies,
    held,
    pad_to_union,
)
from fedpipe.fl.device_work import DeviceWork, RunSettings, evaluate_split, server_run_settings
from fedpipe.fl.eval_generate import generation_record
from fedpipe.fl.freeze import FreezeRule, FreezeState, block_movement, decide, pin_frozen
from fedpipe.fl.orders import TrainOrder
from fedpipe.fl.progress import RoundWatch
from fedpipe.fl.replica_control import ReplicaControl, stage_addresses
from fedpipe.fl.replies import ReplyRules, TrainReply, check_reply, device_keys
from fedpipe.fl.round_grid import DeviceBook, RoundGrid, StopRun
from fedpipe.fl.strategies import STATEFUL, aggregation_rule, make_strategy, robust_options
from fedpipe.lora.aggregation import split_deltas
from fedpipe.lora.freezing import trainable_part
from fedpipe.models import load_config, resolve_model
from fedpipe.runs.folder import FINGERPRINT_KEY, RunFolder
from fedpipe.runs.tensorboard import Board
from fedpipe.wire.control_client import StageControlClient

__all__ = [
    "FedpipeStrategy",
    "RoundHooks",
    "StageControl",
    "run_rounds",
    "seeded_adapters",
    "server_app",
    "stage_control",
]

log = logging.getLogger(__name__)

server_app = ServerApp()

StageControl = StageControlClient | ReplicaControl  # one StageServer, or its replicas

_PROGRESS_EVERY_S = 2.0  # how often a round asks the StageServer how far its devices have got


class RoundHooks:
    """Per-round hooks around a Flower strategy, for one run: tokens and train orders, reply
    checks, the StageServer's counts and commit, exact aggregation, freezing, and the run's
    round number on resume. Built complete here from the run's settings; nothing is set on it
    afterwards but each round's own state.

    ``grid`` is Flower's (the ServerApp's, or a bench's in-process one), wrapped in fedpipe's
    round policy (:class:`RoundGrid`). ``initial``: the seeded device adapters (``stack``
    restarts from them every round). ``offset``: the rounds a resumed run has done already;
    ``freeze``: its checkpoint's freezing decision (``pipeline.freeze = progressive``). ``log``
    takes every record of the run (the ServerApp's: metrics.jsonl and TensorBoard).
    """

    def __init__(
        self,
        cfg: FedpipeConfig,
        control: StageControl,
        run: RunSettings,
        grid: Grid,
        *,
        initial: dict[str, torch.Tensor],
        log: Callable[[dict[str, Any]], None],
        offset: int = 0,
        freeze: FreezeState | None = None,
    ) -> None:
        fed = self.policy = cfg.federated
        self.cfg, self.control, self.offset, self.log = cfg, control, offset, log
        self.replicas = control if isinstance(control, ReplicaControl) else None
        self.secret, self.run_id = run.secret, run.run_id
        self.stage_address, self.token_ttl_s = run.stage_address, run.round_timeout_s
        self.last_commit: tuple[int, int] = (0, 0)
        self.finished: dict[str, float] = {}
        self.devices = DeviceBook()
        # the last committed round's, for its record (with replicas: lists per replica too)
        self.stats: dict[str, float | int | list[float] | list[int]] = {}
        self.failures_total = 0
        self.started = self.round_started = time.time()
        self.exact = ExactState(  # `exact`, `stack` across rounds
            mode=fed.aggregation,
            lora_scale=cfg.model.lora_alpha / cfg.model.lora_r,
            device_initial=initial,
        )
        self.rule = aggregation_rule(fed)  # both sides combine adapters by it
        num_layers = int(load_config(resolve_model(cfg.model.name)).num_hidden_layers)
        self.reply_rules = ReplyRules(  # what replies may carry
            device_keys(cfg, initial, num_layers),
            default_cut=format_cut((cfg.model.head_layers, cfg.model.tail_layers)),
            max_examples=cfg.train.batch_size * cfg.train.local_steps,
            rows_per_step=cfg.train.batch_size,
        )
        self.codecs = AdapterCodecs.of(fed)  # adapters through Flower (adapter_codec)
        self._down: tuple[ArrayRecord, ArrayRecord] | None = None  # a round's global, encoded
        # pipeline.freeze = progressive (fedpipe.fl.freeze): the rule and the decision so far
        # (a resumed run's from its checkpoint); None: off, and nothing here changes a round.
        progressive = cfg.pipeline.freeze == "progressive"
        self.freeze_rule = FreezeRule.of(cfg.pipeline, num_layers) if progressive else None
        self.freeze = (freeze or FreezeState()) if progressive else None
        self._server_before: dict[str, torch.Tensor] | None = None  # its global, last round
        self.grid = RoundGrid(
            grid,
            log=log,
            devices=self.devices,
            deadline_s=fed.round_deadline_s,
            report_every_s=fed.report_every_s,
            straggler_s=fed.straggler_s,
            watch=RoundWatch(  # each device's steps, as the StageServer counts them
                control.round_status,
                steps=cfg.train.local_steps,
                grace_s=fed.report_every_s,
                connect_s=fed.connect_wait_s,
                every_s=min(_PROGRESS_EVERY_S, fed.report_every_s),
            ),
        )

    def run_round(self, server_round: int) -> int:
        """The run's round number of Flower's ``server_round`` (a resumed run's go on)."""
        return self.offset + server_round

    @property
    def frozen_below(self) -> int:
        """Blocks below this index train nothing this round (0: none; pipeline.freeze)."""
        return self.freeze.frozen_below if self.freeze is not None else 0

    def begin(self, server_round: int) -> None:
        """Before a round: wait (no longer than stated) for the devices to connect."""
        self.round_started = time.time()
        self.grid.round = self.run_round(server_round)
        fed = self.policy
        want = fed.num_devices if fed.fraction_train >= 1 else fed.min_devices
        self.grid.wait_for_devices(
            want=want, min_devices=fed.min_devices, wait_s=fed.connect_wait_s
        )

    def configure(self, server_round: int, messages: Iterable[Message]) -> list[Message]:
        round_ = self.run_round(server_round)
        self.control.begin_round(
            round_,
            self.run_id,
            self.policy.aggregation,
            self.rule.text(),
            frozen_below=self.frozen_below,
        )
        if self.freeze is not None and self._server_before is None:
            self._server_before = split_deltas(self.control.get_adapter())[0]
        messages = list(messages)
        routes = (
            self.replicas.routes(str(m.metadata.dst_node_id) for m in messages)
            if self.replicas is not None
            else {}
        )
        if routes:  # which replica serves each device this round (the run folder keeps it)
            assigned = {node: route.replica for node, route in routes.items()}
            self.log({"event": "routes", "round": round_, "replicas": assigned})
        out = []
        for msg in messages:
            node = str(msg.metadata.dst_node_id)
            config = ConfigRecord(dict(cast(ConfigRecord, msg.content["config"])))
            config.update(self.codecs.to_config())
            route = routes.get(node)  # with replicas: its replica, and that replica's run
            token = (
                issue_token(
                    self.secret,
                    run_id=route.run_id if route else self.run_id,
                    round=round_,
                    device_id=node,
                    ttl_s=self.token_ttl_s,
                )
                if self.secret
                else ""
            )
            TrainOrder(  # all a device needs for the stage link (its CA is its own file)
                round=round_,
                stage_address=route.address if route else self.stage_address,
                token=token,
                replica=route.replica if route else None,
                frozen_below=self.frozen_below if self.freeze is not None else 0,
            ).write(config)
            content = RecordDict(
                {
                    "arrays": self._downlink(cast(ArrayRecord, msg.content["arrays"])),
                    "config": config,
                }
            )
            out.append(
                Message(
                    content=content,
                    message_type=msg.metadata.message_type,
                    dst_node_id=msg.metadata.dst_node_id,
                )
            )
        return out

    def commit(self, server_round: int, replies: list[Message]) -> None:
        """Merge the finished devices on the server, record the round, apply the stop policy."""
        round_ = self.run_round(server_round)
        ok = [r for r in replies if not r.has_error()]
        self.finished = {
            str(r.metadata.src_node_id): float(TrainReply.read(r.content).num_examples) for r in ok
        }
        merged, discarded, dropped = self.control.commit_round(round_, self.finished)
        self.last_commit = (merged, discarded)
        figures = self.replicas.round_figures() if self.replicas is not None else {}
        for device, why in dropped.items():  # its server adapter held NaN/Inf: not merged
            self._fail(int(device), f"server adapter not merged: {why}")
        ok = [r for r in ok if str(r.metadata.src_node_id) not in dropped]
        for reply in ok:
            node = reply.metadata.src_node_id
            metrics = TrainReply.read(reply.content).log_fields()
            self.log({"event": "train", "round": round_, **self.devices.fields(node), **metrics})
        failed = len(self.grid.failures)
        self.failures_total += failed
        self.stats = {**_round_stats(ok, failed), **figures}
        log.info("round %d: %d devices merged, %d failed", round_, len(ok), failed)
        _log_privacy(round_, ok)
        self._apply_stop_policy(round_, len(ok), failed)

    def without_frozen(
        self, held: tuple[list[dict[str, torch.Tensor]], list[float]]
    ) -> tuple[list[dict[str, torch.Tensor]], list[float]]:
        """The replies' adapters less their frozen blocks (``exact`` folds nothing there)."""
        if not self.frozen_below:
            return held
        return [trainable_part(s, self.frozen_below) for s in held[0]], held[1]

    def settle_freeze(
        self, server_round: int, result: tuple[ArrayRecord | None, Any]
    ) -> tuple[ArrayRecord | None, Any]:
        """After the commit: frozen blocks keep their values; measure, and decide the next
        round's frozen blocks (pipeline.freeze = progressive; otherwise ``result`` as it is)."""
        if self.freeze is None or self.freeze_rule is None or result[0] is None:
            return result
        round_ = self.run_round(server_round)
        before = self.exact.device_global  # what this round's devices started from
        state = pin_frozen(result[0].to_torch_state_dict(), before, self.frozen_below)
        server = split_deltas(self.control.get_adapter())[0]
        movement = block_movement(
            _sides(before, self._server_before or {}), _sides(split_deltas(state)[0], server)
        )
        self._server_before = server
        was = self.frozen_below
        now = decide(self.freeze_rule, self.freeze, round_, movement)
        self.stats["frozen_below"] = now
        self.log({"event": "freeze", **self.freeze.history[-1]})
        if now != was:
            log.info("round %d: blocks %d..%d froze (pipeline.freeze)", round_, was, now - 1)
        arrays = ArrayRecord({k: v.contiguous() for k, v in state.items()})
        return arrays, result[1]

    def _downlink(self, arrays: ArrayRecord) -> ArrayRecord:
        """The round's global adapters as the devices receive them: as they are (an fp32
        downlink), else encoded with the downlink codec, once for all the round's messages."""
        if self.codecs.down == "fp32":
            return arrays
        if self._down is None or self._down[0] is not arrays:
            encoded = encode_adapters(arrays.to_torch_state_dict(), self.codecs.down)
            self._down = (arrays, encoded)
        return self._down[1]

    def collect(self, server_round: int, replies: list[Message]) -> list[Message]:
        """Replicas: each hands over its part of the round before anything is aggregated; a
        device whose replica was lost fails the round (named, with why), and its reply is left
        out of both sides' aggregation. One StageServer: the replies as they are."""
        if self.replicas is None:
            return replies
        finished = {
            str(r.metadata.src_node_id): float(TrainReply.read(r.content).num_examples)
            for r in replies
            if not r.has_error()
        }
        lost = self.replicas.collect(self.run_round(server_round), finished)
        for reply in replies:
            if str(reply.metadata.src_node_id) in lost:
                self._fail(reply.metadata.src_node_id, lost[str(reply.metadata.src_node_id)])
        return [r for r in replies if str(r.metadata.src_node_id) not in lost]

    def _fail(self, node: int, reason: str) -> None:
        self.grid.failure(node, reason)

    def valid_replies(self, replies: list[Message]) -> list[Message]:
        """The replies that carry what an honest device of the run sends (fedpipe.fl.replies);
        each other one is its device's failure, named with the reason, and is not averaged."""
        kept = []
        for reply in replies:
            why = ""
            if not reply.has_error():  # an encoded update first becomes whole adapters
                why = decode_reply(reply, self.exact.device_global, self.codecs) or check_reply(
                    reply, self.reply_rules
                )
            if why:
                self._fail(reply.metadata.src_node_id, why)
            else:
                kept.append(reply)
        return kept

    def weigh_by_server(self, server_round: int, replies: list[Message]) -> None:
        """Each reply's weight (``num-examples``) as the StageServer counts it: the rows of the
        microbatches it ran forward and backward in the steps it applied for the device's
        session (an empty step counts nothing), never more than the device claims. Without the
        server's counts (an older server), the checked claims stand."""
        rows = self.reply_rules.rows_per_step
        status = self.control.round_status(self.run_round(server_round)) if rows else None
        if status is None:
            return
        done = {p.device_id: p.rows_done for p in status}
        for reply in replies:
            if reply.has_error():
                continue
            metrics = cast(MetricRecord, reply.content["metrics"])
            claimed = int(cast(int, metrics["num-examples"]))
            counted = done.get(str(reply.metadata.src_node_id), 0)
            if claimed > counted:
                log.warning(
                    "round %d: device %s claims %d examples, the StageServer counted %d: "
                    "weighted by the count",
                    self.run_round(server_round),
                    self.devices.name(reply.metadata.src_node_id),
                    claimed,
                    counted,
                )
                metrics["num-examples"] = counted

    def _apply_stop_policy(self, round_: int, trained: int, failed: int) -> None:
        limit = self.policy.max_failures
        if trained == 0:
            raise StopRun(f"round {round_}: no device trained ({failed} failed)")
        if 0 <= limit < self.failures_total:
            raise StopRun(
                f"round {round_}: {self.failures_total} device failures so far, more than "
                f"federated.max_failures={limit}"
            )


def _sides(
    device: dict[str, torch.Tensor], server: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Both sides' adapters in one mapping: a block both hold (cuts) is measured over both."""
    sides = {f"device.{k}": v for k, v in device.items()}
    return sides | {f"server.{k}": v for k, v in server.items()}


def _log_privacy(round_: int, ok: list[Message]) -> None:
    """The stage link's worst (largest) epsilon over the round's devices, when one is noised."""
    worst: dict[str, float] = {}
    for reply in ok:
        record = cast(ConfigRecord, reply.content.get("privacy", ConfigRecord()))
        for key, value in record.items():
            if key.startswith("privacy-epsilon"):
                worst[key] = max(worst.get(key, 0.0), float(cast(float, value)))
    if worst:
        text = ", ".join(f"{k.removeprefix('privacy-')} {v:.4g}" for k, v in sorted(worst.items()))
        log.info("round %d: stage link privacy (max over devices, per sample): %s", round_, text)


def _round_stats(ok: list[Message], failed: int) -> dict[str, float | int]:
    """A round's totals over the devices that trained: counts, bytes, mean train loss."""
    metrics = [reply.content["metrics"] for reply in ok]
    losses = [float(cast(float, m["train-loss"])) for m in metrics]
    losses = [x for x in losses if math.isfinite(x)]
    stats: dict[str, float | int] = {
        "devices_sampled": len(ok) + failed,
        "devices_trained": len(ok),
        "devices_failed": failed,
        "bytes_up": sum(int(cast(int, m["bytes-up"])) for m in metrics),
        "bytes_down": sum(int(cast(int, m["bytes-down"])) for m in metrics),
        "num_examples": sum(int(cast(int, m["num-examples"])) for m in metrics),
    }
    if losses:
        stats["train_loss"] = sum(losses) / len(losses)
    return stats


class FedpipeStrategy(Strategy):
    """The configured Flower strategy wrapped in the run's round hooks, as Flower's own DP
    wrappers wrap one: ``rounds`` (tokens and train orders, reply checks, the StageServer's
    counts and commit, exact aggregation, freezing) around ``inner``'s sampling and
    aggregation. ``stateful``: ``inner`` keeps momentum over the whole adapter, so every reply
    is padded to every key; otherwise each key is aggregated over the devices that hold it.
    """

    def __init__(self, inner: Strategy, rounds: RoundHooks, *, stateful: bool) -> None:
        self.inner, self.rounds, self.stateful = inner, rounds, stateful

    def summary(self) -> None:
        self.inner.summary()

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        rounds = self.rounds
        rounds.begin(server_round)  # Flower's `grid` is rounds.grid (run_rounds hands it over)
        rounds.exact.device_global, rounds.exact.device_deltas = split_deltas(
            arrays.to_torch_state_dict()
        )
        sampled = self.inner.configure_train(server_round, arrays, config, grid)
        return rounds.configure(server_round, sampled)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        rounds = self.rounds
        held_replies = rounds.valid_replies(list(replies))
        rounds.weigh_by_server(server_round, held_replies)
        held_replies = rounds.collect(server_round, held_replies)
        global_state = rounds.exact.device_global
        if rounds.rule.norm_bound > 0:
            clip_replies(held_replies, global_state, rounds.rule.norm_bound)
        states = held(held_replies)
        result: tuple[ArrayRecord | None, object]
        if self.stateful:  # momentum over the whole adapter: every reply holds every key
            pad_to_union(held_replies, states, global_state)
            result = self.inner.aggregate_train(server_round, held_replies)
        else:
            aggregate = self.inner.aggregate_train
            result = by_holders(aggregate, server_round, held_replies, global_state)
        result = aggregate_exactly(rounds.exact, rounds.without_frozen(states), result)
        rounds.commit(server_round, held_replies)
        return cast(
            "tuple[ArrayRecord | None, MetricRecord | None]",
            rounds.settle_freeze(server_round, result),
        )

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return self.inner.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        return self.inner.aggregate_evaluate(server_round, replies)


def _make_evaluate(
    work: DeviceWork, rounds: RoundHooks, run: RunSettings, folder: RunFolder, *, resumed: bool
) -> Callable[[int, ArrayRecord], MetricRecord]:
    """Flower's ``evaluate_fn``: held-out loss, the round's record and its checkpoint.

    The round's record (``event: eval``) holds its own duration (``wall_s``, from the start
    of the round to its checkpoint), the run's ``elapsed_s`` and the round's device counts.
    """
    control = rounds.control

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        round_ = rounds.run_round(server_round)
        if server_round == 0 and resumed:
            return MetricRecord({})
        state = arrays.to_torch_state_dict()
        where = run
        if rounds.replicas is not None:  # on a replica that holds the global adapter
            route = rounds.replicas.evaluator()
            where = replace(run, stage_address=route.address, run_id=route.run_id)
        loss, tokens = evaluate_split(work, state, where, round_)
        record: dict[str, float | int | list[float] | list[int]] = {
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
        now = time.time()
        record |= {"wall_s": now - rounds.round_started, "elapsed_s": now - rounds.started}
        rounds.log({"event": "eval", **record})
        log.info("round %d: eval loss %.4f (ppl %.2f)", round_, loss, record["eval_ppl"])
        # per replica (with replicas): lists, as MetricRecord holds them
        values = {k: v if isinstance(v, list) else float(v) for k, v in record.items()}
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


def _strategy(cfg: FedpipeConfig, rounds: RoundHooks) -> FedpipeStrategy:
    """The configured Flower strategy; fedpipe's RoundGrid, not Flower, waits for devices."""
    fed = cfg.federated
    strategy = make_strategy(
        fed.strategy,
        fraction_train=fed.fraction_train,
        min_available_nodes=1,
        min_train_nodes=1,
        proximal_mu=fed.proximal_mu,
        server_lr=fed.server_lr
        if fed.strategy in ("fedadam", "fedyogi", "fedadagrad", "fedavgm")
        else None,
        **robust_options(fed),
    )
    sampled = max(1, int(fed.num_devices * fed.fraction_train))
    return FedpipeStrategy(
        with_adapter_dp(strategy, cfg.privacy, sampled_devices=sampled),
        rounds,
        stateful=fed.strategy.strip().lower() in STATEFUL,
    )


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


def run_rounds(
    rounds: RoundHooks,
    arrays: dict[str, torch.Tensor],
    *,
    num_rounds: int,
    evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
) -> Result:
    """``num_rounds`` rounds of ``rounds``' run from the global device adapters ``arrays``.

    The configured Flower strategy (``federated.strategy``, ``server_lr``, ``fraction_train``,
    ``privacy.adapter_dp``) wrapped in fedpipe's round hooks (``rounds``: tokens, reply
    checks, cuts, exact aggregation, the StageServer's commit) runs Flower's own round loop,
    with fedpipe's round policy (``rounds.grid``) between it and Flower's grid.
    """
    fed = rounds.policy
    return _strategy(rounds.cfg, rounds).start(
        grid=rounds.grid,
        initial_arrays=ArrayRecord(arrays),
        num_rounds=num_rounds,
        timeout=fed.round_deadline_s,
        train_config=ConfigRecord({"proximal-mu": fed.proximal_mu}),
        evaluate_fn=evaluate_fn,
    )


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
    offset = 0
    initial = dict(arrays)
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
    board = Board(folder.path / "tensorboard")

    def record(entry: dict[str, Any]) -> None:
        """One metrics record: metrics.jsonl (read live by the CLI) and TensorBoard."""
        folder.log_metrics(entry)
        board.write(entry)

    freeze = None  # a resumed run's freezing decision so far
    if checkpoint is not None and "freeze" in checkpoint.state:
        freeze = FreezeState.from_json(checkpoint.state["freeze"])
    rounds = RoundHooks(
        cfg, control, run, grid, initial=initial, log=record, offset=offset, freeze=freeze
    )
    # Records of rounds after `offset` from an earlier attempt (a crash between commit and
    # checkpoint) are superseded from here on; build_summary drops them.
    rounds.log({"event": "start", "round": offset, "resumed": checkpoint is not None})
    control.begin_round(
        offset,
        run.run_id,
        cfg.federated.aggregation,
        rounds.rule.text(),
        frozen_below=rounds.frozen_below,
    )
    try:
        run_rounds(
            rounds,
            arrays,
            num_rounds=remaining,
            evaluate_fn=_make_evaluate(work, rounds, run, folder, resumed=checkpoint is not None),
        )
    except StopRun as stop:
        rounds.log({"event": "stop", "round": rounds.grid.round, "reason": str(stop)})
        log.error("run stopped: %s", stop)
    finally:
        board.close()
