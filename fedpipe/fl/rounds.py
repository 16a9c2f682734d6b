"""The run's rounds as one object: :class:`FedpipeStrategy`.

It wraps the configured Flower strategy (``federated.strategy``, ``server_lr``,
``fraction_train``, ``privacy.adapter_dp``) as Flower's own DP wrappers wrap one, and is the
round: it numbers the run's rounds (a resumed run goes on), issues tokens and train orders,
checks each reply, weighs it by the StageServer's count, has the configured strategy
aggregate the device adapters (per set of keys held, or padded for strategies with
momentum), folds ``exact`` / ``stack`` products, commits the server side, records the round
and decides freezing. Built complete by its constructor from the run's settings; nothing is
set on it or its parts from outside. :meth:`FedpipeStrategy.run` runs Flower's own round
loop over fedpipe's :class:`~fedpipe.fl.deadline_grid.DeadlineGrid`; where the devices run
(Flower's engines, or a bench's in-process grid) does not matter to it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, cast

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from fedpipe.auth.tokens import issue_token
from fedpipe.config import FedpipeConfig, format_cut
from fedpipe.fl.adapter_codec import AdapterCodecs, decode_reply, encode_adapters
from fedpipe.fl.adapter_dp import with_adapter_dp
from fedpipe.fl.aggregate import ExactState, by_holders, clip_replies, held, pad_to_union
from fedpipe.fl.buffered import BufferedRounds
from fedpipe.fl.deadline_grid import DeadlineGrid, DeviceBook, StopRun
from fedpipe.fl.device_work import RunSettings
from fedpipe.fl.freeze import FreezeRule, FreezeState, block_movement, pin_frozen
from fedpipe.fl.orders import TrainOrder
from fedpipe.fl.progress import StepWatch
from fedpipe.fl.replica_control import ReplicaControl
from fedpipe.fl.replies import ReplyRules, TrainReply, check_reply, device_keys
from fedpipe.fl.strategies import STATEFUL, aggregation_rule, make_strategy, robust_options
from fedpipe.lora.aggregation import split_deltas
from fedpipe.lora.freezing import trainable_part
from fedpipe.models import load_config, resolve_model
from fedpipe.wire.control_client import Committed, StageControlClient

__all__ = ["FedpipeStrategy", "Resumed", "StageControl"]

log = logging.getLogger(__name__)

StageControl = StageControlClient | ReplicaControl  # one StageServer, or its replicas

_PROGRESS_EVERY_S = 2.0  # how often a round asks the StageServer how far its devices have got

State = dict[str, torch.Tensor]
Stats = dict[str, float | int | list[float] | list[int]]


@dataclass(frozen=True)
class Resumed:
    """What a resumed run goes on from: the rounds its checkpoint holds, and its checkpoint's
    freezing decision (``pipeline.freeze = progressive``; None: none was kept)."""

    round: int
    freeze: FreezeState | None = None


def _inner_strategy(cfg: FedpipeConfig) -> Strategy:
    """The configured Flower strategy; fedpipe's DeadlineGrid, not Flower, waits for devices."""
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
    return with_adapter_dp(strategy, cfg.privacy, sampled_devices=sampled)


