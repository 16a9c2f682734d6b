"""``[data]``: how instruction examples become rows."""

from __future__ import annotations

from dataclasses import dataclass

from fedpipe.config.checks import check

__all__ = ["LOSS_ON", "OVERLONG", "DataConfig"]

LOSS_ON = ("answers", "all")  # data.loss_on (fedpipe.data.masks)
OVERLONG = ("truncate", "drop")  # data.overlong (fedpipe.data.rows)


@dataclass(frozen=True)
class DataConfig:
    """How instruction examples (chats, prompt/completion pairs) become rows; plain text is
    cut into blocks whatever these say (fedpipe.data)."""

    # "answers": only assistant turns / completions count in the loss; "all": every token
    loss_on: str = "answers"
    overlong: str = "truncate"  # an example longer than train.seq_len: "truncate" or "drop"
    # true: several whole examples share a row, attending only within themselves at positions
    # restarting per example (the server learns each example's length); false: one per row
    packing: bool = False

    def __post_init__(self) -> None:
        check(
            self.loss_on in LOSS_ON,
            f"data.loss_on must be one of {', '.join(LOSS_ON)}, got {self.loss_on!r}",
        )
        check(
            self.overlong in OVERLONG,
            f"data.overlong must be one of {', '.join(OVERLONG)}, got {self.overlong!r}",
        )
        check(
            isinstance(self.packing, bool),
            f"data.packing must be true or false, got {self.packing!r}",
        )
