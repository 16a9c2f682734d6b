"""TLS and mutual TLS on the stage link, with certificates from ``fedpipe certs``.

A device that trusts the server's CA trains over TLS; a plaintext one cannot. With client
certificates required, a device with a certificate from the CA trains and the ServerApp's
control client (its own certificate) signs calls; a device without one, or with one from
another CA, is refused at the handshake. A plaintext StageServer says so when it starts.
"""

from __future__ import annotations

import logging
from pathlib import Path

import grpc
import pytest
import torch
from harness.certs import certificates, fedpipe_certs
from harness.stage import stage_server

from fedpipe.auth.tokens import issue_token
from fedpipe.config import FedpipeConfig, load_config
from fedpipe.edge.trainer import DeviceTrainer
from fedpipe.wire.backend import SessionRequest
from fedpipe.wire.control_client import StageControlClient
from fedpipe.wire.link_client import StageClient

SECRET = "a-secret-for-the-tls-tests"
SMALL = {
    "model.name": "tiny-llama",
    "train.batch_size": 4,
    "train.seq_len": 16,
    "pipeline.microbatches": 2,
}


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The files `fedpipe certs` writes, made by running the command."""
    out = tmp_path_factory.mktemp("certs")
    assert "server.tls_cert" in fedpipe_certs(out, "--host", "stage.lan")
    assert (out / "server.key").stat().st_mode & 0o077 == 0  # keys readable by the owner only
    return out


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


def _client(address: str, certs: Path, name: str | None) -> StageClient:
    chain = (certs / f"{name}.pem").read_bytes() if name else None
    key = (certs / f"{name}.key").read_bytes() if name else None
    roots = (certs / "ca.pem").read_bytes()
    return StageClient(address, root_certificates=roots, certificate_chain=chain, private_key=key)


def test_stage_link_over_tls(certs: Path) -> None:
    config = load_config(
        None,
        {
            **SMALL,
            "server.tls_cert": str(certs / "server.pem"),
            "server.tls_key": str(certs / "server.key"),
            "server.tls_ca": str(certs / "ca.pem"),
        },
    )
    with stage_server(config) as server:
        trainer = DeviceTrainer(config, device_id="tls-device")
        with _client(server.address, certs, None) as client:
            report = trainer.train_round(client, [_batch()])
        assert len(report.steps) == 1 and report.steps[0].loss > 0
        with StageClient(server.address, reconnect_s=0) as plaintext:
            with pytest.raises(grpc.RpcError) as info:
                plaintext.open(
                    SessionRequest(device_id="plain", round=0, learning_rate=1e-3), timeout_s=5
                )
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_admits_only_clients_with_a_certificate_from_the_ca(
    certs: Path, tmp_path: Path
) -> None:
    config = load_config(
        None,
        {
            **SMALL,
            "server.tls_cert": str(certs / "server.pem"),
            "server.tls_key": str(certs / "server.key"),
            "server.tls_ca": str(certs / "ca.pem"),
            "server.tls_client_ca": str(certs / "ca.pem"),
            "server.tls_client_cert": str(certs / "serverapp.pem"),
            "server.tls_client_key": str(certs / "serverapp.key"),
        },
    )
    with stage_server(config, secret=SECRET) as server:
        assert server.tls == "mtls"
        chain, key = config.server.client_identity()
        control = StageControlClient(
            server.address,
            SECRET,
            root_certificates=config.server.root_certificates(),
            certificate_chain=chain,
            private_key=key,
        )
        control.reset_adapter()
        control.begin_round(0, "run")
        token = issue_token(SECRET, run_id="run", round=0, device_id="device-0")
        trainer = DeviceTrainer(config, device_id="device-0")
        with _client(server.address, certs, "device-0") as client:
            report = trainer.train_round(client, [_batch()], token=token)
        assert report.steps[0].loss > 0
        assert control.commit_round(0, {"device-0": 1.0})[:2] == (1, 0)
        control.close()

        other = certificates(tmp_path / "other", clients=["device-1"])
        for name, folder in ((None, certs), ("device-1", other.ca.parent)):
            with _client(server.address, folder, name) as stranger:
                stranger.reconnect_s = 0  # a refused handshake is UNAVAILABLE: do not wait
                with pytest.raises(grpc.RpcError) as info:
                    stranger.open(
                        SessionRequest(device_id="device-1", round=0, learning_rate=1e-3),
                        timeout_s=5,
                    )
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE, name


def test_plaintext_stage_link_warns_at_start(caplog: pytest.LogCaptureFixture) -> None:
    """Warned when others can reach it (bound beyond loopback), not for loopback alone."""
    config = FedpipeConfig().with_overrides(SMALL)
    for host, warned in (("0.0.0.0", True), ("127.0.0.1", False)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="fedpipe.server.stage_server"):
            open_ = {"server.host": host, "server.allow_unauthenticated": True}  # no secret here
            with stage_server(config.with_overrides(open_)) as server:
                pass
        assert server.tls == "plaintext"
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("is plaintext" in w and "fedpipe certs" in w for w in warnings) is warned


def test_tls_settings_that_go_together_are_config_errors() -> None:
    with pytest.raises(ValueError, match="tls_cert and server.tls_key go together"):
        load_config(None, {"server.tls_cert": "/x.pem"})
    with pytest.raises(ValueError, match="tls_client_cert and server.tls_client_key go together"):
        load_config(None, {"server.tls_client_cert": "/x.pem"})
    with pytest.raises(ValueError, match="tls_client_ca .* needs server.tls_cert"):
        load_config(None, {"server.tls_client_ca": "/ca.pem"})


def test_device_without_its_own_ca_is_told_to_pass_stage_ca() -> None:
    from fedpipe.fl.device_work import DeviceWork

    config = load_config(None, {**SMALL, "server.tls_ca": "/on/the/server/host/ca.pem"})
    work = DeviceWork(config, device_id="d", partition=0, num_partitions=1)
    with pytest.raises(FileNotFoundError, match="pass `fedpipe client --stage-ca ca.pem`"):
        work.train("127.0.0.1:1", round_=0, token="")
