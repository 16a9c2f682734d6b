"""``fedpipe eval``: a run's model and its base on held-out examples, side by side (answer loss,
exact match and containment of greedy answers); written to the run folder's ``eval.json``."""

from __future__ import annotations

import argparse
import shlex

from transformers.utils import logging as hf_logging

from fedpipe.runs.evaluate import eval_path, evaluate_run, format_table

__all__ = ["cmd_eval"]


def _command(args: argparse.Namespace) -> str:
    argv = ["fedpipe", "eval", str(args.run), "--data", str(args.data)]
    for flag, value in (
        ("--round", args.round),
        ("--max-new-tokens", args.max_new_tokens),
        ("--limit", args.limit),
        ("--model", args.model),
    ):
        if value is not None:
            argv += [flag, str(value)]
    return shlex.join(argv)


def cmd_eval(args: argparse.Namespace) -> int:
    hf_logging.disable_progress_bar()  # stderr is for one-line errors; stdout for the table
    record = evaluate_run(
        args.run,
        args.data,
        round_=args.round,
        max_new_tokens=args.max_new_tokens,
        limit=args.limit,
        model=args.model,
        command=_command(args),
    )
    print(format_table(record))
    print(f"-> {eval_path(args.run, args.round)}")
    return 0
