"""The ``fedpipe bench`` commands: their flags, their runs, their tables.

Registered through the ``fedpipe.bench`` entry point (pyproject.toml), so that ``fedpipe bench``
finds them without the product importing this package. Building the parser imports nothing
heavy; each command imports its bench when it runs.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tomllib
from pathlib import Path
from typing import Any

from fedpipe.cli import config_from_args
from fedpipe.cli.parser import add_command, add_settings
from fedpipe.config import parse_overrides

__all__ = ["register"]

_HERE = "fedpipe_bench.commands"


def register(bsub: Any) -> None:
    """Add every benchmark to ``fedpipe bench`` (the entry point of group ``fedpipe.bench``)."""
    q = add_command(
        bsub, "pipeline", f"{_HERE}:cmd_bench_pipeline", "schedules x links vs the bound"
    )
    add_settings(q, model_default="small-llama, split 2 + 2 (fewer for smaller models)")
    q.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    q.add_argument(
        "--links",
        help="comma-separated link names or inline specs, e.g. 1gbit-5ms,up=10,down=25,rtt=50ms "
        "(default: the reference links)",
    )
    q.add_argument("--schedules", help="comma-separated schedules (default: all)")
    q.add_argument("--microbatches", type=int, default=8, help="microbatches per step")
    q.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    q.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    codecs = ["fp32", "bf16", "fp16", "int8", "int4", "int2"]
    q.add_argument("--codec", default="fp32", choices=codecs, help="activation codec")
    q.add_argument("--gradient-codec", choices=codecs, help="codec of gradients (default: --codec)")
    q.add_argument("--steps", type=int, default=4, help="measured steps per schedule (median)")
    q.add_argument("--warmup", type=int, default=1, help="unmeasured steps first")
    q.add_argument(
        "--frozen-head",
        action="store_true",
        help="one more session with the head frozen (pipeline.freeze's frozen head): its step "
        "time and bytes beside the same schedule trained",
    )
    q.add_argument(
        "--input-grad-first",
        action="store_true",
        help="one more run (1F1B) on a server with server.input_grad_first = true: the device's "
        "wait for its input gradient and the step time side by side",
    )
    qb = add_command(bsub, "quality", f"{_HERE}:cmd_bench_quality", "held-out loss vs centralized")
    qb.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    qb.add_argument("--quick", action="store_true", help="a tiny random model (CI, seconds)")
    qb.add_argument("--runs", help="comma-separated run names (default: all but noniid-stack)")
    qb.add_argument(
        "--seeds", type=int, default=1, help="train each run N times (model.seed + 0..N-1)"
    )
    qb.add_argument(
        "--set",
        action="append",
        metavar="SECTION.KEY=VALUE",
        help="override one setting of every run (repeatable), e.g. federated.rounds=5",
    )
    ab = add_command(
        bsub,
        "async",
        f"{_HERE}:cmd_bench_async",
        "a 10x slower phone: sync rounds vs async versions, time to sync's loss",
    )
    ab.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    ab.add_argument("--quick", action="store_true", help="a tiny random model (CI, seconds)")
    ab.add_argument(
        "--set",
        action="append",
        metavar="SECTION.KEY=VALUE",
        help="override one setting of both runs (repeatable), e.g. federated.buffer=3",
    )
    ib = add_command(
        bsub,
        "instruct",
        f"{_HERE}:cmd_bench_instruct",
        "examples/instruct.toml federated, then base vs fine-tuned exact match on held-out",
    )
    ib.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    ib.add_argument("--limit", type=int, help="score the first N held-out questions (default: all)")
    ib.add_argument("--max-new-tokens", type=int, default=16, help="tokens to generate at most")
    ib.add_argument("--runs-dir", type=Path, help="keep the run folder here (default: a temp dir)")
    ib.add_argument(
        "--set",
        action="append",
        metavar="SECTION.KEY=VALUE",
        help="override one setting of the example (repeatable), e.g. federated.rounds=2",
    )
    pk = add_command(
        bsub,
        "packing",
        f"{_HERE}:cmd_bench_packing",
        "rows, tokens per row and pad share of examples/instruct, padded and packed",
    )
    pk.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    pk.add_argument(
        "--set",
        action="append",
        metavar="SECTION.KEY=VALUE",
        help="override one setting of the example (repeatable), e.g. train.seq_len=256",
    )
    pl = add_command(
        bsub, "plan", f"{_HERE}:cmd_bench_plan", "the planner's predicted vs measured step"
    )
    add_settings(pl, model_default="small-llama, split 2 + 2 (fewer for smaller models)")
    pl.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    pl.add_argument("--links", help="comma-separated links (default: the reference links)")
    pl.add_argument("--microbatches", type=int, default=8, help="microbatches of the first step")
    pl.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    pl.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    pl.add_argument("--codecs", default="fp32", help="codecs the planner may pick (fp32 always)")
    pl.add_argument("--steps", type=int, default=4, help="measured steps per session (median)")
    pl.add_argument("--warmup", type=int, default=1, help="unmeasured steps after planning")
    pl.add_argument("--sessions", type=int, default=2, help="sessions per link (rounds)")
    r = add_command(bsub, "memory", f"{_HERE}:cmd_bench_memory", "device memory vs the whole model")
    add_settings(r, model_default="none: the step peaks of the model shapes; M: M's load report")
    _add_step_memory_flags(r)
    v = add_command(
        bsub, "privacy", f"{_HERE}:cmd_bench_privacy", "attacks on the stage link vs defences"
    )
    v.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    v.add_argument(
        "--quick", action="store_true", help="tiny model, one cut, a setting per mechanism (CI)"
    )
    v.add_argument("--plot", metavar="FILE", help="write the Pareto plot (.png or .svg) here")
    _add_bench_server(bsub)
    _add_bench_scale(bsub)


def _add_step_memory_flags(r: Any) -> None:
    """`fedpipe bench memory`'s step-peak run (without --model)."""
    r.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    r.add_argument(
        "--families",
        action="store_true",
        help="the device's and the whole model's fp32 parameter bytes of a tiny random model of "
        "every family fedpipe splits and of the bundled model, at the model.head_layers / "
        "model.tail_layers cut (one JSON object)",
    )
    r.add_argument("--shapes", help="comma-separated model shapes (default: all)")
    r.add_argument("--steps", type=int, default=2, help="training steps per setting")
    r.add_argument("--batch-size", type=int, default=2, help="sequences per step")
    r.add_argument("--seq-len", type=int, default=512, help="tokens per sequence")
    r.add_argument("--microbatches", type=int, default=2, help="microbatches per step")
    r.add_argument(
        "--whole-blocks", type=int, help="blocks of the whole model fine-tuned (default: all)"
    )
    r.add_argument(
        "--weights",
        help="comma-separated device.weights the device is measured at: fp32, bf16, int8, int4 "
        "(default: all four)",
    )
    r.add_argument(
        "--server-weights",
        metavar="W",
        help="instead: the server's middle at each of these comma-separated server.weights "
        "(fp32, bf16, int8, int4), side by side: its frozen parameter bytes and a training step "
        "of --sessions sessions of --batch-size x --seq-len tokens (model: --model, default the "
        "bundled SmolLM2-135M)",
    )
    r.add_argument("--sessions", type=int, default=2, help="--server-weights: sessions per step")


