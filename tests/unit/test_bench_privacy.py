"""``fedpipe bench privacy --quick``: a real tapped training run on a tiny model, attacked."""

from __future__ import annotations

from fedpipe.cli.parser import build_parser


def test_cli_registers_the_bench() -> None:
    args = build_parser().parse_args(["bench", "privacy", "--quick", "--json"])
    assert args.func == "fedpipe_bench.commands:cmd_bench_privacy" and args.quick and args.json
