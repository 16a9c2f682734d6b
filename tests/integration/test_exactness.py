"""Exactness: a pipelined step over real loopback gRPC equals the unsplit model's step.

For every schedule and 1..8 microbatches, with the lossless codec: the same loss, the same
LoRA gradients on both sides, and the same adapter weights after two AdamW steps as the
unsplit model on the same batches (fp32 tolerance), for a GPT-2 and a Llama-family model, in
the U-shaped and the two-part split. Lossy codecs stay within a stated error of the loss.
Instruction rows (answers-only labels, right-padded) give the unsplit model's loss with the same
labels too.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import replace

import pytest
import torch
from harness.batches import random_batches
from harness.close import assert_close_to_scale
from harness.stage import stage_server

from fedpipe.config import FedpipeConfig, ModelConfig, PipelineConfig, TrainConfig
from fedpipe.data import IGNORE_INDEX, Document, example_rows
from fedpipe.data.rows import pack_examples
from fedpipe.edge.runtime import DeviceRuntime
from fedpipe.edge.schedules import SCHEDULES
from fedpipe.edge.trainer import DeviceTrainer
from fedpipe.lora import (
    apply_lora,
    load_lora_state_dict,
    lora_parameters,
    lora_settings,
    lora_state_dict,
)
from fedpipe.models import load_causal_lm, load_tokenizer, model_family, resolve_model
from fedpipe.server.build import build_runtime
from fedpipe.wire.backend import SessionRequest
from fedpipe.wire.link_client import StageClient

LR = 1e-2
BATCH, SEQ = 8, 16


class RecordingAdamW(torch.optim.AdamW):
    """AdamW that keeps a copy of every gradient it applies (in parameter order)."""

    def __init__(self, params, **kw):  # type: ignore[no-untyped-def]
        super().__init__(params, **kw)
        self.grads: list[list[torch.Tensor]] = []

    def step(self, closure=None):  # type: ignore[no-untyped-def]
        self.grads.append([p.grad.detach().clone() for g in self.param_groups for p in g["params"]])
        return super().step(closure)


def _config(
    model: str,
    split: str,
    schedule: str = "gpipe",
    m: int = 1,
    codec: str = "fp32",
    gradient_codec: str = "",
) -> FedpipeConfig:
    return FedpipeConfig(
        model=ModelConfig(
            name=model, head_layers=1, tail_layers=0 if split == "two" else 1, split=split
        ),
        pipeline=PipelineConfig(
            microbatches=m,
            schedule=schedule,
            uplink_codec=codec,
            downlink_codec=codec,
            gradient_codec=gradient_codec,
        ),
        train=TrainConfig(batch_size=BATCH, seq_len=SEQ, lr=LR),
    )


def _batches(vocab: int, n: int = 2) -> list[dict[str, torch.Tensor]]:
    return random_batches(n, BATCH, SEQ, vocab=vocab, seed=1, pad_from=10)  # pads must not count


def _random_adapter(keys: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {k: torch.randn(v.shape, generator=gen) * 0.1 for k, v in keys.items()}


class Setup:
    """A StageServer on port 0 and the unsplit reference, sharing one random adapter."""

    def __init__(self, model: str, split: str, stack: ExitStack) -> None:
        self.model, self.split = model, split
        self.folder = resolve_model(model)
        config = _config(model, split)
        self.runtime, info = build_runtime(config, folder=self.folder)
        self.server_opts: list[RecordingAdamW] = []

        def factory(params, lr, wd):  # type: ignore[no-untyped-def]
            opt = RecordingAdamW(params, lr=lr, weight_decay=wd)
            self.server_opts.append(opt)
            return opt

        self.runtime.optimizer_factory = factory
        self.server = stack.enter_context(stage_server(runtime=self.runtime, split=info))
        full = load_causal_lm(self.folder)
        self.reference = apply_lora(full, lora_settings(config), model_family(full.config))
        self.adapter = _random_adapter(lora_state_dict(self.reference))
        load_lora_state_dict(self.reference, self.adapter)
        server_keys = set(self.runtime.bank.global_state())
        self.runtime.bank.set_global_state({k: self.adapter[k] for k in server_keys})
        self.server_keys = server_keys
        self.vocab = int(self.reference.get_input_embeddings().num_embeddings)

    def reference_run(self, batches):  # type: ignore[no-untyped-def]
        model = self.reference
        load_lora_state_dict(model, self.adapter)
        params = lora_parameters(model)
        opt = RecordingAdamW(list(params.values()), lr=LR, weight_decay=0.0)
        losses = []
        for batch in batches:
            out = model(input_ids=batch["input_ids"], labels=batch["labels"])
            out.loss.backward()
            losses.append(float(out.loss.detach()))
            opt.step()
            opt.zero_grad()
        grads = dict(zip(params, opt.grads[0], strict=True))
        return losses, grads, {k: v.detach().clone() for k, v in lora_state_dict(model).items()}


class Setups(dict[tuple[str, str], Setup]):
    """The setups built so far; their servers stop with ``stack``."""

    def __init__(self, stack: ExitStack) -> None:
        super().__init__()
        self.stack = stack


@pytest.fixture(scope="module")
def setups() -> Iterator[Setups]:
    with ExitStack() as stack:
        yield Setups(stack)


def _setup(setups: Setups, model: str, split: str) -> Setup:
    if (model, split) not in setups:
        setups[(model, split)] = Setup(model, split, setups.stack)
    return setups[(model, split)]


def _pipelined(setup: Setup, config: FedpipeConfig, batches):  # type: ignore[no-untyped-def]
    """Run the batches through the split model; returns losses, first-step grads, final weights."""
    trainer = DeviceTrainer(
        config, device_id=f"dev-{config.pipeline.schedule}", folder=setup.folder
    )
    trainer.load_adapters({k: v for k, v in setup.adapter.items() if k not in setup.server_keys})
    params = lora_parameters(trainer.head) | (lora_parameters(trainer.tail) if trainer.tail else {})
    opt = RecordingAdamW(list(params.values()), lr=LR, weight_decay=0.0)
    setup.server_opts.clear()
    losses = []
    with StageClient(setup.server.address) as client:
        session, runtime = trainer.connect(client, optimizer=opt)
        with session:
            for step, batch in enumerate(batches):
                losses.append(runtime.train_step(batch, step=step).loss)
    (server_session,) = [s for s in setup.runtime.sessions() if s.device_id == trainer.device_id]
    (server_opt,) = setup.server_opts
    server_params = setup.runtime.bank.named_parameters(server_session.session_id)
    grads = dict(zip(params, opt.grads[0], strict=True))
    grads |= dict(zip(server_params, server_opt.grads[0], strict=True))
    weights = trainer.adapters() | setup.runtime.bank.state_dict(server_session.session_id)
    return losses, grads, weights


MODELS = ["tiny-llama", "tiny-gpt2"]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("split", ["u", "two"])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])
def test_pipelined_step_equals_unsplit(
    setups, model: str, split: str, schedule: str, m: int
) -> None:
    setup = _setup(setups, model, split)
    batches = _batches(setup.vocab)
    ref_losses, ref_grads, ref_weights = setup.reference_run(batches)
    losses, grads, weights = _pipelined(setup, _config(model, split, schedule, m), batches)
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    assert set(grads) == set(ref_grads)
    for key, grad in ref_grads.items():
        assert_close_to_scale(grads[key], grad, rel=1e-4, atol=1e-6, msg=f"grad {key}")
    assert set(weights) == set(ref_weights)
    for key, value in ref_weights.items():
        # AdamW divides by sqrt(v): a gradient element near 0 turns fp32 rounding into up to
        # ~1e-5 of weight change, so weights get 1% of one step (lr) as absolute tolerance.
        assert_close_to_scale(weights[key], value, rel=1e-4, atol=LR * 1e-2, msg=key)


# Lossy codecs: the loss of one step stays within these relative errors of the fp32 loss.
# (activation codec, gradient codec) -> bound on one step's relative loss error; gradients
# must stay within 10x that (relative norm of the LoRA gradient error).
LOSSY_BOUNDS = {
    ("bf16", ""): 2e-2,
    ("fp16", ""): 2e-3,
    ("int8", ""): 3e-2,
    ("int8", "bf16"): 3e-2,
}


@pytest.mark.parametrize("codecs", list(LOSSY_BOUNDS), ids=lambda c: "+".join(filter(None, c)))
def test_lossy_codecs_stay_within_stated_error(setups, codecs: tuple[str, str]) -> None:
    setup = _setup(setups, "tiny-llama", "u")
    batches = _batches(setup.vocab, n=1)
    ref_losses, ref_grads, _ = setup.reference_run(batches)
    config = _config("tiny-llama", "u", "greedy", 4, *codecs)
    losses, grads, _ = _pipelined(setup, config, batches)
    assert losses[0] == pytest.approx(ref_losses[0], rel=LOSSY_BOUNDS[codecs])
    num = sum(float((grads[k] - g).norm()) for k, g in ref_grads.items())
    den = sum(float(g.norm()) for g in ref_grads.values())
    assert num / den < 10 * LOSSY_BOUNDS[codecs]


def test_bf16_gradients_are_closer_than_int8_gradients(setups) -> None:
    """Keeping gradients in 16 bits (int8 activations only) cuts the gradient error."""
    setup = _setup(setups, "tiny-llama", "u")
    batches = _batches(setup.vocab, n=1)
    _, ref_grads, _ = setup.reference_run(batches)
    errors = {}
    for codecs in (("int8", ""), ("int8", "bf16")):
        _, grads, _ = _pipelined(setup, _config("tiny-llama", "u", "greedy", 4, *codecs), batches)
        num = sum(float((grads[k] - g).norm()) for k, g in ref_grads.items())
        errors[codecs] = num / sum(float(g.norm()) for g in ref_grads.values())
    assert errors[("int8", "bf16")] < errors[("int8", "")]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("split", ["u", "two"])
def test_evaluation_through_the_split_model_equals_unsplit(setups, model: str, split: str) -> None:
    """Forward-only evaluation over the stage link gives the unsplit model's loss, no update."""
    setup = _setup(setups, model, split)
    (batch,) = _batches(setup.vocab, n=1)
    load_lora_state_dict(setup.reference, setup.adapter)
    setup.runtime.bank.set_global_state({k: setup.adapter[k] for k in setup.server_keys})
    with torch.no_grad():
        expected = float(setup.reference(input_ids=batch["input_ids"], labels=batch["labels"]).loss)
    config = _config(model, split, "gpipe", 4)
    trainer = DeviceTrainer(config, device_id="evaluator", folder=setup.folder)
    trainer.load_adapters({k: v for k, v in setup.adapter.items() if k not in setup.server_keys})
    before = setup.runtime.bank.global_state()
    with StageClient(setup.server.address) as client:
        with client.open(
            SessionRequest(device_id="evaluator", round=0, split=trainer.split, learning_rate=1e-3)
        ) as session:
            runtime = DeviceRuntime(
                trainer.head, trainer.tail, session, optimizer=None, microbatches=4
            )
            loss_sum, tokens = runtime.evaluate(batch, step=0)
    assert loss_sum / tokens == pytest.approx(expected, rel=1e-5)
    after = setup.runtime.bank.global_state()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not [s for s in setup.runtime.sessions() if s.device_id == "evaluator"]


