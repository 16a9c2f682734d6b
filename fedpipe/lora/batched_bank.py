"""Many sessions' LoRA adapters on one frozen stage, computed in one batched call.

The peft :class:`~fedpipe.lora.peft_bank.AdapterBank` activates one adapter at a time, and
switching walks every adapter (1.7 ms with 2 sessions, 42 ms with 64). Here each session's
adapter is a plain set of leaf Parameters (``A``: (r, in), ``B``: (out, r) per target linear)
that the stage's forward indexes by name: adding or removing a session touches only its own
tensors, and a call costs what its rows cost, whatever the number of sessions.

A batched call takes a list of :class:`Group` (one session's microbatch each). Every frozen
linear of the blocks runs as ONE matmul over the tokens of all groups (flattened to
(rows*T, C) and concatenated, so groups of different sizes and sequence lengths need no
padding); everything else (norms, rotary, attention, activations, residuals and each group's
low-rank term) runs per group. The forward builds no autograd graph: each group gets its own
tape (:mod:`fedpipe.lora.batched_blocks`), and :meth:`BatchedAdapterBank.backward` walks the
tapes of any set of groups, from any forward calls, in one batched backward (one ``dy @ W`` per
frozen linear over all their rows). :meth:`run` wraps each group's output in an autograd node
over its tape, so ``y.backward(g)`` works as through the HF layers. A lone backward of one
session costs its own rows only, needs no other session's gradient, and its tape is freed when
the session drops it.

State dicts, initialisation and merging are those of :mod:`fedpipe.lora.base`
(``layers.N.self_attn.q_proj.lora_A.weight``, A from (seed, global name), B zero), so a bank of
either kind saves, loads and aggregates the same adapters.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from fedpipe.lora.aggregation import BaseFold
from fedpipe.lora.base import Family, Group, LoraSettings, global_name, initial_lora_a
from fedpipe.lora.batched_backward import TapedBlocks, WeightGrads, backward_blocks
from fedpipe.lora.batched_blocks import (
    ACTIVATIONS,
    AdapterTensors,
    BlockRunner,
    Tape,
    activation_name,
)
from fedpipe.lora.peft_bank import GLOBAL_ADAPTER, AdapterBank, SharedAggregation
from fedpipe.models.families import FAMILIES, FamilySpec

log = logging.getLogger(__name__)

__all__ = ["BatchedAdapterBank", "adapter_bank", "batchable", "batched_families"]

# Dropout inside the blocks (active while a stage trains): the batched forward has none.
_BLOCK_DROPOUTS = ("attention_dropout", "resid_pdrop")

# linear -> (A, B): see batched_blocks.AdapterTensors


def batched_families() -> tuple[str, ...]:
    """The model_types whose blocks the batched bank computes, in table order."""
    return tuple(t for t, s in FAMILIES.items() if s.batched)


def batchable(stage: nn.Module, settings: LoraSettings, family: Family) -> str:
    """Why ``stage`` cannot be served by a :class:`BatchedAdapterBank` ("" when it can)."""
    exact = ", ".join(batched_families())
    if family != "llama":
        return f"the {family} family has no batched forward (Llama-layout blocks only: {exact})"
    config = getattr(stage, "config", None)
    model_type = getattr(config, "model_type", None)
    spec = FAMILIES.get(model_type or "")
    if spec is None or not spec.batched:
        return f"model_type {model_type!r} has no batched forward (batched blocks: {exact})"
    if not getattr(stage, "block_indices", ()):
        return "the stage has no blocks"
    act = activation_name(config, spec.block)
    if act not in ACTIVATIONS:
        return f"MLP activation {act!r} (the batched backward has {', '.join(ACTIVATIONS)})"
    if settings.dropout:
        return f"LoRA dropout {settings.dropout} (the batched forward has none)"
    dropouts = [n for n in _BLOCK_DROPOUTS if getattr(config, n, 0)]
    if dropouts and stage.training:
        return f"{', '.join(dropouts)} in a training stage (the batched forward has no dropout)"
    unknown = set(_targets(settings, spec)) - set(spec.block.linears)
    if unknown:
        return f"LoRA targets {sorted(unknown)} are outside the blocks' linears"
    return ""


def adapter_bank(
    stage: nn.Module,
    settings: LoraSettings,
    *,
    family: Family,
    batched: bool = True,
) -> AdapterBank | BatchedAdapterBank:
    """The bank to serve ``stage`` with: batched where the stage allows, else peft's (logged)."""
    reason = batchable(stage, settings, family) if batched else "batching is off"
    if not reason:
        return BatchedAdapterBank(stage, settings, family=family)
    log.info("server adapters: one at a time (%s)", reason)
    return AdapterBank(stage, settings, family=family)


