"""The stage link's message path against a plain grpcio bytes stream, same loopback, same run.

Both sides stream ``--messages`` messages of one SmolLM2-sized activation (8 x 512 x 576 fp32,
9.4 MB) up and get a message of the same size back for each, as a middle stage answers an
activation with its output. The stage link frames with ``msg_to_wire``, travels a
``StageLink/Exchange`` method registered as the StageServer registers it (bytes in and out) and
decodes with ``msg_from_wire`` on both sides, with the server's bounds checks; the plain stream
sends ``bytes`` through a method of its own. Trials alternate between the two so drift hits
both alike; the medians are compared.

    python benchmarks/transport_bench.py --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import torch

from fedpipe.messages import Kind, StageMsg
from fedpipe.wire.channels import EXCHANGE_METHOD, channel_options
from fedpipe.wire.serde import MessageBounds, msg_from_wire, msg_to_wire

SHAPE = (8, 512, 576)  # SmolLM2-135M: microbatch 8, 512 tokens, hidden 576
_PLAIN = "/bench.Plain/Echo"
_MAX_BYTES = 64 * 2**20


def _stage_echo(bounds: MessageBounds):  # type: ignore[no-untyped-def]
    """An Exchange that decodes as the StageServer does and answers with an output."""

    def exchange(request_iterator, context):  # type: ignore[no-untyped-def]
        for frame in request_iterator:
            msg = msg_from_wire(frame, bounds=bounds, max_elements=_MAX_BYTES)
            reply = StageMsg(Kind.OUTPUT, msg.step, msg.microbatch, tensor=msg.tensor)
            yield msg_to_wire(reply, session_id="bench", codec="fp32")

    return exchange


def _plain_echo(request_iterator, context):  # type: ignore[no-untyped-def]
    yield from request_iterator  # each message straight back: grpcio's own copies only


def _serve() -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(4), options=channel_options(_MAX_BYTES))
    bounds = MessageBounds(hidden_size=SHAPE[2], max_batch=SHAPE[0], max_tokens=SHAPE[1])
    stage = grpc.method_handlers_generic_handler(
        "fedpipe.proto.StageLink",
        {"Exchange": grpc.stream_stream_rpc_method_handler(_stage_echo(bounds))},
    )
    plain = grpc.method_handlers_generic_handler(
        "bench.Plain", {"Echo": grpc.stream_stream_rpc_method_handler(_plain_echo)}
    )
    server.add_generic_rpc_handlers((stage, plain))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def _stage_trial(channel: grpc.Channel, tensor: torch.Tensor, n: int) -> float:
    """Seconds to send ``n`` activations and decode their ``n`` outputs over StageLink."""
    exchange = channel.stream_stream(EXCHANGE_METHOD)

    def requests() -> Iterator[bytes]:
        for mb in range(n):
            msg = StageMsg(Kind.ACTIVATION, 0, mb, tensor=tensor)
            yield msg_to_wire(msg, session_id="bench", codec="fp32")

    start = time.perf_counter()
    for frame in exchange(requests()):
        reply = msg_from_wire(frame, max_elements=_MAX_BYTES)
        assert reply.tensor is not None and reply.tensor.shape == tensor.shape
    return time.perf_counter() - start


def _plain_trial(channel: grpc.Channel, payload: bytes, n: int) -> float:
    """Seconds to send ``payload`` ``n`` times and receive it back ``n`` times."""
    call = channel.stream_stream(_PLAIN)
    start = time.perf_counter()
    for data in call(iter([payload] * n)):
        assert len(data) == len(payload)
    return time.perf_counter() - start


def run(messages: int = 8, trials: int = 5) -> dict[str, float]:
    """Median throughputs (MB/s, both directions counted) and their ratio."""
    tensor = torch.randn(SHAPE)
    payload = tensor.numpy().tobytes()  # real values: no zero pages the kernel could share
    nbytes = len(payload)
    server, address = _serve()
    channel = grpc.insecure_channel(address, options=channel_options(_MAX_BYTES))
    try:
        _stage_trial(channel, tensor, 2)  # warm both paths up: connection, first-touch pages
        _plain_trial(channel, payload, 2)
        stage, plain = [], []
        for _ in range(trials):
            stage.append(_stage_trial(channel, tensor, messages))
            plain.append(_plain_trial(channel, payload, messages))
    finally:
        channel.close()
        server.stop(grace=None)
    moved_mb = 2 * messages * nbytes / 1e6
    stage_mbs = moved_mb / statistics.median(stage)
    plain_mbs = moved_mb / statistics.median(plain)
    return {
        "ratio": round(stage_mbs / plain_mbs, 3),
        "stage_mb_per_s": round(stage_mbs, 1),
        "plain_grpc_mb_per_s": round(plain_mbs, 1),
        "message_mb": round(nbytes / 1e6, 2),
        "messages": messages,
        "trials": trials,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=8, help="messages each way per trial")
    parser.add_argument("--trials", type=int, default=5, help="alternating trials of each path")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = run(args.messages, args.trials)
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"stage link {result['stage_mb_per_s']} MB/s, plain grpcio "
            f"{result['plain_grpc_mb_per_s']} MB/s: ratio {result['ratio']} "
            f"({result['message_mb']} MB messages)"
        )


if __name__ == "__main__":
    main()