@pytest.fixture(scope="module")
def windowed_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Mistral whose sliding window (4) is shorter than the sequence (16)."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=258,
        max_position_embeddings=64,
        sliding_window=4,
    )
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("windowed") / "tiny-mistral"
    MistralForCausalLM(config).save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("schedule", ["gpipe", "greedy"])
def test_sliding_window_model_over_the_wire_equals_unsplit(
    setups, windowed_folder: str, schedule: str
) -> None:
    setup = _setup(setups, windowed_folder, "u")
    batches = _batches(setup.vocab)
    ref_losses, ref_grads, _ = setup.reference_run(batches)
    losses, grads, _ = _pipelined(setup, _config(windowed_folder, "u", schedule, 4), batches)
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    for key, grad in ref_grads.items():
        assert_close_to_scale(grads[key], grad, rel=1e-4, atol=1e-6, msg=f"grad {key}")


@pytest.mark.parametrize("split", ["u", "two"])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("m", [2, 5])
def test_consecutive_steps_without_step_end_wait_equal_unsplit(
    setups, split: str, schedule: str, m: int
) -> None:
    """Four steps back to back, STEP_DONE collected lazily: losses and adapters stay exact.

    Each step's forwards leave before the previous step's STEP_DONE is read, so this fails if
    the server ever computed a forward before applying the previous step's update.
    """
    setup = _setup(setups, "tiny-llama", split)
    batches = _batches(setup.vocab, n=4)
    ref_losses, _, ref_weights = setup.reference_run(batches)
    losses, _, weights = _pipelined(setup, _config("tiny-llama", split, schedule, m), batches)
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    assert len(set(losses)) == len(losses)  # every step saw updated weights
    for key, value in ref_weights.items():
        assert_close_to_scale(weights[key], value, rel=1e-4, atol=LR * 1e-2, msg=key)