def _targets(settings: LoraSettings, spec: FamilySpec) -> tuple[str, ...]:
    """The linears LoRA adapts: as configured, else the family's default (peft's, the same)."""
    return settings.targets if settings.targets is not None else spec.lora_targets


class BatchedAdapterBank(SharedAggregation):
    """Named LoRA adapters over a MiddleStage or ServerLossStage, any of them in one call.

    The public API is :class:`~fedpipe.lora.peft_bank.AdapterBank`'s (``add``, ``remove``,
    ``parameters``, ``state_dict``, ``global_state``, ``merge``, ...) plus :meth:`run` and
    :meth:`run_loss`, which compute groups of several adapters at once.
    """

    def __init__(
        self,
        stage: nn.Module,
        settings: LoraSettings | None = None,
        *,
        family: Family | None = None,
    ) -> None:
        self.settings = settings or LoraSettings()
        self.family: Family = family or getattr(stage, "family")  # noqa: B009
        reason = batchable(stage, self.settings, self.family)
        if reason:
            raise ValueError(f"this stage cannot be batched: {reason}; use AdapterBank")
        self.stage = stage.requires_grad_(False)
        self.scale = self.settings.alpha / self.settings.r
        spec = FAMILIES[getattr(stage, "config").model_type]  # noqa: B009
        self._linears = _target_linears(stage, _targets(self.settings, spec))
        self._adapters: dict[str, AdapterTensors] = {GLOBAL_ADAPTER: self._fresh()}
        self._runner = BlockRunner(stage, self._tensors, self.scale)
        self._initial = self._global_adapter()
        self.fold = BaseFold.of_linears(self._linears)  # the base as `exact` / `stack` change it
        self.aggregation = "separate"  # federated.aggregation, set per run by BeginRound

    # -- the AdapterBank API ------------------------------------------------------------------
    def names(self) -> list[str]:
        """Per-device adapter names (the global adapter excluded), in the order added."""
        return [n for n in self._adapters if n != GLOBAL_ADAPTER]

    def add(self, name: str, init: dict[str, Tensor] | None = None) -> None:
        """Add adapter ``name``, initialised from ``init`` or else the global adapter."""
        if name in self._adapters:
            raise ValueError(
                f"adapter {name!r} already exists; remove it first or pick another name"
            )
        state = init if init is not None else self._global_adapter()
        tensors = self._fresh(trainable=True)
        _load(tensors, state)  # raises before the adapter is visible
        if self.aggregation == "ffa":  # FFA-LoRA: A stays at the shared init, only B trains
            for a, _ in tensors.values():
                a.requires_grad_(False)
        self._adapters[name] = tensors

    def remove(self, name: str) -> None:
        """Drop adapter ``name`` (its tensors go with it)."""
        self._check(name, allow_global=False)
        del self._adapters[name]

    def parameters(self, name: str) -> list[nn.Parameter]:
        """The trainable tensors of adapter ``name`` (for that device's optimizer)."""
        self._check(name, allow_global=True)
        return [p for a, b in self._adapters[name].values() for p in (a, b)]

    def named_parameters(self, name: str) -> dict[str, nn.Parameter]:
        """Adapter ``name``'s Parameters themselves under global keys (state-dict order)."""
        self._check(name, allow_global=True)
        out: dict[str, nn.Parameter] = {}
        for key, (a, b) in self._adapters[name].items():
            out[f"{key}.lora_A.weight"], out[f"{key}.lora_B.weight"] = a, b
        return out

    def state_dict(self, name: str) -> dict[str, Tensor]:
        return {k: p.detach().clone() for k, p in self.named_parameters(name).items()}

    def _global_adapter(self) -> dict[str, Tensor]:
        return self.state_dict(GLOBAL_ADAPTER)

    def _load_global(self, sd: dict[str, Tensor]) -> None:
        _load(self._adapters[GLOBAL_ADAPTER], sd)

    # -- batched compute ----------------------------------------------------------------------
    def run(self, groups: Sequence[Group]) -> list[Tensor]:
        """Each group's hidden states after the stage's blocks, (b, T, C) per group.

        Under autograd each output has its own backward path (to its input and adapter) over
        its own tape; under ``no_grad`` nothing is recorded.
        """
        for group in groups:
            self._check_group(group, loss=False)
        if not torch.is_grad_enabled():
            return self._runner.blocks(groups)
        taped = self.run_taped(groups)
        out = []
        for group, (y, tape) in zip(groups, taped, strict=True):
            params = [p for pair in tape.adapter.values() for p in pair]
            out.append(TapedBlocks.apply(group.hidden, y, self._runner, tape, *params))
        return out

    def run_taped(
        self, groups: Sequence[Group], need_input_grad: Sequence[bool] | None = None
    ) -> list[tuple[Tensor, Tape]]:
        """Each group's output (no graph) and its tape, for :meth:`backward` later.

        ``need_input_grad`` per group (default all True): False lets the backward skip the
        input gradient (a frozen device head needs none).
        """
        for group in groups:
            self._check_group(group, loss=False)
        wants = need_input_grad if need_input_grad is not None else [True] * len(groups)
        tapes = [
            Tape(tuple(g.hidden.shape), self._tensors(g.adapter), bool(w), segments=g.segments)
            for g, w in zip(groups, wants, strict=True)
        ]
        outs = self._runner.blocks(groups, tapes)
        return list(zip(outs, tapes, strict=True))

    def backward(self, items: Sequence[tuple[Tape, Tensor]]) -> list[Tensor | None]:
        """One batched backward over (tape, dL/d output) pairs of any groups and calls.

        Adds each adapter's gradients to its tensors' ``.grad`` (as autograd would) and
        returns each item's input gradient (None where its tape needs none). Raises before
        touching any ``.grad`` when a gradient does not fit its tape.
        """
        dxs, weights = self.backward_inputs(items, defer_weights=False)
        self.add_weight_grads(weights)
        return dxs

    def backward_inputs(
        self, items: Sequence[tuple[Tape, Tensor]], *, defer_weights: bool = True
    ) -> tuple[list[Tensor | None], WeightGrads]:
        """:meth:`backward`'s input gradients now; the adapters' gradients when
        :meth:`add_weight_grads` is given what this returns (zero-bubble's B/W split).

        Nothing touches ``.grad`` until then; calls' weight gradients added in the order of
        their backwards sum as :meth:`backward` would have, to the bit.
        """
        for tape, dy in items:
            if tuple(dy.shape) != tape.shape:
                raise ValueError(
                    f"output gradient of shape {tuple(dy.shape)} for an output of shape "
                    f"{tape.shape}; send the gradient of the output this tape recorded"
                )
        return backward_blocks(self._runner, items, defer_weights=defer_weights)

    @staticmethod
    def add_weight_grads(weights: WeightGrads) -> None:
        """Compute what :meth:`backward_inputs` recorded and add it to the adapters' ``.grad``
        (all or nothing: a computation that fails adds none)."""
        grads = weights.compute()
        with torch.no_grad():
            for param, grad in grads.items():
                if param.grad is None:
                    param.grad = grad
                else:
                    param.grad += grad

    def run_loss(self, groups: Sequence[Group]) -> list[tuple[Tensor, int]]:
        """Each group's (summed shifted token loss, tokens counted): the loss stage only."""
        for group in groups:
            self._check_group(group, loss=True)
            if group.labels is None:
                raise ValueError(f"group of adapter {group.adapter!r} has no labels")
        hs = self.run(groups)
        return self._runner.head_loss(hs, [g.labels for g in groups if g.labels is not None])

    def _check_group(self, group: Group, *, loss: bool) -> None:
        self._check(group.adapter, allow_global=True)
        if group.blocks is None:
            return
        held = self._runner.block_indices
        wanted = tuple(group.blocks)
        if not wanted or wanted != tuple(b for b in held if b in wanted):
            raise ValueError(
                f"group of adapter {group.adapter!r} asks for blocks {list(wanted)}; the stage "
                f"holds {list(held)} (a non-empty subset, in order)"
            )
        if loss and wanted[-1] != held[-1]:
            raise ValueError(
                f"group of adapter {group.adapter!r} stops at block {wanted[-1]}, but the loss "
                f"follows the stage's last block {held[-1]}"
            )

    # -- internals ------------------------------------------------------------------------------
    def _tensors(self, name: str) -> AdapterTensors:
        return self._adapters[name]

    def _fresh(self, *, trainable: bool = False) -> AdapterTensors:
        """A new adapter at the deterministic initial values (A from the seed, B zero)."""
        r, seed = self.settings.r, self.settings.seed
        out: AdapterTensors = {}
        for key, linear in self._linears.items():
            device = next(linear.parameters()).device  # its weight, or its stored form's
            a = initial_lora_a((r, linear.in_features), seed, key).to(device)
            b = torch.zeros(linear.out_features, r, device=device)
            out[key] = (nn.Parameter(a, trainable), nn.Parameter(b, trainable))
        return out

    def _check(self, name: str, *, allow_global: bool) -> None:
        if name in self._adapters and (allow_global or name != GLOBAL_ADAPTER):
            return
        raise KeyError(f"no adapter {name!r}; the bank holds {list(self._adapters)}")