def _add_bench_scale(bsub: Any) -> None:
    c = add_command(
        bsub, "scale", f"{_HERE}:cmd_bench_scale", "N devices vs 1 and 2 StageServer replicas"
    )
    c.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    c.add_argument("--quick", action="store_true", help="CI size: tiny-llama, 4 devices, 2 steps")
    c.add_argument("--model", help="tiny-llama | small-llama | SmolLM2 (default: small-llama)")
    c.add_argument("--devices", type=int, help="devices per row (default: 16; 4 --quick)")
    c.add_argument("--rounds", type=int, help="rounds per row (default: 2; 1 --quick)")
    c.add_argument("--steps", type=int, help="measured steps per device (default: 4; 2 --quick)")
    c.add_argument("--warmup", type=int, help="unmeasured steps first (default: 1)")


def _add_bench_server(bsub: Any) -> None:
    s = add_command(bsub, "server", f"{_HERE}:cmd_bench_server", "N devices vs one StageServer")
    s.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    s.add_argument(
        "--model",
        help="tiny-llama | small-llama | SmolLM2 (default: small-llama; tiny-llama with --quick)",
    )
    s.add_argument("--devices", help="comma-separated N (default: 1,2,4,8,16,32; 1,2,4 --real)")
    s.add_argument("--steps", type=int, help="measured steps per device (default: 3; 2 --quick)")
    s.add_argument("--warmup", type=int, default=1, help="unmeasured steps first")
    s.add_argument("--quick", action="store_true", help="CI size: tiny-llama, N 1,2,4, 2 steps")
    s.add_argument("--real", action="store_true", help="real head/tail stages, not generators")
    s.add_argument("--link", help="each device's link (default: 100mbit-5ms; loopback --quick)")
    s.add_argument(
        "--server-threads",
        type=int,
        help="torch threads of the server (default: one per core, the load generator shares them;"
        " fewer pins the load generator to the first core and the server to the next ones)",
    )
    s.add_argument("--microbatches", type=int, default=2, help="microbatches per device step")
    s.add_argument("--microbatch-size", type=int, default=2, help="sequences per microbatch")
    s.add_argument("--seq-len", type=int, help="tokens per sequence (default: 128; 16 --quick)")
    s.add_argument(
        "--offload",
        action="store_true",
        help='a third column: batched with server.offload = "auto" (stash in host memory)',
    )


