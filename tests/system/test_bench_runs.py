"""One smoke run per bench: each `fedpipe bench ...` (or bench script) runs on a tiny model,
as a real process where the command is one, and keeps the JSON contract other tools read
(DESIGN.md). The delta-cache run also checks what the quality bench shows of kept caches,
and the transport bench's run where its stage-link figure comes from.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from fedpipe_bench.pipeline import round_robin
from fedpipe_bench.privacy import QUICK, run_privacy_bench
from fedpipe_bench.quality import RUNS, run_quality_bench

from fedpipe.cli.main import main
from fedpipe.edge.planner.bound import Components, pipeline_bound
from fedpipe.models import load_config, resolve_model

ROOT = Path(__file__).resolve().parents[2]


# -- bench pipeline -------------------------------------------------------------------------------
CONTRACT_KEYS = {
    "link",
    "microbatches",
    "t_seq_s",
    "t_pipe_s",
    "t_bound_s",
    "speedup",
    "efficiency",
    "ceiling",
    "components_solo",
    "components_inrun",
    "t_bound_inrun_s",
    "t_seq_whole_s",
    "schedules",
    "noisy",
}


def _bench(links: str, *extra: str) -> tuple[dict, str]:
    args = [
        *("bench", "pipeline", "--model", "tiny-llama", "--json"),
        *("--links", links, "--schedules", "sequential,greedy"),
        *("--steps", "2", "--warmup", "1", "--batch-size", "4", "--seq-len", "16"),
        *("--microbatches", "2", *extra),
    ]
    done = subprocess.run(
        [sys.executable, "-m", "fedpipe.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout), done.stderr


@pytest.mark.parametrize(
    ("split", "layers", "transfers", "links"),
    [
        # an inline link spec beside a named one (one smoke run for both)
        ("u", ("1", "1"), 4, ["up=1000,down=1000,rtt=2ms", "100mbit-5ms"]),
        ("two", ("1", "0"), 2, ["100mbit-5ms"]),
    ],
)
def test_bench_json_holds_the_contract_in_both_split_modes(
    split: str, layers: tuple[str, str], transfers: int, links: list[str]
) -> None:
    report, stderr = _bench(
        ",".join(links),
        *("--set", f"model.split={split}", "--set", f"model.head_layers={layers[0]}"),
        *("--set", f"model.tail_layers={layers[1]}"),
    )
    assert [e["link"] for e in report["links"]] == links
    # Progress goes to stderr in round-robin order: every run's step k before any step k+1.
    ran = re.findall(r"(\S+) step (\d+)\s+(\S+):", stderr)
    runs = ["solo", "sequential", "greedy", "sequential-whole"]
    for entry in report["links"]:
        assert CONTRACT_KEYS <= set(entry), CONTRACT_KEYS - set(entry)
        assert entry["t_seq_s"] > 0 and entry["t_pipe_s"] > 0
        assert set(entry["schedules"]) == {"sequential", "greedy", "sequential-whole"}
        assert entry["speedup"] == pytest.approx(
            min(entry["t_seq_s"], entry["t_seq_whole_s"]) / entry["t_pipe_s"], rel=1e-2
        )
        solo = entry["components_solo"]
        assert solo["split"] == split and solo["c_f"] > 0 and solo["s_b"] > 0
        assert (solo["c_t"] > 0) == (split == "u")  # the two-part device has no tail
        rebuilt = Components(**solo)  # the bound is what bench.bound makes of the solo parts
        assert len(rebuilt.transfers) == transfers
        assert pipeline_bound(rebuilt, 2)[0] == pytest.approx(entry["t_bound_s"], abs=2e-4)
        steps = [(int(s), n) for link, s, n in ran if link == entry["link"]]
        assert steps == round_robin(runs, 3)
    assert report["noisy"] == any(e["noisy"] for e in report["links"])


# -- bench quality --------------------------------------------------------------------------------
FIELDS = {"name", "eval_loss", "eval_ppl", "bytes_up", "bytes_down", "bytes_per_token", "wall_s"}


def test_quick_run_keeps_the_json_contract() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "fedpipe.cli", "bench", "quality", "--quick", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    runs = {r["name"]: r for r in json.loads(done.stdout)["runs"]}
    assert set(runs) == {"centralized", *(r["name"] for r in RUNS)}
    for run in runs.values():
        assert FIELDS | {"steps"} <= set(run) and math.isfinite(run["eval_loss"])
        assert run["eval_ppl"] == pytest.approx(math.exp(run["eval_loss"]))
    assert len({r["steps"] for r in runs.values()}) == 1  # the same optimizer steps everywhere
    assert runs["centralized"]["bytes_up"] == 0
    lossless = runs["lossless"]
    assert (
        runs["int8"]["bytes_per_token"]
        < runs["fp16"]["bytes_per_token"]
        < (lossless["bytes_per_token"])
    )
    assert runs["frozen"]["bytes_down"] < 0.6 * lossless["bytes_down"]  # no INPUT_GRAD tensors
    assert runs["noniid-exact"]["adapter_bytes_down"] > runs["noniid"]["adapter_bytes_down"]


def test_the_quality_bench_shows_fewer_bytes_in_later_rounds_only_with_kept_caches() -> None:
    report = run_quality_bench(
        quick=True,
        names=["int8-delta", "int8-delta-session"],
        # 4 blocks a device, 4 samples a round: every round is one epoch of its data
        overrides={"federated.device_blocks": 4, "federated.rounds": 3},
    )
    kept, session = (r["per_round"] for r in report["runs"])
    assert [r["delta_hit_rate"] for r in kept] == [0.0, 1.0, 1.0]
    assert [r["delta_resumed"] for r in kept] == [0, 4, 4]  # all four devices
    assert [r["delta_hit_rate"] for r in session] == [0.0, 0.0, 0.0]
    assert kept[0]["bytes_per_token"] == session[0]["bytes_per_token"]
    assert kept[2]["bytes_per_token"] < 0.9 * session[2]["bytes_per_token"]
    losses = [r["eval_loss"] for r in report["runs"]]
    assert losses[0] == pytest.approx(losses[1], rel=1e-2)


# -- bench privacy --------------------------------------------------------------------------------
ROW_KEYS = {
    "head_layers",
    "defence",
    "strength",
    "attacker",
    "reconstruction_acc",
    "label_acc",
    "eval_loss",
    "epsilon",
}


def test_quick_bench_attacks_work_and_the_json_has_the_contract(tmp_path: Path) -> None:
    report = run_privacy_bench(QUICK)
    json.dumps(report)  # one JSON object, as --json prints it
    rows = report["rows"]
    assert not QUICK.deeper_cuts
    assert len(rows) == len(QUICK.cuts) * (1 + len(QUICK.settings)) * 2  # x fixed, adaptive
    for row in rows:
        assert ROW_KEYS <= row.keys()
        assert 0 <= row["reconstruction_acc"] <= 1 and 0 <= row["label_acc"] <= 1
    assert report["settings"]["held_out"].startswith("the run's evaluator's")

    def row(defence: str, attacker: str) -> dict:  # type: ignore[type-arg]
        return next(r for r in rows if r["defence"] == defence and r["attacker"] == attacker)

    plain = row("none", "fixed")
    # The attacks are real: far above chance and above always guessing the commonest token.
    assert plain["reconstruction_acc"] > max(0.5, 20 * report["chance_acc"])
    assert plain["reconstruction_acc"] > report["majority_token_acc"] + 0.3
    assert plain["label_acc"] > report["majority_token_acc"] + 0.3
    assert plain["epsilon"] is None  # no noise, no guarantee
    clipped = row("clip", "fixed")
    assert clipped["epsilon"] is not None and clipped["epsilon"] > 0
    assert clipped["reconstruction_acc"] < plain["reconstruction_acc"]
    # The adaptive attacker refits to the defence it knows and beats the one that ignores it.
    for defence in ("clip", "token-dim"):
        fixed, adaptive = row(defence, "fixed"), row(defence, "adaptive")
        assert adaptive["reconstruction_acc"] > fixed["reconstruction_acc"], defence
        assert adaptive["eval_loss"] == fixed["eval_loss"]  # one training run, two attackers
    assert row("token-dim", "fixed")["epsilon"] is None  # nothing bounded: no epsilon
    # Resampled labels: the gradients no longer tell the labels, the activations still do.
    resampled = row("label-resample", "adaptive")
    assert resampled["label_acc"] < 0.6 * row("none", "adaptive")["label_acc"]
    assert resampled["reconstruction_acc"] > 0.9 * row("none", "adaptive")["reconstruction_acc"]
    both = row("decorrelation+token-dim", "adaptive")
    assert both["head_dcor"] is not None and 0 < both["head_dcor"] <= 1
    # The same setting with other draws of the device's noise: the cost's spread, no attacks.
    assert [s["device_seed"] for s in report["spread"]] == list(QUICK.spread_seeds)
    for repeat in report["spread"]:
        assert "eval_loss_cost_pct" in repeat and "reconstruction_acc" not in repeat
    # The Pareto plot the bench writes, from its own report.
    from fedpipe_bench.privacy_plot import write_pareto

    path = write_pareto(report, tmp_path / "pareto.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- bench server ---------------------------------------------------------------------------------
COLUMN_KEYS = {"mb_per_s", "tokens_per_s", "step_p50_s", "step_p95_s", "busy", "mean_batch"}


def test_quick_run_prints_the_contract_for_every_n() -> None:
    cmd = [sys.executable, "-m", "fedpipe.cli", "bench", "server", "--json", "--quick"]
    done = subprocess.run(
        [*cmd, "--devices", "1,3"], capture_output=True, text=True, timeout=900, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)  # stdout is one JSON object; progress went to stderr
    assert "N=  3" in done.stderr
    assert [row["devices"] for row in report["rows"]] == [1, 3]
    for row in report["rows"]:
        for column in ("batched", "unbatched"):
            figures = row[column]
            assert COLUMN_KEYS <= figures.keys()
            for key in COLUMN_KEYS:
                assert math.isfinite(figures[key]) and figures[key] > 0, (column, key, figures)
            assert figures["busy"] <= 1.0 and figures["step_p95_s"] >= figures["step_p50_s"]
            assert figures["mean_batch"] >= 1.0
    assert math.isfinite(report["n_star"]) and report["n_star"] > 0
    pinning = report["pinning"]
    assert {"server_cpus", "server_threads", "loadgen_cpus", "machine_cpus"} <= pinning.keys()
    assert isinstance(report["batching_available"], bool) and isinstance(report["noisy"], bool)
    assert all(row["batched_over_unbatched"] > 0 for row in report["rows"])
    assert report["loadgen_cpu_max"] >= 0 and len(report["load_average"]["start"]) == 3


# -- bench memory, and the transport bench script -------------------------------------------------
def test_bench_memory_default_model_and_split_work(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "memory", "--model", "tiny-gpt2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"] == "tiny-gpt2"


def _transport_bench() -> ModuleType:
    """benchmarks/transport_bench.py as a module, for its constants."""
    path = ROOT / "benchmarks" / "transport_bench.py"
    spec = importlib.util.spec_from_file_location("transport_bench", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_transport_bench_prints_the_ratio_as_json() -> None:
    """The script's JSON, and where its stage-link figure comes from: every timed message
    crossed a session the StageServer opened (its streams answered them), and the device's
    sessions counted the bytes of every message both ways. Not a timing test."""
    messages, trials = 3, 2
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/transport_bench.py"), "--json"]
        + ["--messages", str(messages), "--trials", str(trials)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    result = json.loads(out.stdout)
    assert result["message_mb"] == pytest.approx(9.44, abs=0.01)  # the bundled model's
    assert result["stage_mb_per_s"] > 0 and result["plain_grpc_mb_per_s"] > 0
    expected = result["stage_mb_per_s"] / result["plain_grpc_mb_per_s"]
    assert result["ratio"] == pytest.approx(expected, rel=1e-2)
    bench = _transport_bench()
    hidden = int(load_config(resolve_model("default")).hidden_size)
    assert result["shape"] == [bench.MICROBATCH, bench.SEQ_LEN, hidden]
    payload = bench.MICROBATCH * bench.SEQ_LEN * hidden * 4  # fp32
    # the server held one session per timed trial, and its streams answered every message
    assert result["server_sessions"] == trials
    assert result["server_echoes"] == trials * messages
    # the device's sessions counted each message's frame: the payload plus a small header
    for key in ("session_bytes_up", "session_bytes_down"):
        per_message = result[key] / (trials * messages)
        assert payload < per_message < payload + 256, (key, per_message)


def test_async_bench_quick_runs_both_modes_and_keeps_its_contract() -> None:
    """`fedpipe bench async --quick --json`: both modes on the same five devices; the sync
    run's final loss is the target; each mode's figures are present and consistent."""
    done = subprocess.run(
        [sys.executable, "-m", "fedpipe.cli", "bench", "async", "--quick", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    sync, asyn = report["sync"], report["async"]
    assert report["settings"]["slowdowns"] == [1.5, 1.2, 6.0, 3.0, 30.0]
    assert report["target_loss"] == sync["final_eval_loss"] == sync["evals"][-1]["eval_loss"]
    assert sync["rounds"] == report["settings"]["rounds"]
    assert sync["updates"] == 5 * sync["rounds"]  # every device, every round
    assert asyn["updates"] == report["settings"]["buffer"] * asyn["versions"]
    for mode in (sync, asyn):
        assert set(mode["device_idle"]) == set(report["settings"]["profiles"])
        assert all(0.0 <= f <= 1.0 for f in mode["device_idle"].values())
        assert mode["bytes_up"] > 0 and mode["adapter_bytes_down"] > 0
        assert [e["at_s"] for e in mode["evals"]] == sorted(e["at_s"] for e in mode["evals"])
    to = asyn["wall_to_target_s"]
    assert report["wall_to_target_ratio"] == (None if to is None else to / sync["wall_s"])
