"""Step time with and without waiting for STEP_DONE at each step's end, on one emulated link.

One session (tiny-llama, U split, greedy, 4 microbatches of 2 x 64) over a 100 Mbit/s link with
100 ms RTT; blocks of 5 steps alternate between a lazy STEP_DONE and a step-end wait, so drift
hits both alike. Each block ends by collecting its last STEP_DONE, so the lazy figure includes
that one wait spread over its 5 steps.

    python benchmarks/step_end_bench.py
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from fedpipe.config import FedpipeConfig, ModelConfig, PipelineConfig, ServerConfig, TrainConfig
from fedpipe.edge.trainer import DeviceTrainer
from fedpipe.server.build import build_runtime
from fedpipe.server.stage_server import StageServer
from fedpipe.wire.link_client import StageClient

STEPS_PER_BLOCK, BLOCKS, LINK = 5, 6, "100mbit-100ms"


def main() -> None:
    torch.set_num_threads(1)
    cfg = FedpipeConfig(
        model=ModelConfig(name="tiny-llama", head_layers=1, tail_layers=1, split="u"),
        pipeline=PipelineConfig(microbatches=4, schedule="greedy"),
        train=TrainConfig(batch_size=8, seq_len=64),
        server=ServerConfig(device="cpu"),
    )
    runtime, info = build_runtime(cfg)
    server = StageServer(runtime, info, port=0).start()
    ids = torch.randint(0, 250, (8, 64), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.clone()}
    times: dict[bool, list[float]] = {True: [], False: []}
    try:
        trainer = DeviceTrainer(cfg, device_id="bench")
        opt = torch.optim.AdamW(trainer.parameters(), lr=1e-3)
        with StageClient(server.address) as client:
            session, pipeline = trainer.connect(client, optimizer=opt, link=LINK)
            with session:
                step = 0
                for block in range(BLOCKS):
                    wait = block % 2 == 1
                    pipeline.wait_step_done = wait
                    start = time.perf_counter()
                    for _ in range(STEPS_PER_BLOCK):
                        pipeline.train_step(batch, step=step)
                        step += 1
                    pipeline.finish()
                    times[wait].append((time.perf_counter() - start) / STEPS_PER_BLOCK)
    finally:
        server.stop(grace=None)
    lazy, waiting = statistics.median(times[False]), statistics.median(times[True])
    print(
        json.dumps({"link": LINK, "lazy_step_s": round(lazy, 3), "wait_step_s": round(waiting, 3)})
    )


if __name__ == "__main__":
    main()
