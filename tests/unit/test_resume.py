"""Resume that remembers: the run folder's settings are the base, explicit changes win, and
changes the checkpoints cannot continue with are refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedpipe.config import FedpipeConfig, load_config
from fedpipe.launch.run import simulate
from fedpipe.runs.folder import RunFolder
from fedpipe.runs.resume import ResumeRefused, resume_settings

SAVED = load_config(
    None, {"federated.num_devices": 8, "federated.rounds": 2, "model.lora_r": 4}
).to_flat()


def test_resume_without_flags_reuses_the_saved_settings() -> None:
    config, notes = resume_settings(SAVED, FedpipeConfig(), explicit=set())
    assert config.to_flat() == SAVED
    assert config.federated.num_devices == 8 and notes == []


def test_harmless_changes_are_allowed_and_said() -> None:
    asked = load_config(None, {"federated.rounds": 5, "train.lr": 1e-3})
    config, notes = resume_settings(SAVED, asked, explicit={"federated.rounds", "train.lr"})
    assert config.federated.rounds == 5 and config.model.lora_r == 4
    assert config.federated.num_devices == 8  # not given: the saved value, not the default
    assert notes == [
        "resuming with federated.rounds changed: 2 -> 5",
        "resuming with train.lr changed: 0.002 -> 0.001",
    ]


def test_a_change_that_cannot_be_continued_is_refused_in_one_line() -> None:
    asked = load_config(None, {"model.lora_r": 16})
    with pytest.raises(ResumeRefused) as info:
        resume_settings(SAVED, asked, explicit={"model.lora_r"})
    message = str(info.value)
    assert "\n" not in message
    assert "model.lora_r was 4, now 16" in message and "--name" in message


def test_an_api_caller_passing_a_whole_config_changes_what_differs() -> None:
    asked = load_config(None, {**SAVED, "federated.rounds": 3})
    config, notes = resume_settings(SAVED, asked)
    assert config.federated.rounds == 3 and notes == [
        "resuming with federated.rounds changed: 2 -> 3"
    ]
    with pytest.raises(ResumeRefused, match="federated.num_devices was 8, now 4"):
        resume_settings(SAVED, load_config(None, {**SAVED, "federated.num_devices": 4}))


def test_a_run_folder_without_settings_resumes_with_what_it_is_given() -> None:
    config, notes = resume_settings(None, FedpipeConfig(), explicit=set())
    assert config == FedpipeConfig() and "records no settings" in notes[0]


def test_simulate_refuses_before_starting_anything(tmp_path: Path) -> None:
    RunFolder.open(tmp_path, "r").save_settings(SAVED)
    asked = load_config(None, {"model.lora_r": 16})
    with pytest.raises(ResumeRefused, match="model.lora_r"):
        simulate(asked, name="r", runs_dir=tmp_path, resume=True, explicit={"model.lora_r"})
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["checkpoints", "settings.json"]
    assert RunFolder.open(tmp_path, "r").load_settings() == SAVED  # unchanged


def test_a_changed_stage_link_defence_is_refused() -> None:
    """The accountant prices every round with one mechanism: the noise cannot change mid-run."""
    saved = {**SAVED, "privacy.activation_clip": 1.0, "privacy.activation_noise": 0.5}
    asked = load_config(None, {**saved, "privacy.activation_noise": 0.1})
    with pytest.raises(ResumeRefused, match="privacy.activation_noise was 0.5, now 0.1"):
        resume_settings(saved, asked, explicit={"privacy.activation_noise"})