def _split_given(args: argparse.Namespace) -> bool:
    """Whether ``--set`` or ``--config`` chose the split (else the bench picks one)."""
    keys = set(parse_overrides(args.set or []))
    if args.config is not None and Path(args.config).is_file():
        with open(args.config, "rb") as fh:
            keys |= {f"model.{k}" for k in tomllib.load(fh).get("model", {})}
    return bool(keys & {"model.head_layers", "model.tail_layers"})


def cmd_bench_pipeline(args: argparse.Namespace) -> int:
    """`fedpipe bench pipeline`: schedules x links against the pipeline bound."""
    from fedpipe.cli.preflight import check_links, check_model, default_split, model_layers

    model = {"small": "small-llama", None: "small-llama"}.get(args.model, args.model)
    flags: dict[str, Any] = {"model.name": model}
    if not _split_given(args):  # 2 + 2 blocks, fewer where the model is too small for that
        side = default_split(model_layers(model)[0])
        flags |= {"model.head_layers": side, "model.tail_layers": side}
    flags |= {"train.batch_size": args.batch_size, "train.seq_len": args.seq_len}
    flags["pipeline.microbatches"] = args.microbatches
    flags["pipeline.uplink_codec"] = args.codec
    flags["pipeline.downlink_codec"] = args.codec
    flags["pipeline.gradient_codec"] = args.gradient_codec
    config = config_from_args(args, **flags)
    from fedpipe.emulation import REFERENCE_LINKS, split_specs
    from fedpipe_bench.pipeline import BENCH_SCHEDULES, run_pipeline_bench

    links = split_specs(args.links) if args.links else list(REFERENCE_LINKS)
    schedules = args.schedules.split(",") if args.schedules else list(BENCH_SCHEDULES)
    check_links(links)
    check_model(config)
    unknown = [s for s in schedules if s not in BENCH_SCHEDULES]
    if unknown:
        raise ValueError(f"--schedules: unknown {unknown}; choose from {list(BENCH_SCHEDULES)}")
    report = run_pipeline_bench(
        config,
        links=links,
        schedules=schedules,
        steps=args.steps,
        warmup=args.warmup,
        frozen_head=args.frozen_head,
        input_grad_first=args.input_grad_first,
    )
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_bench_table(report)
    return 0


