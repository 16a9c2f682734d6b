"""Turn the benches' records (``docs/benchmarks/data/*.json``) into the docs' tables.

A record is what ``scripts/bench_record.py`` wrote: the bench's JSON (``result``) with the
command, date, commit and machine. A page asks for a bench's tables with a marker on a line of
its own, ``<!-- fedpipe:bench NAME -->``; the docs build (``scripts/mkdocs_hooks.py``) replaces
it with the tables of ``data/NAME.json``, each followed by where the figures come from. Without
a record the marker becomes a note naming the command that makes one: no figure is shown.

The README's one result sits between ``<!-- fedpipe:readme-result -->`` and
``<!-- /fedpipe:readme-result -->``, rendered from the same record:

    python scripts/render_bench_docs.py --readme          # rewrite the README's block
    python scripts/render_bench_docs.py --check-readme    # fail if it is stale
    python scripts/render_bench_docs.py NAME              # print NAME's tables
"""

from __future__ import annotations

import argparse
import base64
import importlib
import json
import math
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = REPO_ROOT / "docs" / "benchmarks" / "data"
README = REPO_ROOT / "README.md"
MARKER = re.compile(r"^<!-- fedpipe:bench (?P<name>[\w.@-]+) -->$", re.MULTILINE)
README_BEGIN, README_END = "<!-- fedpipe:readme-result -->", "<!-- /fedpipe:readme-result -->"
README_BENCH = "pipeline"  # the bench whose figure the README shows
LOADED = 0.5  # load average before the run, per core, past which the machine was shared

Row = Sequence[Any]
Table = tuple[str, list[str], list[Row]]  # (caption, headers, rows)


# --- formatting -----------------------------------------------------------------------------


def num(value: Any, digits: int = 3) -> str:
    """A figure as text: ``-`` when absent, integers as they are, floats to ``digits`` places."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}" if abs(value) >= 10_000 else str(value)
    if isinstance(value, float):
        if value != 0 and (abs(value) < 10**-digits or abs(value) >= 1e6):
            return f"{value:.2e}"
        return f"{value:.{digits}f}"
    return str(value)


def pct(value: Any, digits: int = 1) -> str:
    """A fraction as a signed percentage (``0.052`` -> ``+5.2%``)."""
    if not isinstance(value, int | float) or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value * 100:+.{digits}f}%"


def sci(value: Any) -> str:
    """An error or other small figure in scientific notation (``0`` stays ``0``)."""
    if not isinstance(value, int | float) or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return "0" if value == 0 else f"{value:.2e}"


def mib(nbytes: Any) -> str:
    return "–" if not isinstance(nbytes, int | float) else f"{nbytes / 2**20:.1f} MiB"


def size(nbytes: Any) -> str:
    """Bytes in KiB below one MiB (the tiny models), in MiB from there."""
    if isinstance(nbytes, int | float) and abs(nbytes) < 2**20:
        return f"{nbytes / 2**10:.1f} KiB"
    return mib(nbytes)


def escape_pipes(text: str) -> str:
    """``|`` escaped for a Markdown table cell, except inside code spans (kept as they are)."""
    parts = text.split("`")
    return "`".join(p if i % 2 else p.replace("|", "\\|") for i, p in enumerate(parts))


def cell(text: Any) -> str:
    """Text safe inside a Markdown table cell."""
    return escape_pipes(str(text).replace("\n", " "))


def markdown_table(headers: Sequence[str], rows: Iterable[Row]) -> str:
    lines = ["| " + " | ".join(cell(h) for h in headers) + " |"]
    lines.append("|" + "---|" * len(headers))
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def get(data: Any, *path: str | int, default: Any = None) -> Any:
    """``data[path[0]][path[1]]...``, or ``default`` where a step is missing."""
    for key in path:
        try:
            data = data[key]
        except (KeyError, IndexError, TypeError):
            return default
    return data


# --- one renderer per bench: result -> tables -------------------------------------------------


def _pipeline(r: dict[str, Any]) -> list[Table]:
    caption = (
        f"{r.get('model')} ({r.get('split')}), batch {' x '.join(map(str, r.get('batch', [])))} "
        f"tokens in {r.get('microbatches')} microbatches, {r.get('codec')} on the wire, median "
        f"of {r.get('steps')} steps after {r.get('warmup')} warm-up"
    )
    headers = ["link", "T_seq s", "T_seq whole s", "T_pipe s (best)", "T_bound s (term)"]
    headers += ["T_bound in-run s", "speedup", "efficiency", "ceiling", "noisy"]
    rows = [
        [
            e.get("link"),
            num(e.get("t_seq_s")),
            num(e.get("t_seq_whole_s")),
            f"{num(e.get('t_pipe_s'))} ({e.get('best_schedule')})",
            f"{num(e.get('t_bound_s'))} ({e.get('bound_term')})",
            num(e.get("t_bound_inrun_s")),
            num(e.get("speedup"), 2),
            num(e.get("efficiency"), 2),
            num(e.get("ceiling"), 2),
            num(e.get("noisy")),
        ]
        for e in r.get("links", [])
    ]
    schedules = sorted({s for e in r.get("links", []) for s in e.get("schedules", {})})
    per = [[e.get("link"), *(num(get(e, "schedules", s)) for s in schedules)] for e in r["links"]]
    tables: list[Table] = [
        (caption, headers, rows),
        ("Step time of every schedule, seconds", ["link", *schedules], per),
    ]
    frozen = [e for e in r.get("links", []) if "frozen_head" in e]
    if frozen:  # --frozen-head: the head frozen beside the same schedule trained
        tables.append(_frozen_head(frozen))
    if any("step_end_share" in e for e in r.get("links", [])):
        tables.append(_step_end_shares(r["links"], schedules))
    first = [e for e in r.get("links", []) if e.get("input_grad_first")]
    if first:
        tables.append(_input_grad_first(first))
    return tables


def _frozen_head(entries: list[dict[str, Any]]) -> Table:
    headers = ["link", "schedule", "trained s", "head frozen s", "step saved"]
    headers += ["bytes down/step trained", "bytes down/step frozen", "bytes saved (both ways)"]
    rows = [
        [
            e.get("link"),
            get(e, "frozen_head", "schedule"),
            num(get(e, "frozen_head", "t_trained_s")),
            num(get(e, "frozen_head", "t_frozen_s")),
            pct(get(e, "frozen_head", "step_saving")),
            num(get(e, "frozen_head", "bytes_down_trained_per_step")),
            num(get(e, "frozen_head", "bytes_down_per_step")),
            pct(get(e, "frozen_head", "bytes_saving")),
        ]
        for e in entries
    ]
    return ("The head frozen (--frozen-head), one more session in the same run", headers, rows)


def _input_grad_first(links: list[dict[str, Any]]) -> Table:
    """server.input_grad_first beside the default: the device's wait and the step, off / on."""
    caption = (
        "server.input_grad_first: the device's median wait per microbatch from sending "
        "OUTPUT_GRAD to receiving INPUT_GRAD, and the median step, off / on"
    )
    headers = ["link", "schedule", "wait s (off / on)", "wait on/off", "step s (off / on)"]
    headers += ["step on/off"]
    rows = [
        [
            e.get("link"),
            get(e, "input_grad_first", "schedule"),
            f"{num(get(e, 'input_grad_first', 'wait_s', 'off'), 4)} / "
            f"{num(get(e, 'input_grad_first', 'wait_s', 'on'), 4)}",
            num(get(e, "input_grad_first", "wait_on_over_off")),
            f"{num(get(e, 'input_grad_first', 'step_s', 'off'))} / "
            f"{num(get(e, 'input_grad_first', 'step_s', 'on'))}",
            num(get(e, "input_grad_first", "step_on_over_off")),
        ]
        for e in links
    ]
    return caption, headers, rows


