"""The stage link (StageClient -> a real StageServer) against a plain grpcio bytes stream.

Both paths move ``--messages`` messages of one activation (microbatch 8 x 512 tokens x the
model's hidden size, fp32: 9.4 MB for SmolLM2-135M) up and a message of the same size back for
each, one round trip at a time (a stream answers one link probe at a time), in the same
process and run, over loopback:

- **stage link**: the StageServer that ``fedpipe server`` runs, built from the same settings
  (:func:`~fedpipe.server.build.build_stage_server`), and a :class:`StageClient` session as a
  device opens one. The messages are ECHOs: the device's encoder and gRPC stream, the server's
  link servicer decoding each one with the session's bounds, a reply of the same shape
  encoded by the server's stream encoder, and the device's reader and decoder. The server's
  link servicer answers an ECHO beside the compute worker, so **no compute is in the figure**
  and none is subtracted: nothing runs the model (the scheduler's queue is skipped too).
- **plain grpcio**: the same payload as ``bytes`` through a stream-stream method whose
  handler sends each message straight back (grpcio's own copies only), also one round trip at
  a time.

Trials alternate between the two paths so that drift hits both alike; each stage trial is one
session (opened and closed outside the timed part), and the medians are compared. The JSON
says what crossed: how many sessions the server opened, the ECHOs its streams answered, and
the bytes the device's sessions counted on the wire.

    python benchmarks/transport_bench.py --json
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import time
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch
import xxhash

from fedpipe.config import FedpipeConfig
from fedpipe.messages import Kind, StageMsg
from fedpipe.server.build import build_stage_server
from fedpipe.server.sessions import RuntimeLimits
from fedpipe.server.stage_server import StageServer
from fedpipe.wire.backend import SessionRequest
from fedpipe.wire.channels import channel_options
from fedpipe.wire.link_client import StageClient
from fedpipe.wire.serde import msg_to_wire

MICROBATCH, SEQ_LEN = 8, 512  # a SmolLM2-135M activation: 8 x 512 x 576 fp32
CODEC = "fp32"
_PLAIN = "/bench.Plain/Echo"


@dataclass
class _StageTally:
    """What the stage trials moved, as the server and the device's sessions counted it."""

    sessions: int = 0  # sessions the server held open during a trial
    echoes: int = 0  # ECHOs the server's streams answered
    bytes_up: int = 0  # the device sessions' wire bytes (SessionStats), both ways
    bytes_down: int = 0
    seconds: list[float] = field(default_factory=list)


def _plain_echo(request_iterator, context):  # type: ignore[no-untyped-def]
    yield from request_iterator  # each message straight back: grpcio's own copies only


