"""LoRA adapters on stages (or the unsplit model) via peft, keyed by global module names.

Adapters are initialised from (seed, global module name), never from the global RNG, so the split
stages and the unsplit model get identical adapters. State dicts use global keys such as
``layers.3.self_attn.q_proj.lora_A.weight``: the same whether the model is split, wrapped or whole.
"""

from __future__ import annotations

import hashlib
import math
import re
import warnings
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.lora import LoraLayer
from torch import Tensor, nn

from fedpipe.config import FedpipeConfig
from fedpipe.models.families import FAMILIES

__all__ = [
    "Group",
    "LoraSettings",
    "lora_settings",
    "apply_lora",
    "lora_layers",
    "lora_state_dict",
    "load_lora_state_dict",
    "average_state_dicts",
    "global_name",
    "initial_lora_a",
]

Family = Literal["llama", "gpt2"]
_LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
# GPT-2's c_proj also exists in the MLP; the default adapts attention only.
_GPT2_ATTENTION = r"(.*\.)?h\.\d+\.attn\.(c_attn|c_proj)"
_BLOCK_NAME = re.compile(r"(?:^|\.)((?:layers|h)\.\d+(?:\..+)?)$")


@dataclass(frozen=True)
class LoraSettings:
    """LoRA hyper-parameters; ``targets`` None picks the family default (attention projections:
    the family table's ``lora_targets``, such as Phi-3's fused ``qkv_proj``)."""

    r: int = 8
    alpha: float = 16
    dropout: float = 0.0
    targets: tuple[str, ...] | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.r < 1:
            raise ValueError(f"LoRA rank r must be >= 1, got {self.r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout}")

    def peft_config(self, family: Family, model_type: str | None = None) -> LoraConfig:
        """peft's config for a module of ``family`` (``model_type`` picks the default targets)."""
        if self.targets is not None:
            targets: list[str] | str = list(self.targets)
        elif family == "llama":
            spec = FAMILIES.get(model_type or "")
            targets = list(spec.lora_targets if spec is not None else _LLAMA_TARGETS)
        else:
            targets = _GPT2_ATTENTION
        return LoraConfig(
            r=self.r,
            lora_alpha=self.alpha,  # type: ignore[arg-type]  # peft annotates int; floats work
            lora_dropout=self.dropout,
            target_modules=targets,
            fan_in_fan_out=family == "gpt2",  # GPT-2 uses Conv1D, weights stored (in, out)
            bias="none",
        )


def lora_settings(config: FedpipeConfig) -> LoraSettings:
    """The LoRA settings both sides derive from one config."""
    targets = config.model.lora_targets
    return LoraSettings(
        r=config.model.lora_r,
        alpha=config.model.lora_alpha,
        targets=targets or None,
        seed=config.model.seed,
    )


def global_name(module_name: str) -> str:
    """``model.layers.3.self_attn.q_proj`` -> ``layers.3.self_attn.q_proj`` (any wrapper prefix)."""
    match = _BLOCK_NAME.search(module_name)
    if match is None:
        raise ValueError(f"{module_name!r} is not inside a transformer block (layers.N / h.N)")
    return match.group(1)


def lora_layers(module: nn.Module) -> dict[str, LoraLayer]:
    """LoRA-wrapped layers of ``module`` by global name, in module order."""
    return {global_name(n): m for n, m in module.named_modules() if isinstance(m, LoraLayer)}


def apply_lora(
    module: nn.Module,
    settings: LoraSettings,
    family: Family,
    *,
    adapter: str = "default",
) -> nn.Module:
    """Inject adapter ``adapter`` into ``module`` in place (forward signature unchanged).

    Base weights are frozen; lora_A is drawn from (seed, global module name), lora_B is zero.
    Calling it again with another ``adapter`` name adds a second adapter beside the first. A module
    with no target layers (a head with no blocks) is returned frozen and without adapters.
    """
    if not _has_targets(module, settings, family):
        return module.requires_grad_(False)
    active = _active_adapter(module)
    earlier = {n: p.requires_grad for n, p in module.named_parameters() if ".lora_" in n}
    with warnings.catch_warnings():  # "multiple adapters" is what we want when adding one
        warnings.filterwarnings("ignore", message=".*multiple adapters.*")
        # GPT-2's Conv1D stored as a linear (device.weights, fedpipe.split.quant): peft then
        # turns fan_in_fan_out off for it, which is right (its weight is stored (out, in))
        warnings.filterwarnings("ignore", message="fan_in_fan_out is set to True but the target")
        peft_config = settings.peft_config(family, _model_type(module))
        inject_adapter_in_model(peft_config, module, adapter_name=adapter)
    for name, param in module.named_parameters():  # base frozen, earlier adapters as they were
        param.requires_grad_(earlier.get(name, ".lora_" in name))
    _init_adapter(module, settings.seed, adapter)
    set_active_adapter(module, active or adapter)
    return module


def set_active_adapter(module: nn.Module, adapter: str) -> None:
    """Make ``adapter`` the one every LoRA layer uses, leaving requires_grad flags as they were."""
    layers = lora_layers(module).values()
    flags = [(p, p.requires_grad) for m in layers for p in cast(nn.Module, m).parameters()]
    for layer in layers:
        layer.set_adapter(adapter)
    for param, flag in flags:  # peft's set_adapter would freeze the other adapters
        param.requires_grad_(flag)


