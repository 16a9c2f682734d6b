"""TensorBoard event files from metrics records, read back with TensorBoard's own reader; and
how Flower's error replies are turned back into a device and a reason."""

from __future__ import annotations

import time
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from fedpipe.fl.deadline_grid import clean_reason, identity_from_reason
from fedpipe.runs.tensorboard import Board


def _scalars(acc: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_board_writes_scalars_tensorboard_reads(tmp_path: Path) -> None:
    board = Board(tmp_path / "tb")
    board.write({"event": "eval", "round": 0, "eval_loss": 5.0, "eval_ppl": 148.4})
    board.write(
        {
            "event": "train",
            "round": 1,
            "partition": 2,
            "profile": "phone-lte",
            "step_time_median_s": 0.25,
            "bytes_up": 1000,
            "bytes_down": 2000,
            "train_loss": 4.5,
        }
    )
    board.write({"event": "failure", "round": 1, "device": "partition 3", "reason": "gone"})
    board.write(
        {"event": "eval", "round": 1, "eval_loss": 4.0, "eval_ppl": 54.6, "devices_trained": 1,
         "devices_failed": 1, "wall_s": 3.5}
    )  # fmt: skip
    board.write({"event": "waiting", "round": 2})  # not a scalar
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()  # before close: the writer flushed each record
    assert _scalars(acc, "eval/loss") == [(0, 5.0), (1, 4.0)]
    assert _scalars(acc, "round/devices_failed") == [(1, 1.0)]
    assert _scalars(acc, "round/wall_s") == [(1, 3.5)]
    assert _scalars(acc, "device/p2-phone-lte/step_time_s") == [(1, 0.25)]
    assert _scalars(acc, "device/p2-phone-lte/bytes_down") == [(1, 2000.0)]
    assert _scalars(acc, "failures/total") == [(1, 1.0)]
    board.close()


def test_flower_error_reasons_name_the_device() -> None:
    flower = (
        "<class 'flwr.clientapp.client_app.ClientAppException'>:<'\nException "
        "ClientAppException occurred. Message: [partition 1 (phone-lte)] DeviceFailure: "
        "device 7 vanished in round 1 (injected)'>"
    )
    reason = clean_reason(flower)
    assert (
        reason == "[partition 1 (phone-lte)] DeviceFailure: device 7 vanished in round 1 (injected)"
    )
    info, rest = identity_from_reason(reason)
    assert info is not None and info.name == "partition 1 (phone-lte)"
    assert rest == "DeviceFailure: device 7 vanished in round 1 (injected)"
    assert identity_from_reason("Node Unavailable") == (None, "Node Unavailable")
    assert clean_reason("x" * 1000).endswith("...")


def test_device_book_names_known_devices_and_counts_the_others() -> None:
    from fedpipe.fl.deadline_grid import DeviceBook, DeviceInfo

    book = DeviceBook()
    book.known[7] = DeviceInfo(1, "phone-lte")
    assert book.names([7, 8, 9]) == ["partition 1 (phone-lte)", "2 devices not heard from yet"]
    assert book.names([8]) == ["1 device not heard from yet"]
    assert book.fields(7) == {
        "device": "partition 1 (phone-lte)",
        "node_id": 7,
        "partition": 1,
        "profile": "phone-lte",
    }
    assert book.fields(8) == {"device": "node 8 (not heard from yet)", "node_id": 8}


class _Nodes:
    """Only what DeadlineGrid.wait_for_devices asks of Flower's grid: the connected node ids."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def get_node_ids(self) -> list[int]:
        return list(self.ids)


def test_a_device_gone_for_good_costs_one_connect_wait() -> None:
    import pytest

    from fedpipe.fl.deadline_grid import DeadlineGrid, DeviceBook, StopRun

    records: list[dict] = []
    nodes = _Nodes([1, 2])
    grid = DeadlineGrid(
        nodes,  # type: ignore[arg-type]
        log=records.append,
        devices=DeviceBook(),
        deadline_s=60,
        report_every_s=30,
    )
    assert grid.wait_for_devices(want=3, min_devices=1, wait_s=0) == [1, 2]
    assert [(r["phase"], r["connected"], r["want"]) for r in records] == [("start", 2, 3)]
    records.clear()
    assert grid.wait_for_devices(want=3, min_devices=1, wait_s=0) == [1, 2]
    assert records == []  # the next round does not wait for the missing device again
    nodes.ids = []
    with pytest.raises(StopRun, match=r"only 0 of 2 devices connected .*min_devices=1"):
        grid.wait_for_devices(want=3, min_devices=1, wait_s=0)


def test_a_device_flower_reports_gone_costs_no_connect_wait() -> None:
    """After a round, a device Flower no longer lists (killed, its heartbeat expired) is not
    waited for: the next round starts at once with the live ones (min_devices allowing)."""
    from fedpipe.fl.deadline_grid import DeadlineGrid, DeviceBook

    records: list[dict] = []
    nodes = _Nodes([1, 2])
    grid = DeadlineGrid(
        nodes,  # type: ignore[arg-type]
        log=records.append,
        devices=DeviceBook(),
        deadline_s=60,
        report_every_s=30,
    )
    assert grid.wait_for_devices(want=2, min_devices=1, wait_s=600) == [1, 2]
    nodes.ids = [1]  # device 2 was killed in its round; Flower reports it gone
    started = time.monotonic()
    assert grid.wait_for_devices(want=2, min_devices=1, wait_s=600) == [1]
    assert time.monotonic() - started < 60  # no connect wait (it would be 600 s)
    assert records == []
