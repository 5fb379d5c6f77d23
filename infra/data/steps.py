"""What each process trains on at a step: its share of the step's global batch, read as micro-batches. One of two readers,
by how the step is split (infra.shares):

    EvenShares     a plain job's: this rank's loader (infra.data.stream), which reads its even share of every
                   micro-step, `gradient_accumulation_steps` micro-batches a step; each traced as it is read
    SplitShares    a replica group's: the step's global batch at the cursor (GlobalBatches), split among the live
                   groups by their seat in the quorum (evenly, or by the seat's shares when the groups are rebalanced:
                   infra.replicas.pace); the cursor moves, and the step is traced, when it commits

Both answer the same calls, so the Trainer's step asks no question about which it has:

    shares.start()                          from the resumed cursor
    micros = shares.take(seat, step, trace) this process's micro-batches of the next step (a Micro each)
    shares.stand_in()                       a sample for the passes of an empty micro-batch (a share of nothing)
    shares.committed(step, trace)           the step counted: the cursor moves on (SplitShares)
    shares.samples_per_step                 the step's global batch (samples_read: this process's part of the last)
    shares.state_dict(), load_state_dict()  what a checkpoint keeps of the split: EvenShares' schedule of sizes
    shares.close()                          what reads ahead stopped (a run's end)

EvenShares' sizes can follow the processes' speeds (straggler_action: rebalance): `resize(sizes)` changes every
process's samples of each micro-step from the next step no process's loader has read ahead to (the same call on every
process, from the same gathered numbers); its samples and the global batch stay those of the even split. A process
that waits for its data reads ahead in a thread (`read_further(depths)`, infra.data.ahead).

A new way of splitting is a function in infra.shares and, if it reads otherwise, a reader here with these calls.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np

from infra.data.ahead import ReadAhead
from infra.data.loader import EpochOrder, SampleTrace, collate
from infra.shares import Seat, SizeSchedule, group_share, process_share


class Micro(NamedTuple):
    """One micro-batch of this process: its samples (None: an empty share, whose passes run on a stand-in with no weight),
    their global ids, and its number since the run began (what the test hooks count)."""

    batch: Any
    ids: np.ndarray
    position: int


class GlobalBatches:
    """The samples of a step: `size` positions of the epoch's order from the cursor; an epoch's last positions that do
    not fill a step are left out, as the plain loader leaves out a short last batch."""

    def __init__(self, dataset, seed: int, window: int, size: int):
        self.dataset, self.seed, self.window, self.size = dataset, seed, window, size
        self.shard_sizes = list(getattr(dataset, "shard_sizes", [len(dataset)]))
        self._order: EpochOrder | None = None

    def order(self, epoch: int) -> EpochOrder:
        if self._order is None or self._order.epoch != epoch:
            self._order = EpochOrder(self.shard_sizes, self.seed, epoch, self.window)
        return self._order

    def ids(self, cursor) -> np.ndarray:
        """The global sample ids of the step at `cursor` (rolled over to the next epoch first if the rest is short)."""
        self.roll(cursor)
        return self.order(cursor.epoch)[cursor.samples_consumed : cursor.samples_consumed + self.size]

    def roll(self, cursor) -> None:
        if cursor.samples_consumed + self.size > len(self.dataset):
            cursor.epoch += 1
            cursor.samples_consumed = 0

    def advance(self, cursor) -> None:
        self.roll(cursor)
        cursor.samples_consumed += self.size

    def read(self, ids: np.ndarray):
        get = getattr(self.dataset, "__getitems__", None)
        return collate(get(ids.tolist()) if get else [self.dataset[int(i)] for i in ids])


class EvenShares:
    """A plain job's shares: this rank's loader, `accumulation` micro-batches a step. The loader's cursor moves as it
    reads; every rank traces its own samples as it reads them, with their sources (a mixture's)."""

    def __init__(self, loader, accumulation: int):
        self.loader, self.accumulation = loader, accumulation
        self.samples_per_step = loader.global_batch_size * accumulation
        self.batches: Iterator | None = None
        self.samples_read = 0
        self.depths = [0] * len(loader.schedule.even)  # each process's batches read ahead by a thread (0: none)

    def start(self) -> None:
        """Reading from the cursor (a fresh start, a resume, a rollback), read ahead where `read_further` asked."""
        self.close()
        depth = self.depths[self.loader.rank]
        self.batches = ReadAhead(self.loader, depth) if depth else iter(self.loader)

    def close(self) -> None:
        """What reads ahead stopped (the batches it read and the loop did not take were never counted): a ReadAhead's
        thread, or the loader's own generator, whose DataLoader's workers stop now rather than at its collection."""
        if self.batches is not None:
            self.batches.close()
        self.batches = None

    def read_further(self, depths: list[int]) -> None:
        """Each process's batches read ahead by a thread (infra.data.ahead), the same list on every process: raised only,
        so that `resize` counts what any loader may have sliced."""
        assert all(new >= old for new, old in zip(depths, self.depths, strict=True)), (depths, self.depths)
        self.depths = list(depths)
        depth = depths[self.loader.rank]
        if isinstance(self.batches, ReadAhead):
            self.batches.depth = depth
        elif depth and self.batches is not None:  # from the cursor, where the loop is: nothing is read twice or skipped
            self.batches.close()
            self.batches = ReadAhead(self.loader, depth)

    def take(self, seat: Seat, step: int, trace: SampleTrace | None) -> list[Micro]:
        micros = []
        for _ in range(self.accumulation):
            batch = next(self.batches)
            ids = self.loader.last_sample_ids
            if trace:
                trace.write(step + 1, ids, self.loader.source_names(ids))
            micros.append(Micro(batch, ids, self.loader.batches_consumed))
        self.samples_read = sum(len(m.ids) for m in micros)
        return micros

    def stand_in(self):
        raise AssertionError("an even share is never empty")

    def committed(self, step: int, trace: SampleTrace | None) -> None:
        """Nothing to do: the loader's cursor moved as it read."""

    def sizes(self, ahead: bool = False) -> list[int]:
        """Each process's samples of a micro-step now (`ahead`: once the changes made so far are in force)."""
        schedule = self.loader.schedule
        return list(schedule.changes[-1][1] if ahead and schedule.changes else schedule.at(self.loader.batches_consumed))

    def resize(self, sizes: list[int]) -> int:
        """Every process's samples of each micro-step from the first step that no loader has read ahead to: the steps
        until then."""
        now = self.loader.batches_consumed
        position = now + self.loader.read_ahead(max(self.depths))
        position += -position % self.accumulation  # a step's micro-batches alike
        self.loader.schedule.change(position, sizes)
        return (position - now) // self.accumulation

    def state_dict(self) -> dict:
        return {"schedule": self.loader.schedule.state_dict(), "read_ahead": self.depths}

    def replay(self, state: dict) -> str | None:
        """A recorded run's schedule (a checkpoint's `shares`) in force from its start: None, or why it cannot split
        this run's micro-steps."""
        schedule, even = SizeSchedule.from_state(state["schedule"]), self.loader.schedule.even
        if schedule.even != even:
            theirs = f"{len(schedule.even)} processes x {schedule.even[0]}"
            return f"its shares split micro-steps of {theirs}, this run's are {len(even)} x {even[0]}"
        self.loader.schedule.changes = schedule.changes  # in place: a sampler holds the loader's schedule
        return None

    def load_state_dict(self, state: dict | None) -> str | None:
        """The checkpoint's schedule, when it splits this run's micro-steps (its processes and sizes); else a line saying
        the shares start even."""
        if not state:
            return None
        schedule = SizeSchedule.from_state(state["schedule"])
        if schedule.even != self.loader.schedule.even:
            return f"shares: the checkpoint's were of {len(schedule.even)} processes x {schedule.even[0]}; even shares from here"
        self.loader.schedule.changes = schedule.changes  # in place: a sampler holds the loader's schedule
        self.depths = list(state.get("read_ahead", self.depths))  # a checkpoint from before read-ahead: none
        return None


class SplitShares:
    """A replica group's shares: of the `size` samples at the cursor, this process's part by its group's seat in the
    quorum (infra.shares.process_share: nothing for a hot spare), in micro-batches of at most `micro_batch`. A step that
    does not commit is taken again from the same cursor; one that commits moves it, and the group's main process traces
    the whole global batch (what every live group trained on)."""

    def __init__(self, dataset, cursor, seed: int, window: int, size: int, process: int, processes: int, micro_batch: int, limit: int):
        self.global_batches = GlobalBatches(dataset, seed, window, size)
        self.cursor, self.process, self.processes, self.micro_batch, self.limit = cursor, process, processes, micro_batch, limit
        self.samples_per_step = size
        self.ids = np.arange(0)
        self.samples_read = 0

    def start(self) -> None:
        """Nothing to do: the step's samples come from the cursor, whatever it was resumed or healed to."""

    def take(self, seat: Seat, step: int, trace: SampleTrace | None) -> list[Micro]:
        self.ids = self.global_batches.ids(self.cursor)
        if seat.shares is None:
            parts = process_share(self.ids, seat.rank, seat.training(self.limit), self.process, self.processes, self.micro_batch)
        else:  # rebalanced among the training groups (infra.replicas.pace)
            parts = group_share(self.ids, seat.shares, seat.rank, self.process, self.processes, self.micro_batch)
        self.samples_read = sum(len(part) for part in parts)
        return [Micro(self.global_batches.read(p) if len(p) else None, p, step * len(parts) + i + 1) for i, p in enumerate(parts)]

    def stand_in(self):
        return self.global_batches.read(self.ids[:1])

    def state_dict(self) -> dict:
        """Nothing: the split follows from the quorum."""
        return {}

    def load_state_dict(self, state: dict | None) -> str | None:
        return None

    def replay(self, state: dict) -> str | None:
        return "replica groups split a step by their seats in the quorum, not by recorded shares"

    def close(self) -> None:
        """Nothing reads ahead: the step's samples are read as it starts."""

    def committed(self, step: int, trace: SampleTrace | None) -> None:
        self.global_batches.advance(self.cursor)
        if trace and self.process == 0:
            trace.write(step, self.ids.tolist())
            trace.flush()  # a line a step: what a group killed next leaves is exactly what it committed
