"""``fedpipe bench instruct``: the example's settings reach the run, the held-out questions are
evaluated on the run it wrote (a tiny run folder in place of the federation), and the JSON
carries both sides and the gain computed from them; a failed run is refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fedpipe_bench.instruct import EXAMPLE, instruct_config, run_instruct_bench
from harness.export import tiny_model, write_run

from fedpipe.config import FedpipeConfig, load_config

TINY = {"model.head_layers": 1, "model.tail_layers": 1, "train.seq_len": 48}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("model") / "m", "llama")


def _held_out(tmp_path: Path) -> Path:
    path = tmp_path / "test.jsonl"
    records = [
        {"prompt": [{"role": "user", "content": "Which? v"}], "completion": [
            {"role": "assistant", "content": "Ruth"}]},
        {"prompt": "ab", "completion": "cd"},
        {"prompt": "xy", "completion": "zz"},
    ]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def test_the_report_is_the_eval_of_the_run_the_federation_wrote(
    model: Path, tmp_path: Path
) -> None:
    seen: dict[str, Any] = {}

    def simulate(config: FedpipeConfig, *, name: str, runs_dir: Path, **_: Any) -> dict[str, Any]:
        seen["config"] = config
        flat = config.to_flat()
        settings = {k: v for k, v in flat.items() if k.startswith(("train.", "federated."))}
        write_run(runs_dir, name, model, round_=3, **{**settings, **TINY})
        return {"ok": True, "problems": []}

    report = run_instruct_bench(
        overrides={"model.name": str(model), "federated.rounds": 3, **TINY},
        limit=2,
        max_new_tokens=3,
        runs_dir=tmp_path / "runs",
        held_out=_held_out(tmp_path),
        simulate=simulate,
    )
    cfg = seen["config"]
    assert cfg.federated.data == str(EXAMPLE.parent / "instruct" / "train.jsonl")
    assert cfg.federated.profiles == load_config(EXAMPLE).federated.profiles
    (run,) = (tmp_path / "runs").iterdir()
    written = json.loads((run / "eval.json").read_text())
    for side in ("base", "finetuned"):
        assert report[side]["exact_match"] == written[side]["exact_match"]
        assert report[side]["answer_loss"] == written[side]["answer_loss"]
        assert (report[side]["examples"], report[side]["answered"]) == (2, 2)
    gain = 100 * (written["finetuned"]["exact_match"] - written["base"]["exact_match"])
    assert report["exact_match_gain_points"] == round(gain, 1)
    assert report["rounds"] == 3 and report["settings"]["rounds"] == 3
    assert report["settings"]["limit"] == 2 and report["settings"]["loss_on"] == "answers"
    assert report["wall_s"] == pytest.approx(
        report["train_wall_s"] + report["eval_wall_s"], abs=0.11
    )
    assert report["base"]["answer_loss"] != report["finetuned"]["answer_loss"]


def test_a_failed_run_is_refused_with_its_problems(tmp_path: Path) -> None:
    def simulate(config: FedpipeConfig, **_: Any) -> dict[str, Any]:
        return {"ok": False, "problems": ["device 2 failed"]}

    with pytest.raises(RuntimeError, match="device 2 failed"):
        run_instruct_bench(runs_dir=tmp_path, simulate=simulate)


def test_the_example_config_is_read_with_its_data_made_absolute() -> None:
    cfg = instruct_config({"federated.rounds": 1})
    assert Path(cfg.federated.data).is_absolute() and Path(cfg.federated.data).is_file()
    assert cfg.federated.rounds == 1
