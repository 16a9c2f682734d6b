"""``fedpipe bench privacy --quick``: a real tapped training run on a tiny model, attacked."""

from __future__ import annotations

import json

import pytest
from fedpipe_bench.privacy import DEFENCE, QUICK, run_privacy_bench

from fedpipe.cli.parser import build_parser

ROW_KEYS = {
    "head_layers",
    "defence",
    "strength",
    "reconstruction_acc",
    "label_acc",
    "eval_loss",
    "epsilon",
}


def test_cli_registers_the_bench() -> None:
    args = build_parser().parse_args(["bench", "privacy", "--quick", "--json"])
    assert args.func == "fedpipe_bench.commands:cmd_bench_privacy" and args.quick and args.json


@pytest.mark.slow
def test_quick_bench_attacks_work_and_the_json_has_the_contract() -> None:
    report = run_privacy_bench(QUICK)
    json.dumps(report)  # one JSON object, as --json prints it
    rows = report["rows"]
    assert len(rows) == len(QUICK.cuts) * (1 + len(QUICK.strengths))
    for row in rows:
        assert ROW_KEYS <= row.keys()
        assert 0 <= row["reconstruction_acc"] <= 1 and 0 <= row["label_acc"] <= 1
    plain = next(r for r in rows if r["defence"] == "none")
    # The attacks are real: far above chance and above always guessing the commonest token.
    assert plain["reconstruction_acc"] > max(0.5, 20 * report["chance_acc"])
    assert plain["reconstruction_acc"] > report["majority_token_acc"] + 0.3
    assert plain["label_acc"] > report["majority_token_acc"] + 0.3
    assert plain["epsilon"] is None  # no noise, no guarantee
    defended = next(r for r in rows if r["defence"] == DEFENCE)
    assert defended["epsilon"] is not None and defended["epsilon"] > 0
    assert defended["reconstruction_acc"] < plain["reconstruction_acc"]