def _step_end_shares(links: list[dict[str, Any]], schedules: list[str]) -> Table:
    """Each link's step end (last backward to the optimizer applied) over its median step."""
    headers = ["link", "share (best)", "device s", "server s", *schedules]
    rows = [
        [
            e.get("link"),
            f"{num(e.get('step_end_share'), 4)} ({e.get('best_schedule')})",
            num(get(e, "step_end_s", "device_s"), 4),
            num(get(e, "step_end_s", "server_s"), 4),
            *(num(get(e, "step_end_by_schedule", s), 4) for s in schedules),
        ]
        for e in links
    ]
    return ("Step end as a share of a step (median steps)", headers, rows)


def _server(r: dict[str, Any]) -> list[Table]:
    caption = (
        f"{r.get('model')} ({r.get('split')}), {r.get('microbatches')} microbatches of "
        f"{' x '.join(map(str, r.get('microbatch', [])))} tokens per step, link {r.get('link')}, "
        f"{r.get('mode')} devices; N* = {num(r.get('n_star'), 2)}, knee {r.get('knee')}; "
        f"{get(r, 'pinning', 'text')}"
        + ("; **noisy**: the server got too little of its cores" if r.get("noisy") else "")
    )
    headers = ["N", "unbatched mb/s", "batched mb/s", "batched / unbatched"]
    headers += ["step p50 s (unb. / b.)", "step p95 s (unb. / b.)", "busy (unb. / b.)"]
    headers += ["mean batch (b.)", "model mb/s"]
    rows = []
    for row in r.get("rows", []):
        u, b = row.get("unbatched", {}), row.get("batched", {})
        rows.append(
            [
                row.get("devices"),
                num(u.get("mb_per_s"), 2),
                num(b.get("mb_per_s"), 2),
                num(row.get("batched_over_unbatched"), 2),
                f"{num(u.get('step_p50_s'), 2)} / {num(b.get('step_p50_s'), 2)}",
                f"{num(u.get('step_p95_s'), 2)} / {num(b.get('step_p95_s'), 2)}",
                f"{num(u.get('busy'), 2)} / {num(b.get('busy'), 2)}",
                num(b.get("mean_batch"), 2),
                num(row.get("predicted_mb_per_s"), 2),
            ]
        )
    tables: list[Table] = [(caption, headers, rows)]
    if r.get("offload"):
        tables.append(_server_offload(r))
    return tables


def _server_offload(r: dict[str, Any]) -> Table:
    """``--offload``: the stash per session on the stage's device and in host memory."""
    headers = ["N", "column", "mb/s", "step p50 s", "stash on device at peak, per session"]
    headers += ["waiting on device, per session", "offloaded, per session"]
    rows = []
    for row in r.get("rows", []):
        for column in ("unbatched", "batched", "offload"):
            f = row.get(column, {})
            rows.append(
                [
                    row.get("devices"),
                    column,
                    num(f.get("mb_per_s"), 2),
                    num(f.get("step_p50_s"), 2),
                    mib(f.get("peak_stash_bytes_per_session")),
                    mib(f.get("peak_waiting_bytes_per_session")),
                    mib(f.get("peak_offloaded_bytes_per_session")),
                ]
            )
        ratios = row.get("offload_over_batched", {})
        rows.append(
            [
                row.get("devices"),
                "offload / batched",
                num(ratios.get("mb_per_s"), 2),
                num(ratios.get("step_p50_s"), 2),
                num(ratios.get("peak_stash_bytes"), 2),
                num(ratios.get("peak_waiting_bytes"), 2),
                "",
            ]
        )
    caption = (
        'server.offload = "auto" (column offload) beside batched: the stash of waiting '
        "microbatches (tapes, saved tensors, received inputs) in MiB per session at its peak"
    )
    return caption, headers, rows


