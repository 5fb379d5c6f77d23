"""When to save: every `save_steps`, and every so many minutes of wall clock (fixed, or Young/Daly's optimum)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from infra.config import require


@dataclass
class SaveClockConfig:
    """Save-schedule flags (part of TrainingArguments)."""

    _argument_group_name = "checkpoints: when to save"  # its heading in --help

    save_steps: int = field(default=100, metadata={"help": "Save a checkpoint every N optimizer steps (0: only at the end)."})
    save_every_minutes: str = field(
        default="30",
        metadata={
            "help": "Also save when this many minutes of wall clock passed since the last save (0: off), whichever of this and "
            "save_steps comes first; 'auto' picks the Young/Daly interval sqrt(2 * save cost * mtbf_hours) from measured saves."
        },
    )
    mtbf_hours: float = field(default=24.0, metadata={"help": "Mean time between failures of the whole job, for save_every_minutes=auto."})

    @property
    def save_interval_minutes(self) -> float | str | None:
        """save_every_minutes as a number, 'auto', or None when it is neither."""
        if str(self.save_every_minutes).strip() == "auto":
            return "auto"
        try:
            minutes = float(self.save_every_minutes)
        except ValueError:
            return None
        return minutes if minutes >= 0 else None

    def __post_init__(self):
        require(self.save_steps >= 0, "save_steps", self.save_steps, "an integer >= 0")
        require(self.save_interval_minutes is not None, "save_every_minutes", self.save_every_minutes, "a number of minutes >= 0 or 'auto'")
        require(self.mtbf_hours > 0, "mtbf_hours", self.mtbf_hours, "a number > 0")


class SaveClock:
    """Whether a save is due at a step (`by_steps`) or by the clock (`by_time`, decided on rank 0 and agreed by
    StepConsensus). With `save_every_minutes=auto` the interval is Young/Daly's sqrt(2 * C * MTBF), C the
    last measured save time (30 minutes until the first save has been measured)."""

    def __init__(self, config: SaveClockConfig):
        minutes = config.save_interval_minutes
        self.save_steps = config.save_steps
        self.auto = minutes == "auto"
        self.interval = 30 * 60.0 if self.auto else float(minutes) * 60
        self.mtbf = config.mtbf_hours * 3600
        self.last_save = time.monotonic()

    def restart(self) -> None:
        """The interval counts from now (training starts: the preflight and the resume are not training time)."""
        self.last_save = time.monotonic()

    def by_steps(self, step: int) -> bool:
        return self.save_steps > 0 and step % self.save_steps == 0

    def by_time(self) -> bool:
        return self.interval > 0 and time.monotonic() - self.last_save >= self.interval

    def saved(self, seconds: float) -> float | None:
        """Record a save that took `seconds`; returns the new interval in minutes when it is chosen automatically."""
        self.last_save = time.monotonic()
        if not self.auto:
            return None
        self.interval = math.sqrt(2 * seconds * self.mtbf)
        return self.interval / 60