def _print_bench_table(report: dict[str, Any]) -> None:
    print(
        f"model {report['model']} ({report['split']}), batch {report['batch']}, "
        f"M={report['microbatches']}, {report['pinning']}"
    )
    print(
        f"{'link':>18} {'T_seq s':>8} {'T_whole s':>9} {'T_pipe s':>9} {'T_bound s':>10} "
        f"{'in-run':>7} {'speedup':>8} {'efficiency':>10} {'ceiling':>8}  best / bound term"
    )
    for e in report["links"]:
        print(
            f"{e['link']:>18} {e['t_seq_s']:>8.3f} {e['t_seq_whole_s']:>9.3f} "
            f"{e['t_pipe_s']:>9.3f} {e['t_bound_s']:>10.3f} {e['t_bound_inrun_s']:>7.3f} "
            f"{e['speedup']:>8.2f} {e['efficiency']:>10.2f} {e['ceiling']:>8.2f}  "
            f"{e['best_schedule']} / {e['bound_term']}" + ("  (noisy)" if e["noisy"] else "")
        )


def cmd_bench_server(args: argparse.Namespace) -> int:
    """`fedpipe bench server`: N devices against one StageServer, batching off and on."""
    from fedpipe_bench.server import make_settings, run_server_bench

    devices = _int_list(args.devices, "--devices") if args.devices else None
    settings = make_settings(
        model=args.model,
        devices=devices,
        steps=args.steps,
        warmup=args.warmup,
        quick=args.quick,
        real=args.real,
        link=args.link,
        server_threads=args.server_threads,
        microbatches=args.microbatches,
        microbatch_size=args.microbatch_size,
        seq_len=args.seq_len,
        offload=args.offload,
    )
    report = run_server_bench(settings)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_server_table(report)
    return 0


def cmd_bench_scale(args: argparse.Namespace) -> int:
    """`fedpipe bench scale`: the server load generator against 1 and 2 replicas on Ray."""
    from fedpipe_bench.scale import make_settings, run_scale_bench

    settings = make_settings(
        model=args.model,
        devices=args.devices,
        rounds=args.rounds,
        steps=args.steps,
        warmup=args.warmup,
        quick=args.quick,
    )
    report = run_scale_bench(settings)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(
        f"model {report['model']} ({report['split']}), microbatch {report['microbatch']} x "
        f"{report['microbatches']}, {report['devices']} devices; {report['pinning']['text']}"
    )
    print(
        f"{'replicas':>8} {'mb/s':>8} {'tokens/s':>9} {'p50 s':>7} {'p95 s':>7} "
        f"{'commit s':>9} {'commit B':>10}  sessions"
    )
    for row in report["rows"]:
        print(
            f"{row['replicas']:>8} {row['mb_per_s']:>8.2f} {row['tokens_per_s']:>9.0f} "
            f"{row['step_p50_s']:>7.3f} {row['step_p95_s']:>7.3f} {row['commit_s']:>9.3f} "
            f"{row['commit_bytes']:>10}  {row['sessions_per_replica']}"
        )
    if report["speedup_2_over_1"] is not None:
        print(f"2 replicas / 1: {report['speedup_2_over_1']:.2f}x")
    return 0


def _int_list(text: str, flag: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"{flag}: expected comma-separated whole numbers, got {text!r}") from None