def _scale(r: dict[str, Any]) -> list[Table]:
    caption = (
        f"{r.get('model')} ({r.get('split')}), {r.get('devices')} devices, "
        f"{r.get('microbatches')} microbatches of "
        f"{' x '.join(map(str, r.get('microbatch', [])))} tokens per step, {r.get('rounds')} "
        f"round(s) of {r.get('steps')} steps; {get(r, 'pinning', 'text')}; 2 replicas / 1: "
        f"{num(r.get('speedup_2_over_1'), 2)}x"
    )
    headers = ["replicas", "mb/s", "tokens/s", "step p50 s", "step p95 s", "sessions"]
    headers += ["commit s", "commit bytes"]
    rows = [
        [
            row.get("replicas"),
            num(row.get("mb_per_s"), 2),
            num(row.get("tokens_per_s"), 0),
            num(row.get("step_p50_s"), 3),
            num(row.get("step_p95_s"), 3),
            " / ".join(str(n) for n in row.get("sessions_per_replica", [])),
            num(row.get("commit_s"), 3),
            num(row.get("commit_bytes")),
        ]
        for row in r.get("rows", [])
    ]
    return [(caption, headers, rows)]


def _plan(r: dict[str, Any]) -> list[Table]:
    caption = (
        f"{r.get('model')} ({r.get('split')}), batch {' x '.join(map(str, r.get('batch', [])))}, "
        f"codecs {', '.join(r.get('codecs', []))}, {r.get('sessions')} sessions per link, "
        f"{r.get('steps')} measured steps after {r.get('warmup')} warm-up"
    )
    headers = ["link", "plan", "predicted s", "measured s", "error", "error from in-run compute"]
    rows = []
    for e in r.get("links", []):
        p = e.get("plan", {})
        plan = f"{p.get('schedule')} M={p.get('microbatches')} {p.get('codec', '')}".strip()
        rows.append(
            [
                e.get("link"),
                plan,
                num(e.get("predicted_s")),
                num(e.get("measured_s")),
                pct(e.get("error")),
                pct(e.get("error_inrun")),
            ]
        )
    return [(caption, headers, rows)]


def _memory(r: dict[str, Any]) -> list[Table]:
    """One model's load report, or (``--families``) each model's parameter bytes."""
    if "rows" in r:
        headers = ["model", "model_type", "split", "device parameters", "whole model"]
        rows = [
            [
                report.get("model"),
                report.get("model_type"),
                report.get("plan"),
                f"{size(report.get('device_param_bytes'))} "
                f"({pct(report.get('param_fraction')).lstrip('+')})",
                size(report.get("model_param_bytes")),
            ]
            for report in r["rows"]
        ]
        return [
            ("fp32 parameters: the device's head and tail against the whole model", headers, rows)
        ]
    headers = ["model", "split", "device parameters", "whole model", "device RSS growth"]
    headers += ["whole model RSS growth"]
    row = [
        r.get("model"),
        r.get("plan"),
        f"{mib(r.get('device_param_bytes'))} ({pct(r.get('param_fraction')).lstrip('+')})",
        mib(r.get("model_param_bytes")),
        f"{mib(r.get('device_rss_bytes'))} ({pct(r.get('rss_fraction')).lstrip('+')})",
        mib(r.get("model_rss_bytes")),
    ]
    return [("fp32 parameters, and resident memory growth while loading", headers, [row])]


def _memory_steps(r: dict[str, Any]) -> list[Table]:
    """The device's step peak (chunked loss and full logits) against whole-model peft LoRA, per
    model and device.weights; the last column: the peak against the fp32 device's."""
    headers = ["model", "weights", "device parameters", "device step peak"]
    headers += ["with full logits", "whole model, peft LoRA", "device / whole", "baseline"]
    headers += ["device / fp32 device"]
    fp32 = {
        row.get("model"): row.get("device_step_peak_bytes")
        for row in r.get("rows", [])
        if row.get("weights", "fp32") == "fp32"
    }
    rows: list[Row] = []
    for row in r.get("rows", []):
        device, whole = row.get("device_step_peak_bytes"), row.get("whole_lora_step_peak_bytes")
        ratio = device / whole if isinstance(device, int) and whole else None
        base = fp32.get(row.get("model"))
        vs_fp32 = device / base if isinstance(device, int) and isinstance(base, int) else None
        rows.append(
            [
                row.get("model"),
                row.get("weights"),
                mib(row.get("device_param_bytes")),
                mib(device),
                mib(row.get("device_step_peak_full_logits_bytes")),
                f"{mib(whole)} ({row.get('whole_blocks')} blocks)",
                "–" if ratio is None else f"{ratio:.2f}",
                mib(row.get("baseline_rss_bytes")),
                "–" if vs_fp32 is None else f"{vs_fp32:.2f}",
            ]
        )
    caption = (
        f"peak resident memory (ru_maxrss of a fresh process) over {r.get('steps')} training "
        f"steps of {r.get('batch_size')} x {r.get('seq_len')} tokens in "
        f"{r.get('microbatches')} microbatches, {r.get('head_layers')} + "
        f"{r.get('tail_layers')} blocks on the device, train.loss_chunk = {r.get('loss_chunk')}"
    )
    return [(caption, headers, rows)]


