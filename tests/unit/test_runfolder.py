"""The run folder: checkpoints round-trip and are atomic, resume is guarded, metrics survive a
torn line, summaries are written whole; the plots write real PNGs."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from fedpipe.runs.folder import Checkpoint, RunFolder
from fedpipe.trace import Event

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(8, 6, generator=g)
    return {
        "blocks.0.attn.lora_A": torch.randn(4, 16, generator=g),
        "blocks.0.attn.lora_B": base.t(),  # not contiguous
        "blocks.0.mlp.lora_A": base[:2],  # shares storage with the one above
        "half": torch.randn(3, generator=g).to(torch.bfloat16),
    }


def _save(run: RunFolder, round_: int) -> tuple[dict, dict, dict]:
    device, server = _tensors(round_), _tensors(100 + round_)
    state = {"round": round_, "rng": [1, 2, 3], "strategy": {"name": "FedAvg"}}
    run.save_checkpoint(round_, device=device, server=server, state=state)
    return device, server, state


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert b[k].dtype == a[k].dtype and b[k].is_contiguous()
        assert torch.equal(a[k], b[k]), k


def test_checkpoint_round_trip(tmp_path: Path) -> None:
    run = RunFolder.open(tmp_path, "rt")
    device, server, state = _save(run, 3)
    assert (run.path / "checkpoints" / "round-0003" / "device.safetensors").is_file()

    ckpt = run.load_checkpoint(3)
    assert isinstance(ckpt, Checkpoint) and ckpt.round == 3
    assert ckpt.path == run.path / "checkpoints" / "round-0003"
    _assert_same(device, ckpt.device)
    _assert_same(server, ckpt.server)
    assert ckpt.state == state
    with pytest.raises(AttributeError):
        ckpt.round = 4  # type: ignore[misc]


def test_latest_checkpoint_and_overwrite(tmp_path: Path) -> None:
    run = RunFolder.open(tmp_path, "latest")
    assert run.latest_checkpoint() is None
    for r in (1, 2, 10):
        _save(run, r)
    latest = run.latest_checkpoint()
    assert latest is not None and latest.round == 10

    device, _, _ = _save(run, 10)  # a resumed run repeating a round replaces it
    _assert_same(device, run.load_checkpoint(10).device)
    assert [p.name for p in (run.path / "checkpoints").iterdir() if p.name.startswith(".")] == []
    with pytest.raises(FileNotFoundError, match="have rounds"):
        run.load_checkpoint(7)


def test_latest_skips_tmp_incomplete_and_corrupt(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = RunFolder.open(tmp_path, "atomic")
    _save(run, 1)
    ckpts = run.path / "checkpoints"
    # A crash mid-save leaves a tmp folder; it must not count even though it looks like round 9.
    tmp = ckpts / ".tmp-round-0009-abc"
    tmp.mkdir()
    for f in ("device.safetensors", "server.safetensors", "state.json"):
        (tmp / f).write_bytes((ckpts / "round-0001" / f).read_bytes())
    # A round folder missing a file, and one with a torn tensor file.
    _save(run, 2)
    (ckpts / "round-0002" / "server.safetensors").unlink()
    _save(run, 3)
    torn = ckpts / "round-0003" / "device.safetensors"
    torn.write_bytes(torn.read_bytes()[:20])

    with caplog.at_level(logging.WARNING, logger="fedpipe.runs.folder"):
        latest = run.latest_checkpoint()
    assert latest is not None and latest.round == 1
    assert "round 3" in caplog.text and "corrupt" in caplog.text
    assert "round 2" in caplog.text and "missing server.safetensors" in caplog.text


def test_failed_save_leaves_nothing(tmp_path: Path) -> None:
    run = RunFolder.open(tmp_path, "fail")
    with pytest.raises(TypeError, match="not a tensor"):
        run.save_checkpoint(1, device={"w": [1.0]}, server={}, state={})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="JSON"):
        run.save_checkpoint(1, device={}, server={}, state={"x": object()})
    assert list((run.path / "checkpoints").iterdir()) == []


def test_resume_guard(tmp_path: Path) -> None:
    run = RunFolder.open(tmp_path, "exp")
    assert RunFolder.open(tmp_path, "exp").path == run.path  # no checkpoints yet: reused
    _save(run, 0)
    with pytest.raises(ValueError, match="--resume.*--name"):
        RunFolder.open(tmp_path, "exp")
    resumed = RunFolder.open(tmp_path, "exp", resume=True)
    latest = resumed.latest_checkpoint()
    assert latest is not None and latest.round == 0
    (tmp_path / "empty").mkdir()
    RunFolder.open(tmp_path, "empty")  # an existing empty folder is fine
    with pytest.raises(ValueError, match="plain folder name"):
        RunFolder.open(tmp_path, "../escape")


def test_metrics_append_and_torn_line(tmp_path: Path) -> None:
    run = RunFolder.open(tmp_path, "metrics")
    run.log_metrics({"round": 0, "eval_loss": 4.5})
    run.log_metrics({"round": 1, "train_loss": torch.tensor(3.25), "eval_loss": 3.5})
    with (run.path / "metrics.jsonl").open("a") as f:
        f.write('{"round": 2, "eval_lo')  # a crash mid-write

    hist = run.history()
    assert [r["round"] for r in hist] == [0, 1]
    assert hist[1]["train_loss"] == 3.25 and isinstance(hist[0]["time"], float)

    resumed = RunFolder.open(tmp_path, "metrics", resume=True)
    resumed.log_metrics({"round": 2, "eval_loss": 3.0})  # starts on a fresh line
    assert [r["round"] for r in resumed.history()] == [0, 1, 2]


def test_summary_and_paths(tmp_path: Path) -> None:
    run = RunFolder.open(tmp_path, "sum")
    path = run.write_summary({"rounds": 3, "final_eval_loss": 2.5, "out": run.path})
    assert path == run.path / "summary.json"
    assert json.loads(path.read_text()) == {
        "rounds": 3,
        "final_eval_loss": 2.5,
        "out": str(run.path),
    }
    assert "\n  " in path.read_text()  # pretty
    run.write_summary({"rounds": 4})
    assert json.loads(path.read_text()) == {"rounds": 4}
    assert sorted(p.name for p in run.path.iterdir()) == ["checkpoints", "summary.json"]

    assert run.trace_path("step-1") == run.path / "traces" / "step-1.json"
    assert run.plot_path("losses") == run.path / "plots" / "losses.png"
    assert run.plot_path("losses").parent.is_dir()
    with pytest.raises(ValueError):
        run.plot_path("../x")


def _is_png(path: Path) -> bool:
    data = path.read_bytes()
    return len(data) > 1000 and data[:8] == PNG_MAGIC


def test_plots_write_pngs(tmp_path: Path) -> None:
    from fedpipe.runs import plots

    rounds = [{"round": 0, "eval_loss": 5.0}] + [
        {"round": r, "train_loss": 5.0 - r * 0.4, "eval_loss": 5.1 - r * 0.4} for r in (1, 2, 3)
    ]
    assert _is_png(plots.plot_losses(rounds, tmp_path / "losses.png"))

    events = []
    for mb in range(3):
        t = 0.010 * mb
        events += [
            Event(f"F{mb}", "device", 100 + t, 100 + t + 0.004),
            Event(f"up{mb}", "uplink", 100 + t + 0.004, 100 + t + 0.008),
            Event(f"Sf{mb}", "server", 100 + t + 0.008, 100 + t + 0.010),
            Event(f"down{mb}", "downlink", 100 + t + 0.010, 100 + t + 0.012),
            Event(f"T{mb}", "device", 100 + t + 0.012, 100 + t + 0.014),
            Event(f"B{mb}", "device", 100 + t + 0.020, 100 + t + 0.022),
        ]
    events.append(Event("O", "device", 100.05, 100.06))
    events.append(Event("gc", "host", 100.0, 100.001))
    out = plots.plot_timeline(events, tmp_path / "sub" / "timeline.png", title="1F1B, 3 mb")
    assert _is_png(out)

    times = {"device-0": [0.21, 0.25, 0.22], "device-1": [0.5, 0.45], "device-2": []}
    assert _is_png(plots.plot_step_times(times, tmp_path / "steps.png"))


def test_plots_with_no_data(tmp_path: Path) -> None:
    from fedpipe.runs import plots

    assert _is_png(plots.plot_losses([], tmp_path / "a.png"))
    assert _is_png(plots.plot_timeline([], tmp_path / "b.png"))
    assert _is_png(plots.plot_step_times({}, tmp_path / "c.png"))


def test_checkpoint_files_and_folders_are_fsynced_before_the_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every file of a checkpoint and its folder reach the disk before the folder is renamed
    into place; the parent folder (holding the rename) is fsynced after."""
    import os

    run = RunFolder.open(tmp_path, "durable")
    final = run.path / "checkpoints" / "round-0001"
    synced: list[tuple[str, bool]] = []  # (what, did the final folder exist yet)
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append((os.readlink(f"/proc/self/fd/{fd}"), final.exists()))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    _save(run, 1)
    names = [Path(p).name for p, _ in synced]
    before = [Path(p).name for p, exists in synced if not exists]
    for f in ("device.safetensors", "server.safetensors", "state.json"):
        assert f in before, synced
    assert any(n.startswith(".tmp-round-0001-") for n in before), synced
    assert names[-1] == "checkpoints" and synced[-1][1], synced