def _print_server_table(report: dict[str, Any]) -> None:
    print(
        f"model {report['model']} ({report['split']}), microbatch {report['microbatch']} x "
        f"{report['microbatches']}, link {report['link']}, {report['pinning']['text']}; "
        f"N* {report['n_star']} (knee: {report['knee']})"
    )
    print(
        f"{'N':>4} {'column':>9} {'mb/s':>8} {'tokens/s':>9} {'p50 s':>7} {'p95 s':>7} "
        f"{'busy':>5} {'batch':>5} {'model mb/s':>10} {'stash peak B':>12} {'offloaded B':>11}"
    )
    for row in report["rows"]:
        for column in [c for c in ("unbatched", "batched", "offload") if c in row]:
            f = row[column]
            print(
                f"{row['devices']:>4} {column:>9} {f['mb_per_s']:>8.2f} {f['tokens_per_s']:>9.0f} "
                f"{f['step_p50_s']:>7.3f} {f['step_p95_s']:>7.3f} {f['busy']:>5.2f} "
                f"{f['mean_batch']:>5.2f} {row['predicted_mb_per_s']:>10.2f} "
                f"{f.get('peak_stash_bytes')!s:>12} {f.get('peak_offloaded_bytes')!s:>11}"
            )


def cmd_bench_quality(args: argparse.Namespace) -> int:
    """`fedpipe bench quality`: held-out loss and bytes of fedpipe's runs against centralized."""
    overrides = parse_overrides(args.set or [])
    from fedpipe_bench.quality import run_quality_bench

    names = [n.strip() for n in args.runs.split(",") if n.strip()] if args.runs else None
    report = run_quality_bench(quick=args.quick, names=names, overrides=overrides, seeds=args.seeds)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"model {report['model']}, {report['devices']} devices, {report['rounds']} rounds")
    print(f"seeds {report['seeds']}: eval loss is their mean, std over them")
    print(
        f"{'run':>14} {'eval loss':>9} {'std':>7} {'ppl':>8} {'bytes/token':>11} "
        f"{'wall s':>7} {'steps':>5}"
    )
    for r in report["runs"]:
        print(
            f"{r['name']:>14} {r['eval_loss']:>9.4f} {r['eval_loss_std']:>7.4f} "
            f"{r['eval_ppl']:>8.2f} {r['bytes_per_token']:>11.1f} {r['wall_s']:>7.1f} "
            f"{r['steps']:>5}"
        )
    return 0


def cmd_bench_async(args: argparse.Namespace) -> int:
    """`fedpipe bench async`: sync rounds against async versions with a 10x slower phone."""
    overrides = parse_overrides(args.set or [])
    from fedpipe_bench.async_rounds import run_async_bench

    report = run_async_bench(quick=args.quick, overrides=overrides)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    s = report["settings"]
    print(
        f"model {report['model']}, {s['devices']} devices ({', '.join(s['profiles'])}), "
        f"buffer {s['buffer']}, max staleness {s['max_staleness']}, {s['staleness']}"
    )
    print(f"target: sync's final held-out loss {report['target_loss']:.4f}")
    print(
        f"{'mode':>6} {'to target s':>11} {'wall s':>7} {'final loss':>10} {'updates':>7} "
        f"{'MB up':>7} {'MB down':>7} {'idle':>5}"
    )
    for mode in ("sync", "async"):
        r = report[mode]
        to = "never" if r["wall_to_target_s"] is None else f"{r['wall_to_target_s']:.1f}"
        print(
            f"{mode:>6} {to:>11} {r['wall_s']:>7.1f} {r['final_eval_loss']:>10.4f} "
            f"{r['updates']:>7} {r['bytes_up'] / 1e6:>7.1f} {r['bytes_down'] / 1e6:>7.1f} "
            f"{r['device_idle_mean']:>5.0%}"
        )
    ratio = report["wall_to_target_ratio"]
    said = "not reached" if ratio is None else f"{ratio:.2f}"
    print(f"async time to target / sync's: {said} (goal <= {report['goal']})")
    return 0