def _memory_server(r: dict[str, Any]) -> list[Table]:
    """The server's middle at each server.weights: its frozen parameters, a training step and
    its outputs' distance from fp32's, each against the fp32 row."""
    headers = ["server.weights", "frozen parameters", "vs fp32", "step s (median)"]
    headers += ["step vs fp32", "fastest step s", "fastest vs fp32", "output rel. error vs fp32"]
    fp32 = next((row for row in r.get("rows", []) if row.get("weights") == "fp32"), {})

    def ratio(row: dict[str, Any], key: str) -> str:
        got, base = row.get(key), fp32.get(key)
        return f"{got / base:.2f}" if isinstance(got, int | float) and base else "–"

    rows: list[Row] = []
    for row in r.get("rows", []):
        error = row.get("output_rel_error")
        rows.append(
            [
                row.get("weights"),
                mib(row.get("server_param_bytes")),
                ratio(row, "server_param_bytes"),
                num(row.get("step_s")),
                ratio(row, "step_s"),
                num(row.get("step_s_min")),
                ratio(row, "step_s_min"),
                "–" if error is None else f"{error:.1e}",
            ]
        )
    caption = (
        f"{r.get('model')}, split {r.get('split')}: the server's middle built by build_runtime "
        f"at each setting, {r.get('sessions')} sessions of {r.get('batch_size')} x "
        f"{r.get('seq_len')} tokens per training step (median of {r.get('steps')}, the settings "
        f"stepped in turn), server.threads = {r.get('threads')}"
    )
    return [(caption, headers, rows)]


def _codec(r: dict[str, Any]) -> list[Table]:
    tables: list[Table] = []
    for head in r.get("heads", []):
        grads = {c.get("codec"): c for c in get(head, "output_grad", "codecs", default=[])}
        steps = {c.get("codec"): c for c in get(head, "step", "codecs", default=[])}
        caption = (
            f"{r.get('model')}, {head.get('head_layers')} head block(s): activation "
            f"{head.get('shape')} ({num(head.get('fp32_mb'))} MB fp32, max {head.get('max_abs')}, "
            f"RMS {head.get('rms')}); one training step of {get(head, 'step', 'shape')} tokens"
        )
        headers = ["codec", "bytes/value", "bytes/token", "activation rel. RMS err"]
        headers += ["activation max abs err", "output grad rel. RMS err", "encode ms"]
        headers += ["decode ms", "one step's loss vs fp32", "head gradient cosine"]
        rows = []
        for c in head.get("codecs", []):
            name = c.get("codec")
            step = steps.get(name, {})
            rows.append(
                [
                    name,
                    num(c.get("bytes_per_value"), 4),
                    num(c.get("bytes_per_token"), 1),
                    sci(c.get("rms_err_rel")),
                    sci(c.get("max_abs_err")),
                    sci(get(grads, name, "rms_err_rel")),
                    num(c.get("encode_ms"), 1),
                    num(c.get("decode_ms"), 1),
                    pct(step.get("loss_rel_diff"), 2),
                    num(step.get("input_grad_cos", 1.0 if name == "fp32" else None)),
                ]
            )
        tables.append((caption, headers, rows))
        pairs = [s for s in steps.values() if "/" in str(s.get("codec"))]
        if pairs:
            tables.append(
                (
                    "Pairs: forward tensors in the first codec, both gradients in the second",
                    ["forward / gradients", "bytes/value (all four)", "loss vs fp32", "cosine"],
                    [
                        [
                            s.get("codec"),
                            num(s.get("bytes_per_value"), 4),
                            pct(s.get("loss_rel_diff"), 2),
                            num(s.get("input_grad_cos")),
                        ]
                        for s in pairs
                    ],
                )
            )
    return tables


def _load(r: dict[str, Any]) -> list[Table]:
    headers = ["devices", "steps", "every device equal to its solo run", "step p50 s"]
    headers += ["step p95 s", "server RSS at step 5", "growth after", "peak RSS"]
    row = [
        r.get("devices"),
        r.get("steps"),
        num(r.get("exact")),
        num(r.get("step_p50_s"), 2),
        num(r.get("step_p95_s"), 2),
        f"{num(r.get('rss_mb_at_step5'), 1)} MB",
        f"{num(r.get('rss_growth_mb'), 1)} MB",
        f"{num(r.get('peak_rss_mb'), 1)} MB",
    ]
    return [("Emulated devices against one StageServer process", headers, [row])]


def _step_end(r: dict[str, Any]) -> list[Table]:
    headers = ["link", "lazy STEP_DONE, s per step", "waiting for STEP_DONE, s per step"]
    row = [r.get("link"), num(r.get("lazy_step_s")), num(r.get("wait_step_s"))]
    return [("One session, blocks of 5 steps alternating", headers, [row])]


