"""What each process trains on: its share of a step's global batch, as micro-batches of sample ids.

A split gives every process the same number of micro-batches (the engines' collectives run once per micro-batch in
every process), covers the step's samples once each, in order, and leaves the gradient that of the whole step: the loss
is summed per item and divided by the step's items, whatever the split.

    even(ids, process, processes, micro_batch)      a plain run's: micro-step m's samples cut into one slice a process
                                                    (the loader reads each rank's so, infra.data.loader)
    sliced(ids, process, sizes)                     the same with a size a process (the loader's, when the schedule of
                                                    sizes is not even: SizeSchedule, fastest_split)
    share(ids, slot, slots, micro_batch)            contiguous parts, as even as whole samples allow (any step size)
    process_share(ids, rank, training, ...)         a replica group's: by its rank in the quorum, none for a hot spare

A new way of splitting is a function here with the same contract, and a case in tests/test_shares.py, which holds every
split to the even one: the same samples, each once, and the same gradient.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Seat:
    """A step's place among the groups that split it: a replica group's in the quorum of live groups (infra.replicas);
    a plain job is the one group of a quorum of one (`ALONE`)."""

    rank: int  # this group's rank among the live groups
    size: int  # live groups
    id: int  # the quorum's number: a new one at every change of the groups in it
    healed_from: int | None  # the step this group healed to, when it did at this quorum
    seconds: float  # the quorum's wait, a heal included

    def training(self, limit: int) -> int:
        """The groups of this quorum that train: the first `limit` by rank (0: every one); the others are hot spares."""
        return min(self.size, limit) if limit else self.size


ALONE = Seat(rank=0, size=1, id=0, healed_from=None, seconds=0.0)


def even(ids: np.ndarray, process: int, processes: int, micro_batch: int) -> list[np.ndarray]:
    """Process `process`'s micro-batches of a step of `len(ids)` samples (a multiple of processes x micro_batch): of each
    micro-step's `processes * micro_batch` samples in turn, the `process`-th slice of `micro_batch`."""
    return sliced(ids, process, [micro_batch] * processes)


def sliced(ids: np.ndarray, process: int, sizes: Sequence[int]) -> list[np.ndarray]:
    """Process `process`'s micro-batches of `ids` (a multiple of sum(sizes) samples): of each micro-step's `sum(sizes)`
    samples in turn, the slice of `sizes[process]` after those of the processes before it."""
    per_step, start = sum(sizes), sum(sizes[:process])
    return [ids[s + start : s + start + sizes[process]] for s in range(0, len(ids) - per_step + 1, per_step)]


def fastest_split(
    total: int, seconds: Callable[[int, int], float], processes: int, floor: int = 1, caps: Sequence[int] | None = None
) -> list[int]:
    """Each process's whole samples of a micro-step of `total` so that the slowest finishes first: `seconds(process,
    size)` is a process's predicted time for `size` samples (growing with size). Every process gets `floor` (it takes
    part in every collective), then each sample goes to the process that would finish it soonest, never past its cap
    (what fits in its memory); ties go to the lower rank, so the same predictions give the same sizes on every
    process. For times that grow linearly this is the least slowest time. Raises ValueError when no sizes fit the
    bounds."""
    caps = [total] * processes if caps is None else list(caps)
    if not (processes and processes * floor <= total <= sum(caps) and all(c >= floor for c in caps)):
        raise ValueError(f"no split of {total} samples among {processes} processes has {floor} to {caps} each")
    sizes = [floor] * processes
    for _ in range(total - processes * floor):
        open_ = [p for p in range(processes) if sizes[p] < caps[p]]
        p = min(open_, key=lambda p: (seconds(p, sizes[p] + 1), p))
        sizes[p] += 1
    return sizes


