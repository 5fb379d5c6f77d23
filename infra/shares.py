"""What each process trains on: its share of a step's global batch, as micro-batches of sample ids.

A split gives every process the same number of micro-batches (the engines' collectives run once per micro-batch in
every process), covers the step's samples once each, in order, and leaves the gradient that of the whole step: the loss
is summed per item and divided by the step's items, whatever the split.

    even(ids, process, processes, micro_batch)      a plain run's: micro-step m's samples cut into one slice a process
                                                    (the loader reads each rank's so, infra.data.loader)
    sliced(ids, process, sizes)                     the same with a size a process (the loader's, when the schedule of
                                                    sizes is not even: SizeSchedule, sizes_by_speed)
    share(ids, slot, slots, micro_batch)            contiguous parts, as even as whole samples allow (any step size)
    process_share(ids, rank, training, ...)         a replica group's: by its rank in the quorum, none for a hot spare

A new way of splitting is a function here with the same contract, and a case in tests/test_shares.py, which holds every
split to the even one: the same samples, each once, and the same gradient.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
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


def sizes_by_speed(total: int, speeds: Sequence[float], floor: int = 1, caps: Sequence[int] | None = None) -> list[int]:
    """Each process's whole samples of a micro-step of `total`, in proportion to its speed (samples a second), none under
    `floor` (every process takes part in every collective) nor over its cap (what fits in its memory): the bounded
    proportional shares, then the samples left by rounding down to the largest remainders (ties: the lower rank). The
    same numbers give the same sizes on every process. Raises ValueError when no sizes fit the bounds."""
    n = len(speeds)
    caps = [total] * n if caps is None else list(caps)
    if not (n and n * floor <= total <= sum(caps) and all(c >= floor for c in caps)):
        raise ValueError(f"no split of {total} samples among {n} processes has {floor} to {caps} each")
    weights = [s if s > 0 and math.isfinite(s) else 0.0 for s in speeds]
    if not any(weights):
        weights = [1.0] * n
    fixed: dict[int, int] = {}
    while True:  # bound the shares that cross a bound (the ones under the floor first), then share the rest again
        free = [i for i in range(n) if i not in fixed]
        left, weight = total - sum(fixed.values()), sum(weights[i] for i in free)
        ideal = {i: left * weights[i] / weight if weight else left / len(free) for i in free}
        under = [i for i in free if ideal[i] < floor]
        over = [i for i in free if ideal[i] > caps[i]]
        if under:
            fixed |= dict.fromkeys(under, floor)
        elif over:
            fixed |= {i: caps[i] for i in over}
        else:
            break
    sizes = {i: math.floor(ideal[i]) for i in free} | fixed
    left = total - sum(sizes.values())
    for i in sorted(free, key=lambda i: (-(ideal[i] - sizes[i]), i))[:left]:
        sizes[i] += 1
    return [sizes[i] for i in range(n)]


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