def cmd_bench_instruct(args: argparse.Namespace) -> int:
    """`fedpipe bench instruct`: the example federated, then base vs fine-tuned on held-out."""
    overrides = parse_overrides(args.set or [])
    from fedpipe_bench.instruct import run_instruct_bench

    report = run_instruct_bench(
        overrides=overrides,
        limit=args.limit,
        max_new_tokens=args.max_new_tokens,
        runs_dir=args.runs_dir,
        progress=not args.json,
    )
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    s = report["settings"]
    print(f"model {report['model']}, {s['devices']} devices, {report['rounds']} rounds")
    print(f"{'':>12} {'answer loss':>11} {'exact':>7} {'contains':>8} {'answered':>8}")
    for side in ("base", "finetuned"):
        r = report[side]
        loss = "-" if r["answer_loss"] is None else f"{r['answer_loss']:.4f}"
        exact = "-" if r["exact_match"] is None else f"{100 * r['exact_match']:.1f}%"
        has = "-" if r["contains"] is None else f"{100 * r['contains']:.1f}%"
        print(f"{side:>12} {loss:>11} {exact:>7} {has:>8} {r['answered']:>8}")
    print(f"wall {report['wall_s']:.0f} s (train {report['train_wall_s']:.0f} s)")
    return 0


def cmd_bench_packing(args: argparse.Namespace) -> int:
    """`fedpipe bench packing`: the instruct example's rows, padded and packed."""
    from fedpipe_bench.packing import run_packing_bench

    report = run_packing_bench(parse_overrides(args.set or []))
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{report['examples']} examples of {report['data']}, rows of {report['seq_len']}")
    print(f"{'':>8} {'rows':>6} {'tokens/row':>10} {'pad share':>9} {'loss tokens':>11}")
    for way in ("padded", "packed"):
        r = report[way]
        share = f"{100 * r['pad_share']:.1f}%"
        print(
            f"{way:>8} {r['rows']:>6} {r['tokens_per_row']:>10} {share:>9} {r['loss_tokens']:>11}"
        )
    return 0


def cmd_bench_plan(args: argparse.Namespace) -> int:
    """`fedpipe bench plan`: the planner's predicted step time against the measured one."""
    from fedpipe.cli.preflight import check_links, check_model, default_split, model_layers

    model = {"small": "small-llama", None: "small-llama"}.get(args.model, args.model)
    flags: dict[str, Any] = {"model.name": model}
    if not _split_given(args):  # as `bench pipeline`: 2 + 2 blocks where the model allows
        side = default_split(model_layers(model)[0])
        flags |= {"model.head_layers": side, "model.tail_layers": side}
    flags |= {"train.batch_size": args.batch_size, "train.seq_len": args.seq_len}
    flags |= {"pipeline.microbatches": args.microbatches, "pipeline.plan": "auto"}
    flags |= {
        "pipeline.plan_codecs": args.codecs,
        "train.local_steps": 2 + args.warmup + args.steps,
    }
    config = config_from_args(args, **flags)
    from fedpipe.emulation import REFERENCE_LINKS, split_specs
    from fedpipe_bench.plan import run_plan_bench

    links = split_specs(args.links) if args.links else list(REFERENCE_LINKS)
    check_links(links)
    check_model(config)
    report = run_plan_bench(
        config, links=links, steps=args.steps, warmup=args.warmup, sessions=args.sessions
    )
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(
        f"model {report['model']} ({report['split']}), batch {report['batch']}, {report['pinning']}"
    )
    print(f"{'link':>18} {'plan':>28} {'predicted s':>12} {'measured s':>11} {'error':>7}")
    for e in report["links"]:
        p = e["plan"]
        text = f"{p.get('schedule')} M={p.get('microbatches')} {p.get('codec')}"
        print(
            f"{e['link']:>18} {text:>28} {e['predicted_s']:>12.3f} {e['measured_s']:>11.3f} "
            f"{e['error']:>+7.1%}"
        )
    return 0


