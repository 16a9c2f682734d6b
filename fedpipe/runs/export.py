"""The fine-tuned model out of a run: its checkpoint as a PEFT adapter or a merged HF model.

A checkpoint holds the global device adapters (head and tail blocks; with ``model.cuts``,
every offered cut's) and the server's global adapter (the middle), under fedpipe's global keys
(``layers.3.self_attn.q_proj.lora_A.weight``), and under ``exact`` or ``stack`` aggregation the
base deltas those fold into the frozen weights (``<layer>.base_delta``). The model a run
evaluates is its evaluator's split (``model.head_layers`` + ``model.tail_layers``): the head and
tail blocks from the device side, the blocks between from the server. Exactly that model is
rebuilt here, unsplit: peft's LoRA layers over the whole Hugging Face model, their adapters set
by global name (every layer must be filled, none left over), the base deltas folded into the
base weights. A run with replicas or a resumed run writes its checkpoints alike.

- :func:`load_run_model` reads and checks a run folder's checkpoint (round, base model and its
  fingerprint against the run's);
- :func:`peft_model` / :func:`merged_model` build the model in memory;
- :func:`export_run` writes a PEFT adapter folder (``save_pretrained``: ``adapter_config.json``,
  ``adapter_model.safetensors``) or a merged model folder (weights, config, tokenizer).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from torch import Tensor

from fedpipe.config import FedpipeConfig
from fedpipe.errors import ModelFileError
from fedpipe.lora import load_lora_state_dict, lora_settings
from fedpipe.lora.aggregation import BaseFold, adapter_block, split_deltas
from fedpipe.models import (
    load_causal_lm,
    load_config,
    load_tokenizer,
    model_family,
    model_fingerprint,
    resolve_model,
)
from fedpipe.runs.folder import FINGERPRINT_KEY, Checkpoint, RunFolder
from fedpipe.split import split_layout

__all__ = [
    "FORMATS",
    "RunModel",
    "export_run",
    "load_run_model",
    "merged_model",
    "peft_model",
]

log = logging.getLogger(__name__)

FORMATS = ("peft", "merged")
Format = Literal["peft", "merged"]
_FOLDING = ("exact", "stack")  # aggregations that change the base weights


@dataclass(frozen=True)
class RunModel:
    """One checkpoint of a run, as the unsplit model needs it.

    ``adapters`` are the evaluator's split's LoRA tensors under global keys (head, middle and
    tail blocks); ``deltas`` the base deltas by layer name (``(out, in)``, fp32; empty unless
    the aggregation folds).
    """

    run: Path
    round: int
    folder: Path  # the base model
    config: FedpipeConfig
    adapters: dict[str, Tensor]
    deltas: dict[str, Tensor]

    @property
    def aggregation(self) -> str:
        return self.config.federated.aggregation

    @property
    def changes_base(self) -> bool:
        """Whether the run's aggregation folded changes into the base weights."""
        return self.aggregation in _FOLDING or bool(self.deltas)


def load_run_model(run: Path, *, round_: int | None = None, model: str | None = None) -> RunModel:
    """Round ``round_`` (None: the last) of the run in folder ``run``, checked.

    ``model``: the base model to use instead of the run's ``model.name`` (a moved folder); its
    fingerprint must be the run's. Refusals are one-line ValueError / FileNotFoundError.
    """
    folder = _run_folder(Path(run))
    config = _settings(folder)
    checkpoint = _checkpoint(folder, round_)
    base = _base_model(model or config.model.name, model is not None)
    _check_fingerprint(checkpoint, base, folder)
    adapters, deltas = _evaluated_split(config, checkpoint, base)
    return RunModel(folder.path, checkpoint.round, base, config, adapters, deltas)


def _run_folder(path: Path) -> RunFolder:
    if not path.is_dir():
        raise FileNotFoundError(f"run folder {path} does not exist")
    folder = RunFolder(path)
    if not folder.settings_path.is_file() or not folder.checkpoints_dir.is_dir():
        raise ValueError(
            f"{path} is not a fedpipe run folder (no settings.json and checkpoints/); pass "
            "runs/NAME as `fedpipe simulate` or `fedpipe run` wrote it"
        )
    return folder


def _settings(folder: RunFolder) -> FedpipeConfig:
    """The run's resolved settings (keys this version does not know are left out)."""
    try:
        saved = folder.load_settings() or {}
    except ValueError as exc:  # JSONDecodeError is a ValueError
        raise ValueError(f"{folder.settings_path} is not readable settings: {exc}") from None
    known = FedpipeConfig().to_flat()
    return FedpipeConfig().with_overrides({k: v for k, v in saved.items() if k in known})


def _checkpoint(folder: RunFolder, round_: int | None) -> Checkpoint:
    """The checkpoint of ``round_``, or of the last round saved (a corrupt one is refused,
    never silently replaced by an earlier round)."""
    rounds = folder.rounds()
    if not rounds:
        raise FileNotFoundError(
            f"{folder.checkpoints_dir} holds no checkpoint: the run saved no round yet"
        )
    if round_ is not None and round_ not in rounds:
        raise FileNotFoundError(
            f"no checkpoint for round {round_} in {folder.checkpoints_dir} (have rounds "
            f"{_ranges(rounds)})"
        )
    return folder.load_checkpoint(rounds[-1] if round_ is None else round_)


