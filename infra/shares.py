"""What each process trains on: its share of a step's global batch, as micro-batches of sample ids.

A split gives every process the same number of micro-batches (the engines' collectives run once per micro-batch in
every process), covers the step's samples once each, in order, and leaves the gradient that of the whole step: the loss
is summed per item and divided by the step's items, whatever the split.

    even(ids, process, processes, micro_batch)      a plain run's: micro-step m's samples cut into one slice a process
                                                    (the loader reads each rank's so, infra.data.loader)
    share(ids, slot, slots, micro_batch)            contiguous parts, as even as whole samples allow (any step size)
    process_share(ids, rank, training, ...)         a replica group's: by its rank in the quorum, none for a hot spare

A new way of splitting is a function here with the same contract, and a case in tests/test_shares.py, which holds every
split to the even one: the same samples, each once, and the same gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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
    per_step = processes * micro_batch
    return [ids[s + process * micro_batch : s + (process + 1) * micro_batch] for s in range(0, len(ids) - per_step + 1, per_step)]


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