class FedpipeStrategy(Strategy):
    """The run's rounds around the configured Flower strategy (see the module docstring).

    ``grid`` is Flower's (the ServerApp's, or a bench's in-process one), wrapped here in
    fedpipe's round policy (:class:`DeadlineGrid`). ``initial``: the seeded device adapters
    (``stack`` restarts from them every round). ``resumed``: where a resumed run goes on from.
    ``log`` takes every record of the run (the ServerApp's: metrics.jsonl and TensorBoard).
    """

    def __init__(
        self,
        cfg: FedpipeConfig,
        control: StageControl,
        run: RunSettings,
        grid: Grid,
        *,
        initial: State,
        log: Callable[[dict[str, Any]], None],
        resumed: Resumed | None = None,
    ) -> None:
        fed = self.policy = cfg.federated
        self.cfg, self.control, self.log = cfg, control, log
        self.inner = _inner_strategy(cfg)
        # momentum over the whole adapter: every reply is padded to every key; otherwise each
        # key is aggregated over the devices that hold it
        self.stateful = fed.strategy.strip().lower() in STATEFUL
        self.replicas = control if isinstance(control, ReplicaControl) else None
        if fed.mode == "async" and self.replicas is not None:
            raise ValueError(
                "federated.mode = async runs on one StageServer: its sessions of several "
                "versions cannot be split over replicas; give run.stage-address one address"
            )
        self.secret, self.run_id = run.secret, run.run_id
        self.stage_address, self.token_ttl_s = run.stage_address, run.round_timeout_s
        self.offset = resumed.round if resumed is not None else 0
        self.number = self.offset  # the run's round under way (the last one done, between)
        self.last_commit: tuple[int, int] = (0, 0)
        self.devices = DeviceBook()
        # the last committed round's, for its record (with replicas: lists per replica too)
        self.stats: Stats = {}
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
        kept = resumed.freeze if resumed is not None else None
        self.freeze_rule = FreezeRule.of(cfg.pipeline, num_layers) if progressive else None
        self.freeze = (kept or FreezeState()) if progressive else None
        self._server_before: State | None = None  # its global, last round
        self.grid = DeadlineGrid(
            grid,
            number=lambda: self.number,
            log=log,
            devices=self.devices,
            deadline_s=fed.round_deadline_s,
            report_every_s=fed.report_every_s,
            straggler_s=fed.straggler_s,
            watch=StepWatch(  # each device's steps, as the StageServer counts them
                control.round_status,
                steps=cfg.train.local_steps,
                grace_s=fed.report_every_s,
                connect_s=fed.connect_wait_s,
                every_s=min(_PROGRESS_EVERY_S, fed.report_every_s),
            ),
        )

    # -- the run --------------------------------------------------------------------------------
    def run(
        self,
        arrays: State,
        *,
        num_rounds: int,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """``num_rounds`` rounds from the global device adapters ``arrays``: Flower's own
        round loop, with fedpipe's round policy (:attr:`grid`) between it and Flower's grid;
        under ``federated.mode = async``, ``num_rounds`` versions of buffered aggregation
        (:class:`~fedpipe.fl.buffered.BufferedRounds`) over the same grid."""
        fed = self.policy
        if evaluate_fn is not None and fed.eval_every > 1:
            evaluate_fn = _every(evaluate_fn, fed.eval_every, num_rounds)
        if fed.mode == "async":
            return BufferedRounds(self).run(arrays, versions=num_rounds, evaluate_fn=evaluate_fn)
        return self.start(
            grid=self.grid,
            initial_arrays=ArrayRecord(arrays),
            num_rounds=num_rounds,
            timeout=fed.round_deadline_s,
            train_config=ConfigRecord({"proximal-mu": fed.proximal_mu}),
            evaluate_fn=evaluate_fn,
        )

    def number_of(self, server_round: int) -> int:
        """The run's round number of Flower's ``server_round`` (a resumed run's go on)."""
        return self.offset + server_round

    @property
    def frozen_below(self) -> int:
        """Blocks below this index train nothing this round (0: none; pipeline.freeze)."""
        return self.freeze.frozen_below if self.freeze is not None else 0

    def begin_on_server(self) -> None:
        """Tell the StageServer (each replica) which round the run is at and how it merges;
        under async, the versions before it whose sessions it still admits."""
        fed = self.policy
        self.control.begin_round(
            self.number,
            self.run_id,
            fed.aggregation,
            self.rule.text(),
            frozen_below=self.frozen_below,
            window=fed.max_staleness + 1 if fed.mode == "async" else 0,
        )

    def begin_version(self, version: int, arrays: State) -> None:
        """Async: the global is at ``version`` (the device adapters ``arrays``), on both sides."""
        self.number = version
        self.round_started = time.time()
        self.exact.begin(arrays)
        self.begin_on_server()

    def commit_updates(
        self, merge: list[tuple[str, int, float]], discard: list[tuple[str, int]]
    ) -> Committed:
        """Async: the StageServer merges each named (device, version) session as its update
        against that version's server adapter, by the weights given, and drops ``discard``."""
        control = self.control
        if not isinstance(control, StageControlClient):  # refused at construction already
            raise ValueError("federated.mode = async runs on one StageServer, not replicas")
        return control.commit_updates(self.number, merge, discard, server_lr=self.policy.buffer_lr)

    # -- Flower's strategy ------------------------------------------------------------------
    def summary(self) -> None:
        self.inner.summary()

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self._begin(server_round, arrays)
        sampled = self.inner.configure_train(server_round, arrays, config, self.grid)
        return self.orders(sampled)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        if self.number_of(server_round) != self.number:
            raise RuntimeError(
                f"Flower aggregates round {self.number_of(server_round)}, the run is in "
                f"round {self.number}"
            )
        kept = self.collect(self.weigh_by_server(self.valid_replies(list(replies))))
        global_state = self.exact.device_global
        if self.rule.norm_bound > 0:
            clip_replies(kept, global_state, self.rule.norm_bound)
        states = held(kept)
        result: tuple[ArrayRecord | None, object]
        if self.stateful:  # momentum over the whole adapter: every reply holds every key
            pad_to_union(kept, states, global_state)
            result = self.inner.aggregate_train(server_round, kept)
        else:
            aggregate = self.inner.aggregate_train
            result = by_holders(aggregate, server_round, kept, global_state)
        result = self.exact.fold(self._without_frozen(states), result)
        self.commit(kept)
        return cast("tuple[ArrayRecord | None, MetricRecord | None]", self.settle_freeze(result))

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return self.inner.configure_evaluate(server_round, arrays, config, self.grid)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        return self.inner.aggregate_evaluate(server_round, replies)

    # -- a round, in order ------------------------------------------------------------------
    def _begin(self, server_round: int, arrays: ArrayRecord) -> None:
        """Number the round, wait (no longer than stated) for the devices to connect, and
        begin it on the StageServer from the global ``arrays``."""
        self.number = self.number_of(server_round)
        self.round_started = time.time()
        fed = self.policy
        want = fed.num_devices if fed.fraction_train >= 1 else fed.min_devices
        self.grid.wait_for_devices(
            want=want, min_devices=fed.min_devices, wait_s=fed.connect_wait_s
        )
        self.exact.begin(arrays.to_torch_state_dict())
        self.begin_on_server()
        if self.freeze is not None and self._server_before is None:
            self._server_before = split_deltas(self.control.get_adapter())[0]

    def orders(self, messages: Iterable[Message]) -> list[Message]:
        """Each sampled device's message: the strategy's, with the round's train order (its
        StageServer or replica, a token for it) and the global adapters as devices get them."""
        messages = list(messages)
        routes = (
            self.replicas.routes(str(m.metadata.dst_node_id) for m in messages)
            if self.replicas is not None
            else {}
        )
        if routes:  # which replica serves each device this round (the run folder keeps it)
            assigned = {node: route.replica for node, route in routes.items()}
            self.log({"event": "routes", "round": self.number, "replicas": assigned})
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
                    round=self.number,
                    device_id=node,
                    ttl_s=self.token_ttl_s,
                )
                if self.secret
                else ""
            )
            TrainOrder(  # all a device needs for the stage link (its CA is its own file)
                round=self.number,
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

    def _downlink(self, arrays: ArrayRecord) -> ArrayRecord:
        """The round's global adapters as the devices receive them: as they are (an fp32
        downlink), else encoded with the downlink codec, once for all the round's messages."""
        if self.codecs.down == "fp32":
            return arrays
        if self._down is None or self._down[0] is not arrays:
            encoded = encode_adapters(arrays.to_torch_state_dict(), self.codecs.down)
            self._down = (arrays, encoded)
        return self._down[1]

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
                self.grid.failure(reply.metadata.src_node_id, why)
            else:
                kept.append(reply)
        return kept

    def weigh_by_server(self, replies: list[Message], number: int = -1) -> list[Message]:
        """The replies, each weighing (``num-examples``) what the StageServer counted: the
        rows of the microbatches it ran forward and backward in the steps it applied for the
        device's session (an empty step counts nothing), never more than the device claims.
        Without the server's counts (an older server), the checked claims stand. ``number``:
        the round (version) the replies trained in; -1: the one under way."""
        number = self.number if number < 0 else number
        rows = self.reply_rules.rows_per_step
        status = self.control.round_status(number) if rows else None
        if status is None:
            return replies
        done = {p.device_id: p.rows_done for p in status}
        for reply in replies:
            if reply.has_error():
                continue
            said = TrainReply.read(reply.content)
            counted = done.get(str(reply.metadata.src_node_id), 0)
            if said.num_examples > counted:
                log.warning(
                    "round %d: device %s claims %d examples, the StageServer counted %d: "
                    "weighted by the count",
                    number,
                    self.devices.name(reply.metadata.src_node_id),
                    said.num_examples,
                    counted,
                )
                said.weighed(counted).write_into(reply.content)
        return replies

    def collect(self, replies: list[Message]) -> list[Message]:
        """Replicas: each hands over its part of the round before anything is aggregated; a
        device whose replica was lost fails the round (named, with why), and its reply is left
        out of both sides' aggregation. One StageServer: the replies as they are."""
        if self.replicas is None:
            return replies
        lost = self.replicas.collect(self.number, _weights(replies))
        for reply in replies:
            if str(reply.metadata.src_node_id) in lost:
                self.grid.failure(reply.metadata.src_node_id, lost[str(reply.metadata.src_node_id)])
        return [r for r in replies if str(r.metadata.src_node_id) not in lost]

    def _without_frozen(
        self, held: tuple[list[State], list[float]]
    ) -> tuple[list[State], list[float]]:
        """The replies' adapters less their frozen blocks (``exact`` folds nothing there)."""
        if not self.frozen_below:
            return held
        return [trainable_part(s, self.frozen_below) for s in held[0]], held[1]

    def commit(self, replies: list[Message]) -> None:
        """Merge the finished devices on the server, record the round, apply the stop policy."""
        ok = [r for r in replies if not r.has_error()]
        merged, discarded, dropped = self.control.commit_round(self.number, _weights(ok))
        self.recorded(ok, (merged, discarded), dropped, self.grid.failures)

    def recorded(
        self,
        ok: list[Message],
        commit: tuple[int, int],
        dropped: dict[str, str],
        failures: list[dict[str, Any]],
    ) -> None:
        """After the server's commit (``commit``: merged, discarded; ``dropped``: devices whose
        server adapter it refused): each trained device's record, the round's totals over
        ``ok`` less the dropped, and the stop policy (``failures``: the round's, as logged)."""
        self.last_commit = commit
        figures = self.replicas.round_figures() if self.replicas is not None else {}
        for device, why in dropped.items():  # its server adapter held NaN/Inf: not merged
            self.grid.failure(int(device), f"server adapter not merged: {why}")
        ok = [r for r in ok if str(r.metadata.src_node_id) not in dropped]
        said = [TrainReply.read(r.content) for r in ok]
        for reply, reply_said in zip(ok, said, strict=True):
            fields = self.devices.fields(reply.metadata.src_node_id)
            self.log({"event": "train", "round": self.number, **fields, **reply_said.log_fields()})
        failed = len(failures)
        self.failures_total += failed
        self.stats = {**_round_stats(said, failed), **figures}
        log.info("round %d: %d devices merged, %d failed", self.number, len(ok), failed)
        _log_privacy(self.number, said)
        self._apply_stop_policy(len(ok), failed)

    def settle_freeze(
        self, result: tuple[ArrayRecord | None, Any]
    ) -> tuple[ArrayRecord | None, Any]:
        """After the commit: frozen blocks keep their values; measure, and decide the next
        round's frozen blocks (pipeline.freeze = progressive; otherwise ``result`` as it is)."""
        if self.freeze is None or self.freeze_rule is None or result[0] is None:
            return result
        before = self.exact.device_global  # what this round's devices started from
        state = pin_frozen(result[0].to_torch_state_dict(), before, self.frozen_below)
        server = split_deltas(self.control.get_adapter())[0]
        movement = block_movement(
            _sides(before, self._server_before or {}), _sides(split_deltas(state)[0], server)
        )
        self._server_before = server
        was = self.frozen_below
        now = self.freeze.decide(self.freeze_rule, self.number, movement)
        self.stats["frozen_below"] = now
        self.log({"event": "freeze", **self.freeze.history[-1]})
        if now != was:
            log.info("round %d: blocks %d..%d froze (pipeline.freeze)", self.number, was, now - 1)
        arrays = ArrayRecord({k: v.contiguous() for k, v in state.items()})
        return arrays, result[1]

    def _apply_stop_policy(self, trained: int, failed: int) -> None:
        limit = self.policy.max_failures
        if trained == 0:
            raise StopRun(f"round {self.number}: no device trained ({failed} failed)")
        if 0 <= limit < self.failures_total:
            raise StopRun(
                f"round {self.number}: {self.failures_total} device failures so far, more "
                f"than federated.max_failures={limit}"
            )


def _weights(replies: list[Message]) -> dict[str, float]:
    """Device id -> its aggregation weight, for the replies that are not errors."""
    return {
        str(r.metadata.src_node_id): float(TrainReply.read(r.content).num_examples)
        for r in replies
        if not r.has_error()
    }


def _sides(device: State, server: State) -> State:
    """Both sides' adapters in one mapping: a block both hold (cuts) is measured over both."""
    sides = {f"device.{k}": v for k, v in device.items()}
    return sides | {f"server.{k}": v for k, v in server.items()}


def _log_privacy(round_: int, said: list[TrainReply]) -> None:
    """The stage link's worst (largest) epsilon over the round's devices, when one is noised."""
    worst: dict[str, float] = {}
    for reply in said:
        for key, value in reply.privacy.items():
            if key.startswith("privacy-epsilon"):
                worst[key] = max(worst.get(key, 0.0), float(value))
    if worst:
        text = ", ".join(f"{k.removeprefix('privacy-')} {v:.4g}" for k, v in sorted(worst.items()))
        log.info("round %d: stage link privacy (max over devices, per sample): %s", round_, text)


def _round_stats(said: list[TrainReply], failed: int) -> dict[str, float | int]:
    """A round's totals over the devices that trained: counts, bytes, mean train loss."""
    losses = [x for x in (r.train_loss for r in said) if math.isfinite(x)]
    stats: dict[str, float | int] = {
        "devices_sampled": len(said) + failed,
        "devices_trained": len(said),
        "devices_failed": failed,
        "bytes_up": sum(r.bytes_up for r in said),
        "bytes_down": sum(r.bytes_down for r in said),
        "num_examples": sum(r.num_examples for r in said),
    }
    if losses:
        stats["train_loss"] = sum(losses) / len(losses)
    return stats


def _every(
    evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None], every: int, last: int
) -> Callable[[int, ArrayRecord], MetricRecord | None]:
    """``evaluate_fn`` for the seeded model, every ``every``-th round and the last
    (``federated.eval_every``); None for the others, which Flower and BufferedRounds skip."""

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        if server_round == 0 or server_round % every == 0 or server_round == last:
            return evaluate_fn(server_round, arrays)
        return None

    return evaluate