def _privacy(r: dict[str, Any]) -> list[Table]:
    caption = (
        f"{r.get('model')}; chance accuracy {num(r.get('chance_acc'))}, always guessing the "
        f"commonest private token {num(r.get('majority_token_acc'))}"
    )
    headers = ["head blocks", "defence", "strength", "attacker", "reconstruction acc"]
    headers += ["label acc", "label prior acc", "held-out loss", "cost", "ε per sample"]
    rows = [
        [
            row.get("head_layers"),
            row.get("defence"),
            _strength(row),
            row.get("attacker", "–"),
            num(row.get("reconstruction_acc")),
            num(row.get("label_acc")),
            num(row.get("label_prior_acc")),
            num(row.get("eval_loss"), 4),
            f"{row['eval_loss_cost_pct']:+.1f}%"
            if isinstance(row.get("eval_loss_cost_pct"), int | float)
            else "–",
            num(row.get("epsilon")),
        ]
        for row in r.get("rows", [])
    ]
    tables: list[Table] = [(caption, headers, rows)]
    best = r.get("best_within_2pct")
    if best is not None:  # the adaptive attacker's best trade-off within 2% loss, per cut
        reached = r.get("halves_both_within_2pct") or []
        verdict = (
            f"{len(reached)} setting(s) halve both attacks within 2% held-out loss"
            if reached
            else "no setting halves both attacks within 2% held-out loss"
        )
        rows = [
            [
                b.get("head_layers"),
                b.get("defence"),
                _strength(b),
                f"{b['worse_attack_keeps']:.0%}",
                f"{b['eval_loss_cost_pct']:+.1f}%",
            ]
            for b in best
        ]
        headers = ["head blocks", "defence", "strength", "worse attack keeps", "cost"]
        tables.append((f"Against the adaptive attacker, {verdict}; the best found", headers, rows))
    spread: dict[tuple[Any, Any], list[dict[str, Any]]] = {}
    for s in r.get("spread", []):  # the same setting, other draws of the device's noise
        spread.setdefault((s.get("defence"), s.get("strength")), []).append(s)
    if spread:
        rows = []
        for (defence, strength), runs in spread.items():
            costs = [x["eval_loss_cost_pct"] for x in runs if "eval_loss_cost_pct" in x]
            seeds = ", ".join(str(x.get("device_seed")) for x in runs)
            span = f"{min(costs):+.1f}% to {max(costs):+.1f}%" if costs else "–"
            rows.append([defence, num(strength), seeds, span])
        headers = ["defence", "strength", "device seeds", "cost"]
        tables.append(("The cost again with other draws of the device's noise", headers, rows))
    return tables


def _strength(row: dict[str, Any]) -> str:
    """The noise multiplier or the penalty's weight (and the weight beside noise)."""
    if row.get("defence") == "none":
        return "–"
    text = num(row.get("strength"))
    parts = str(row.get("defence")).split("+")
    if len(parts) > 1 and "decorrelation" in parts:  # with noise: strength is the noise's
        text += f" (weight {num(row.get('decorrelation'))})"
    if len(parts) > 1 and "label-resample" in parts:
        text += f" (rate {num(row.get('label_resample'))})"
    return text


def _quality(r: dict[str, Any]) -> list[Table]:
    caption = f"{r.get('model')}, {r.get('devices')} devices, {r.get('rounds')} rounds"
    headers = ["run", "eval loss", "ppl", "bytes/token", "bytes up", "bytes down", "steps"]
    rows = [
        [
            run.get("name"),
            num(run.get("eval_loss"), 4),
            num(run.get("eval_ppl"), 2),
            num(run.get("bytes_per_token"), 1),
            num(run.get("bytes_up")),
            num(run.get("bytes_down")),
            run.get("steps", "–"),
        ]
        for run in r.get("runs", [])
    ]
    if any("adapter_bytes_up_per_round" in run for run in r.get("runs", [])):
        headers += ["adapter codec (up / down)", "adapter bytes up/round", "down/round"]
        for row, run in zip(rows, r["runs"], strict=True):
            codecs = f"{run.get('adapter_codec', '–')} / {run.get('adapter_downlink_codec', '–')}"
            row += [
                codecs,
                num(_whole(run.get("adapter_bytes_up_per_round"))),
                num(_whole(run.get("adapter_bytes_down_per_round"))),
            ]
    tables = [(caption, headers, rows)]
    frozen = [run for run in r.get("runs", []) if "frozen_below" in run]
    if frozen:  # pipeline.freeze runs: which blocks froze, round by round
        headers = ["run", "frozen below, after each round", "wall s"]
        rows = [
            [run.get("name"), " ".join(map(str, run["frozen_below"])), num(run.get("wall_s"), 1)]
            for run in frozen
        ]
        tables.append(("pipeline.freeze: the first block still training", headers, rows))
    return tables


def _share(value: Any) -> str:
    """A share as a percentage, unsigned (``0.4`` -> ``40.0%``)."""
    return f"{100 * value:.1f}%" if isinstance(value, int | float) else "–"


def _instruct(r: dict[str, Any]) -> list[Table]:
    s = r.get("settings", {})
    caption = (
        f"{r.get('model')}, {s.get('devices')} devices ({s.get('profiles')}), "
        f"{r.get('rounds')} rounds x {s.get('local_steps')} steps of {s.get('batch_size')}; "
        f"held-out: {r.get('held_out')}"
    )
    headers = ["model", "answer loss", "exact match", "contains", "questions"]
    rows = [
        [
            side,
            num(get(r, key, "answer_loss"), 4),
            _share(get(r, key, "exact_match")),
            _share(get(r, key, "contains")),
            get(r, key, "answered", default="–"),
        ]
        for side, key in (("base", "base"), (f"round {r.get('rounds')}", "finetuned"))
    ]
    gain = r.get("exact_match_gain_points")
    wall = f"train {num(r.get('train_wall_s'), 0)} s, eval {num(r.get('eval_wall_s'), 0)} s"
    tables = [(f"{caption}; exact match gain {num(gain, 1)} points; {wall}", headers, rows)]
    samples = list(
        zip(
            get(r, "base", "samples", default=[]),
            get(r, "finetuned", "samples", default=[]),
            strict=False,
        )
    )
    if samples:
        rows = [[b.get("reference"), b.get("generated"), f.get("generated")] for b, f in samples]
        tables.append(("the first held-out answers", ["reference", "base", "fine-tuned"], rows))
    return tables


