"""What a Flower app does locally: read its settings, hold a device's model and data, evaluate.

Run-config keys are fedpipe's dotted settings (``pipeline.microbatches``, see
:mod:`fedpipe.config`) plus run keys (``run.*``).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar, cast

import torch

from fedpipe.auth.tokens import issue_token
from fedpipe.config import FedpipeConfig, parse_cuts
from fedpipe.config.flower_keys import RunSettings, settings_from_run_config
from fedpipe.data import (
    BlockSampler,
    Document,
    ExampleCounts,
    Scheme,
    default_corpus,
    example_rows,
    held_out_blocks,
    held_out_rows,
    load_documents,
    tokenize_blocks,
    train_eval_split,
)
from fedpipe.data import partition as partition_docs
from fedpipe.edge.runtime import DeviceRuntime
from fedpipe.edge.trainer import DeviceTrainer, TrainReport
from fedpipe.emulation import DeviceProfile, parse_device_profile
from fedpipe.fl.eval_generate import questions
from fedpipe.models import load_tokenizer
from fedpipe.privacy import LinkAccountant, releases_so_far
from fedpipe.wire.backend import SessionRequest
from fedpipe.wire.link_client import StageClient

__all__ = [
    "DeviceRows",
    "DeviceWork",
    "RunSettings",
    "device_rows",
    "evaluate_split",
    "run_settings",
]

log = logging.getLogger(__name__)


# Settings read from a run config, by the whole config: a ClientApp reads its run's settings
# on every call, and one process may serve calls of several runs.
_SETTINGS_READ: dict[tuple[tuple[str, Any], ...], tuple[FedpipeConfig, RunSettings]] = {}
_SETTINGS_KEPT = 8


def run_settings(run_config: Mapping[str, Any]) -> tuple[FedpipeConfig, RunSettings]:
    """Flower's run config as fedpipe's settings and run keys (reads no file), built and
    validated once per run config (:func:`fedpipe.config.flower_keys.settings_from_run_config`)."""
    key = tuple(sorted(run_config.items()))
    if key not in _SETTINGS_READ:
        if len(_SETTINGS_READ) >= _SETTINGS_KEPT:
            _SETTINGS_READ.clear()
        _SETTINGS_READ[key] = settings_from_run_config(run_config)
    return _SETTINGS_READ[key]


def server_run_settings(run_config: Mapping[str, Any]) -> tuple[FedpipeConfig, RunSettings]:
    """`run_settings` plus the master secret, read from ``run.secret-file``: ServerApp only."""
    cfg, run = run_settings(run_config)
    if not run.secret_file:
        return cfg, run
    path = Path(run.secret_file)
    try:
        secret = path.read_text().strip()
    except OSError as exc:
        raise FileNotFoundError(
            f"the ServerApp cannot read the secret file {path} ({exc.strerror}): it must be "
            "the StageServer's --secret-file, on the host where the SuperLink runs the ServerApp"
        ) from None
    return cfg, replace(run, secret=secret)


def partition_profile(profiles: tuple[str, ...], partition_id: int) -> str:
    """The entry of ``federated.profiles`` (names and inline specs, ``config.profile_spec``)
    that partition ``partition_id`` takes: they are dealt in turn; none given is loopback."""
    return profiles[partition_id % len(profiles)] if profiles else "loopback"


def _profile(cfg: FedpipeConfig, partition_id: int, name: str | None) -> DeviceProfile | None:
    if partition_id < 0:
        return None  # the evaluator runs beside the server, unthrottled
    return parse_device_profile(name or partition_profile(cfg.federated.profiles, partition_id))


@dataclass(frozen=True)
class DeviceRows:
    """A device's rows: token blocks (``labels`` None: the ids are their labels), or one
    instruction example per row with its own labels and what became of the examples."""

    input_ids: torch.Tensor  # (N, T)
    labels: torch.Tensor | None = None  # (N, T), -100 where a token does not count
    counts: ExampleCounts | None = None
    segments: torch.Tensor | None = None  # (N, T) packed rows' segment ids (data.packing)


def _instruct(docs: Sequence[Document]) -> bool:
    """Instruction data (any chat or prompt/completion pair): one example per row."""
    return any(d.is_example for d in docs)


def device_rows(
    docs: Sequence[Document],
    tokenizer: Any,
    cfg: FedpipeConfig,
    *,
    instruct: bool,
    limit: int | None = None,
    held: int | None = None,
) -> DeviceRows:
    """Plain text as blocks (GPT-2 style), instruction data as rows with masks (data.*).

    ``limit``: keep the first rows only; ``held``: that many rows spread over all (held-out).
    """
    seq_len, data = cfg.train.seq_len, cfg.data
    if not instruct:
        if held is not None:
            return DeviceRows(held_out_blocks(docs, tokenizer, seq_len, held))
        return DeviceRows(tokenize_blocks(docs, tokenizer, seq_len, max_blocks=limit))
    options: dict[str, Any] = {
        "loss_on": data.loss_on,
        "overlong": data.overlong,
        "packing": data.packing,
    }
    if held is not None:
        rows = held_out_rows(docs, tokenizer, seq_len, held, **options)
    else:
        rows = example_rows(docs, tokenizer, seq_len, max_rows=limit, **options)
    return DeviceRows(rows.input_ids, rows.labels, rows.counts, rows.segments)


class DeviceWork:
    """One device's trainer and data (its partition, or the held-out set for the evaluator)."""

    _cache: ClassVar[dict[tuple[Any, ...], DeviceWork]] = {}

    def __init__(
        self,
        cfg: FedpipeConfig,
        *,
        device_id: str,
        partition: int,
        num_partitions: int,
        profile: str | None = None,
        data: str | None = None,
        stage_ca: str = "",
        stage_cert: str = "",
        stage_key: str = "",
        cut: str = "",
        delta_dir: str = "",
        privacy: str = "",
        weights: str = "",
    ) -> None:
        # The device's cut: its own (`fedpipe client --cut`), else federated.device_cuts
        # cycled over partitions, else the model's; the server must offer it (model.cuts).
        chosen = parse_cuts(cut, "--cut") or (cfg.device_cut(partition),)
        self.cut = chosen[0]
        cfg = cfg.with_cut(self.cut)
        # The device's own defences (`fedpipe client --privacy`), else privacy.devices cycled
        # over partitions, else the run's [privacy].
        cfg = cfg.for_device_privacy(privacy or cfg.device_privacy(partition))
        # How it stores its frozen weights: its own (`fedpipe client --weights`), else
        # device.weights cycled over partitions (the evaluator, partition -1: fp32).
        cfg = cfg.with_device_weights(weights or cfg.device_weights(partition))
        self.cfg, self.partition = cfg, partition
        # The device's own files (node config / `fedpipe client` flags), never the server's:
        # the StageServer's CA, and its client certificate and key for mutual TLS.
        self.stage_ca, self.stage_cert, self.stage_key = stage_ca, stage_cert, stage_key
        self.profile = _profile(cfg, partition, profile)
        self.questions: list[Document] = []  # the evaluator's, with federated.eval_generate
        self.trainer = DeviceTrainer(cfg, device_id=device_id, profile=self.profile)
        if delta_dir:  # the delta cache and the planner's cut outlive this process (a round)
            name = re.sub(r"[^A-Za-z0-9_.-]", "_", device_id)
            self.trainer.delta_path = Path(delta_dir) / f"{name}.delta.safetensors"
            self.trainer.cut_path = Path(delta_dir) / f"{name}.cut.json"
            self.trainer.recall_cut()
        self._load_data(cfg, load_tokenizer(self.trainer.folder), num_partitions, data)
        log.info(
            "[device %s] partition %d: %d rows%s",
            device_id,
            partition,
            len(self.blocks),
            f" ({self.counts})" if self.counts else "",
        )

    def _load_data(
        self, cfg: FedpipeConfig, tokenizer: Any, num_partitions: int, data: str | None
    ) -> None:
        """The device's rows: its own data, its partition of the run's, or the held-out set."""
        fed = cfg.federated
        if data:  # a deployed device's own data: all of it is its partition
            docs = load_documents(data)
            self._set_rows(device_rows(docs, tokenizer, cfg, instruct=_instruct(docs)))
            return
        docs = load_documents(fed.data) if fed.data else default_corpus()
        instruct = _instruct(docs)  # decided on all the data: every device and the evaluator agree
        train_docs, held_out = train_eval_split(
            docs, eval_fraction=fed.eval_fraction, seed=cfg.model.seed
        )
        if self.partition < 0:
            held = cfg.train.eval_batches * cfg.train.batch_size
            self._set_rows(device_rows(held_out, tokenizer, cfg, instruct=instruct, held=held))
            # federated.eval_generate: the held-out examples each round's model answers
            self.questions = questions(held_out, tokenizer, fed.eval_generate)
            return
        parts = partition_docs(
            train_docs,
            num_partitions,
            scheme=cast(Scheme, fed.partition),  # validated by FederatedConfig
            alpha=fed.dirichlet_alpha,
            seed=cfg.model.seed,
        )
        limit = fed.device_blocks or None  # the first device_blocks rows: data a device revisits
        rows = device_rows(parts[self.partition], tokenizer, cfg, instruct=instruct, limit=limit)
        self._set_rows(rows)

    def _set_rows(self, rows: DeviceRows) -> None:
        self.blocks, self.labels, self.counts = rows.input_ids, rows.labels, rows.counts
        self.segments = rows.segments

    def batches(self, size: int) -> Iterator[dict[str, torch.Tensor]]:
        """The device's rows in order, ``size`` at a time, with their labels (evaluation) and,
        packed, their segments."""
        labels = self.labels if self.labels is not None else self.blocks
        for start in range(0, int(self.blocks.shape[0]), size):
            rows = slice(start, start + size)
            batch = {"input_ids": self.blocks[rows], "labels": labels[rows]}
            if self.segments is not None:
                batch["segments"] = self.segments[rows]
            yield batch

    @classmethod
    def cached(cls, cfg: FedpipeConfig, **kw: Any) -> DeviceWork:
        """Reuse a device's model and data across rounds in one process (simulation)."""
        key = (repr(cfg), *sorted(kw.items()))
        if key not in cls._cache:
            cls._cache[key] = cls(cfg, **kw)
        return cls._cache[key]

    def train(
        self,
        address: str,
        *,
        round_: int,
        token: str,
        proximal_mu: float = 0.0,
        trace_dir: Path | None = None,
        frozen_below: int = 0,
    ) -> TrainReport:
        """One round of local steps; batches depend only on (seed, partition, round, step).

        ``frozen_below``: the round's frozen blocks (pipeline.freeze, from the round's config).
        """
        self.trainer.freeze_below(frozen_below)
        steps = self.cfg.train.local_steps
        sampler = BlockSampler(
            self.blocks,
            self.cfg.train.batch_size,
            seed=self.cfg.model.seed * 1000 + self.partition,
            labels=self.labels,
            segments=self.segments,
        )
        batches = [sampler.batch(round_ * steps + i) for i in range(steps)]
        self.trainer.tracer.clear()
        with self._client(address) as client:
            report = self.trainer.train_round(
                client,
                batches,
                round_=round_,
                token=token,
                proximal_mu=proximal_mu,
            )
        report.privacy.update(self._privacy(sampler, (round_ + 1) * steps))
        report.data = self.counts.metrics() if self.counts is not None else {}
        if trace_dir is not None and trace_dir.parent.is_dir():  # only where the run folder is
            path = trace_dir / f"device-{self.partition}-round-{round_}.json"
            self.trainer.tracer.write(path, pid=f"device {self.partition}")
        return report

    def _privacy(self, sampler: BlockSampler, steps: int) -> dict[str, float]:
        """The stage link's (epsilon, delta) so far, assuming this device trained every round."""
        cfg = self.cfg
        privacy = cfg.privacy
        if cfg.model.split != "u":  # labels go up in clear: no gradient channel to noise
            privacy = replace(privacy, gradient_clip=0.0, gradient_noise=0.0)
        accountant = LinkAccountant.from_config(privacy, seq_len=cfg.train.seq_len)
        if accountant is None:
            return {}
        releases = releases_so_far([sampler.indices(i) for i in range(steps)])
        out = accountant.report(releases)
        log.info("[device %s] stage link privacy so far: %s", self.partition, out)
        return out

    def _client(self, address: str) -> StageClient:
        """A stage-link client with this device's TLS files (its CA; cert and key for mTLS)."""
        if bool(self.stage_cert) != bool(self.stage_key):
            raise ValueError("stage-cert and stage-key go together: give both or neither")
        server_ca = self.cfg.server.tls_ca  # a path on the server host: only for simulations
        if not self.stage_ca and server_ca and not Path(server_ca).is_file():
            raise FileNotFoundError(
                f"the StageServer uses TLS (its CA is {server_ca} on the server host), but this "
                "device has no CA of its own: pass `fedpipe client --stage-ca ca.pem`"
            )
        chain = Path(self.stage_cert).read_bytes() if self.stage_cert else None
        key = Path(self.stage_key).read_bytes() if self.stage_key else None
        return StageClient(
            address,
            root_certificates=self.cfg.server.root_certificates(self.stage_ca),
            certificate_chain=chain,
            private_key=key,
        )