class Speeds:
    """Each process's seconds a micro-batch as a line in its samples: an overhead that does not shrink with the share
    (the passes' launch and Python time, a micro-batch's fixed cost) plus its seconds a sample. A window's measure at
    one size gives the seconds a sample once the overhead is known; two windows at different sizes give the overhead
    (none until then). With the overhead counted, a process given fewer samples does not look slower a sample, which
    would take samples from it again and again."""

    def __init__(self, processes: int):
        self.overhead = [0.0] * processes
        self.per_sample = [0.0] * processes
        self.last: list[tuple[float, float] | None] = [None] * processes  # (samples, seconds) of a micro-batch

    def measured(self, sizes: Sequence[float], seconds: Sequence[float]) -> None:
        """A window's mean samples and seconds of a micro-batch, a process each (the same numbers on every process)."""
        for p, (size, time) in enumerate(zip(sizes, seconds, strict=True)):
            if not (size > 0 and time > 0 and math.isfinite(time)):
                continue
            last = self.last[p]
            if last is not None and abs(size - last[0]) >= 0.5:
                slope = (time - last[1]) / (size - last[0])
                if slope > 0:
                    self.overhead[p] = min(max(time - slope * size, 0.0), 0.9 * time)
            self.per_sample[p] = (time - self.overhead[p]) / size
            self.last[p] = (size, time)

    def known(self) -> bool:
        return all(t > 0 for t in self.per_sample)

    def seconds(self, process: int, size: int) -> float:
        return self.overhead[process] + self.per_sample[process] * size


def rebalanced(current: Sequence[int], speeds: Speeds, floor: int = 1, gain: float = 0.05) -> list[int] | None:
    """The sizes the speeds call for (fastest_split), when they shorten the predicted micro-step (its slowest process's
    time) by at least `gain` of it; else None, so that noise does not move samples to and fro. None too while a
    process has no measure yet."""
    if not speeds.known():
        return None
    sizes = fastest_split(sum(current), speeds.seconds, len(current), floor)
    before = max(speeds.seconds(p, size) for p, size in enumerate(current))
    after = max(speeds.seconds(p, size) for p, size in enumerate(sizes))
    return sizes if sizes != list(current) and after <= (1 - gain) * before else None


@dataclass
class SizeSchedule:
    """Each process's samples of a micro-step from a position on (a global micro-batch's number since the run began, the
    loaders' `batches_consumed`): the even split until the first change. Every process holds the same schedule (the same
    decisions from the same gathered numbers), so every process slices each micro-step alike; a change is made for a
    position the loaders have not read ahead to yet."""

    even: list[int]
    changes: list[tuple[int, list[int]]] = field(default_factory=list)  # (from position, sizes), positions increasing

    def at(self, position: int) -> list[int]:
        sizes = self.even
        for start, changed in self.changes:
            if start > position:
                break
            sizes = changed
        return sizes

    def change(self, position: int, sizes: Sequence[int]) -> None:
        if len(sizes) != len(self.even) or sum(sizes) != sum(self.even) or min(sizes) < 1:
            raise ValueError(f"sizes {list(sizes)} do not split a micro-step of {sum(self.even)} among {len(self.even)} processes")
        if self.changes and position <= self.changes[-1][0]:
            raise ValueError(f"a change at position {position} is not after the last one ({self.changes[-1][0]})")
        self.changes.append((position, list(sizes)))

    def state_dict(self) -> dict:
        return {"even": list(self.even), "changes": [[p, list(s)] for p, s in self.changes]}

    @classmethod
    def from_state(cls, state: dict) -> SizeSchedule:
        return cls(list(state["even"]), [(int(p), list(s)) for p, s in state["changes"]])


def share(ids: np.ndarray, slot: int, slots: int, micro_batch: int) -> list[np.ndarray]:
    """Slot `slot` of `slots`'s part of a step's samples, as micro-batches of at most `micro_batch`: the same number of
    micro-batches in every slot (DDP inside a group syncs on the last), any empty ones first."""
    part = np.array_split(ids, slots)[slot]
    count = math.ceil(math.ceil(len(ids) / slots) / micro_batch)
    sizes = [len(p) for p in np.array_split(part, count)][::-1]  # the smaller ones first, the samples in order
    return np.split(part, np.cumsum(sizes)[:-1])


def process_share(ids: np.ndarray, rank: int, training: int, process: int, processes: int, micro_batch: int) -> list[np.ndarray]:
    """Process `process` (of `processes` in its group)'s micro-batches of a step, in the group of rank `rank` in the
    quorum, of which the first `training` groups train. Nothing for a hot spare (ranked past them): it adds nothing to
    the sums and steps with the others, so it can take a lost group's share at the next step."""
    if rank >= training:
        return []
    return share(ids, rank * processes + process, training * processes, micro_batch)