def _plain_server(max_bytes: int) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(4), options=channel_options(max_bytes))
    plain = grpc.method_handlers_generic_handler(
        "bench.Plain", {"Echo": grpc.stream_stream_rpc_method_handler(_plain_echo)}
    )
    server.add_generic_rpc_handlers((plain,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def _stage_trial(
    server: StageServer, client: StageClient, tensor: torch.Tensor, n: int, tally: _StageTally
) -> float:
    """Seconds to send ``n`` activation-sized ECHOs on a new session and receive their replies."""
    session = client.open(
        SessionRequest(
            device_id="transport-bench",
            round=0,
            microbatch_size=MICROBATCH,
            seq_len=SEQ_LEN,
            uplink_codec=CODEC,
            downlink_codec=CODEC,
            split=server.split,
            learning_rate=1e-3,
        )
    )
    try:
        start = time.perf_counter()
        for mb in range(n):  # one probe outstanding at a time, as the server allows
            session.send(StageMsg(Kind.ECHO, 0, mb, tensor=tensor, tokens=MICROBATCH))
            reply = session.receive(Kind.ECHO, 0, mb)
            assert reply.tensor is not None and reply.tensor.shape == tensor.shape
        seconds = time.perf_counter() - start
        held = server.runtime.session(session.session_id)  # the server's own record of it
        tally.sessions += 1
        tally.echoes += held.echoes
    finally:
        session.close()
    tally.bytes_up += session.stats.bytes_up
    tally.bytes_down += session.stats.bytes_down
    return seconds


def _checksum_frame(tensor: torch.Tensor) -> bytes:
    """A real ECHO frame of ``tensor``: what each of the four checks of a round trip reads
    (the device seals, the server checks, the server seals its reply, the device checks)."""
    return msg_to_wire(StageMsg(Kind.ECHO, 0, 0, tensor=tensor), session_id="s" * 32, codec=CODEC)


def _checksum_seconds(frame: bytes, repeats: int = 5) -> float:
    """Median seconds of one XXH3-64 over ``frame``, ``repeats`` times in a row."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        xxhash.xxh3_64_intdigest(frame)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _plain_trial(channel: grpc.Channel, payload: bytes, n: int) -> float:
    """Seconds to send ``payload`` and receive it back, ``n`` round trips one after another."""
    sends: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
    replies = channel.stream_stream(_PLAIN)(iter(sends.get, None))
    start = time.perf_counter()
    for _ in range(n):
        sends.put(payload)
        assert len(next(replies)) == len(payload)
    seconds = time.perf_counter() - start
    sends.put(None)
    for _ in replies:  # the stream's end
        pass
    return seconds


def run(messages: int = 8, trials: int = 5, model: str = "default") -> dict[str, Any]:
    """Median throughputs (MB/s of tensor payload, both directions counted), their ratio, and
    what crossed the stage link."""
    most = RuntimeLimits().max_echoes
    if not 1 <= messages <= most:
        raise ValueError(f"--messages must be in 1..{most} (ECHOs a session may send)")
    cfg = FedpipeConfig().with_overrides({"model.name": model})
    server = build_stage_server(cfg, port=0).start()
    tensor = torch.randn(MICROBATCH, SEQ_LEN, server.split.hidden_size)
    payload = tensor.numpy().tobytes()  # real values: no zero pages the kernel could share
    max_bytes = cfg.server.max_message_bytes
    plain_server, plain_address = _plain_server(max_bytes)
    client = StageClient(server.address, max_message_bytes=max_bytes)
    channel = grpc.insecure_channel(plain_address, options=channel_options(max_bytes))
    warm, tally = _StageTally(), _StageTally()
    frame = _checksum_frame(tensor)
    crc: list[float] = []
    try:
        _stage_trial(server, client, tensor, 2, warm)  # warm both paths up: connections, pages
        _plain_trial(channel, payload, 2)
        plain = []
        for _ in range(trials):
            tally.seconds.append(_stage_trial(server, client, tensor, messages, tally))
            # Timed beside each stage trial, so both see the same load on a shared machine.
            crc.append(_checksum_seconds(frame))
            plain.append(_plain_trial(channel, payload, messages))
    finally:
        channel.close()
        client.close()
        plain_server.stop(grace=None)
        server.stop(grace=None)
    crc_s, frame_bytes = statistics.median(crc), len(frame)
    moved_mb = 2 * messages * len(payload) / 1e6
    stage_mbs = moved_mb / statistics.median(tally.seconds)
    plain_mbs = moved_mb / statistics.median(plain)
    return {
        "ratio": round(stage_mbs / plain_mbs, 3),
        "stage_mb_per_s": round(stage_mbs, 1),
        "plain_grpc_mb_per_s": round(plain_mbs, 1),
        "message_mb": round(len(payload) / 1e6, 2),
        # The checksums' share of the stage link's time: 4 XXH3-64 per round trip.
        "checksum_ms_per_frame": round(crc_s * 1e3, 3),
        "checksum_gb_per_s": round(frame_bytes / crc_s / 1e9, 1),
        "checksum_share": round(4 * messages * crc_s / statistics.median(tally.seconds), 4),
        "shape": list(tensor.shape),
        "codec": CODEC,
        "model": model,
        "messages": messages,
        "trials": trials,
        "stage_path": "StageClient session -> StageServer (build_stage_server) ECHO -> reply",
        "compute": "none: ECHOs are answered by the server's link servicer, the model never runs",
        "server_sessions": tally.sessions,
        "server_echoes": tally.echoes,
        "session_bytes_up": tally.bytes_up,
        "session_bytes_down": tally.bytes_down,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=8, help="messages each way per trial")
    parser.add_argument("--trials", type=int, default=5, help="alternating trials of each path")
    parser.add_argument(
        "--model", default="default", help="the StageServer's model (sets the hidden size)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = run(args.messages, args.trials, args.model)
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"stage link {result['stage_mb_per_s']} MB/s, plain grpcio "
            f"{result['plain_grpc_mb_per_s']} MB/s: ratio {result['ratio']} "
            f"({result['message_mb']} MB messages, {result['server_echoes']} ECHOs answered "
            f"by the StageServer in {result['server_sessions']} sessions)"
        )


if __name__ == "__main__":
    main()