def evaluate_split(
    work: DeviceWork,
    adapters: dict[str, torch.Tensor],
    run: RunSettings,
    round_: int,
) -> tuple[float, int]:
    """Held-out mean token loss through the split model (device adapters + server's global);
    on instruction data, over the tokens that count (the answers, with data.loss_on = answers)."""
    trainer, cfg = work.trainer, work.cfg
    trainer.load_adapters(adapters)
    token = (
        issue_token(
            run.secret,
            run_id=run.run_id,
            round=round_,
            device_id="evaluator",
            ttl_s=run.round_timeout_s,
        )
        if run.secret
        else ""
    )
    loss_sum, tokens = 0.0, 0
    chain, key = cfg.server.client_identity()
    roots = cfg.server.root_certificates()
    with StageClient(
        run.stage_address, root_certificates=roots, certificate_chain=chain, private_key=key
    ) as client:
        session = client.open(
            SessionRequest(device_id="evaluator", token=token, round=round_, split=trainer.split),
            timeout_s=cfg.pipeline.timeout_s,
        )
        with session:
            runtime = DeviceRuntime(
                trainer.head,
                trainer.tail,
                session,
                optimizer=None,
                microbatches=cfg.pipeline.microbatches,
                dtype=cfg.device.dtype,
            )
            for batch in work.batches(cfg.train.batch_size):  # instruction rows: answer loss
                part_sum, part_tokens = runtime.evaluate(batch, step=0)
                loss_sum, tokens = loss_sum + part_sum, tokens + part_tokens
    return (loss_sum / tokens if tokens else math.nan), tokens
