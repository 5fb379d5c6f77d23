"""What watches a run without changing it, told by the Trainer in a few events: the watchdog (a lost peer, a hung step:
infra.hangs), goodput (where the time went: infra.goodput), the progress bar, the MLflow tracker (infra.tracking), the
sample trace (infra.data.loader) and the pace check (infra.metrics). Each event is one call; each observer takes what
it needs of it, so the loop reads as its story.

    watch = Observers(watchdog, goodput, main)       with the Trainer
    watch.resumed(manifest, tracker, trace, bar, eta) once resumed: the rest of them, from the resumed step
    watch.step_began(); watch.entering(where)        a step under way, and what it waits on
    watch.step_ended(step, seconds, skipped_steps)   a step done
    with watch.stalled("checkpoint"): ...            a long wait that is no hang, and goodput's time of its kind
    watch.rolled_back(manifest, step, rollbacks)     back to a checkpoint
    watch.logged(metrics, step, postfix)             every logging_steps; watch.log(metrics, step), watch.say(line)
    watch.loop_ended(); watch.closed(step, finished) the end: the goodput of the run
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from tqdm.auto import tqdm

from infra.data.loader import SampleTrace
from infra.goodput import Goodput
from infra.hangs import Watchdog
from infra.metrics import EtaCheck
from infra.tracking import MetricLogger


def say(main: bool, line: str) -> None:
    """A line from the main process, above the progress bar (printed after the bar's last state, it was glued to it)."""
    if main:
        tqdm.write(line)


class Observers:
    def __init__(self, watchdog: Watchdog, goodput: Goodput, main: bool):
        self.watchdog, self.goodput, self.main = watchdog, goodput, main
        # from resumed(): they start at the step resumed from
        self.tracker: MetricLogger | None = None
        self.trace: SampleTrace | None = None
        self.bar: tqdm | None = None
        self.eta: EtaCheck | None = None
        self.new_trace: Callable[[int], SampleTrace] | None = None

    def resumed(
        self,
        manifest: dict,
        tracker: MetricLogger,
        new_trace: Callable[[int], SampleTrace] | None,
        step: int,
        bar: tqdm,
        eta: EtaCheck,
    ) -> None:
        """The run goes on from `step` of the checkpoint `manifest` came with (goodput's ledger in it)."""
        self.goodput.resume(manifest)
        self.tracker, self.new_trace, self.bar, self.eta = tracker, new_trace, bar, eta
        self.trace = new_trace(step) if new_trace else None

    # -- the loop's events ---------------------------------------------------------------------------------------------

    def step_began(self) -> None:
        self.goodput.first_step()
        self.watchdog.entering("data")

    def entering(self, where: str) -> None:
        """Before a collective of the step: what the hang report says if it never returns."""
        self.watchdog.entering(where)

    def step_ended(self, step: int, seconds: float, skipped_steps: int | None) -> None:
        """Step `step` done in `seconds`; `skipped_steps` (the run's count) when it was skipped for a non-finite value."""
        self.bar.update()
        self.watchdog.beat(step, seconds)
        if pace := self.eta.step(step):
            self.tracker.log(pace, step=step)
        if skipped_steps is not None:
            self.tracker.log({"health/skipped_steps": skipped_steps}, step=step)

    @contextlib.contextmanager
    def stalled(self, kind: str) -> Iterator[None]:
        """A long synchronous wait (a save, an eval): no hang for the watchdog, its own kind of time for goodput."""
        with self.watchdog.relaxed(), self.goodput.stall(kind):
            yield

    def relaxed(self, *what: str) -> contextlib.AbstractContextManager:
        """A wait that is no hang, and no time of its own (a quorum, an export); `what` as the watchdog takes it."""
        return self.watchdog.relaxed(*what)

    def rolled_back(self, manifest: dict, step: int, rollbacks: int, repair: bool = False) -> None:
        """Back to the checkpoint of `step`: its goodput ledger (`repair`: the steps undone counted as the repair's), the
        bar, and the trace from there."""
        self.goodput.rolled_back(manifest, repair)
        self.tracker.log({"health/rollbacks": rollbacks}, step=step)
        self.bar.n = step
        if self.trace:
            self.trace.close()
            self.trace = self.new_trace(step)

    def explaining(self) -> contextlib.AbstractContextManager:
        """The loop's body: a collective's error inside it is explained (a lost peer named) rather than raised."""
        return self.watchdog.explaining()

    def on_lost_peer(self, call: Callable[[str], None]) -> None:
        """`call(line)` before this process exits for a lost peer (rank 0 logs the hang reports at once)."""
        self.watchdog.on_exit = call

    def ledger(self) -> dict:
        """Goodput's time history of the weights so far, for a checkpoint (infra.goodput)."""
        return self.goodput.ledger()

    def healed(self, step: int) -> None:
        """This replica group's state replaced by a live one's, of `step` (infra.replicas): the bar there."""
        if self.bar is not None:
            self.bar.n = step

    def allow_waits(self, seconds: float) -> None:
        """A rank may wait this long inside a step (on other replica groups): the watchdog takes no silence shorter than
        that for a lost peer."""
        self.watchdog.floor = max(self.watchdog.floor, seconds)

    def log(self, metrics: dict[str, float], step: int, again: bool = False) -> None:
        self.tracker.log(metrics, step=step, again=again)

    def logged(self, metrics: dict[str, float], step: int, postfix: dict[str, str]) -> None:
        """Every logging_steps: goodput's figures so far (a step done again after a fault cost more), the loop's metrics,
        and the bar's postfix."""
        self.tracker.log(self.goodput.metrics(), step=step, again=True)
        self.goodput.alive()
        self.tracker.log(metrics, step=step)
        self.bar.set_postfix(postfix)

    def say(self, line: str) -> None:
        say(self.main, line)

    def saving(self) -> None:
        """The trace of the steps a checkpoint holds, on disk with it."""
        if self.trace:
            self.trace.flush()

    def loop_ended(self) -> None:
        self.bar.close()
        if self.trace:
            self.trace.close()

    def closed(self, step: int, finished: bool) -> dict[str, float]:
        """The run's end: the watchdog stopped, goodput logged, the tracker's last metrics sent; goodput's figures."""
        self.watchdog.stop()
        goodput = self.goodput.metrics()
        self.tracker.log(goodput, step=step, again=True)
        self.goodput.alive(finished=finished)
        self.tracker.close()
        return goodput
