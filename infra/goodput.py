"""Goodput: what fraction of a run's wall time, over every launch since its first, went into steps that were kept.

    ETTR (effective training time ratio) = time of the kept steps / wall time since the run's first launch

The rest is broken down into

- `startup`:     from a launch's process start to its first step (imports, rendezvous, preflight, loading the checkpoint);
- `checkpoint`:  the loop stalled on saves;
- `eval`:        held-out evaluations;
- `restart`:     from the last sign of life of a launch that stopped without finishing to the start of the next one
                 (detecting the fault, the scheduler's or the elastic agent's restart);
- `repair`:      steps undone by a repair of silent data corruption (infra.sdc), to be trained again, and steps
                 computed again to tell a transient fault from the data (infra.replay);
- `lost`:        the rest: steps trained after the newest checkpoint and lost with their launch (done again), launches
                 that never reached a checkpoint, and steps undone by a rollback.

The ledger of the first four and of the kept steps (`train`) travels in each checkpoint's manifest, so a resumed launch
carries exactly the history of the weights it resumed: what was trained after that checkpoint is no longer counted as
kept, and shows up as `lost`. `OUTPUT_DIR/goodput.json` (rank 0, at every log) holds the run's first launch time and the
last sign of life, for what no checkpoint can hold: when the run began, and when its last launch stopped.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil

LEDGER = "goodput.json"
KEPT = ("train", "startup", "checkpoint", "eval", "restart", "repair")  # carried in checkpoints; `lost` is the remainder
STALLS = ("checkpoint", "eval", "repair")  # times inside the loop that are not training: Goodput.stall's kinds


def process_start() -> float:
    """When this process started (wall clock): a launch's time begins before Python imports anything."""
    return psutil.Process().create_time()


class Goodput:
    """One launch's share of the ledger, on every rank (rank 0 logs it and writes goodput.json)."""

    def __init__(
        self, output_dir: str | os.PathLike, main: bool, launch_start: float | None = None, clock: Callable[[], float] = time.time
    ):
        self.path, self.main, self.clock = Path(output_dir) / LEDGER, main, clock
        self.launch_start = process_start() if launch_start is None else launch_start
        self.kept = dict.fromkeys(KEPT, 0.0)  # the history of the resumed weights, before this launch
        self.first_launch = self.launch_start
        self.idle = 0.0  # between a launch that finished and one that continued the run: not part of its wall time
        self.loop_start: float | None = None  # this launch's first step (or its last rollback)
        self.own_startup = 0.0  # this launch's start-up, once its first step began
        self.stalls = dict.fromkeys(STALLS, 0.0)  # this launch's, inside the loop

    def resume(self, manifest: dict) -> None:
        """The ledger of the checkpoint resumed from (if any), and what goodput.json says of earlier launches."""
        earlier = read_ledger(self.path)
        if "goodput" in manifest:
            ledger = manifest["goodput"]
            self.first_launch = ledger["first_launch"]
            self.idle = float(ledger.get("idle", 0.0))
            self.kept = {k: float(ledger.get(k, 0.0)) for k in KEPT}
        elif earlier:  # launches that never reached a checkpoint: the run began with the first of them
            self.first_launch = min(self.first_launch, earlier["first_launch"])
        if earlier and earlier.get("last_alive") and earlier["first_launch"] == self.first_launch:
            gap = max(0.0, self.launch_start - earlier["last_alive"])
            if earlier.get("finished"):  # a finished run continued later (a larger max_steps): no fault cost that time
                self.idle += gap
            else:
                self.kept["restart"] += gap

    def rolled_back(self, manifest: dict, repair: bool = False) -> None:
        """A rollback to `manifest`'s checkpoint: the steps since are undone (lost; with `repair`, counted as the repair's),
        the stalls of this launch stay."""
        ledger = manifest.get("goodput")
        if ledger:
            undone = sum(self.ledger()[k] for k in KEPT) - sum(float(ledger.get(k, 0.0)) for k in KEPT)
            self.kept = {k: float(ledger.get(k, 0.0)) for k in KEPT}
            if repair:
                self.kept["repair"] += max(0.0, undone)
            self.loop_start = self.clock()
            self.stalls = dict.fromkeys(STALLS, 0.0)
            self.own_startup = 0.0  # in the checkpoint's ledger if that checkpoint is this launch's, else lost

    def first_step(self) -> None:
        """Called as the first step of this launch begins: start-up ends."""
        if self.loop_start is None:
            self.loop_start = self.clock()
            self.own_startup = self.loop_start - self.launch_start

    @contextlib.contextmanager
    def stall(self, kind: str) -> Iterator[None]:
        """Time spent inside on a save or an evaluation."""
        start = self.clock()
        try:
            yield
        finally:
            self.stalls[kind] += self.clock() - start

    def ledger(self, now: float | None = None) -> dict[str, float]:
        """The kept history as of `now` (default: the clock's now): what a checkpoint written then carries."""
        now = self.clock() if now is None else now
        out = {"first_launch": self.first_launch, "idle": self.idle, **self.kept}
        if self.loop_start is not None:
            out["startup"] += self.own_startup
            loop = now - self.loop_start
            for kind, seconds in self.stalls.items():
                out[kind] += seconds
            out["train"] += max(0.0, loop - sum(self.stalls.values()))
        else:
            out["startup"] += now - self.launch_start
        return out

    def metrics(self) -> dict[str, float]:
        """goodput/ettr, goodput/wall_seconds and goodput/<part>_seconds for every part, `lost` included."""
        now = self.clock()
        ledger = self.ledger(now)
        wall = max(now - ledger["first_launch"] - ledger["idle"], 1e-9)
        parts = {k: ledger[k] for k in KEPT}
        parts["lost"] = max(0.0, wall - sum(parts.values()))
        return {
            "goodput/ettr": parts["train"] / wall,
            "goodput/wall_seconds": wall,
            **{f"goodput/{k}_seconds": v for k, v in parts.items()},
        }

    def alive(self, finished: bool = False) -> None:
        """Rank 0, at every log: goodput.json's first launch and last sign of life. Best effort and not fsynced (a
        rename of a small file; an fsync at every log would wait on a network filesystem): a host that loses power may
        lose the last few signs of life, counted as lost instead of restart."""
        if not self.main:
            return
        tmp = self.path.with_name(LEDGER + ".tmp")
        with contextlib.suppress(OSError):
            tmp.write_text(json.dumps({"first_launch": self.first_launch, "last_alive": self.clock(), "finished": finished}))
            os.replace(tmp, self.path)


def read_ledger(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def summary(metrics: dict[str, float]) -> str:
    """`ETTR 0.93 (train 93%, start-up 4%, ...)`: the run's last line."""
    wall = metrics["goodput/wall_seconds"]
    names = {
        "train": "train",
        "startup": "start-up",
        "checkpoint": "checkpoints",
        "eval": "eval",
        "restart": "restarts",
        "repair": "repairs",
        "lost": "lost",
    }
    parts = ", ".join(f"{label} {100 * metrics[f'goodput/{k}_seconds'] / wall:.0f}%" for k, label in names.items())
    line = f"goodput: ETTR {metrics['goodput/ettr']:.2f} of {wall:.0f}s since the first launch ({parts})"
    if metrics["goodput/startup_seconds"] > wall / 2:  # a short run, not an alarm: a launch's start-up is a fixed cost
        line += "; mostly start-up, a fixed cost of each launch that a long run spreads thin"
    return line