def _async(r: dict[str, Any]) -> list[Table]:
    s = r.get("settings", {})
    profiles = ", ".join(
        f"{name} (x{slow:g})"
        for name, slow in zip(s.get("profiles", []), s.get("slowdowns", []), strict=False)
    )
    caption = (
        f"{r.get('model')}, cut {s.get('cut')}, {s.get('devices')} devices: {profiles}; "
        f"{s.get('rounds')} sync rounds x {s.get('local_steps')} steps of {s.get('batch_size')} "
        f"x {s.get('seq_len')} tokens; async buffer {s.get('buffer')}, max staleness "
        f"{s.get('max_staleness')}, weight {s.get('staleness')}; target: sync's final held-out "
        f"loss {num(r.get('target_loss'), 4)}"
    )
    headers = [
        "mode", "time to target s", "wall s", "final loss", "loss at sync's wall",
        "updates", "refused (stale)", "stage link up / down", "adapters up / down",
        "device idle (mean)", "eval s",
    ]  # fmt: skip
    rows = []
    for mode in ("sync", "async"):
        m = r.get(mode, {})
        rows.append(
            [
                mode,
                num(m.get("wall_to_target_s"), 1),
                num(m.get("wall_s"), 1),
                num(m.get("final_eval_loss"), 4),
                num(m.get("eval_loss_at_sync_wall", m.get("final_eval_loss")), 4),
                m.get("updates"),
                m.get("stale_refused", "–"),
                f"{size(m.get('bytes_up'))} / {size(m.get('bytes_down'))}",
                f"{size(m.get('adapter_bytes_up'))} / {size(m.get('adapter_bytes_down'))}",
                pct(m.get("device_idle_mean")),
                num(m.get("eval_s"), 1),
            ]
        )
    ratio = r.get("wall_to_target_ratio")
    verdict = "not reached" if ratio is None else num(ratio, 2)
    tables = [
        (
            f"{caption}; async time to target / sync's: {verdict} (goal <= {r.get('goal')})",
            headers,
            rows,
        )
    ]
    idle = [
        [name, pct(get(r, "sync", "device_idle", name)), pct(get(r, "async", "device_idle", name))]
        for name in get(r, "sync", "device_idle", default={})
    ]
    if idle:
        tables.append(("idle share of the window per device", ["device", "sync", "async"], idle))
    return tables


def _whole(value: Any) -> Any:
    """A mean count of bytes as a whole number (``None`` as it is)."""
    return round(value) if isinstance(value, float) else value


def _batch(r: dict[str, Any]) -> list[Table]:
    caption = f"{r.get('model')}, {r.get('sessions')} sessions of {r.get('microbatch')} tokens"
    headers = ["torch threads", "clock", "unbatched s", "batched s (ratio)"]
    headers += ["batched backward s (ratio)"]
    rows = [
        [
            e.get("threads"),
            clock,
            num(e.get(f"unbatched_{clock}_s")),
            f"{num(e.get(f'batched_{clock}_s'))} ({num(e.get(f'ratio_{clock}'), 2)}x)",
            f"{num(e.get(f'batched_bwd_{clock}_s'))} ({num(e.get(f'ratio_bwd_{clock}'), 2)}x)",
        ]
        for e in r.get("forward_backward", [])
        for clock in ("wall", "cpu")
    ]
    costs = [
        [present, bank, *(num(get(r, "per_session", present, key, k), 2) for k in _COSTS)]
        for present in r.get("per_session", {})
        for key, bank in (("old", "peft"), ("new", "batched"))
    ]
    per_session = ["sessions present", "adapter bank", "add ms", "switch ms", "forward ms"]
    return [
        (caption, headers, rows),
        ("One more session's costs", [*per_session, "remove ms"], costs),
    ]


_COSTS = ("add_ms", "switch_ms", "forward_ms", "remove_ms")


def _gpu_check(r: dict[str, Any]) -> list[Table]:
    if "skipped" in r:
        return [("", ["skipped"], [[r["skipped"]]])]
    caption = f"{r.get('gpu')}, {r.get('dtype')}, grouped LoRA kernel: {r.get('grouped_lora')}"
    headers = ["model", "devices", "column", "tokens/s", "peak GPU MB", "idle", "mean batch"]
    rows = []
    for res in r.get("results", []):
        for column, f in res.items():
            if isinstance(f, dict) and "tokens_per_s" in f:
                rows.append(
                    [
                        res.get("model"),
                        res.get("devices"),
                        column,
                        num(f.get("tokens_per_s"), 0),
                        num(f.get("peak_gpu_mb"), 0),
                        num(f.get("idle"), 2),
                        num(f.get("mean_batch"), 2),
                    ]
                )
    return [(caption, headers, rows)]


def _dtype(r: dict[str, Any]) -> list[Table]:
    """device.dtype: a device step's seconds at fp32 and bf16, and their ratio."""
    shape = (
        f"{r.get('model')}, {r.get('head_layers')} + {r.get('tail_layers')} device blocks, "
        f"batch {r.get('batch_size')} x {r.get('seq_len')} tokens in {r.get('microbatches')} "
        f"microbatches, {r.get('threads')} thread(s), CPU flags "
        f"{', '.join(r.get('cpu_bf16_flags') or []) or 'none'}"
    )
    steps = get(r, "step_s", default={})
    losses = get(r, "losses", default={})
    rows: list[Row] = [[d, num(steps.get(d)), num((losses.get(d) or [None])[0], 4)] for d in steps]
    rows.append(["fp32 / bf16", num(r.get("fp32_over_bf16"), 2), ""])
    return [(shape, ["device.dtype", "median step (s)", "first loss"], rows)]