def _target_linears(stage: nn.Module, targets: Sequence[str]) -> dict[str, nn.Linear]:
    """The stage's target linears by global name (``layers.3.self_attn.q_proj``), module order."""
    out: dict[str, nn.Linear] = {}
    for name, module in stage.named_modules():
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in targets:
            out[global_name(name)] = module
    if not out:
        raise ValueError(f"the stage has no LoRA target layers {list(targets)}")
    return out


@torch.no_grad()
def _load(tensors: AdapterTensors, sd: dict[str, Any]) -> None:
    """Copy ``sd`` (global keys) into ``tensors``; keys and shapes must match exactly."""
    expected = {f"{k}.lora_{s}.weight" for k in tensors for s in "AB"}
    missing, unexpected = sorted(expected - set(sd)), sorted(set(sd) - expected)
    if missing or unexpected:
        raise KeyError(
            f"LoRA state does not fit this stage: missing {missing[:6]} ({len(missing)}), "
            f"unexpected {unexpected[:6]} ({len(unexpected)}); was it saved from another "
            "split, model or target list?"
        )
    for key, (a, b) in tensors.items():
        for param, part in ((a, "A"), (b, "B")):
            value = sd[f"{key}.lora_{part}.weight"]
            if value.shape != param.shape:
                raise ValueError(
                    f"{key}.lora_{part}.weight: shape {tuple(value.shape)} != {tuple(param.shape)}"
                )
    for key, (a, b) in tensors.items():
        a.copy_(sd[f"{key}.lora_A.weight"])
        b.copy_(sd[f"{key}.lora_B.weight"])
