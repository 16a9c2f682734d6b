"""Device and StageServer agree on model and cut: fingerprints, and refusals over real gRPC."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import grpc
import pytest
import torch
from harness.batches import random_batches
from safetensors.torch import load_file, save_file

from fedpipe.config import FedpipeConfig, ModelConfig, PipelineConfig, TrainConfig
from fedpipe.edge.trainer import DeviceTrainer
from fedpipe.errors import SplitMismatchError
from fedpipe.models import model_fingerprint, resolve_model
from fedpipe.models.fingerprint import FINGERPRINT_FILE
from fedpipe.proto import stage_pb2 as pb
from fedpipe.proto import stage_pb2_grpc as pb_grpc
from fedpipe.server.stage_server import StageServer
from fedpipe.split import SplitTerms, check_agreement
from fedpipe.wire.link_client import StageClient

torch.set_num_threads(1)
BATCH, SEQ = 2, 8


def _config(head: int = 1, tail: int = 1, model: str = "tiny-llama") -> FedpipeConfig:
    return FedpipeConfig(
        model=ModelConfig(name=model, head_layers=head, tail_layers=tail),
        pipeline=PipelineConfig(microbatches=2, schedule="gpipe", timeout_s=20.0),
        train=TrainConfig(batch_size=BATCH, seq_len=SEQ, lr=1e-2),
    )


SERVER_CONFIG = _config(1, 1)  # for the `server` fixture (conftest.py)


def _copy(folder: Path, dest: Path) -> Path:
    shutil.copytree(folder, dest)
    (dest / FINGERPRINT_FILE).unlink(missing_ok=True)
    return dest


# -- fingerprints ---------------------------------------------------------------------------------
def test_fingerprint_is_equal_across_homes_and_differs_for_other_models(
    folder: Path, tmp_path: Path
) -> None:
    other_home = resolve_model("tiny-llama", cache_dir=tmp_path / "home2")
    assert other_home != folder
    assert model_fingerprint(other_home) == model_fingerprint(folder)
    assert model_fingerprint(resolve_model("tiny-gpt2")) != model_fingerprint(folder)


def test_one_changed_weight_changes_the_fingerprint(folder: Path, tmp_path: Path) -> None:
    copy = _copy(folder, tmp_path / "copy")
    assert model_fingerprint(copy) == model_fingerprint(folder)
    weights = load_file(str(copy / "model.safetensors"))
    weights["model.norm.weight"][3] += 1e-3
    save_file(weights, str(copy / "model.safetensors"), metadata={"format": "pt"})
    assert model_fingerprint(copy) != model_fingerprint(folder)


def test_saving_details_do_not_change_the_fingerprint(folder: Path, tmp_path: Path) -> None:
    copy = _copy(folder, tmp_path / "copy")
    config = json.loads((copy / "config.json").read_text())
    config.update(_name_or_path="/home/someone/else", transformers_version="0.0.1")
    (copy / "config.json").write_text(json.dumps(config, indent=4))
    assert model_fingerprint(copy) == model_fingerprint(folder)
    config["rms_norm_eps"] = 1e-3  # a setting that changes the maths
    (copy / "config.json").write_text(json.dumps(config))
    assert model_fingerprint(copy) != model_fingerprint(folder)


def test_fingerprint_is_cached_beside_the_model_and_recomputed_when_files_change(
    folder: Path, tmp_path: Path
) -> None:
    copy = _copy(folder, tmp_path / "copy")
    digest = model_fingerprint(copy)
    cache = json.loads((copy / FINGERPRINT_FILE).read_text())
    assert cache["sha256"] == digest
    cache["sha256"] = "0" * 64  # a cached value is trusted while the files are unchanged
    (copy / FINGERPRINT_FILE).write_text(json.dumps(cache))
    assert model_fingerprint(copy) == "0" * 64
    weights = load_file(str(copy / "model.safetensors"))
    save_file(weights, str(copy / "model.safetensors"), metadata={"format": "pt"})
    (copy / "model.safetensors").touch()
    assert model_fingerprint(copy) == digest


def test_a_fresh_model_is_fingerprinted_as_it_is_written(tmp_path: Path) -> None:
    folder = resolve_model("tiny-gpt2", cache_dir=tmp_path)
    cached = json.loads((folder / FINGERPRINT_FILE).read_text())["sha256"]
    assert cached == model_fingerprint(folder) == model_fingerprint(resolve_model("tiny-gpt2"))


def test_a_folder_that_cannot_hold_the_cache_uses_fedpipes_cache(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FEDPIPE_CACHE", str(tmp_path / "cache"))
    copy = _copy(folder, tmp_path / "copy")
    (copy / FINGERPRINT_FILE).mkdir()  # stands in for a read-only folder (tests run as root)
    assert model_fingerprint(copy) == model_fingerprint(folder)
    (entry,) = (tmp_path / "cache" / "fingerprints").iterdir()
    assert json.loads(entry.read_text())["sha256"] == model_fingerprint(folder)


# -- the comparison -------------------------------------------------------------------------------
TERMS = SplitTerms("ab" * 32, num_layers=4, head_layers=1, tail_layers=2, mode="u", hidden_size=64)


def test_matching_terms_pass_and_each_difference_is_named() -> None:
    check_agreement(TERMS, TERMS)
    device = SplitTerms("ab" * 32, 4, 2, 2, "u", 64)
    with pytest.raises(SplitMismatchError) as cut:
        check_agreement(device, TERMS, model="tiny-llama")
    assert "device cut head=2 tail=2 mode=u, server holds head=1 tail=2 mode=u" in str(cut.value)
    assert "--set model.head_layers=1 --set model.tail_layers=2" in str(cut.value)
    other = SplitTerms("cd" * 32, 4, 1, 2, "u", 64)
    with pytest.raises(SplitMismatchError) as model:
        check_agreement(other, TERMS, model="tiny-llama")
    text = str(model.value)
    assert "device model fingerprint cdcdcdcdcdcd" in text
    assert "server model fingerprint abababababab" in text and "'tiny-llama'" in text
    assert "device cut" not in text  # only what differs is named


def test_a_missing_split_is_refused_and_says_why() -> None:
    for device in (None, SplitTerms("", 0, 0, 0, "", 0)):
        with pytest.raises(SplitMismatchError, match="sent no split.*upgrade fedpipe"):
            check_agreement(device, TERMS)


# -- over real loopback gRPC ----------------------------------------------------------------------
def _batches() -> list[dict[str, torch.Tensor]]:
    return random_batches(1, BATCH, SEQ)


def _open_error(server: StageServer, trainer: DeviceTrainer) -> grpc.RpcError:
    with StageClient(server.address) as client, pytest.raises(grpc.RpcError) as info:
        trainer.train_round(client, _batches())
    return info.value


def test_mismatched_cut_is_failed_precondition_with_both_values(
    server: StageServer, folder: Path
) -> None:
    trainer = DeviceTrainer(_config(2, 1), device_id="wrong-cut", folder=folder)
    error = _open_error(server, trainer)
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "device cut head=2 tail=1 mode=u, server holds head=1 tail=1 mode=u" in error.details()
    assert not [s for s in server.runtime.sessions() if s.device_id == "wrong-cut"]


def test_mismatched_model_is_failed_precondition_with_both_fingerprints(
    server: StageServer, folder: Path, tmp_path: Path
) -> None:
    copy = _copy(folder, tmp_path / "other-weights")
    weights = load_file(str(copy / "model.safetensors"))
    weights["model.layers.0.mlp.up_proj.weight"] *= 1.01
    save_file(weights, str(copy / "model.safetensors"), metadata={"format": "pt"})
    trainer = DeviceTrainer(_config(1, 1), device_id="wrong-model", folder=copy)
    error = _open_error(server, trainer)
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"device model fingerprint {model_fingerprint(copy)[:12]}" in error.details()
    assert f"server model fingerprint {model_fingerprint(folder)[:12]}" in error.details()


def test_an_old_client_without_a_split_is_refused(server: StageServer) -> None:
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.StageLinkStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.OpenSession(pb.OpenSessionRequest(device_id="old-client"), timeout=20)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "sent no split" in info.value.details()


def test_matching_split_from_another_home_trains(server: StageServer, tmp_path: Path) -> None:
    elsewhere = resolve_model("tiny-llama", cache_dir=tmp_path / "device-home")
    trainer = DeviceTrainer(_config(1, 1), device_id="match", folder=elsewhere)
    with StageClient(server.address) as client:
        report = trainer.train_round(client, _batches())
    assert len(report.steps) == 1 and report.steps[0].loss > 0
