"""The benchmark pages' tables come from bench records, rendered with their source."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import mkdocs_hooks  # noqa: E402
import render_bench_docs as rb  # noqa: E402

PIPELINE = {
    "model": "tiny-llama",
    "split": "u: head 1, tail 1",
    "batch": [4, 16],
    "microbatches": 2,
    "codec": "fp32",
    "steps": 2,
    "warmup": 1,
    "links": [
        {
            "link": "100mbit-100ms",
            "t_seq_s": 0.5,
            "t_seq_whole_s": 0.4,
            "t_pipe_s": 0.25,
            "best_schedule": "greedy",
            "t_bound_s": 0.2,
            "bound_term": "server",
            "t_bound_inrun_s": 0.21,
            "speedup": 1.6,
            "efficiency": 0.8,
            "ceiling": 2.0,
            "noisy": False,
            "schedules": {"gpipe": 0.27, "greedy": 0.25},
        }
    ],
}


def record(result: dict[str, Any], **over: Any) -> dict[str, Any]:
    entry = {
        "command": "fedpipe bench pipeline --json",
        "date": "2026-01-02T03:04:05+00:00",
        "commit": "0123456789abcdef0123456789abcdef01234567",
        "dirty": [],
        "machine": {"cpu": "Test CPU", "cores": 4, "ram_gib": 8.0, "gpu": None, "torch": "2.x"},
        "load_average": {"before": [0.5, 0.5, 0.5], "peak": 1.0},
        "wall_s": 12.0,
        "result": result,
    }
    return entry | over


def write(folder: Path, name: str, entry: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    path.write_text(json.dumps(entry))
    return path


def test_a_record_renders_as_its_tables_with_the_source(tmp_path: Path) -> None:
    write(tmp_path, "pipeline", record(PIPELINE))
    text = rb.render("pipeline", tmp_path)
    assert "| 100mbit-100ms | 0.500 | 0.400 | 0.250 (greedy) | 0.200 (server) |" in text
    assert "| link | gpipe | greedy |" in text  # every schedule's time
    source = text.splitlines()[-1]
    for part in ("`fedpipe bench pipeline --json`", "2026-01-02 03:04:05 UTC", "0123456789"):
        assert part in source
    assert "Test CPU, 4 cores, 8.0 GiB RAM, no GPU, torch 2.x" in source
    assert "[pipeline.json](data/pipeline.json)" in source
    assert "loaded the machine" not in text and "A smaller run" not in text


def test_a_loaded_machine_and_a_smaller_run_are_said(tmp_path: Path) -> None:
    loaded = {"before": [3.0, 2.0, 1.0], "peak": 5.0}  # 3.0 on 4 cores: past half
    command = "fedpipe bench pipeline --json --links 1gbit-5ms --steps 2"
    write(tmp_path, "pipeline", record(PIPELINE, load_average=loaded, command=command))
    text = rb.render("pipeline", tmp_path)
    assert "measured while other work loaded the machine" in text
    assert f"These figures come from `{command}`" in text


def test_a_run_of_full_size_with_other_settings_is_not_called_smaller(tmp_path: Path) -> None:
    command = "fedpipe bench pipeline --json --codec int8"
    write(tmp_path, "pipeline", record(PIPELINE, command=command))
    assert "A smaller run" not in rb.render("pipeline", tmp_path)


def test_local_changes_to_the_benched_code_are_named(tmp_path: Path) -> None:
    write(tmp_path, "pipeline", record(PIPELINE, dirty=["fedpipe/x.py"]))
    assert "with local changes to `fedpipe/x.py`" in rb.render("pipeline", tmp_path)


def test_without_a_record_the_page_shows_the_command_and_no_figure(tmp_path: Path) -> None:
    text = rb.render("server", tmp_path)
    assert "No figure yet" in text
    assert "python scripts/bench_record.py -- fedpipe bench server --json" in text
    assert "|" not in text


def test_a_file_that_is_not_a_record_is_refused(tmp_path: Path) -> None:
    write(tmp_path, "pipeline", {"result": PIPELINE})
    with pytest.raises(ValueError, match="not a bench record"):
        rb.render("pipeline", tmp_path)


def test_an_unknown_bench_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown bench 'nosuch'"):
        rb.render("nosuch", tmp_path)


def test_a_second_record_of_one_bench_uses_its_renderer(tmp_path: Path) -> None:
    memory = {"model": "m", "plan": "u:1+1", "device_param_bytes": 2**20}
    write(tmp_path, "memory@1-1", record(memory, command="fedpipe bench memory --model default"))
    assert "| m | u:1+1 | 1.0 MiB" in rb.render("memory@1-1", tmp_path)


def test_the_families_memory_record_renders_a_row_per_model(tmp_path: Path) -> None:
    rows = [
        {"model": "tiny qwen3", "model_type": "qwen3", "plan": "u:1+1"}
        | {"device_param_bytes": 66 * 2**10, "param_fraction": 0.5},
        {"model": "default", "model_type": "llama", "plan": "u:1+1"}
        | {"device_param_bytes": 162 * 2**20, "model_param_bytes": 513 * 2**20},
    ]
    command = "fedpipe bench memory --families"
    write(tmp_path, "memory@families", record({"rows": rows}, command=command))
    text = rb.render("memory@families", tmp_path)
    assert "| tiny qwen3 | qwen3 | u:1+1 | 66.0 KiB (50.0%) |" in text
    assert "| default | llama | u:1+1 | 162.0 MiB (–) | 513.0 MiB |" in text


def test_an_unknown_result_shape_still_renders_every_figure(tmp_path: Path) -> None:
    result = {"ratio": 0.8, "rows": [{"size_mb": 9.4, "mb_per_s": 500.0}]}
    write(tmp_path, "transport", record(result))
    text = rb.render("transport", tmp_path)
    assert "| ratio | 0.800 |" in text
    assert "| 9.400 | 500.000 |" in text


def test_the_hook_replaces_markers_with_links_relative_to_the_page(tmp_path: Path) -> None:
    data = tmp_path / "benchmarks" / "data"
    write(data, "pipeline", record(PIPELINE))
    page = "# Title\n\n<!-- fedpipe:bench pipeline -->\n\nafter\n"
    out = mkdocs_hooks.expand_page(page, data, Path("guides"))
    assert "<!-- fedpipe" not in out and out.endswith("after\n")
    assert "(../benchmarks/data/pipeline.json)" in out
    at_root = mkdocs_hooks.expand_page(page, data, Path("."))
    assert "(benchmarks/data/pipeline.json)" in at_root


def test_the_hook_refuses_an_unknown_marker(tmp_path: Path) -> None:
    from mkdocs.exceptions import PluginError

    with pytest.raises(PluginError, match="fedpipe:setings"):
        mkdocs_hooks.expand_page("<!-- fedpipe:setings -->\n", tmp_path, Path("."))
    with pytest.raises(PluginError, match="unknown bench"):
        mkdocs_hooks.expand_page("<!-- fedpipe:bench nosuch -->\n", tmp_path, Path("."))


def test_the_readme_block_is_rewritten_between_its_markers(tmp_path: Path) -> None:
    write(tmp_path, "pipeline", record(PIPELINE))
    text = f"before\n{rb.README_BEGIN}\nold\n{rb.README_END}\nafter\n"
    new = rb.replace_readme_block(text, rb.readme_block(tmp_path))
    assert new.startswith(f"before\n{rb.README_BEGIN}\n")
    assert new.endswith(f"{rb.README_END}\nafter\n")
    assert "old" not in new and "| 100mbit-100ms |" in new
    assert "(docs/benchmarks/data/pipeline.json)" in new


# --- the repository's own pages and records ---------------------------------------------------


def test_every_committed_record_renders() -> None:
    for path in sorted(rb.DATA_DIR.glob("*.json")):
        assert "Source:" in rb.render(path.stem), path


def test_every_marker_in_the_docs_names_a_known_bench() -> None:
    names = {
        m.group("name")
        for page in (ROOT / "docs").rglob("*.md")
        for m in rb.MARKER.finditer(page.read_text())
    }
    assert names, "no page asks for a bench's tables"
    for name in names:
        rb._bench(name)  # raises for an unknown one


def test_the_readme_result_is_current() -> None:
    text = rb.README.read_text()
    assert rb.replace_readme_block(text, rb.readme_block()) == text, (
        "run python scripts/render_bench_docs.py --readme"
    )


def test_the_readme_quickstart_holds_two_commands_the_second_runs_test_sh() -> None:
    text = rb.README.read_text()
    quickstart = text.split("## Quickstart", 1)[1]
    block = re.search(r"```\w*\n(.*?)```", quickstart, re.DOTALL)
    assert block is not None
    lines = block.group(1).strip().splitlines()
    assert len(lines) == 2
    assert "fedpipe simulate --config examples/demo.toml" in lines[0]
    assert lines[1].endswith("bash scripts/test.sh")


def _privacy_row(defence: str, strength: float, attacker: str, rec: float, cost: float) -> dict:  # type: ignore[type-arg]
    return {
        "head_layers": 1,
        "defence": defence,
        "strength": strength,
        "decorrelation": 10.0 if defence.startswith("decorrelation") else 0.0,
        "attacker": attacker,
        "reconstruction_acc": rec,
        "label_acc": rec,
        "label_prior_acc": 0.4,
        "eval_loss": 3.0 * (1 + cost / 100),
        "eval_loss_cost_pct": cost,
        "epsilon": 900.0 if defence == "clip" else None,
    }


PRIVACY = {
    "model": "default",
    "chance_acc": 2e-5,
    "majority_token_acc": 0.05,
    "rows": [
        _privacy_row(defence, strength, attacker, rec, cost)
        for defence, strength, rec, cost in (
            ("none", 0.0, 0.95, 0.0),
            ("clip", 0.03, 0.8, 1.0),
            ("clip", 0.1, 0.4, 15.0),
            ("decorrelation+token-dim", 0.03, 0.85, 2.5),
        )
        for attacker in ("fixed", "adaptive")
    ],
    "halves_both_within_2pct": [],
    "spread": [
        {"defence": "clip", "strength": 0.03, "device_seed": 1, "eval_loss_cost_pct": 0.5},
        {"defence": "clip", "strength": 0.03, "device_seed": 2, "eval_loss_cost_pct": 3.25},
    ],
    "best_within_2pct": [
        {
            "head_layers": 1,
            "defence": "clip",
            "strength": 0.03,
            "decorrelation": 0.0,
            "worse_attack_keeps": 0.842,
            "eval_loss_cost_pct": 1.0,
        }
    ],
}


def test_the_privacy_tables_name_the_attacker_and_the_best_trade_off(tmp_path: Path) -> None:
    write(tmp_path, "privacy", record(PRIVACY, command="fedpipe bench privacy --json"))
    text = rb.render("privacy", tmp_path)
    row = "| 1 | clip | 0.030 | adaptive | 0.800 | 0.800 | 0.400 | 3.0300 | +1.0% | 900.000 |"
    assert row in text
    assert "| 1 | decorrelation+token-dim | 0.030 (weight 10.000) | fixed |" in text
    assert "no setting halves both attacks within 2% held-out loss" in text
    assert "| 1 | clip | 0.030 | 84% | +1.0% |" in text
    assert "| clip | 0.030 | 1, 2 | +0.5% to +3.2% |" in text


def test_the_privacy_plot_is_drawn_from_the_record_at_build_time(tmp_path: Path) -> None:
    import base64

    data = tmp_path / "benchmarks" / "data"
    write(data, "privacy", record(PRIVACY, command="fedpipe bench privacy --json"))
    out = mkdocs_hooks.expand_page("<!-- fedpipe:plot privacy -->\n", data, Path("."))
    found = re.search(r'src="data:image/svg\+xml;base64,([^"]+)"', out)
    assert found is not None
    svg = base64.b64decode(found.group(1)).decode()
    assert svg.lstrip().startswith("<?xml") and "<svg" in svg
    assert "(benchmarks/data/privacy.json)" in out  # its source, as under a table
    assert "No plot yet" in rb.render_plot("privacy", tmp_path / "empty")
    with pytest.raises(ValueError, match="no plot for bench 'pipeline'"):
        rb.render_plot("pipeline", data)


def test_the_device_memory_plot_is_drawn_from_its_record(tmp_path: Path) -> None:
    """The memory page's plot comes from the memory-steps record: a panel per model, a bar per
    weights setting at its device step peak, whole-model LoRA's peak as a line."""
    import base64

    from fedpipe_bench.memory_plot import memory_figure

    kept = json.loads((Path(rb.DATA_DIR) / "memory-steps.json").read_text())
    data = tmp_path / "benchmarks" / "data"
    write(data, "memory-steps", kept)
    out = mkdocs_hooks.expand_page("<!-- fedpipe:plot memory-steps -->\n", data, Path("."))
    found = re.search(r'src="data:image/svg\+xml;base64,([^"]+)"', out)
    assert found is not None
    assert "<svg" in base64.b64decode(found.group(1)).decode()
    rows = kept["result"]["rows"]
    fig = memory_figure(kept["result"])
    models = list(dict.fromkeys(r["model"] for r in rows))
    assert [ax.get_title() for ax in fig.axes] == models
    for ax, model in zip(fig.axes, models, strict=True):
        mine = [r for r in rows if r["model"] == model]
        heights = [p.get_height() for p in ax.patches][: len(mine)]  # the peaks, then baselines
        assert heights == pytest.approx([r["device_step_peak_bytes"] / 2**20 for r in mine])
        (line,) = ax.get_lines()
        assert line.get_ydata()[0] == pytest.approx(mine[0]["whole_lora_step_peak_bytes"] / 2**20)


