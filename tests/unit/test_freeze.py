"""pipeline.freeze = progressive: the ServerApp's decision on crafted adapter histories, the
settings that refuse what it cannot do, and the parts that keep frozen blocks as they were."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from fedpipe.config import FedpipeConfig, PipelineConfig
from fedpipe.edge.planner.plan import (
    LinkFigures,
    Measured,
    OpTimes,
    components,
    with_frozen_head,
)
from fedpipe.edge.trainer import DeviceTrainer
from fedpipe.fl.device_work import RunSettings
from fedpipe.fl.freeze import FreezeRule, FreezeState, block_movement, pin_frozen
from fedpipe.fl.server_app import _checkpoint_state
from fedpipe.lora import lora_parameters
from fedpipe.lora.freezing import freeze_blocks, is_frozen, trainable_part
from fedpipe.runs.folder import RunFolder

RULE = FreezeRule(ratio=0.5, after=2, max_blocks=3)


def _history(rule: FreezeRule, rounds: list[dict[int, float]]) -> list[int]:
    """Each round's frozen_below after feeding ``rounds`` of movements in order."""
    state = FreezeState()
    return [state.decide(rule, r, movement) for r, movement in enumerate(rounds, start=1)]


def test_lowest_converged_blocks_freeze_in_order_after_the_warm_up() -> None:
    rounds = [
        {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0},  # round 1: the peaks
        {0: 0.4, 1: 0.4, 2: 0.9, 3: 0.1},  # round 2: 0 and 1 fell to <= half; 2 did not
        {0: 0.4, 1: 0.4, 2: 0.3, 3: 0.1},  # round 3: 2 converged as well
    ]
    assert _history(RULE, rounds) == [0, 2, 3]


def test_nothing_freezes_before_freeze_after_even_when_converged() -> None:
    rule = FreezeRule(ratio=0.5, after=3, max_blocks=3)
    rounds = [{0: 1.0}, {0: 0.1}, {0: 0.1}]
    assert _history(rule, rounds) == [0, 0, 1]


def test_a_block_freezes_only_when_every_block_below_it_is_frozen() -> None:
    # Block 1 converged at once, but block 0 keeps moving: nothing freezes.
    rounds = [{0: 1.0, 1: 1.0}, {0: 1.2, 1: 0.1}, {0: 0.9, 1: 0.1}]
    assert _history(RULE, rounds) == [0, 0, 0]


def test_the_reference_is_the_peak_not_the_first_round() -> None:
    # Movement grows while B leaves zero: round 3's 0.6 is half of no earlier round but of
    # round 2's peak 2.0 it is below half; the peak carries over.
    rounds = [{0: 0.5}, {0: 2.0}, {0: 0.9}]
    assert _history(RULE, rounds) == [0, 0, 1]


def test_frozen_below_never_exceeds_freeze_max_nor_goes_down() -> None:
    rule = FreezeRule(ratio=0.5, after=1, max_blocks=2)
    rounds = [{0: 1.0, 1: 1.0, 2: 1.0}, {0: 0.1, 1: 0.1, 2: 0.1}, {2: 5.0}]
    assert _history(rule, rounds) == [0, 2, 2]


def test_a_block_not_measured_this_round_does_not_freeze() -> None:
    # Block 1 trained on no device (nothing moved): unmeasured, it cannot be called converged.
    rounds = [{0: 1.0, 1: 1.0}, {0: 0.1}]
    assert _history(FreezeRule(ratio=0.5, after=1, max_blocks=4), rounds) == [0, 1]


def test_rule_from_settings_counts_blocks_of_the_model() -> None:
    pipe = PipelineConfig(freeze="progressive", freeze_ratio=0.3, freeze_after=4, freeze_max=0.5)
    assert FreezeRule.of(pipe, 30) == FreezeRule(ratio=0.3, after=4, max_blocks=15)
    assert FreezeRule.of(pipe, 3).max_blocks == 1


def test_state_survives_a_checkpoint_round_trip() -> None:
    state = FreezeState()
    state.decide(FreezeRule(ratio=0.5, after=1, max_blocks=2), 1, {0: 1.0, 1: 2.0})
    state.decide(FreezeRule(ratio=0.5, after=1, max_blocks=2), 2, {0: 0.2, 1: 2.0})
    again = FreezeState.from_json(state.to_json())
    assert again == state and again.frozen_below == 1 and again.peaks == {0: 1.0, 1: 2.0}
    assert FreezeState.from_json(None) == FreezeState()


def _adapter(values: dict[int, float]) -> dict[str, torch.Tensor]:
    out = {}
    for block, value in values.items():
        out[f"model.layers.{block}.self_attn.q_proj.lora_A.weight"] = torch.full((2, 4), value)
        out[f"model.layers.{block}.self_attn.q_proj.lora_B.weight"] = torch.full((4, 2), value)
    return out


def test_movement_is_each_blocks_relative_change() -> None:
    before = _adapter({0: 1.0, 1: 2.0, 2: 1.0})
    after = _adapter({0: 1.5, 1: 2.0, 2: 0.0})
    after["model.layers.0.self_attn.q_proj.base_delta"] = torch.ones(4, 4)  # left out
    before["model.layers.0.self_attn.q_proj.base_delta"] = torch.zeros(4, 4)
    move = block_movement(before, after)
    assert move == {0: pytest.approx(0.5), 2: pytest.approx(1.0)}  # block 1 did not move