def _generic(r: dict[str, Any]) -> list[Table]:
    """Any other bench: its top-level figures, then each list of objects as a table."""
    scalars = [[k, num(v)] for k, v in r.items() if not isinstance(v, dict | list)]
    tables: list[Table] = [("", ["figure", "value"], scalars)] if scalars else []
    for key, value in r.items():
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            headers = list(dict.fromkeys(k for v in value for k in v if _flat(v[k])))
            tables.append((key, headers, [[num(v.get(h)) for h in headers] for v in value]))
    return tables


def _flat(value: Any) -> bool:
    return not isinstance(value, dict | list)


@dataclass(frozen=True)
class Bench:
    """How one bench is recorded and shown."""

    command: str  # the full-size command the lead records with bench_record.py
    render: Callable[[dict[str, Any]], list[Table]]
    size_flags: tuple[str, ...] = ()  # flags that make a run smaller than the full bench


BENCHES: dict[str, Bench] = {
    "pipeline": Bench(
        "fedpipe bench pipeline --json",
        _pipeline,
        ("--links", "--schedules", "--steps", "--warmup", "--microbatches", "--batch-size"),
    ),
    "server": Bench(
        "fedpipe bench server --json", _server, ("--quick", "--devices", "--steps", "--warmup")
    ),
    "plan": Bench(
        "fedpipe bench plan --json", _plan, ("--links", "--steps", "--warmup", "--sessions")
    ),
    "scale": Bench(
        "fedpipe bench scale --json",
        _scale,
        ("--quick", "--devices", "--rounds", "--steps", "--warmup"),
    ),
    "memory": Bench("fedpipe bench memory --model default", _memory),
    "memory-steps": Bench(
        "fedpipe bench memory --json --set model.head_layers=2 --set model.tail_layers=2",
        _memory_steps,
        ("--shapes", "--steps", "--whole-blocks", "--seq-len", "--batch-size"),
    ),
    "memory-server": Bench(
        "fedpipe bench memory --server-weights fp32,bf16,int8,int4 --seq-len 128 --json",
        _memory_server,
        ("--steps", "--sessions", "--batch-size"),
    ),
    "quality": Bench("fedpipe bench quality --json", _quality, ("--quick",)),
    "privacy": Bench("fedpipe bench privacy --json", _privacy, ("--quick",)),
    "instruct": Bench("fedpipe bench instruct --json", _instruct, ("--limit", "--set")),
    "async": Bench("fedpipe bench async --json", _async, ("--quick", "--set")),
    "transport": Bench(
        "python benchmarks/transport_bench.py --json", _generic, ("--messages", "--trials")
    ),
    "codec": Bench("python benchmarks/codec_bench.py", _codec, ("--repeats", "--batch")),
    "batch": Bench("python benchmarks/batch_bench.py --reps 5", _batch, ("--sessions",)),
    "load": Bench("python benchmarks/load_bench.py --json", _load, ("--devices", "--steps")),
    "stress": Bench(
        "python benchmarks/stress_bench.py --json", _generic, ("--devices", "--steps", "--seconds")
    ),
    "step-end": Bench("python benchmarks/step_end_bench.py", _step_end),
    "gpu-check": Bench("python benchmarks/gpu_check.py", _gpu_check, ("--devices", "--steps")),
    "aggregation-residual": Bench("python benchmarks/aggregation_residual.py", _generic),
    "dtype": Bench(
        "python benchmarks/dtype_bench.py", _dtype, ("--steps", "--seq-len", "--batch-size")
    ),
}


def smaller(bench: Bench, command: str) -> bool:
    """Whether ``command`` ran ``bench`` at less than its full size (one of its size flags)."""
    words = command.split()
    return any(w == flag or w.startswith(flag + "=") for w in words for flag in bench.size_flags)


# --- records, provenance, pages ---------------------------------------------------------------


def _bench(name: str) -> Bench:
    base = name.split("@", 1)[0]  # "memory@2-2": a second record of the memory bench
    if base not in BENCHES:
        raise ValueError(f"unknown bench {name!r}; known: {', '.join(BENCHES)}")
    return BENCHES[base]


def load_record(name: str, data_dir: Path = DATA_DIR) -> dict[str, Any] | None:
    """The record ``data_dir/NAME.json``, or None when the bench has not been recorded."""
    path = data_dir / f"{name}.json"
    if not path.is_file():
        return None
    record: dict[str, Any] = json.loads(path.read_text())
    missing = {"command", "date", "commit", "machine", "result"} - set(record)
    if missing:
        raise ValueError(f"{path}: not a bench record, it lacks {sorted(missing)}")
    return record


def machine_text(m: dict[str, Any]) -> str:
    gpu = m.get("gpu")
    gpu_text = f"{gpu['name']} x{gpu.get('count', 1)}" if gpu else "no GPU"
    ram = f", {m['ram_gib']} GiB RAM" if m.get("ram_gib") else ""
    return f"{m.get('cpu')}, {m.get('cores')} cores{ram}, {gpu_text}, torch {m.get('torch')}"