def test_the_step_memory_record_shows_device_against_whole(tmp_path: Path) -> None:
    row = {
        "model": "llama-3.2-1b",
        "weights": "fp32",
        "device_param_bytes": 2**30,
        "device_step_peak_bytes": 2 * 2**30,
        "device_step_peak_full_logits_bytes": 3 * 2**30,
        "whole_lora_step_peak_bytes": 8 * 2**30,
        "baseline_rss_bytes": 2**28,
        "whole_blocks": 16,
    }
    result = {"loss_chunk": 256, "steps": 2, "batch_size": 2, "seq_len": 512, "rows": [row]}
    write(tmp_path, "memory-steps", record(result, command="fedpipe bench memory --json"))
    text = rb.render("memory-steps", tmp_path)
    assert "| llama-3.2-1b | fp32 | 1024.0 MiB | 2048.0 MiB | 3072.0 MiB |" in text
    assert "| 8192.0 MiB (16 blocks) | 0.25 | 256.0 MiB | 1.00 |" in text


def test_the_step_memory_record_shows_each_weights_against_the_fp32_device(
    tmp_path: Path,
) -> None:
    def row(weights: str, params: int, peak: int, full: int | None) -> dict[str, object]:
        return {
            "model": "llama-3.2-1b",
            "weights": weights,
            "device_param_bytes": params,
            "device_step_peak_bytes": peak,
            "device_step_peak_full_logits_bytes": full,
            "whole_lora_step_peak_bytes": 8 * 2**30,
            "baseline_rss_bytes": 2**28,
            "whole_blocks": 16,
        }

    rows = [row("fp32", 2**30, 4 * 2**30, 5 * 2**30), row("int4", 2**27, 2**30, None)]
    result = {"loss_chunk": 256, "steps": 2, "batch_size": 2, "seq_len": 512, "rows": rows}
    write(tmp_path, "memory-steps", record(result, command="fedpipe bench memory --json"))
    text = rb.render("memory-steps", tmp_path)
    assert "| llama-3.2-1b | int4 | 128.0 MiB | 1024.0 MiB | – |" in text
    assert "| 8192.0 MiB (16 blocks) | 0.12 | 256.0 MiB | 0.25 |" in text