def cmd_bench_memory(args: argparse.Namespace) -> int:
    """`fedpipe bench memory`: what the device side holds against the whole model.

    Without ``--model``: the device's peak over training steps of each model shape, beside the
    whole model's with peft LoRA (fedpipe_bench.step_memory); with it, that model's parameter
    bytes and resident memory after loading.
    """
    if args.server_weights:
        return _bench_server_weights(args)
    if args.families:
        if args.model:
            raise SystemExit("--families reports its own models: give it without --model")
        return _bench_memory_families(args)
    if not args.model:
        return _bench_step_memory(args)
    from fedpipe.cli.preflight import check_model

    config = config_from_args(args, **{"model.name": args.model})
    check_model(config)
    from fedpipe.models import load_config as load_hf_config
    from fedpipe.models import resolve_model
    from fedpipe.split import device_memory_report, split_layout

    folder = resolve_model(config.model.name)
    plan = split_layout(
        load_hf_config(folder),
        head_layers=config.model.head_layers,
        tail_layers=config.model.tail_layers,
        mode=config.model.split,  # type: ignore[arg-type]
    )
    report = device_memory_report(folder, plan)
    print(json.dumps({"model": config.model.name, **report}, indent=2))
    return 0


def _bench_server_weights(args: argparse.Namespace) -> int:
    """`fedpipe bench memory --server-weights`: the server's middle stored each way."""
    from fedpipe.cli.preflight import check_model
    from fedpipe.config import SERVER_WEIGHTS
    from fedpipe.models import resolve_model
    from fedpipe_bench.server_weights import server_weights_report

    weights = tuple(w.strip() for w in args.server_weights.split(",") if w.strip())
    if not weights or set(weights) - set(SERVER_WEIGHTS):
        raise ValueError(
            f"--server-weights {args.server_weights!r}: choose among {', '.join(SERVER_WEIGHTS)}"
        )
    config = config_from_args(args, **{"model.name": args.model or "default"})
    check_model(config)
    folder = resolve_model(config.model.name)
    report = server_weights_report(
        config,
        folder,
        weights,
        sessions=args.sessions,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        steps=args.steps,
    )
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(
        f"{'weights':>7} {'server params MiB':>17} {'step s':>7} {'vs fp32':>7} {'output err':>10}"
    )
    fp32 = next((r["step_s"] for r in report["rows"] if r["weights"] == "fp32"), None)
    for row in report["rows"]:
        ratio = "-" if fp32 is None else f"{row['step_s'] / fp32:.2f}"
        err = row["output_rel_error"]
        print(
            f"{row['weights']:>7} {row['server_param_bytes'] / 2**20:>17.1f} "
            f"{row['step_s']:>7.2f} {ratio:>7} {'-' if err is None else f'{err:.1e}':>10}"
        )
    return 0


def _bench_memory_families(args: argparse.Namespace) -> int:
    """``--families``: each family's tiny random model (fedpipe_bench.families) and the bundled
    model, the device's and the whole model's parameter bytes at the configured cut, one row
    each (nothing is loaded: ``--model M`` measures one model's load memory)."""
    import tempfile

    from fedpipe.models import load_config as load_hf_config
    from fedpipe.models import resolve_model
    from fedpipe.models.families import supported_types
    from fedpipe.split import device_param_report, split_layout
    from fedpipe_bench.families import tiny_family_folder

    config = config_from_args(args)
    rows = []
    with tempfile.TemporaryDirectory(prefix="fedpipe-families-") as root:
        models = [(f"tiny {t}", tiny_family_folder(Path(root), t)) for t in supported_types()]
        models.append(("default", resolve_model("default")))
        for name, folder in models:
            hf_config = load_hf_config(folder)
            plan = split_layout(
                hf_config,
                head_layers=config.model.head_layers,
                tail_layers=config.model.tail_layers,
                mode=config.model.split,  # type: ignore[arg-type]
            )
            report = device_param_report(folder, plan)
            rows.append({"model": name, "model_type": hf_config.model_type, **report})
    print(json.dumps({"rows": rows}, indent=2))
    return 0