class _FailingAdamW(torch.optim.AdamW):
    def step(self, closure=None):  # type: ignore[no-untyped-def]
        raise RuntimeError("injected optimizer failure")


@pytest.mark.parametrize("wait", [False, True], ids=["lazy", "eager"])
def test_a_failed_server_update_still_surfaces(setups, wait: bool) -> None:
    """The server's optimizer fails: an eager step raises, a lazy one raises at finish()."""
    from fedpipe.errors import StageLinkError

    setup = _setup(setups, "tiny-llama", "u")
    (batch,) = _batches(setup.vocab, n=1)
    config = _config("tiny-llama", "u", "greedy", 2)
    trainer = DeviceTrainer(config, device_id=f"failing-{wait}", folder=setup.folder)
    saved = setup.runtime.optimizer_factory
    setup.runtime.optimizer_factory = lambda p, lr, wd: _FailingAdamW(p, lr=lr)
    try:
        with StageClient(setup.server.address) as client:
            session, _ = trainer.connect(client, optimizer=None)
            runtime = DeviceRuntime(
                trainer.head,
                trainer.tail,
                session,
                optimizer=None,
                microbatches=2,
                wait_step_done=wait,
            )
            with session, pytest.raises(StageLinkError, match="injected optimizer failure"):
                runtime.train_step(batch, step=0)
                runtime.finish()
    finally:
        setup.runtime.optimizer_factory = saved


