"""Server-side adapter bank: one LoRA adapter per device on one shared, frozen server stage.

The bank keeps a "global" adapter (the round's aggregate, frozen) and per-device adapters
initialised from it. Only one adapter is active at a time: the server serialises compute,
activating the device's adapter before running its microbatch. Switching does not touch
requires_grad, so an autograd graph built under one adapter still trains that adapter after another
has been activated.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from torch import Tensor, nn

from fedpipe.lora.aggregation import (
    BaseFold,
    aggregate_held,
    apply_updates,
    check_aggregation,
    held_blocks,
    split_deltas,
)
from fedpipe.lora.base import (
    Family,
    Group,
    LoraSettings,
    apply_lora,
    load_lora_state_dict,
    lora_layers,
    lora_parameters,
    lora_state_dict,
    set_active_adapter,
)
from fedpipe.lora.robust import AggregationRule

__all__ = ["GLOBAL_ADAPTER", "AdapterBank", "SharedAggregation"]

GLOBAL_ADAPTER = "global"


class SharedAggregation:
    """What every adapter bank does alike: the global state with its folded base deltas, and
    merging finished adapters by ``federated.aggregation``.

    A bank provides where its adapters live (``_global_adapter``, ``_load_global``,
    ``state_dict``, ``remove``, ``_check``) and sets ``settings``, ``fold``, ``aggregation``
    and ``_initial``.
    """

    settings: LoraSettings
    fold: BaseFold
    aggregation: str
    rule: AggregationRule = AggregationRule()  # the plain weighted mean
    _initial: dict[str, Tensor]

    def _global_adapter(self) -> dict[str, Tensor]:
        raise NotImplementedError

    def _load_global(self, sd: dict[str, Tensor]) -> None:
        raise NotImplementedError

    def state_dict(self, name: str) -> dict[str, Tensor]:
        raise NotImplementedError

    def remove(self, name: str) -> None:
        raise NotImplementedError

    def _check(self, name: str, *, allow_global: bool) -> None:
        raise NotImplementedError

    def set_aggregation(self, mode: str, rule: AggregationRule | None = None) -> None:
        """How merge() aggregates from now on (see :mod:`fedpipe.lora.aggregation`), and by
        which rule (:mod:`fedpipe.lora.robust`; None: the weighted mean)."""
        rule = rule or AggregationRule()
        mode = check_aggregation(mode)
        self.fold.check_foldable(mode)
        if not rule.plain and mode not in ("separate", "ffa"):
            raise ValueError(
                f"aggregation rule {rule.name!r} applies to separate and ffa aggregation, not "
                f"{mode!r}"
            )
        self.aggregation, self.rule = mode, rule

    def global_state(self) -> dict[str, Tensor]:
        """The global adapter, plus the base deltas folded so far (``<layer>.base_delta``)."""
        return {**self._global_adapter(), **self.fold.state()}

    def set_global_state(self, sd: dict[str, Tensor]) -> None:
        """Load a global state; base deltas absent from ``sd`` mean the original base."""
        adapter, deltas = split_deltas(sd)
        self._load_global(adapter)
        self.fold.set(deltas)

    def reset_global_state(self) -> None:
        """Back to the adapter the bank started with (deterministic from the LoRA seed), and
        the original base weights."""
        self.set_global_state(self._initial)

    def merge(
        self,
        weights: dict[str, float],
        *,
        blocks: dict[str, tuple[int, ...] | None] | None = None,
    ) -> dict[str, Tensor]:
        """Global <- the named adapters aggregated by ``self.aggregation``; remove them.

        ``blocks`` names the blocks each adapter's session ran (absent or None: all). Each
        block's adapter becomes the aggregate over the sessions that ran it, their weights
        renormalised; a block no session ran keeps its global value. ``exact`` and ``stack``
        also fold a change into the base weights (no link bytes).
        """
        if not weights:
            raise ValueError("merge needs at least one adapter name with a weight")
        for name in weights:
            self._check(name, allow_global=False)
        names = list(weights)
        ran = blocks or {}
        merged, deltas = aggregate_held(
            [held_blocks(self.state_dict(n), ran.get(n)) for n in names],
            [weights[n] for n in names],
            self.aggregation,
            scale=self.settings.alpha / self.settings.r,
            initial=self._initial,
            rule=self.rule,
            global_state=self._global_adapter() if self.rule.norm_bound > 0 else None,
        )
        self._load_global({**self._global_adapter(), **merged})
        if deltas:
            self.fold.add(deltas)
        for name in names:
            self.remove(name)
        return merged

    def apply_updates(
        self,
        starts: dict[str, dict[str, Tensor]],
        weights: dict[str, float],
        *,
        server_lr: float = 1.0,
        blocks: dict[str, tuple[int, ...] | None] | None = None,
    ) -> dict[str, Tensor]:
        """Global <- global + ``server_lr`` x the weighted mean of the named adapters' updates,
        each against the global it started from (``starts[name]``); remove them.

        Buffered asynchronous rounds (:func:`~fedpipe.lora.aggregation.apply_updates`):
        sessions that started from older globals are merged as their change, not as their
        value. ``blocks`` as for :meth:`merge`. Only ``separate`` aggregation folds nothing
        into the base, and only it is offered here.
        """
        if not weights:
            raise ValueError("apply_updates needs at least one adapter name with a weight")
        if self.aggregation != "separate" or not self.rule.plain:
            raise ValueError(
                f"buffered updates merge by the weighted mean of separate aggregation, not "
                f"{self.aggregation!r} with rule {self.rule.name!r}"
            )
        for name in weights:
            self._check(name, allow_global=False)
        names, ran = list(weights), blocks or {}
        states = [held_blocks(self.state_dict(n), ran.get(n)) for n in names]
        moved = apply_updates(
            self._global_adapter(),
            [starts[n] for n in names],
            states,
            [weights[n] for n in names],
            server_lr=server_lr,
        )
        self._load_global({**self._global_adapter(), **moved})
        for name in names:
            self.remove(name)
        return moved


class AdapterBank(SharedAggregation):
    """Named LoRA adapters over a MiddleStage or ServerLossStage (modified in place)."""

    def __init__(
        self,
        stage: nn.Module,
        settings: LoraSettings | None = None,
        *,
        family: Family | None = None,
    ) -> None:
        self.settings = settings or LoraSettings()
        self.family: Family = family or getattr(stage, "family")  # noqa: B009
        self.stage = apply_lora(stage, self.settings, self.family, adapter=GLOBAL_ADAPTER)
        if not lora_layers(self.stage):
            raise ValueError("the stage has no LoRA target layers; an adapter bank needs blocks")
        self._names: list[str] = []
        self._active = GLOBAL_ADAPTER
        self._set_trainable(GLOBAL_ADAPTER, False)  # the aggregate only changes by merge()
        self._initial = self._global_adapter()
        self.fold = BaseFold(self.stage)  # the frozen base as `exact` and `stack` change it
        self.aggregation = "separate"  # federated.aggregation, set per run by BeginRound

    @property
    def active(self) -> str:
        return self._active

    def names(self) -> list[str]:
        """Per-device adapter names (the global adapter excluded), in the order added."""
        return list(self._names)

    def add(self, name: str, init: dict[str, Tensor] | None = None) -> None:
        """Add adapter ``name``, initialised from ``init`` or else the global adapter."""
        if name == GLOBAL_ADAPTER or name in self._names:
            raise ValueError(
                f"adapter {name!r} already exists; remove it first or pick another name"
            )
        state = init if init is not None else self._global_adapter()
        apply_lora(self.stage, self.settings, self.family, adapter=name)
        self._names.append(name)
        try:
            load_lora_state_dict(self.stage, state, adapter=name)
        except (KeyError, ValueError):
            self.remove(name)
            raise
        self._set_trainable(name, True)
        if self.aggregation == "ffa":  # FFA-LoRA: A stays at the shared init, only B trains
            for param in self.parameters(name)[0::2]:
                param.requires_grad_(False)
        set_active_adapter(self.stage, self._active)

    def activate(self, name: str) -> None:
        """Make the stage's forward use adapter ``name`` (or GLOBAL_ADAPTER)."""
        self._check(name, allow_global=True)
        if name != self._active:
            set_active_adapter(self.stage, name)
            self._active = name

    def parameters(self, name: str) -> list[nn.Parameter]:
        """The trainable tensors of adapter ``name`` (for that device's optimizer)."""
        self._check(name, allow_global=True)
        out: list[nn.Parameter] = []
        for layer in lora_layers(self.stage).values():
            a, b = layer.lora_A[name].weight, layer.lora_B[name].weight
            out += [cast(nn.Parameter, a), cast(nn.Parameter, b)]
        return out

    def named_parameters(self, name: str) -> dict[str, nn.Parameter]:
        """Adapter ``name``'s Parameters themselves under global keys (state-dict order)."""
        self._check(name, allow_global=True)
        return lora_parameters(self.stage, name)

    def state_dict(self, name: str) -> dict[str, Tensor]:
        self._check(name, allow_global=True)
        return lora_state_dict(self.stage, name)

    def remove(self, name: str) -> None:
        """Drop adapter ``name``; if it was active, the global adapter becomes active."""
        self._check(name, allow_global=False)
        if self._active == name:
            self.activate(GLOBAL_ADAPTER)
        for layer in lora_layers(self.stage).values():
            layer.delete_adapter(name)
        self._names.remove(name)
        set_active_adapter(self.stage, self._active)

    def _global_adapter(self) -> dict[str, Tensor]:
        return lora_state_dict(self.stage, GLOBAL_ADAPTER)

    def _load_global(self, sd: dict[str, Tensor]) -> None:
        load_lora_state_dict(self.stage, sd, adapter=GLOBAL_ADAPTER)

    def run(self, groups: Sequence[Group]) -> list[Tensor]:
        """Each group through the stage with its own adapter, one group at a time.

        The unbatched path (GPT-2, LoRA dropout): the same contract as
        :meth:`~fedpipe.lora.batched_bank.BatchedAdapterBank.run`, paying a switch per group.
        """
        outs = []
        for group in groups:
            self.activate(group.adapter)
            outs.append(self.stage(group.hidden, group.blocks, group.segments))
        return outs

    def run_loss(self, groups: Sequence[Group]) -> list[tuple[Tensor, int]]:
        """Each group's (summed shifted token loss, tokens counted), one group at a time."""
        outs = []
        for group in groups:
            self.activate(group.adapter)
            _check_suffix(group, getattr(self.stage, "block_indices", ()))
            outs.append(self.stage(group.hidden, group.labels, group.blocks, group.segments))
        return outs

    def _set_trainable(self, name: str, flag: bool) -> None:
        for param in self.parameters(name):
            param.requires_grad_(flag)

    def _check(self, name: str, *, allow_global: bool) -> None:
        if name in self._names or (allow_global and name == GLOBAL_ADAPTER):
            return
        raise KeyError(f"no adapter {name!r}; the bank holds {[GLOBAL_ADAPTER, *self._names]}")


def _check_suffix(group: Group, held: Sequence[int]) -> None:
    """The loss follows the stage's last block, so a loss group's blocks must end there."""
    if group.blocks and held and group.blocks[-1] != held[-1]:
        raise ValueError(
            f"group of adapter {group.adapter!r} stops at block {group.blocks[-1]}, but the "
            f"loss follows the stage's last block {held[-1]}"
        )