def _ranges(rounds: list[int]) -> str:
    """``[1, 2, 3]`` as ``1..3``; rounds with gaps as the list."""
    whole = rounds == list(range(rounds[0], rounds[-1] + 1))
    return f"{rounds[0]}..{rounds[-1]}" if whole else str(rounds)


def _base_model(spec: str, given: bool) -> Path:
    try:
        return resolve_model(spec)
    except ValueError as exc:
        hint = "" if given else "; pass --model with the base model's folder"
        raise ValueError(f"the run's base model: {exc}{hint}") from None


def _check_fingerprint(checkpoint: Checkpoint, base: Path, folder: RunFolder) -> None:
    """The base model must be the one the run trained (its weights and config, hashed)."""
    recorded = checkpoint.state.get(FINGERPRINT_KEY)
    if not recorded:
        log.warning(
            "%s records no model fingerprint (a run from an older fedpipe): the base model %s "
            "is not checked against the run's",
            checkpoint.path,
            base,
        )
        return
    actual = model_fingerprint(base)
    if actual != recorded:
        raise ValueError(
            f"base model {base} (fingerprint {actual[:12]}) is not the model run {folder.path} "
            f"trained (fingerprint {str(recorded)[:12]}); pass --model with that model's folder"
        )


def _evaluated_split(
    config: FedpipeConfig, checkpoint: Checkpoint, base: Path
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """The adapters and base deltas of the evaluator's split: head and tail blocks from the
    device side, the blocks between from the server."""
    model = config.model
    layout = split_layout(
        load_config(base),
        head_layers=model.head_layers,
        tail_layers=model.tail_layers,
        mode=model.split,  # type: ignore[arg-type]
    )
    device_blocks = {*layout.head_blocks, *layout.tail_blocks}
    server_blocks = set(layout.server_blocks)
    state: dict[str, Tensor] = {}
    for side, blocks in ((checkpoint.device, device_blocks), (checkpoint.server, server_blocks)):
        state |= {k: v for k, v in side.items() if adapter_block(k) in blocks}
    adapters, deltas = split_deltas(state)
    return adapters, {k: v.float() for k, v in deltas.items()}


# -- the unsplit model -----------------------------------------------------------------------
def peft_model(run_model: RunModel) -> Any:
    """A ``PeftModelForCausalLM`` over the whole base model, holding the run's adapters.

    Refused for a run whose aggregation changed the base weights (a PEFT adapter cannot hold
    them): use :func:`merged_model`.
    """
    if run_model.changes_base:
        raise ValueError(
            f"run {run_model.run} used federated.aggregation = {run_model.aggregation}, which "
            "folds changes into the base weights that a PEFT adapter cannot hold; export it "
            "with --format merged"
        )
    return _with_adapters(run_model)


def merged_model(run_model: RunModel) -> Any:
    """The whole model with the adapters merged in and the base deltas folded (a plain
    ``PreTrainedModel``, in eval mode)."""
    wrapped = _with_adapters(run_model)
    BaseFold(wrapped).set(run_model.deltas)  # original + delta, transposed where Conv1D
    return wrapped.merge_and_unload().eval()


def _with_adapters(run_model: RunModel) -> Any:
    from peft import get_peft_model  # deferred with torch's other heavy imports

    folder = run_model.folder
    family = model_family(load_config(folder))
    base = load_causal_lm(folder)
    peft_config = lora_settings(run_model.config).peft_config(family, base.config.model_type)
    peft_config.task_type = "CAUSAL_LM"
    peft_config.base_model_name_or_path = str(folder.resolve())
    with warnings.catch_warnings():  # peft asks transformers a deprecated question; not ours
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
        wrapped = get_peft_model(base, peft_config)
    try:  # every LoRA layer of the whole model filled, by global name; nothing left over
        load_lora_state_dict(wrapped, run_model.adapters)
    except (KeyError, ValueError) as exc:
        raise ValueError(f"checkpoint of round {run_model.round}: {exc}") from None
    return wrapped.eval()


# -- folders ---------------------------------------------------------------------------------
def export_run(
    run: Path,
    out: Path,
    *,
    format: Format,
    round_: int | None = None,
    model: str | None = None,
) -> RunModel:
    """Write round ``round_`` (None: the last) of ``run`` to the new folder ``out``.

    The folder is written beside ``out`` and renamed into place once complete, so a failure
    leaves no half-written model where a loader would take it for a whole one.
    """
    if format not in FORMATS:
        raise ValueError(f"--format {format!r} unknown; choose one of {', '.join(FORMATS)}")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {out} exists and is not an empty folder; choose a new one")
    run_model = load_run_model(run, round_=round_, model=model)
    built = peft_model(run_model) if format == "peft" else merged_model(run_model)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out.name}-", dir=out.parent))
    try:
        built.save_pretrained(tmp)
        if format == "merged":
            _copy_tokenizer(run_model.folder, tmp)
        if out.exists():
            out.rmdir()  # empty, checked above
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return run_model


def _copy_tokenizer(base: Path, out: Path) -> None:
    """The base's tokenizer (and chat template) beside the merged weights, when it has one."""
    try:
        tokenizer = load_tokenizer(base)
    except ModelFileError as exc:
        log.warning("no tokenizer copied into %s: %s", out, exc)
        return
    tokenizer.save_pretrained(out)
