"""``fedpipe generate``: a prompt answered by a base model with an adapter or a run's checkpoint,
its tokens streamed to stdout."""

from __future__ import annotations

import argparse

from transformers.utils import logging as hf_logging

from fedpipe.runs.generate import Sampling, generate, load_model

__all__ = ["cmd_generate"]


def cmd_generate(args: argparse.Namespace) -> int:
    hf_logging.disable_progress_bar()  # stderr is for one-line errors; stdout for the answer
    sampling = Sampling(  # checked before the model loads
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
    )
    model, tokenizer = load_model(args.model, adapter=args.adapter, run=args.run, round_=args.round)
    generate(model, tokenizer, args.prompt, chat=args.chat, sampling=sampling)
    return 0
