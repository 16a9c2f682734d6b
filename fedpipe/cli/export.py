"""``fedpipe export``: a run's fine-tuned model as a PEFT adapter or a merged HF model folder."""

from __future__ import annotations

import argparse

from transformers.utils import logging as hf_logging

from fedpipe.runs.export import export_run

__all__ = ["cmd_export"]


def cmd_export(args: argparse.Namespace) -> int:
    hf_logging.disable_progress_bar()  # stderr is for one-line errors; stdout for the answer
    done = export_run(args.run, args.out, format=args.format, round_=args.round, model=args.model)
    what = "PEFT adapter" if args.format == "peft" else "merged model"
    print(f"round {done.round} of {done.run} -> {args.out} ({what}; base {done.folder})")
    return 0
