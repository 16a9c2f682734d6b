"""``FedpipeConfig``: every section of a run, the checks across sections, a simulated
device's own view (cut, weights, defences), and the flat ``section.key`` form."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields, replace
from typing import Any, get_type_hints

from fedpipe.config.checks import check
from fedpipe.config.convert import coerce_field, unknown_setting
from fedpipe.config.cuts import format_cut, format_cuts
from fedpipe.config.data import DataConfig
from fedpipe.config.device import DeviceConfig, parse_device_weights
from fedpipe.config.federated import FederatedConfig
from fedpipe.config.lists import list_text
from fedpipe.config.model import ModelConfig
from fedpipe.config.pipeline import PipelineConfig
from fedpipe.config.privacy import PrivacyConfig
from fedpipe.config.server import ServerConfig
from fedpipe.config.train import TrainConfig

__all__ = ["FedpipeConfig"]


@dataclass(frozen=True)
class FedpipeConfig:
    """All settings of a run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    federated: FederatedConfig = field(default_factory=FederatedConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)  # defences, all off by default
    device: DeviceConfig = field(default_factory=DeviceConfig)  # what a device stores

    def __post_init__(self) -> None:
        check(
            self.pipeline.microbatches <= self.train.batch_size,
            f"pipeline.microbatches ({self.pipeline.microbatches}) must not exceed "
            f"train.batch_size ({self.train.batch_size})",
        )
        if self.model.split == "two":
            check(self.model.tail_layers == 0, "model.split='two' needs model.tail_layers=0")
        self._check_cuts()
        check(
            self.pipeline.freeze == "off" or self.federated.aggregation != "stack",
            "pipeline.freeze = progressive reads how far each block's global adapter moved in "
            "a round, but federated.aggregation = stack restarts the adapters every round "
            "(nothing to read); use separate, exact or ffa, or set pipeline.freeze = off",
        )
        for bad, what in (
            (self.pipeline.freeze != "off", f"pipeline.freeze = {self.pipeline.freeze}"),
            (self.privacy.adapter_dp != "off", f"privacy.adapter_dp = {self.privacy.adapter_dp}"),
        ):
            check(
                self.federated.mode != "async" or not bad,
                f"federated.mode = async cannot hold {what}: it decides per round what every "
                "device trains or adds; set it off or use mode = sync",
            )
        for entry in ({}, *self.privacy.device_specs):
            self._check_device_privacy(self.privacy.for_device(entry))
        stored = [w for w in self.device.weights if w != "fp32"] or [""]
        check(
            not stored[0] or self.federated.aggregation not in ("exact", "stack"),
            f"device.weights = {stored[0]} stores the device's frozen weights rounded, but "
            f"federated.aggregation = {self.federated.aggregation} folds each round's base "
            "deltas into them, which a rounded weight cannot hold; use aggregation separate or "
            "ffa, or device.weights = fp32",
        )
        check(
            self.server.weights == "fp32" or self.federated.aggregation not in ("exact", "stack"),
            f"server.weights = {self.server.weights} stores the server's frozen block weights "
            f"rounded, but federated.aggregation = {self.federated.aggregation} folds each "
            "round's base deltas into them, which a rounded weight cannot hold; use aggregation "
            "separate or ffa, or server.weights = fp32",
        )

    def _check_device_privacy(self, privacy: PrivacyConfig) -> None:
        """The device-side defences a device runs (the run's, or its own) fit its pipeline."""
        clipped = privacy.mechanism == "clip" and privacy.activation_clip > 0
        check(
            not (self.pipeline.recompute_head and clipped),
            "pipeline.recompute_head = true cannot be combined with privacy.activation_clip > 0: "
            "the recomputed head would not see the clipping and noise that were sent; "
            "turn one of them off",
        )
        check(
            not (self.pipeline.recompute_head and privacy.decorrelation > 0),
            "pipeline.recompute_head = true cannot be combined with privacy.decorrelation > 0: "
            "the penalty needs the head's forward graph, which recompute drops; "
            "turn one of them off",
        )
        check(
            not (self.data.packing and privacy.label_resample > 0),
            "data.packing = true cannot be combined with privacy.label_resample > 0: the "
            "resampled tail step runs the tail without the packed rows' boundaries; turn one "
            "of them off",
        )
        check(
            self.model.split == "u" or privacy.label_resample == 0,
            "privacy.label_resample > 0 resamples the labels of the gradient a device's tail "
            f"sends up, but model.split = {self.model.split!r} sends the labels themselves to "
            "the server: use model.split = u or set label_resample = 0",
        )
        check(
            self.pipeline.device_trains or privacy.decorrelation == 0,
            "privacy.decorrelation > 0 trains the device's head, but pipeline.device_trains = "
            "false freezes it: turn one of them off",
        )
        check(
            self.device.dtype == "fp32" or privacy.label_resample == 0,
            f"device.dtype = {self.device.dtype} runs the tail's forward under autocast, but "
            "privacy.label_resample > 0 runs the tail's forward and backward in one call, which "
            "fedpipe does not autocast: set device.dtype = fp32 or label_resample = 0",
        )

    def for_device_privacy(self, spec: str | dict[str, Any]) -> FedpipeConfig:
        """A copy whose ``privacy`` has a device's own overrides (checked against the pipeline)."""
        privacy = self.privacy.for_device(spec)
        return self if privacy == self.privacy else replace(self, privacy=privacy)

    def device_privacy(self, partition: int) -> dict[str, Any]:
        """Simulated device ``partition``'s overrides: ``privacy.devices`` cycled ({} = none)."""
        entries = self.privacy.device_specs
        if partition < 0 or not entries:
            return {}
        return entries[partition % len(entries)]

    def _check_cuts(self) -> None:
        """Mode "two" varies only the head; every simulated device's cut must be offered."""
        offered = self.model.offered_cuts
        if self.model.split == "two":
            tails = [format_cut(c) for c in offered if c[1] != 0]
            check(
                not tails,
                f"model.cuts {tails} keep tail blocks, but model.split='two' runs everything "
                "after the head on the server: write each cut as head+0",
            )
        check(
            len(offered) == 1 or self.privacy.adapter_dp == "off",
            f"model.cuts {format_cuts(self.model.cuts)!r} lets devices hold different blocks, "
            "which "
            f"privacy.adapter_dp = {self.privacy.adapter_dp!r} does not account for (a device's "
            "update would reach the blocks others lack); offer one cut or set adapter_dp = off",
        )
        missing = [format_cut(c) for c in self.federated.device_cuts if c not in offered]
        check(
            not missing,
            f"federated.device_cuts names {missing}, which the server does not offer "
            f"({', '.join(format_cut(c) for c in offered)}): add them to model.cuts",
        )

    def device_weights(self, partition: int) -> str:
        """The storage simulated device ``partition`` uses: ``device.weights`` cycled (the
        evaluator beside the server, partition -1, keeps fp32)."""
        entries = self.device.weights
        return "fp32" if partition < 0 else entries[partition % len(entries)]

    def with_device_weights(self, weights: str) -> FedpipeConfig:
        """A copy whose devices store their frozen weights as ``weights`` (one entry)."""
        entries = parse_device_weights(weights, "--weights")
        if entries == self.device.weights:
            return self
        return replace(self, device=replace(self.device, weights=entries))

    def device_cut(self, partition: int) -> tuple[int, int]:
        """The cut simulated device ``partition`` uses: ``federated.device_cuts`` cycled."""
        cuts = self.federated.device_cuts
        if partition < 0 or not cuts:
            return (self.model.head_layers, self.model.tail_layers)
        return cuts[partition % len(cuts)]

    def with_cut(self, cut: tuple[int, int]) -> FedpipeConfig:
        """A copy whose device side is built with ``cut`` (the server's offer is unchanged)."""
        if cut == (self.model.head_layers, self.model.tail_layers):
            return self
        offered = self.model.offered_cuts
        model = replace(self.model, head_layers=cut[0], tail_layers=cut[1], cuts=offered)
        return replace(self, model=model)

    def to_flat(self) -> dict[str, Any]:
        """``{"section.key": value}`` for every setting (Flower run config, summaries): scalars
        only, a list setting as the string it is written as (:func:`list_text`), which
        :meth:`with_overrides` reads back to the same entries."""
        out = {}
        for section in fields(self):
            for f in fields(getattr(self, section.name)):
                key, value = (
                    f"{section.name}.{f.name}",
                    getattr(getattr(self, section.name), f.name),
                )
                out[key] = list_text(key, value) if isinstance(value, tuple) else value
        return out

    def with_overrides(self, flat: dict[str, Any]) -> FedpipeConfig:
        """A copy with ``{"section.key": value}`` applied (strings are converted to the type)."""
        sections = {s.name: dataclasses.asdict(getattr(self, s.name)) for s in fields(self)}
        for key, value in flat.items():
            section, _, name = key.partition(".")
            if section not in sections or name not in sections[section]:
                raise ValueError(unknown_setting(key, list(self.to_flat())))
            sections[section][name] = coerce_field(type(self), section, name, value)
        types = get_type_hints(type(self))
        return replace(self, **{k: types[k](**v) for k, v in sections.items()})
