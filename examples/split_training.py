"""fedpipe as a library: one StageServer, one emulated phone, a few pipelined split steps.

    python examples/split_training.py [--model tiny-llama] [--link phone-lte] [--schedule greedy]

Prints each step's loss and time, and writes a pipeline timeline (Chrome trace and PNG).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fedpipe.config import load_config
from fedpipe.data import BlockSampler, default_corpus, tokenize_blocks
from fedpipe.edge.trainer import DeviceTrainer
from fedpipe.emulation import parse_device_profile
from fedpipe.models import load_tokenizer
from fedpipe.runs.plots import plot_timeline
from fedpipe.server.build import build_stage_server
from fedpipe.wire.link_client import StageClient


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument(
        "--link",
        default="phone-lte",
        help="device profile, link name, or inline spec such as up=10,down=25,rtt=50ms",
    )
    parser.add_argument("--schedule", default="greedy")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("runs/example"))
    args = parser.parse_args()

    config = load_config(
        None,
        {
            "model.name": args.model,
            "pipeline.schedule": args.schedule,
            "pipeline.microbatches": 4,
            "train.batch_size": 8,
            "train.seq_len": 64,
        },
    )
    server = build_stage_server(config, port=0).start()  # the middle blocks, on port 0
    try:
        device = DeviceTrainer(config, device_id="phone-0", profile=parse_device_profile(args.link))
        tokenizer = load_tokenizer(device.folder)
        blocks = tokenize_blocks(default_corpus()[:20], tokenizer, config.train.seq_len)
        sampler = BlockSampler(blocks, config.train.batch_size, seed=0)
        batches = [sampler.batch(step) for step in range(args.steps)]
        with StageClient(server.address) as client:
            report = device.train_round(client, batches)
        for result in report.steps:
            print(f"step {result.step}: loss {result.loss:.4f} in {result.wall_s:.2f} s")
        print(f"{report.bytes_up / 1e6:.1f} MB up, {report.bytes_down / 1e6:.1f} MB down")
        trace = device.tracer.write(args.out / "timeline.json")
        png = plot_timeline(device.tracer.events, args.out / "timeline.png", title=args.link)
        print(f"timeline: {trace} and {png}")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
