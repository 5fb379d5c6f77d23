"""Preemption: SIGTERM and SIGUSR1 (SLURM's `--signal=USR1@120`) ask the job to save and stop.

A signal only sets a flag; StepConsensus tells every rank at the same step. After a signal the
process has `preemption_grace_seconds` to save and exit before a watchdog ends it (the commit is
atomic: a cut save is never loaded). Why the launch stopped is written to `OUTPUT_DIR/stopped.json`
(infra.stopped) for batch scripts (infra/slurm/pretrain.sbatch) to decide whether to requeue.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from infra.config import require


@dataclass
class PreemptionConfig:
    """Preemption flags (part of TrainingArguments)."""

    _argument_group_name = "preemption"  # its heading in --help

    preemption_grace_seconds: float = field(
        default=120.0, metadata={"help": "After SIGTERM/SIGUSR1, the time allowed to save and exit before the process stops anyway."}
    )

    def __post_init__(self):
        require(self.preemption_grace_seconds > 0, "preemption_grace_seconds", self.preemption_grace_seconds, "a number > 0")


class Preemption:
    """Catches SIGTERM and SIGUSR1 while `armed()`; `signal` is this rank's first one (a number), or None."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self, grace_seconds: float):
        self.grace = grace_seconds
        self.signal: int | None = None
        self._watchdog = threading.Timer(grace_seconds, self._out_of_time)
        self._watchdog.daemon = True

    def _on_signal(self, signum, frame) -> None:
        if self.signal is None:
            self.signal = signum
            self._watchdog.start()

    def _out_of_time(self) -> None:
        print(f"preemption: no clean exit within preemption_grace_seconds={self.grace:g}; stopping now", flush=True)
        os._exit(1)

    @contextlib.contextmanager
    def armed(self) -> Iterator[None]:
        """The signals caught inside; on leaving, the watchdog stopped and the previous handlers back."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in self.SIGNALS}
        try:
            yield
        finally:
            self._watchdog.cancel()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
