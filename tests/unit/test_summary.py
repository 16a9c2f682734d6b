"""summary.json from metrics records, and Flower run-config nesting."""

from fedpipe.federated.commands import nest
from fedpipe.federated.summary import build_summary


def test_summary_per_round_and_loss_drop() -> None:
    history = [
        {"event": "eval", "round": 0, "eval_loss": 4.0, "eval_ppl": 54.6, "wall_s": 1.0},
        {
            "event": "train",
            "round": 1,
            "partition-id": 0,
            "train-loss": 3.9,
            "step-time-median-s": 0.5,
            "bytes-up": 100,
            "bytes-down": 120,
        },
        {
            "event": "train",
            "round": 1,
            "partition-id": 1,
            "train-loss": 3.7,
            "step-time-median-s": 0.7,
            "bytes-up": 50,
            "bytes-down": 60,
        },
        {"event": "failed", "round": 1, "devices": 1},
        {"event": "eval", "round": 1, "eval_loss": 3.6, "merged": 2, "discarded": 1, "wall_s": 9.0},
    ]
    summary = build_summary(history, config={"model.name": "tiny-llama"})
    r0, r1 = summary["rounds"]
    assert r0["eval_loss"] == 4.0 and "train_loss" not in r0
    assert r1["train_loss"] == (3.9 + 3.7) / 2
    assert r1["bytes_up"] == 150 and r1["bytes_down"] == 180
    assert r1["step_times_s"] == {"0": 0.5, "1": 0.7}
    assert r1["merged"] == 2 and r1["discarded"] == 1 and r1["failed_devices"] == 1
    assert summary["first_eval_loss"] == 4.0 and summary["last_eval_loss"] == 3.6
    assert summary["eval_loss_drop_pct"] == (4.0 - 3.6) / 4.0 * 100


def test_nest_turns_dotted_keys_into_tables() -> None:
    assert nest({"model.name": "x", "model.lora_r": 8, "run.dir": "/r", "top": 1}) == {
        "model": {"name": "x", "lora_r": 8},
        "run": {"dir": "/r"},
        "top": 1,
    }