def _adapter_weights(layer: LoraLayer, adapter: str) -> tuple[nn.Parameter, nn.Parameter]:
    """Adapter ``adapter``'s (lora_A, lora_B) weights in ``layer``: the Parameters themselves."""
    a, b = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
    return cast(nn.Parameter, a), cast(nn.Parameter, b)


def _active_adapter(module: nn.Module) -> str | None:
    for layer in lora_layers(module).values():
        return layer.active_adapters[0] if layer.active_adapters else None
    return None


def _model_type(module: nn.Module) -> str | None:
    """The model_type of a stage or an unsplit model (its ``config``), None when it has none."""
    config: Any = getattr(module, "config", None)
    return getattr(config, "model_type", None)


def _has_targets(module: nn.Module, settings: LoraSettings, family: Family) -> bool:
    targets = settings.peft_config(family, _model_type(module)).target_modules
    assert targets is not None  # peft_config always sets target_modules
    for name, _ in module.named_modules():
        if isinstance(targets, str):
            if re.fullmatch(targets, name):
                return True
        elif any(name == t or name.endswith("." + t) for t in targets):
            return True
    return False


def _seed_for(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def initial_lora_a(shape: tuple[int, ...], seed: int, name: str) -> Tensor:
    """A fresh lora_A (float32, on the CPU) for layer ``name``: drawn from (seed, name) only."""
    gen = torch.Generator().manual_seed(_seed_for(seed, name))
    fresh = torch.empty(shape, dtype=torch.float32)
    nn.init.kaiming_uniform_(fresh, a=math.sqrt(5), generator=gen)  # peft's default A init
    return fresh


@torch.no_grad()
def _init_adapter(module: nn.Module, seed: int, adapter: str) -> None:
    for name, layer in lora_layers(module).items():
        a, b = _adapter_weights(layer, adapter)
        a.copy_(initial_lora_a(tuple(a.shape), seed, name))
        b.zero_()


def lora_parameters(module: nn.Module, adapter: str = "default") -> dict[str, nn.Parameter]:
    """Adapter ``adapter``'s parameters themselves (not copies) under global keys."""
    out: dict[str, nn.Parameter] = {}
    for name, layer in lora_layers(module).items():
        if adapter not in layer.lora_A:
            raise KeyError(f"adapter {adapter!r} not found in {name}; it has {list(layer.lora_A)}")
        a, b = _adapter_weights(layer, adapter)
        out[f"{name}.lora_A.weight"] = a
        out[f"{name}.lora_B.weight"] = b
    return out


def lora_state_dict(module: nn.Module, adapter: str = "default") -> dict[str, Tensor]:
    """Adapter ``adapter``'s tensors (detached copies) under global keys."""
    return {k: p.detach().clone() for k, p in lora_parameters(module, adapter).items()}


@torch.no_grad()
def load_lora_state_dict(
    module: nn.Module, sd: dict[str, Tensor], adapter: str = "default"
) -> None:
    """Copy ``sd`` (global keys) into adapter ``adapter``; keys must match exactly."""
    targets: dict[str, Tensor] = {}
    for name, layer in lora_layers(module).items():
        a, b = _adapter_weights(layer, adapter)
        targets[f"{name}.lora_A.weight"] = a
        targets[f"{name}.lora_B.weight"] = b
    missing, unexpected = sorted(set(targets) - set(sd)), sorted(set(sd) - set(targets))
    if missing or unexpected:
        raise KeyError(
            f"LoRA state does not fit this module: missing {_few(missing)}, unexpected "
            f"{_few(unexpected)}; was it saved from another split, model or target list?"
        )
    for key, param in targets.items():
        if sd[key].shape != param.shape:
            raise ValueError(f"{key}: shape {tuple(sd[key].shape)} != {tuple(param.shape)}")
        param.copy_(sd[key])


def _few(keys: list[str], limit: int = 6) -> str:
    shown = ", ".join(keys[:limit])
    return f"[{shown}{', ...' if len(keys) > limit else ''}] ({len(keys)})"


def average_state_dicts(sds: list[dict[str, Tensor]], weights: list[float]) -> dict[str, Tensor]:
    """Weighted average of state dicts with identical keys; weights are normalised to sum 1."""
    if not sds or len(sds) != len(weights):
        raise ValueError(
            f"need one weight per state dict, got {len(sds)} dicts, {len(weights)} weights"
        )
    total = float(sum(weights))
    if total <= 0 or any(w < 0 for w in weights):
        raise ValueError(f"weights must be >= 0 with a positive sum, got {weights}")
    keys = set(sds[0])
    for i, sd in enumerate(sds[1:], start=1):
        if set(sd) != keys:
            raise KeyError(f"state dict {i} has different keys: {_few(sorted(set(sd) ^ keys))}")
    out: dict[str, Tensor] = {}
    for key in sds[0]:
        acc = sum(sd[key].float() * (w / total) for sd, w in zip(sds, weights, strict=True))
        out[key] = torch.as_tensor(acc).to(sds[0][key].dtype)
    return out


@dataclass
class Group:
    """One session's microbatch in a batched call: its adapter, hidden states and labels."""

    adapter: str
    hidden: Tensor  # (b, T, C)
    labels: Tensor | None = None  # (b, T): the loss stage only
    # The stage's blocks this group runs through (None: all). A device whose cut leaves it
    # fewer server blocks names them here; in the loss stage they must end at its last block.
    blocks: tuple[int, ...] | None = None
    # Packed rows (data.packing): (b, T) segment ids, each token attending to its own
    # segment at positions restarting per segment (fedpipe.split.packing); None: not packed.
    segments: Tensor | None = None