def _bench_step_memory(args: argparse.Namespace) -> int:
    from fedpipe_bench.step_memory import MODEL_SHAPES, WEIGHTS, StepSpec, step_memory_report

    config = config_from_args(args)
    shapes = args.shapes.split(",") if args.shapes else list(MODEL_SHAPES)
    unknown = sorted(set(shapes) - set(MODEL_SHAPES))
    if unknown:
        raise SystemExit(f"--shapes: unknown {unknown}; known: {', '.join(MODEL_SHAPES)}")
    weights = tuple(w.strip() for w in (args.weights or ",".join(WEIGHTS)).split(",") if w)
    if not weights or set(weights) - set(WEIGHTS):
        raise SystemExit(f"--weights {args.weights!r}: choose among {', '.join(WEIGHTS)}")
    specs = [
        StepSpec(
            model=name,
            what="device",
            loss_chunk=config.train.loss_chunk,
            head_layers=config.model.head_layers,
            tail_layers=config.model.tail_layers,
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            microbatches=args.microbatches,
            steps=args.steps,
            blocks=args.whole_blocks,
        )
        for name in shapes
    ]
    report = step_memory_report(specs, loss_chunk=config.train.loss_chunk, weights=weights)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    _print_step_memory_table(report)
    return 0


def _print_step_memory_table(report: dict[str, Any]) -> None:
    mib = 2**20
    print(
        f"{'model':>14} {'weights':>7} {'device params':>14} {'device peak':>12} "
        f"{'full logits':>12} {'whole LoRA peak':>16} {'baseline':>9}  (MiB) {'steps s':>8}"
    )
    for row in report["rows"]:
        full = row["device_step_peak_full_logits_bytes"]
        print(
            f"{row['model']:>14} {row['weights']:>7} {row['device_param_bytes'] / mib:>14.0f} "
            f"{row['device_step_peak_bytes'] / mib:>12.0f} "
            f"{'-' if full is None else f'{full / mib:.0f}':>12} "
            f"{row['whole_lora_step_peak_bytes'] / mib:>16.0f} "
            f"{row['baseline_rss_bytes'] / mib:>9.0f}       {row['device_steps_s']:>8.1f}"
        )


def cmd_bench_privacy(args: argparse.Namespace) -> int:
    """`fedpipe bench privacy`: an honest-but-curious server's attacks against each defence."""
    from fedpipe_bench.privacy import DEFAULT, QUICK, run_privacy_bench
    from fedpipe_bench.privacy_plot import write_pareto

    logging.getLogger("fedpipe_bench.privacy").setLevel(logging.INFO)  # progress on stderr
    report = run_privacy_bench(QUICK if args.quick else DEFAULT)
    if args.plot:
        print(f"Pareto plot: {write_pareto(report, args.plot)}", file=sys.stderr)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{'head':>4} {'defence':>24} {'strength':>8} {'attacker':>8} {'recon':>6} "
          f"{'label':>6} {'eval loss':>9} {'cost %':>7} {'epsilon':>9}")  # fmt: skip
    for row in report["rows"]:
        eps = "-" if row["epsilon"] is None else f"{row['epsilon']:.3g}"
        print(
            f"{row['head_layers']:>4} {row['defence']:>24} {row['strength']:>8.3g} "
            f"{row['attacker']:>8} {row['reconstruction_acc']:>6.3f} {row['label_acc']:>6.3f} "
            f"{row['eval_loss']:>9.4f} {row['eval_loss_cost_pct']:>7.2f} {eps:>9}"
        )
    best = report["best_within_2pct"]
    for row in best:
        print(
            f"best within 2% loss, head {row['head_layers']}: {row['defence']} "
            f"{row['strength']:g} (the worse attack keeps {row['worse_attack_keeps']:.0%})"
        )
    return 0