def test_settings_round_trip(tmp_path: Path) -> None:
    run = RunFolder.open(tmp_path, "settings")
    assert run.load_settings() is None
    run.save_settings({"model.name": "tiny-llama", "federated.rounds": 3})
    assert run.load_settings() == {"model.name": "tiny-llama", "federated.rounds": 3}
    assert [p.name for p in run.path.iterdir() if p.name.startswith(".tmp")] == []


def test_plots_mark_failed_devices(tmp_path: Path) -> None:
    from fedpipe.runs import plots

    rounds = [
        {"round": 0, "eval_loss": 5.0},
        {"round": 1, "eval_loss": 4.8, "devices_trained": 2, "devices_failed": 1},
        {"round": 2, "eval_loss": 4.6, "devices_trained": 3, "devices_failed": 0},
    ]
    assert _is_png(plots.plot_losses(rounds, tmp_path / "loss.png"))
    assert _is_png(plots.plot_devices(rounds, tmp_path / "devices.png"))
    times = {"partition 0 (loopback)": [0.2, 0.3], "partition 1 (phone-lte)": [0.9]}
    failed = {"partition 2 (rpi-wifi)"}  # failed in every round: no step times, still shown
    assert _is_png(plots.plot_step_times(times, tmp_path / "steps.png", failed=failed))
    assert _is_png(plots.plot_devices([], tmp_path / "none.png"))