def test_the_server_weights_record_shows_each_setting_against_fp32(tmp_path: Path) -> None:
    def row(weights: str, params: int, step: float, error: float | None) -> dict[str, object]:
        return {
            "weights": weights,
            "server_param_bytes": params,
            "step_s": step,
            "step_s_min": step / 2,
            "output_rel_error": error,
        }

    rows = [row("fp32", 4 * 2**20, 2.0, 0.0), row("int8", 2**20, 2.5, 0.004)]
    result = {"model": "default", "split": "2+2", "sessions": 2, "steps": 3, "rows": rows}
    command = "fedpipe bench memory --server-weights fp32,int8 --json"
    write(tmp_path, "memory-server", record(result, command=command))
    text = rb.render("memory-server", tmp_path)
    assert "| fp32 | 4.0 MiB | 1.00 | 2.000 | 1.00 | 1.000 | 1.00 | 0.0e+00 |" in text
    assert "| int8 | 1.0 MiB | 0.25 | 2.500 | 1.25 | 1.250 | 1.25 | 4.0e-03 |" in text


def test_instruct_tables_show_both_sides_shares_and_the_gain() -> None:
    side = {"answer_loss": 1.5, "contains": 0.5, "answered": 50}
    r = {
        "model": "default",
        "rounds": 3,
        "settings": {"devices": 4},
        "base": {**side, "exact_match": 0.1, "samples": [{"reference": "Ruth", "generated": "It"}]},
        "finetuned": {**side, "exact_match": 0.42, "samples": [{"generated": "Ruth"}]},
        "exact_match_gain_points": 32.0,
    }
    (caption, headers, rows), (_, _, answers) = rb._instruct(r)
    assert "exact match gain 32.0 points" in caption and headers[2] == "exact match"
    assert [row[:3] for row in rows] == [
        ["base", "1.5000", "10.0%"],
        ["round 3", "1.5000", "42.0%"],
    ]
    assert answers == [["Ruth", "It", "Ruth"]]
