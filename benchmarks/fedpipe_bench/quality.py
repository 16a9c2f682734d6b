"""`fedpipe bench quality`: how close federated split training comes to one machine, and its bytes.

Every run trains the same model on the same text with the same per-step batch and number of
optimizer steps, then evaluates held-out loss:

- ``centralized``: the unsplit model with LoRA in one process (peft); step ``k`` trains on the
  union of the devices' step-``k`` batches, so it sees exactly the tokens the federated runs see;
- ``lossless`` (IID partitions, fp32), ``noniid`` (by source), the non-IID run again under
  each exact aggregation (``noniid-exact``, ``noniid-ffa``), one run per compression setting
  (named by its codec) and ``frozen`` (frozen-device mode): fedpipe with 4 devices.

The federated runs use the real pipeline (device runtime, codecs, the real StageServer over gRPC
on 127.0.0.1) and the ServerApp's own rounds (:class:`fedpipe.fl.rounds.FedpipeStrategy`: the
Flower strategy ``federated.strategy`` builds, with ``server_lr``, ``fraction_train`` sampling
and ``privacy.adapter_dp``, inside fedpipe's round hooks: tokens, finite checks, cuts, exact
aggregation, CommitRound on the StageServer). Only the transport of Flower's messages differs:
instead of a SuperLink and ClientApp workers (tens of seconds of setup per run on two cores),
an in-process grid (:class:`~fedpipe_bench.local_grid.LocalGrid`) hands each message to a
device in this process, which answers it as the ClientApp does
(:class:`~fedpipe_bench.local_devices.LocalDevices`). Devices train one after another each
round, as they would share this machine's cores anyway; so the round deadline and the
straggler cut, which need devices racing the clock, are refused (:func:`check_modelled`).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch

from fedpipe.config import FederatedConfig, FedpipeConfig
from fedpipe.data import (
    BlockSampler,
    default_corpus,
    held_out_blocks,
    load_documents,
    tokenize_blocks,
    train_eval_split,
)
from fedpipe.data import partition as partition_docs
from fedpipe.edge.trainer import TrainReport
from fedpipe.fl.device_work import DeviceWork, RunSettings, evaluate_split
from fedpipe.fl.rounds import FedpipeStrategy
from fedpipe.fl.server_app import seeded_adapters
from fedpipe.lora import apply_lora, lora_settings
from fedpipe.models import (
    load_causal_lm,
    load_config,
    load_tokenizer,
    model_family,
    resolve_model,
)
from fedpipe.server.build import build_stage_server
from fedpipe.wire.control_client import StageControlClient
from fedpipe_bench.local_devices import LocalDevices, Traffic
from fedpipe_bench.local_grid import LocalGrid

__all__ = [
    "ADAPTER_CODEC",
    "COMPRESSION",
    "DEFAULT_SIZE",
    "QUICK_SIZE",
    "RUNS",
    "check_modelled",
    "run_quality_bench",
    "federated_rounds",
]

log = logging.getLogger(__name__)

# The same for every run: 4 devices, unthrottled loopback (the bench measures learning and
# bytes, not link time), the bundled King James text.
COMMON: dict[str, Any] = {
    "federated.num_devices": 4,
    "federated.profiles": "loopback",
    "federated.partition": "iid",
    "pipeline.schedule": "greedy",
}
# About 15 minutes on 2 cores: SmolLM2-135M (real, pretrained), 2 + 2 blocks on the device.
DEFAULT_SIZE: dict[str, Any] = {
    "model.name": "default",
    "model.head_layers": 2,
    "model.tail_layers": 2,
    "train.batch_size": 4,
    "train.seq_len": 64,
    "train.local_steps": 2,
    "train.lr": 2e-3,
    "train.eval_batches": 8,
    "federated.rounds": 3,
    "pipeline.microbatches": 2,
}
# Seconds: a tiny random Llama, for CI (says nothing about quality).
QUICK_SIZE: dict[str, Any] = {
    "model.name": "tiny-llama",
    "model.head_layers": 1,
    "model.tail_layers": 1,
    "train.batch_size": 2,
    "train.seq_len": 32,
    "train.local_steps": 2,
    "train.eval_batches": 2,
    "federated.rounds": 2,
    "pipeline.microbatches": 1,
}
# One run per compression setting, named by its codec: data, so new codecs are one more line.
COMPRESSION: list[dict[str, Any]] = [
    {"name": "fp16", "pipeline.uplink_codec": "fp16", "pipeline.downlink_codec": "fp16"},
    {"name": "bf16", "pipeline.uplink_codec": "bf16", "pipeline.downlink_codec": "bf16"},
    {"name": "int8", "pipeline.uplink_codec": "int8", "pipeline.downlink_codec": "int8"},
    # Gradients in 4 or 2 bits keep what quantisation dropped and send it next step (error
    # feedback); activations and outputs in 4 bits are grouped along tokens (int4t): SmolLM2
    # has a few huge channels that per-row groups would smear over every value.
    {
        "name": "int8-int4ef",
        "pipeline.uplink_codec": "int8",
        "pipeline.downlink_codec": "int8",
        "pipeline.gradient_codec": "int4",
        "pipeline.error_feedback": True,
    },
    {
        "name": "int4t-int2ef",
        "pipeline.uplink_codec": "int4t",
        "pipeline.downlink_codec": "int4t",
        "pipeline.gradient_codec": "int2",
        "pipeline.error_feedback": True,
    },
    {  # groups of 128: half the scale and offset bytes of the default 64
        "name": "int4tg128-int2g128ef",
        "pipeline.uplink_codec": "int4tg128",
        "pipeline.downlink_codec": "int4tg128",
        "pipeline.gradient_codec": "int2g128",
        "pipeline.error_feedback": True,
    },
]
_NONIID = {"federated.partition": "by-source"}
RUNS: list[dict[str, Any]] = [
    {"name": "lossless"},
    {"name": "noniid", **_NONIID},
    {"name": "noniid-exact", **_NONIID, "federated.aggregation": "exact"},
    {"name": "noniid-ffa", **_NONIID, "federated.aggregation": "ffa"},
    *COMPRESSION,
    {"name": "frozen", "pipeline.device_trains": False},
]
# Delta coding of activations (AQ-SGD): int8 sends, int2 differences for samples seen before;
# `-session` keeps each cache for one round only. They gain only where devices revisit their
# data: run them with e.g. --set federated.device_blocks=8 (one epoch a round).
_DELTA = {
    "pipeline.uplink_codec": "int8",
    "pipeline.downlink_codec": "int8",
    "pipeline.delta": True,
    "pipeline.delta_codec": "int2",
}
# Adapters through Flower in a stage-link codec (fedpipe.fl.adapter_codec): each device's
# update, with error feedback kept on the device between rounds; `-both` compresses the global
# adapters sent to the devices too. Measured beside `lossless`: adapter bytes and held-out loss.
ADAPTER_CODEC: list[dict[str, Any]] = [
    {"name": "adapter-int8", "federated.adapter_codec": "int8"},
    {"name": "adapter-int4", "federated.adapter_codec": "int4"},
    {
        "name": "adapter-int8-both",
        "federated.adapter_codec": "int8",
        "federated.adapter_downlink_codec": "int8",
    },
    {
        "name": "adapter-int4-both",
        "federated.adapter_codec": "int4",
        "federated.adapter_downlink_codec": "int4",
    },
]
# The devices' frozen weights stored in fewer bits (device.weights, fedpipe.split.quant): the
# lossless run with every device's embedding, block linears and LM head in bf16, int8 or int4
# (the evaluator beside the server keeps fp32: the held-out loss is the trained adapters' on
# the model itself). Measured beside `lossless`.
DEVICE_WEIGHTS: list[dict[str, Any]] = [
    {"name": f"device-{weights}", "device.weights": weights} for weights in ("bf16", "int8", "int4")
]
# Known but not run by default (--runs noniid-stack).
EXTRA_RUNS: list[dict[str, Any]] = [
    # lossless with the lowest blocks frozen as their adapters converge (pipeline.freeze); its
    # row holds each round's frozen blocks (`frozen_below`) beside its bytes and wall time.
    {"name": "progressive", "pipeline.freeze": "progressive"},
    *ADAPTER_CODEC,
    *DEVICE_WEIGHTS,
    {"name": "noniid-stack", **_NONIID, "federated.aggregation": "stack"},
    {"name": "int8-delta", **_DELTA},
    {"name": "int8-delta-session", **_DELTA, "pipeline.delta_resume": False},
    {  # the fewest bytes: differences grouped along tokens, like the int4t rows they correct
        **next(r for r in COMPRESSION if r["name"] == "int4t-int2ef"),
        "name": "int4t-int2ef-delta",
        "pipeline.delta": True,
        "pipeline.delta_codec": "int2t",
    },
    # int4t-int2ef with each group's largest activation/output value sent exactly ("o"): with
    # groups of 64 (more bytes), and of 128 (fewer bytes than int4t's 64).
    {
        "name": "int4to-int2ef",
        "pipeline.uplink_codec": "int4to",
        "pipeline.downlink_codec": "int4to",
        "pipeline.gradient_codec": "int2",
        "pipeline.error_feedback": True,
    },
    {
        "name": "int4tog128-int2ef",
        "pipeline.uplink_codec": "int4tog128",
        "pipeline.downlink_codec": "int4tog128",
        "pipeline.gradient_codec": "int2",
        "pipeline.error_feedback": True,
    },
]


# The round policy's clock: this bench's devices train one after another and always reply.
_UNMODELLED = ("round_deadline_s", "straggler_s")


def run_names() -> list[str]:
    """Every run this bench knows, defaults first."""
    return ["centralized", *(r["name"] for r in RUNS + EXTRA_RUNS)]


def run_quality_bench(
    *,
    quick: bool = False,
    names: list[str] | None = None,
    overrides: dict[str, Any] | None = None,
    seeds: int = 1,
) -> dict[str, Any]:
    """Train every run in ``names`` (default: all but the extras) ``seeds`` times; the report.

    Seed ``k`` sets ``model.seed`` to the base seed + k: the held-out split, the partitions,
    the LoRA init and the batch order change, the model does not. Every run sees the same
    seeds, so two runs' per-seed losses are paired.
    """
    base = FedpipeConfig().with_overrides(
        {**COMMON, **(QUICK_SIZE if quick else DEFAULT_SIZE), **(overrides or {})}
    )
    check_modelled(base)
    wanted = names or ["centralized", *(r["name"] for r in RUNS)]
    unknown = sorted(set(wanted) - set(run_names()))
    if unknown:
        raise ValueError(f"--runs: unknown {unknown}; choose from {', '.join(run_names())}")
    if seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {seeds}")
    seed_list = [base.model.seed + k for k in range(seeds)]
    runs = []
    for name in wanted:
        rows = []
        for seed in seed_list:
            log.info("quality bench: run %s, seed %d", name, seed)
            rows.append(_one_run(name, base.with_overrides({"model.seed": seed})))
            log.info("quality bench: %s", rows[-1])  # each row as it ends, for a run cut short
        runs.append(over_seeds(rows, seed_list))
    return {
        "model": base.model.name,
        "quick": quick,
        "devices": base.federated.num_devices,
        "rounds": base.federated.rounds,
        "local_steps": base.train.local_steps,
        "batch_size": base.train.batch_size,
        "seq_len": base.train.seq_len,
        "split": f"{base.model.head_layers} + {base.model.tail_layers}",
        "seeds": seed_list,
        "runs": runs,
    }


def check_modelled(cfg: FedpipeConfig) -> None:
    """Refuse, in one line naming them, the settings this bench's rounds do not model."""
    fed, default = cfg.federated, FederatedConfig()
    given = [
        f"federated.{k}={getattr(fed, k)}"
        for k in _UNMODELLED
        if getattr(fed, k) != getattr(default, k)
    ]
    if given:
        raise ValueError(
            f"fedpipe bench quality does not model {', '.join(given)}: its devices train one "
            "after another and always reply, so no deadline or straggler cut applies; keep the "
            "defaults, or measure with fedpipe simulate"
        )