def load_text(record: dict[str, Any]) -> str:
    """The load the run shared the machine with, and a warning when it was busy."""
    load, cores = record.get("load_average"), get(record, "machine", "cores", default=0)
    if not load or not cores:
        return ""
    before, peak = load["before"][0], load["peak"]
    text = f"load average {before:.1f} before the run, up to {peak:.1f} during it"
    if before > LOADED * cores:
        text += (
            f" on {cores} cores: **measured while other work loaded the machine**, so its "
            "timings are noisy (sizes, bytes and losses are not)"
        )
    return text


def provenance(name: str, record: dict[str, Any], link: str) -> str:
    """The line under a table: command, date, commit, machine, load."""
    commit = str(record["commit"])[:10]
    if record.get("dirty"):
        commit += " with local changes to " + ", ".join(f"`{p}`" for p in record["dirty"])
    parts = [
        f"`{record['command']}`",
        str(record["date"]).replace("T", " ").replace("+00:00", " UTC"),
        f"commit {commit}",
        machine_text(record["machine"]),
    ]
    if load_text(record):
        parts.append(load_text(record))
    if record.get("wall_s") is not None:
        parts.append(f"{record['wall_s']:.0f} s")
    return f"<small>Source: {'; '.join(parts)} ([{name}.json]({link}{name}.json)).</small>"


def render(name: str, data_dir: Path = DATA_DIR, link: str = "data/") -> str:
    """Markdown for one marker: the bench's tables with their source, or how to make them."""
    bench = _bench(name)
    record = load_record(name, data_dir)
    if record is None:
        return (
            f'!!! note "No figure yet"\n    Nothing has been recorded for this bench. Record it '
            f"with:\n\n        python scripts/bench_record.py -- {bench.command}\n"
        )
    out = []
    if smaller(bench, record["command"]):
        out.append(
            f'!!! info "A smaller run"\n    These figures come from `{record["command"]}`; the '
            f"full bench is `{bench.command}`.\n"
        )
    for caption, headers, rows in bench.render(record["result"]):
        if caption:
            out.append(f"*{caption}*\n")
        out.append(markdown_table(headers, rows) + "\n")
    out.append(provenance(name, record, link) + "\n")
    return "\n".join(out)


# Benches whose record also makes a plot: name -> (module, function of the result -> SVG text).
PLOTS = {
    "privacy": ("fedpipe_bench.privacy_plot", "svg_text"),
    "memory-steps": ("fedpipe_bench.memory_plot", "svg_text"),
}


def render_plot(name: str, data_dir: Path = DATA_DIR, link: str = "data/") -> str:
    """Markdown for ``<!-- fedpipe:plot NAME -->``: the bench's plot drawn from its record (an
    inline SVG), with the record's source under it; a note when nothing is recorded."""
    if name not in PLOTS:
        raise ValueError(f"no plot for bench {name!r}; plots exist for {', '.join(PLOTS)}")
    record = load_record(name, data_dir)
    if record is None:
        return '!!! note "No plot yet"\n    Nothing has been recorded for this bench.\n'
    module, function = PLOTS[name]  # imported here: matplotlib only for a page with a plot
    svg = getattr(importlib.import_module(module), function)(record["result"])
    data = base64.b64encode(svg.encode()).decode()
    image = f'<img alt="{name} plot" src="data:image/svg+xml;base64,{data}">'
    return f"{image}\n\n{provenance(name, record, link)}\n"


def expand(markdown: str, data_dir: Path = DATA_DIR, link: str = "data/") -> str:
    """A page with every ``<!-- fedpipe:bench NAME -->`` replaced by ``render(NAME)``."""
    return MARKER.sub(lambda m: render(m.group("name"), data_dir, link), markdown)


def readme_block(data_dir: Path = DATA_DIR) -> str:
    """The README's one result: the pipeline bench's main table and its source."""
    record = load_record(README_BENCH, data_dir)
    page = "docs/benchmarks/pipeline.md"
    if record is None:
        return f"No pipeline figure is recorded yet: see [{page}]({page}).\n"
    caption, headers, rows = _bench(README_BENCH).render(record["result"])[0]
    keep = [0, 1, 2, 3, 6, 7]  # link, T_seq, T_seq whole, T_pipe, speedup, efficiency
    table = markdown_table([headers[i] for i in keep], [[row[i] for i in keep] for row in rows])
    return (
        f"*{caption}*\n\n{table}\n\n"
        + provenance(README_BENCH, record, link="docs/benchmarks/data/")
        + f"\n\nWhat each column means, and every other figure: [{page}]({page}).\n"
    )


def replace_readme_block(text: str, block: str) -> str:
    begin, end = text.find(README_BEGIN), text.find(README_END)
    if begin < 0 or end < begin:
        raise ValueError(f"README.md lacks the {README_BEGIN} ... {README_END} block")
    return text[: begin + len(README_BEGIN)] + "\n" + block + text[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("names", nargs="*", help="benches whose tables to print")
    parser.add_argument("--data", type=Path, default=DATA_DIR, help="folder of the records")
    parser.add_argument("--readme", action="store_true", help="rewrite the README's result")
    parser.add_argument("--check-readme", action="store_true", help="fail if it is stale")
    args = parser.parse_args(argv)
    if args.readme or args.check_readme:
        text = README.read_text()
        new = replace_readme_block(text, readme_block(args.data))
        if args.check_readme and new != text:
            print(
                "README.md's result is stale: run python scripts/render_bench_docs.py --readme",
                file=sys.stderr,
            )
            return 1
        if args.readme:
            README.write_text(new)
    for name in args.names:
        print(render(name, args.data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