def test_pin_frozen_takes_frozen_blocks_from_before_bit_for_bit() -> None:
    before, after = _adapter({0: 1.0, 1: 1.0}), _adapter({0: 1.0 + 1e-7, 1: 3.0})
    pinned = pin_frozen(after, before, frozen_below=1)
    for key, value in pinned.items():
        expected = before[key] if ".layers.0." in key else after[key]
        assert value is expected


def test_freeze_blocks_turns_off_only_the_frozen_blocks_gradients() -> None:
    params = {k: nn.Parameter(v) for k, v in _adapter({0: 1.0, 1: 1.0, 2: 1.0}).items()}
    assert freeze_blocks(params, 2) == 4
    assert {k for k, p in params.items() if p.requires_grad} == set(_adapter({2: 1.0}))
    assert is_frozen("h.1.attn.c_attn.lora_A.weight", 2)
    assert not is_frozen("lm_head.weight", 2)
    assert set(trainable_part(_adapter({0: 1.0, 3: 1.0}), 2)) == set(_adapter({3: 1.0}))


def test_frozen_head_figures_drop_the_head_backward_and_the_gradient_down() -> None:
    figures = Measured(
        batch_size=8,
        device={4: OpTimes(head_forward=1.0, tail=2.0, head_backward=1.5)},
        server={4: (3.0, 4.0)},
        link=LinkFigures(rtt_s=0.05, up_mbps=10.0, down_mbps=20.0),
        message_bytes={("fp32", 4): 100_000},
    )
    frozen = with_frozen_head(figures)
    assert frozen.frozen_head and frozen.device[4].head_backward == 0.0
    trained = components(figures, 4, "fp32", "fp32")
    cut = components(frozen, 4, "fp32", "fp32")
    assert cut.c_b == 0.0 and cut.tau_down_grad == 0.0
    assert trained.c_b == 1.5 and trained.tau_down_grad > 0
    assert cut.c_f == trained.c_f and cut.tau_up_grad == trained.tau_up_grad


def test_settings_refuse_unknown_modes_and_stack() -> None:
    with pytest.raises(ValueError, match="pipeline.freeze must be off or progressive"):
        PipelineConfig(freeze="always")
    with pytest.raises(ValueError, match="freeze_ratio"):
        PipelineConfig(freeze_ratio=1.0)
    with pytest.raises(ValueError, match="freeze_max"):
        PipelineConfig(freeze_max=1.0)
    with pytest.raises(ValueError, match="restarts the adapters every round"):
        FedpipeConfig().with_overrides(
            {"pipeline.freeze": "progressive", "federated.aggregation": "stack"}
        )
    assert PipelineConfig().freeze == "off"


def test_a_checkpoint_keeps_the_decision_for_a_resumed_run(tmp_path: Path) -> None:
    state = FreezeState()
    rule = FreezeRule(ratio=0.5, after=1, max_blocks=2)
    state.decide(rule, 1, {0: 1.0, 1: 1.0})
    state.decide(rule, 2, {0: 0.1, 1: 0.9})
    run = RunSettings(run_id="r")
    folder = RunFolder.open(tmp_path, "run")
    adapter = {"model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(2, 4)}
    folder.save_checkpoint(
        2, device=adapter, server=adapter, state=_checkpoint_state(2, run, state)
    )
    saved = folder.latest_checkpoint()
    assert saved is not None
    assert FreezeState.from_json(saved.state["freeze"]) == state and state.frozen_below == 1
    # pipeline.freeze = off: the checkpoint holds no decision
    assert "freeze" not in _checkpoint_state(2, run, None)


def test_a_frozen_head_turns_the_trainer_forward_only_and_its_planner_plans_anew() -> None:
    cfg = FedpipeConfig().with_overrides(
        {"model.name": "tiny-llama", "pipeline.plan": "auto", "pipeline.freeze": "progressive"}
    )
    trainer = DeviceTrainer(cfg, device_id="d")
    planner = trainer.planner
    assert planner is not None and not trainer.frozen
    planner.figures = Measured(
        batch_size=8,
        device={4: OpTimes(head_forward=1.0, tail=2.0, head_backward=1.5)},
        server={4: (3.0, 4.0)},
        link=LinkFigures(rtt_s=0.05, up_mbps=10.0, down_mbps=20.0),
        message_bytes={("fp32", 4): 100_000},
    )
    trainer.freeze_below(1)  # the head's one block (tiny-llama: head 1, tail 1 of 4)
    assert trainer.frozen and not any(
        p.requires_grad for p in lora_parameters(trainer.head).values()
    )
    assert all(p.requires_grad for p in lora_parameters(trainer.tail).values())
    assert planner.figures.frozen_head and planner.figures.device[4].head_backward == 0.0
    assert "head froze" in planner.replan
    trainer.freeze_below(0)  # a new run in this process: everything trains again
    assert not trainer.frozen
    assert all(p.requires_grad for p in lora_parameters(trainer.head).values())