def _one_run(name: str, cfg: FedpipeConfig) -> dict[str, Any]:
    """The row of run ``name`` trained under ``cfg`` (its seed already set)."""
    if name == "centralized":
        return _centralized(cfg)
    catalogue = {r["name"]: r for r in RUNS + EXTRA_RUNS}
    settings = {k: v for k, v in catalogue[name].items() if k != "name"}
    return {"name": name, **_federated(cfg.with_overrides(settings))}


def over_seeds(rows: list[dict[str, Any]], seeds: list[int]) -> dict[str, Any]:
    """One run's rows, one per seed, as one row: means, plus each seed's loss and the spread.

    The contract's fields keep their meaning (``eval_loss`` is the mean over seeds, ``eval_ppl``
    its exponential, bytes and wall time the means); ``eval_loss_seeds`` lists each seed's
    loss in the order of ``seeds``, and ``eval_loss_std`` (sample std, 0 for one seed),
    ``eval_loss_min`` and ``eval_loss_max`` give the spread.
    """
    losses = [float(r["eval_loss"]) for r in rows]
    mean = sum(losses) / len(losses)
    var = sum((x - mean) ** 2 for x in losses) / max(len(losses) - 1, 1)
    row = dict(rows[0])
    for key, value in rows[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            row[key] = sum(r[key] for r in rows) / len(rows)
            if isinstance(value, int) and all(r[key] == value for r in rows):
                row[key] = value  # a count the seeds agree on stays an int
    return row | {
        "eval_loss": mean,
        "eval_ppl": math.exp(min(mean, 50.0)),
        "seeds": list(seeds),
        "eval_loss_seeds": losses,
        "eval_loss_std": math.sqrt(var),
        "eval_loss_min": min(losses),
        "eval_loss_max": max(losses),
    }


# -- data ---------------------------------------------------------------------------------------
def _documents(cfg: FedpipeConfig) -> tuple[list[Any], list[Any]]:
    fed = cfg.federated
    docs = load_documents(fed.data) if fed.data else default_corpus()
    return train_eval_split(docs, eval_fraction=fed.eval_fraction, seed=cfg.model.seed)


def _device_batches(cfg: FedpipeConfig, tokenizer: Any) -> list[list[dict[str, torch.Tensor]]]:
    """batches[step][device]: what DeviceWork.train draws for each device and step."""
    train_docs, _ = _documents(cfg)
    fed, train = cfg.federated, cfg.train
    parts = partition_docs(
        train_docs,
        fed.num_devices,
        scheme=fed.partition,  # type: ignore[arg-type]  # validated by FederatedConfig
        alpha=fed.dirichlet_alpha,
        seed=cfg.model.seed,
    )
    samplers = [
        BlockSampler(
            tokenize_blocks(part, tokenizer, train.seq_len, max_blocks=fed.device_blocks or None),
            train.batch_size,
            seed=cfg.model.seed * 1000 + i,
        )
        for i, part in enumerate(parts)
    ]
    steps = range(train.local_steps, (fed.rounds + 1) * train.local_steps)  # rounds 1..R
    return [[s.batch(step) for s in samplers] for step in steps]


# -- centralized --------------------------------------------------------------------------------
def _centralized(cfg: FedpipeConfig) -> dict[str, Any]:
    """The unsplit model with LoRA, one optimizer, the devices' batches joined per step."""
    folder = resolve_model(cfg.model.name)
    tokenizer = load_tokenizer(folder)
    model = apply_lora(
        load_causal_lm(folder), lora_settings(cfg), model_family(load_config(folder))
    )
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    batches = _device_batches(cfg, tokenizer)
    start, tokens = time.perf_counter(), 0
    for step, per_device in enumerate(batches):
        ids = torch.cat([b["input_ids"] for b in per_device])  # (devices * B, T)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        tokens += int(ids.shape[0] * (ids.shape[1] - 1))
        log.info("centralized step %d loss %.4f", step, float(loss))
    wall = time.perf_counter() - start
    loss = _held_out_loss(model, cfg, tokenizer)
    return _row("centralized", loss, Traffic(tokens=tokens), wall, len(batches))


@torch.no_grad()
def _held_out_loss(model: torch.nn.Module, cfg: FedpipeConfig, tokenizer: Any) -> float:
    """Mean token loss over the held-out blocks the federated evaluator uses."""
    _, held_out = _documents(cfg)
    limit = cfg.train.eval_batches * cfg.train.batch_size
    blocks = held_out_blocks(held_out, tokenizer, cfg.train.seq_len, limit)
    total, tokens = 0.0, 0
    for batch in torch.split(blocks, cfg.train.batch_size):
        n = int(batch.shape[0] * (batch.shape[1] - 1))
        total += float(model(input_ids=batch, labels=batch).loss) * n
        tokens += n
    return total / tokens


# -- federated ----------------------------------------------------------------------------------
def _federated(cfg: FedpipeConfig) -> dict[str, Any]:
    """Rounds of fedpipe over a real StageServer on loopback; the last round's held-out loss."""
    server = build_stage_server(cfg, port=0).start()
    control = StageControlClient(f"127.0.0.1:{server.port}", "")
    try:
        control.reset_adapter()
        row, _ = federated_rounds(cfg, server.port, control)
        return row
    finally:
        control.close()
        server.stop(grace=None)


def federated_rounds(
    cfg: FedpipeConfig, port: int, control: StageControlClient
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``federated.rounds`` rounds of the ServerApp's own code with this process's devices on
    the StageServer at ``port``: the run's row and the final global device adapters."""
    check_modelled(cfg)
    fed = cfg.federated
    run = RunSettings(stage_address=f"127.0.0.1:{port}", run_id="quality")
    devices = LocalDevices(cfg)
    evaluator = DeviceWork(cfg, device_id="evaluator", partition=-1, num_partitions=fed.num_devices)
    initial = seeded_adapters(cfg, evaluator)
    records: list[dict[str, Any]] = []
    grid = LocalGrid(devices.nodes())
    rounds = FedpipeStrategy(cfg, control, run, grid, initial=dict(initial), log=records.append)
    start = time.perf_counter()
    result = rounds.run(initial, num_rounds=fed.rounds)
    wall = time.perf_counter() - start
    failures = [r for r in records if r["event"] == "failure"]
    if failures:  # the ServerApp goes on without them; a bench row must not
        raise RuntimeError(f"quality bench: devices failed: {failures}")
    final = result.arrays.to_torch_state_dict()
    loss, _ = evaluate_split(evaluator, final, run, fed.rounds)
    steps = fed.rounds * cfg.train.local_steps
    row = _row("", loss, devices.traffic, wall, steps)
    row |= {  # Flower's adapter bytes of a round, all its devices together
        "adapter_codec": fed.adapter_codec,
        "adapter_downlink_codec": fed.adapter_downlink_codec,
        "adapter_bytes_up_per_round": round(devices.traffic.adapters_up / fed.rounds),
        "adapter_bytes_down_per_round": round(devices.traffic.adapters_down / fed.rounds),
    }
    per_round = [_round_row(r, devices.reports[r]) for r in sorted(devices.reports)]
    row |= {"aggregation": fed.aggregation, "strategy": fed.strategy, "per_round": per_round}
    freeze = [r for r in records if r["event"] == "freeze"]
    if freeze:  # pipeline.freeze: after each round, the blocks below this train no more
        row["frozen_below"] = [r["frozen_below"] for r in freeze]
    return row, final


def _round_row(round_: int, reports: list[TrainReport]) -> dict[str, Any]:
    """One round's devices (those the strategy sampled), its stage-link bytes per trained
    token and, with delta coding, its hit rate."""
    tokens = sum(s.tokens for r in reports for s in r.steps)
    row: dict[str, Any] = {
        "round": round_,
        "devices": len(reports),
        "bytes_per_token": sum(r.bytes_up + r.bytes_down for r in reports) / max(tokens, 1),
    }
    if reports and reports[0].delta_resumed is not None:
        hits = sum(r.delta_rows[0] for r in reports)
        rows = sum(sum(r.delta_rows) for r in reports)
        row |= {
            "delta_hit_rate": hits / max(rows, 1),
            "delta_resumed": sum(bool(r.delta_resumed) for r in reports),
        }
    return row


def _row(name: str, loss: float, traffic: Traffic, wall_s: float, steps: int) -> dict[str, Any]:
    row: dict[str, Any] = {"name": name} if name else {}
    return row | {
        "eval_loss": loss,
        "eval_ppl": math.exp(min(loss, 50.0)),
        "bytes_up": traffic.up,
        "bytes_down": traffic.down,
        "bytes_per_token": (traffic.up + traffic.down) / max(traffic.tokens, 1),
        "adapter_bytes_up": traffic.adapters_up,
        "adapter_bytes_down": traffic.adapters_down,
        "trained_tokens": traffic.tokens,
        "wall_s": wall_s,
        "steps": steps,
    }