# The families of the table beyond Llama, Qwen2 and Mistral: tiny random models of each, whose
# blocks the server serves with the batched bank (its own forward and backward of each layout).
_FAMILY_CONFIGS: dict[str, dict] = {
    "qwen3": {"head_dim": 16, "use_sliding_window": True, "max_window_layers": 2},
    "olmo2": {},
    "granite": {"embedding_multiplier": 0.25, "logits_scaling": 3.0, "residual_multiplier": 0.5},
    "smollm3": {"use_sliding_window": True},
    "phi3": {"tie_word_embeddings": True},
    "gemma2": {"head_dim": 16, "attn_logit_softcapping": 2.0, "final_logit_softcapping": 1.0},
    "gemma3_text": {"head_dim": 16, "final_logit_softcapping": 1.0, "tie_word_embeddings": False},
}


@pytest.fixture(scope="module")
def family_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Each family saved once: 4 blocks, width 64, a sliding window (4) shorter than SEQ."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    root = tmp_path_factory.mktemp("families")
    folders = {}
    for model_type, extra in _FAMILY_CONFIGS.items():
        config = CONFIG_MAPPING[model_type](
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=258,
            max_position_embeddings=64,
            sliding_window=4,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            **extra,
        )
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(root / model_type)
        folders[model_type] = str(root / model_type)
    return folders


@pytest.mark.parametrize(
    ("model_type", "split"),
    [(t, "u") for t in _FAMILY_CONFIGS] + [("gemma3_text", "two"), ("granite", "two")],
)
def test_every_family_over_the_wire_equals_unsplit(
    setups, family_folders: dict[str, str], model_type: str, split: str
) -> None:
    folder = family_folders[model_type]
    setup = _setup(setups, folder, split)
    assert type(setup.runtime.bank).__name__ == "BatchedAdapterBank"
    batches = _batches(setup.vocab)
    ref_losses, ref_grads, ref_weights = setup.reference_run(batches)
    losses, grads, weights = _pipelined(setup, _config(folder, split, "gpipe", 2), batches)
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    assert set(grads) == set(ref_grads)
    for key, grad in ref_grads.items():
        assert_close_to_scale(grads[key], grad, rel=1e-4, atol=1e-6, msg=f"grad {key}")
    for key, value in ref_weights.items():
        assert_close_to_scale(weights[key], value, rel=1e-4, atol=LR * 1e-2, msg=key)


INSTRUCT_SEQ = 48


def _instruction_batches(setup: Setup) -> list[dict[str, torch.Tensor]]:
    """Two batches of chats and prompt/completion pairs as rows: labels on the answers only."""
    tok = load_tokenizer(setup.folder)
    docs = []
    for i in range(2 * BATCH):
        user = {"role": "user", "content": "q" * (1 + i % 5)}
        answer = {"role": "assistant", "content": "a" * (2 + i)}
        if i % 4 == 0:
            docs.append(Document(messages=(user, answer, user, answer)))  # two answers
        elif i % 4 == 1:
            docs.append(Document(messages=(user, answer), prompt_turns=1))
        elif i % 4 == 2:
            docs.append(Document(prompt="p" * i, completion="c" * (1 + i)))
        else:
            docs.append(Document(messages=({"role": "system", "content": "s"}, user, answer)))
    rows = example_rows(docs, tok, INSTRUCT_SEQ, loss_on="answers")  # some are truncated
    assert rows.counts.truncated > 0 and rows.counts.rows == 2 * BATCH
    prompt_masked = (rows.labels == IGNORE_INDEX) & (rows.input_ids != tok.pad_token_id)
    assert prompt_masked.any(dim=1).all()  # every row keeps some of its tokens out of the loss
    return [
        {"input_ids": rows.input_ids[i : i + BATCH], "labels": rows.labels[i : i + BATCH]}
        for i in (0, BATCH)
    ]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("split", ["u", "two"])
