"""Run folders for the export tests, written by fedpipe's own code, and the split model's logits.

:func:`tiny_model` saves a tiny random model of any family fedpipe splits (with fedpipe's byte
tokenizer and a chat template). :func:`write_run` writes a run folder whose checkpoint holds the
device trainer's and the server bank's adapters (as the ServerApp saves them: ``adapters()`` and
``global_state()``), perturbed so every LoRA B is nonzero; with ``exact`` or ``stack``
aggregation the adapters of two perturbed "devices" are aggregated by fedpipe's own rule, so the
checkpoint carries real base deltas. :func:`split_logits` is what fedpipe's evaluation computes
for that checkpoint: the device trainer's head and tail with ``load_adapters(checkpoint.device)``
around the StageServer runtime with ``load_global_state(checkpoint.server)``, the global adapter.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from fedpipe.config import FedpipeConfig
from fedpipe.edge.trainer import DeviceTrainer, initial_device_adapters
from fedpipe.lora import GLOBAL_ADAPTER, Group
from fedpipe.lora.aggregation import DELTA_SUFFIX, aggregate_adapters
from fedpipe.models import build_byte_tokenizer, model_fingerprint
from fedpipe.runs.folder import FINGERPRINT_KEY, RunFolder
from fedpipe.server.build import build_runtime

__all__ = [
    "FAMILY_CONFIGS",
    "CHAT_TEMPLATE",
    "split_logits",
    "split_loss",
    "tiny_model",
    "write_run",
]

VOCAB = 257  # fedpipe's byte tokenizer: 256 bytes and <|endoftext|>
_TINY = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=64,
    pad_token_id=256,
    bos_token_id=None,
    eos_token_id=256,
    initializer_range=0.1,
)
_ALTERNATING = ["sliding_attention", "full_attention"] * 2
# One tiny config per family fedpipe splits (fedpipe.models.families, and GPT-2).
FAMILY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen2": {"use_sliding_window": True, "max_window_layers": 2, "sliding_window": 4},
    "mistral": {"sliding_window": 4},
    "qwen3": {"head_dim": 8, "tie_word_embeddings": False},
    "olmo2": {},
    "granite": {"embedding_multiplier": 0.25, "logits_scaling": 3.0, "residual_multiplier": 0.5},
    "smollm3": {"tie_word_embeddings": True},
    "phi3": {},
    "gemma2": {"head_dim": 8, "sliding_window": 4, "final_logit_softcapping": 5.0},
    "gemma3_text": {"head_dim": 8, "sliding_window": 4, "layer_types": _ALTERNATING},
    "gpt2": {},
}
_GPT2 = dict(
    n_embd=32, n_layer=4, n_head=4, vocab_size=VOCAB, n_positions=64, resid_pdrop=0.0,
    embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=256, eos_token_id=256, pad_token_id=256,
)  # fmt: skip
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tiny_model(folder: Path, model_type: str = "llama", seed: int = 0) -> Path:
    """A tiny random ``model_type`` model saved in ``folder``, with a byte tokenizer."""
    if model_type == "gpt2":
        config = CONFIG_MAPPING["gpt2"](**_GPT2)
    else:
        config = CONFIG_MAPPING[model_type](**{**_TINY, **FAMILY_CONFIGS[model_type]})
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer = build_byte_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


def _config(model: Path, settings: dict[str, Any]) -> FedpipeConfig:
    return FedpipeConfig().with_overrides(
        {"model.name": str(model), "model.lora_r": 4, "model.lora_alpha": 8, **settings}
    )


def _perturbed(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: v + 0.1 * torch.randn(v.shape, generator=gen) for k, v in state.items()}


def _trained(
    state: dict[str, torch.Tensor], mode: str, scale: float, round_: int
) -> dict[str, torch.Tensor]:
    """``state`` as round ``round_`` leaves it: perturbed; under exact/stack two perturbed
    devices aggregated by fedpipe's rule, with the base deltas it folds (``<layer>.base_delta``)."""
    seed = 10 * round_
    if mode not in ("exact", "stack"):
        return _perturbed(state, seed + 1)
    devices = [_perturbed(state, seed + 2), _perturbed(state, seed + 3)]
    merged, deltas = aggregate_adapters(devices, [1.0, 3.0], mode, scale=scale, initial=state)
    if mode == "stack":  # the adapter restarts from its init; perturb it again (a later round)
        merged = _perturbed(merged, seed + 4)
    return {**merged, **{k + DELTA_SUFFIX: v for k, v in deltas.items()}}


def write_run(runs: Path, name: str, model: Path, *, round_: int = 2, **settings: Any) -> RunFolder:
    """A run folder (settings.json, a checkpoint of ``round_``) of ``model`` with
    trained-looking adapters; an existing run gets one more checkpoint (a resumed run's)."""
    cfg = _config(model, settings)
    scale = cfg.model.lora_alpha / cfg.model.lora_r
    mode = cfg.federated.aggregation
    runtime, _ = build_runtime(cfg)
    try:
        server = _trained(runtime.global_state(), mode, scale, round_)
    finally:
        runtime.stop()
    device = initial_device_adapters(cfg, model)  # every offered cut's, as the ServerApp's
    folder = RunFolder.open(runs, name, resume=True)
    folder.save_settings(cfg.to_flat())
    folder.save_checkpoint(
        round_,
        device=_trained(device, mode, scale, round_),
        server=server,
        state={"round": round_, "run_id": name, FINGERPRINT_KEY: model_fingerprint(model)},
    )
    return folder


def _split(folder: RunFolder, round_: int, input_ids: torch.Tensor, *, loss: bool) -> Any:
    cfg = FedpipeConfig().with_overrides(folder.load_settings() or {})
    checkpoint = folder.load_checkpoint(round_)
    trainer = DeviceTrainer(cfg, device_id="evaluator")
    trainer.load_adapters(checkpoint.device)
    runtime, _ = build_runtime(cfg)
    try:
        runtime.load_global_state(checkpoint.server)
        with torch.no_grad():
            hidden = trainer.head(input_ids)
            group = Group(GLOBAL_ADAPTER, hidden, blocks=tuple(trainer.layout.server_blocks))
            if trainer.tail is None:  # mode "two": the server's stage ends in the loss
                group.labels = input_ids
                return runtime.bank.run_loss([group])[0]
            (middle,) = runtime.bank.run([group])
            return trainer.tail(middle, input_ids) if loss else trainer.tail.logits(middle)
    finally:
        runtime.stop()


def split_logits(folder: RunFolder, round_: int, input_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) ids -> (B, T, V) logits of the split model (U-shaped) at round ``round_``."""
    return _split(folder, round_, input_ids, loss=False)


def split_loss(folder: RunFolder, round_: int, input_ids: torch.Tensor) -> float:
    """The split model's mean next-token loss on ``input_ids`` at round ``round_`` (either
    split mode: in mode "two" the server's stage computes it, as in training)."""
    total, tokens = _split(folder, round_, input_ids, loss=True)
    return float(total) / int(tokens)
