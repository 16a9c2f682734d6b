"""Answering a prompt with a fine-tuned model: a base with a PEFT adapter folder, or a run's
checkpoint put into the unsplit model (:mod:`fedpipe.runs.export`), and transformers' own
``generate``, its tokens streamed as they come (``TextStreamer``).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from transformers import TextStreamer

from fedpipe.models import load_causal_lm, load_tokenizer, resolve_model
from fedpipe.runs.export import load_run_model, merged_model, peft_model

__all__ = ["Sampling", "generate", "load_model", "prompt_ids"]


@dataclass(frozen=True)
class Sampling:
    """How tokens are chosen: greedy at temperature 0, else sampled (top-p) from ``seed``."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0 (0: greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")

    def options(self) -> dict[str, Any]:
        """``generate``'s keyword arguments."""
        if self.temperature == 0:
            return {"max_new_tokens": self.max_new_tokens, "do_sample": False}
        return {
            "max_new_tokens": self.max_new_tokens,
            "do_sample": True,
            "temperature": self.temperature,
            "top_p": self.top_p,
        }


def load_model(
    model: str | None = None,
    *,
    adapter: Path | None = None,
    run: Path | None = None,
    round_: int | None = None,
) -> tuple[Any, Any]:
    """(model in eval mode, tokenizer): the base ``model`` alone, with a PEFT ``adapter``
    folder, or with round ``round_`` of ``run`` (merged when its aggregation changed the base).

    ``model`` None: the run's base, or the adapter's ``base_model_name_or_path``.
    """
    if run is not None:
        run_model = load_run_model(run, round_=round_, model=model)
        built = merged_model(run_model) if run_model.changes_base else peft_model(run_model)
        return built, load_tokenizer(run_model.folder)
    if round_ is not None:
        raise ValueError("--round picks a checkpoint of --run; give --run RUN_FOLDER too")
    spec = model or (_adapter_base(adapter) if adapter is not None else None)
    if spec is None:
        raise ValueError("name the base model: --model BASE (or --run RUN_FOLDER)")
    try:
        folder = resolve_model(spec)
    except (OSError, ValueError) as exc:
        if model is not None or adapter is None:
            raise
        raise FileNotFoundError(  # the adapter was made on another machine, or the base moved
            f"--adapter {adapter}: its base model {spec!r} (base_model_name_or_path in "
            f"adapter_config.json) is not here ({exc}); pass --model BASE with that model"
        ) from None
    base = load_causal_lm(folder)
    if adapter is None:
        return base, load_tokenizer(folder)
    from peft import PeftModel  # deferred: peft imports its tuners

    with warnings.catch_warnings():  # peft asks transformers a deprecated question; not ours
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
        wrapped = PeftModel.from_pretrained(base, adapter)
    return wrapped.eval(), load_tokenizer(folder)


def _adapter_base(adapter: Path) -> str:
    path = Path(adapter) / "adapter_config.json"
    try:
        base = json.loads(path.read_text(encoding="utf-8")).get("base_model_name_or_path")
    except (OSError, ValueError) as exc:
        raise FileNotFoundError(f"{adapter} is not a PEFT adapter folder ({path}: {exc})") from None
    if not base:
        raise ValueError(f"{path} names no base_model_name_or_path; pass --model BASE")
    return str(base)


def prompt_ids(tokenizer: Any, prompt: str, *, chat: bool) -> dict[str, Tensor]:
    """``input_ids`` and ``attention_mask`` (1, T) of ``prompt``; with ``chat``, as one user
    turn in the tokenizer's chat template, ready for the assistant's answer."""
    if not chat:
        return dict(tokenizer(prompt, return_tensors="pt"))
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("--chat: the model's tokenizer has no chat template; drop --chat")
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    return dict(tokenizer(text, return_tensors="pt", add_special_tokens=False))


def generate(
    model: Any,
    tokenizer: Any,
    prompt: str,
    *,
    chat: bool = False,
    sampling: Sampling | None = None,
    stream: bool = True,
) -> Tensor:
    """The ids ``model.generate`` gives for ``prompt`` (prompt first, (1, T + new)); the new
    tokens are printed to stdout as they come when ``stream``."""
    sampling = sampling or Sampling()
    inputs = prompt_ids(tokenizer, prompt, chat=chat)
    device = next(model.parameters()).device
    inputs = {k: v.to(device) for k, v in inputs.items()}
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    torch.manual_seed(sampling.seed)
    with torch.no_grad():
        return model.generate(
            **inputs,
            **sampling.options(),
            pad_token_id=pad,
            streamer=streamer if stream else None,
        )