def test_answers_only_rows_train_as_the_unsplit_model(setups, model: str, split: str) -> None:
    """The split's loss, gradients and weights on masked, padded rows are the unsplit model's
    with the same labels (Hugging Face's loss: the mean over labels that are not -100)."""
    setup = _setup(setups, model, split)
    batches = _instruction_batches(setup)
    ref_losses, ref_grads, ref_weights = setup.reference_run(batches)
    base = _config(model, split, "greedy", 3)
    config = replace(base, train=replace(base.train, seq_len=INSTRUCT_SEQ))
    losses, grads, weights = _pipelined(setup, config, batches)
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    for key, grad in ref_grads.items():
        assert_close_to_scale(grads[key], grad, rel=1e-4, atol=1e-6, msg=f"grad {key}")
    for key, value in ref_weights.items():
        assert_close_to_scale(weights[key], value, rel=1e-4, atol=LR * 1e-2, msg=key)


def _example_batches(vocab: int) -> tuple[list[dict[str, torch.Tensor]], list[dict]]:
    """Two batches of 8 examples (2 to 16 tokens, the first third out of the loss): padded one
    per row, and the same examples packed into fewer rows with their segments."""
    gen = torch.Generator().manual_seed(3)
    padded, packed = [], []
    for _ in range(2):
        examples = []
        for n in torch.randint(2, SEQ + 1, (BATCH,), generator=gen).tolist():
            ids = torch.randint(3, vocab, (n,), generator=gen).tolist()
            cut = max(1, n // 3)
            examples.append((ids, [IGNORE_INDEX] * cut + ids[cut:]))
        ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
        labels = torch.full((BATCH, SEQ), IGNORE_INDEX, dtype=torch.long)
        for r, (i, lab) in enumerate(examples):
            ids[r, : len(i)], labels[r, : len(lab)] = torch.tensor(i), torch.tensor(lab)
        padded.append({"input_ids": ids, "labels": labels})
        rows = pack_examples(examples, SEQ, pad=0)
        assert rows.segments is not None and rows.input_ids.shape[0] < BATCH
        packed.append(
            {"input_ids": rows.input_ids, "labels": rows.labels, "segments": rows.segments}
        )
    return padded, packed


@pytest.mark.parametrize(
    ("model", "split"),
    [("tiny-llama", "u"), ("tiny-llama", "two"), ("tiny-gpt2", "u"), ("gemma3_text", "u")],
)
def test_packed_rows_over_the_wire_train_as_padded_rows_in_the_unsplit_model(
    setups, family_folders: dict[str, str], model: str, split: str
) -> None:
    """Packed rows (data.packing) through the split over loopback gRPC, their segment lengths
    on the ACTIVATION: the loss, every LoRA gradient and the weights after two steps are the
    unsplit model's on the same examples right-padded one per row (Gemma 3: sliding and full
    blocks on the batched bank; GPT-2: the peft bank and absolute positions); so is the
    forward-only evaluation of a packed batch."""
    folder = family_folders.get(model, model)
    setup = _setup(setups, folder, split)
    padded, packed = _example_batches(setup.vocab)
    ref_losses, ref_grads, ref_weights = setup.reference_run(padded)
    config = _config(folder, split, "greedy", 2)
    losses, grads, weights = _pipelined(setup, config, packed)
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    assert set(grads) == set(ref_grads)
    for key, grad in ref_grads.items():
        assert_close_to_scale(grads[key], grad, rel=1e-4, atol=1e-6, msg=f"grad {key}")
    for key, value in ref_weights.items():
        assert_close_to_scale(weights[key], value, rel=1e-4, atol=LR * 1e-2, msg=key)
    load_lora_state_dict(setup.reference, setup.adapter)
    setup.runtime.bank.set_global_state({k: setup.adapter[k] for k in setup.server_keys})
    with torch.no_grad():
        expected = float(setup.reference(**padded[0]).loss)
    trainer = DeviceTrainer(config, device_id="evaluator", folder=setup.folder)
    trainer.load_adapters({k: v for k, v in setup.adapter.items() if k not in setup.server_keys})
    with StageClient(setup.server.address) as client:
        with client.open(
            SessionRequest(device_id="evaluator", round=0, split=trainer.split, learning_rate=1e-3)
        ) as session:
            runtime = DeviceRuntime(
                trainer.head, trainer.tail, session, optimizer=None, microbatches=2
            )
            loss_sum, tokens = runtime.evaluate(packed[0], step=0)
    assert loss_sum / tokens == pytest.approx(expected, rel=1e-5)
