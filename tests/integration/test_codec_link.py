"""Low-bit codecs, error feedback and delta coding over a real stage link on loopback gRPC."""

from __future__ import annotations

import grpc
import pytest
import torch
from harness.batches import random_batches

from fedpipe.config import FedpipeConfig, PipelineConfig, TrainConfig
from fedpipe.data.rows import pack_examples
from fedpipe.edge.trainer import DeviceTrainer, split_terms
from fedpipe.models import resolve_model
from fedpipe.proto import stage_pb2 as pb
from fedpipe.proto import stage_pb2_grpc as pb_grpc
from fedpipe.server.stage_server import StageServer
from fedpipe.wire.link_client import StageClient
from fedpipe.wire.serde import split_to_proto

BATCH, SEQ = 4, 16
PIPELINE = PipelineConfig(microbatches=2, schedule="gpipe", timeout_s=20.0)
TRAIN = TrainConfig(batch_size=BATCH, seq_len=SEQ, lr=1e-2)


# for the `server` fixture (conftest.py)
SERVER_CONFIG = FedpipeConfig(pipeline=PIPELINE, train=TRAIN)


def _batches() -> list[dict[str, torch.Tensor]]:
    """Two batches, each seen twice: the second epoch's activations are delta-coded."""
    firsts = random_batches(2, BATCH, SEQ)
    return firsts + firsts


def _run(server: StageServer, folder, device_id: str, batches=None, **pipeline: object):  # type: ignore[no-untyped-def]
    """A fresh device's steps over ``batches`` (``_batches()``); returns (losses, its session)."""
    config = FedpipeConfig(
        pipeline=PipelineConfig(**{**PIPELINE.__dict__, **pipeline}), train=TRAIN
    )
    trainer = DeviceTrainer(config, device_id=device_id, folder=folder)
    optimizer = torch.optim.SGD(trainer.parameters(), lr=TRAIN.lr)
    with StageClient(server.address) as client:
        session, runtime = trainer.connect(client, optimizer=optimizer)
        with session:
            steps = enumerate(batches or _batches())
            losses = [runtime.train_step(b, step=i).loss for i, b in steps]
            runtime.finish()
    return losses, session


def test_int4_both_ways_with_feedback_and_delta_trains_close_to_lossless(
    server: StageServer, folder
) -> None:  # type: ignore[no-untyped-def]
    lossless, plain = _run(server, folder, "lossless")
    lossy, session = _run(
        server,
        folder,
        "int4",
        uplink_codec="int4",
        downlink_codec="int4",
        error_feedback=True,
        delta=True,
    )
    assert lossy[0] == pytest.approx(lossless[0], rel=1e-3)  # the same weights, coded tensors
    assert lossy == pytest.approx(lossless, rel=3e-3)  # and after three updates from coded grads
    assert lossy != lossless  # the codec did act
    encoder = session._encoder
    assert encoder.delta is not None
    # Both epochs' 8 samples: the first epoch whole, the second as differences that the
    # server rebuilt from its mirrored cache (a mismatch would have failed the step).
    assert (encoder.delta.rows_whole, encoder.delta.rows_delta) == (8, 8)
    assert encoder.feedback.nbytes > 0  # output gradients' residuals kept
    # int4 with 64-value groups: 4.5 bits a value against fp32's 32.
    assert session.stats.bytes_up < plain.stats.bytes_up / 6


def test_a_delta_cache_beyond_the_server_limit_is_refused(server: StageServer) -> None:
    config = FedpipeConfig(pipeline=PIPELINE, train=TRAIN)
    request = pb.OpenSessionRequest(
        device_id="greedy",
        learning_rate=1e-2,
        split=split_to_proto(split_terms(config, resolve_model("tiny-llama"))),
        delta_cache_bytes=2**40,
    )
    with grpc.insecure_channel(server.address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.StageLinkStub(channel).OpenSession(request, timeout=20)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "server.max_delta_cache_mb" in str(info.value.details())


def _packed_batches() -> list[dict[str, torch.Tensor]]:
    """Two batches of packed rows (data.packing: 2-8 token examples, first fit into rows of
    SEQ), each seen twice; then the first batch's ids again with its segments merged into one
    example a row (the same ids, other activations)."""
    gen = torch.Generator().manual_seed(11)
    firsts = []
    for _ in range(2):
        examples = []
        for n in torch.randint(2, 9, (8,), generator=gen).tolist():
            ids = torch.randint(3, 250, (n,), generator=gen).tolist()
            examples.append((ids, ids))
        rows = pack_examples(examples, SEQ, pad=0)
        assert rows.segments is not None and int(rows.segments.max()) > 0
        firsts.append(
            {"input_ids": rows.input_ids, "labels": rows.labels, "segments": rows.segments}
        )
    merged = {**firsts[0], "segments": torch.zeros_like(firsts[0]["segments"])}
    return firsts + firsts + [merged]


def test_packed_rows_are_delta_coded_by_ids_and_segments_and_train_as_without(
    server: StageServer, folder
) -> None:  # type: ignore[no-untyped-def]
    """pipeline.delta with packed rows: the second epoch goes as differences (its rows and
    their segments seen before), the same ids with other segments go whole, and the losses are
    those of the run without delta coding."""
    batches = _packed_batches()
    rows = [int(b["input_ids"].shape[0]) for b in batches]
    plain, _ = _run(server, folder, "packed-plain", batches=batches)
    coded, session = _run(server, folder, "packed-delta", batches=batches, delta=True)
    assert coded == pytest.approx(plain, rel=1e-5, abs=1e-6)
    delta = session._encoder.delta
    assert delta is not None
    assert (delta.rows_whole, delta.rows_delta) == (rows[0] + rows[1] + rows[4], rows[2] + rows[3])
