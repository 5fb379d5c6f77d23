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
    group_share(ids, sizes, rank, ...)              the same with a size a training group (rebalanced groups: the
                                                    quorum's, infra.replicas.pace)

A new way of splitting is a function here with the same contract, and a case in tests/test_shares.py, which holds every
split to the even one: the same samples, each once, and the same gradient.
"""

from __future__ import annotations

import heapq
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
    shares: tuple[int, ...] | None = None  # each training group's samples of the step (rebalanced); None: even

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
    # each process's time with one sample more, in a heap: a sample's choice in log(processes), not processes (64
    # processes, 512 samples: 0.17 ms, against 4.9 ms choosing by a scan)
    ready = [(seconds(p, floor + 1), p) for p in range(processes) if floor < caps[p]]
    heapq.heapify(ready)
    for _ in range(total - processes * floor):
        _, p = heapq.heappop(ready)
        sizes[p] += 1
        if sizes[p] < caps[p]:
            heapq.heappush(ready, (seconds(p, sizes[p] + 1), p))
    return sizes


class Speeds:
    """Each process's seconds a micro-batch as a line in its samples: an overhead that does not shrink with the share
    (the passes' launch and Python time, a micro-batch's fixed cost) plus its seconds a sample. With the overhead
    counted, a process given fewer samples does not look slower a sample, which would take samples from it again and
    again; without it the shares still settle where the measured times agree, only a window or two later.

    A process's overhead is kept as a fraction of its time (a host slowed or freed is slowed or freed at both alike),
    from its last two windows at sizes a quarter or more apart (nearer, the slope is the timing's noise), and never
    counted above half its time: an overhead counted too large moves too many samples and the shares swing (seen on CPU
    hosts held by a CFS quota, whose time comes in bursts: the slow host given more than the fast one for a window),
    where one counted too small only takes another window to settle. (What the model cannot see, a process fast again
    at the floor of its share with an overhead learnt while it was slow, the probe in `rebalanced` moves.)"""

    MOST_OVERHEAD = 0.5  # of a micro-batch's time

    def __init__(self, processes: int):
        self.overhead = [0.0] * processes  # seconds
        self.per_sample = [0.0] * processes
        self.fraction = [0.0] * processes  # the overhead's part of a micro-batch's time
        self.last: list[tuple[float, float] | None] = [None] * processes  # (samples, seconds) of a micro-batch

    def measured(self, sizes: Sequence[float], seconds: Sequence[float]) -> None:
        """A window's mean samples and seconds of a micro-batch, a process each (the same numbers on every process)."""
        for p, (size, time) in enumerate(zip(sizes, seconds, strict=True)):
            if not (size > 0 and 0 < time < math.inf):
                continue
            last = self.last[p]
            if last is not None and abs(size - last[0]) >= max(1.0, 0.25 * max(size, last[0])):
                slope = (time - last[1]) / (size - last[0])
                if slope > 0:
                    self.fraction[p] = min(max(1 - slope * size / time, 0.0), self.MOST_OVERHEAD)
            self.last[p] = (size, time)
            self.overhead[p] = self.fraction[p] * time
            self.per_sample[p] = (time - self.overhead[p]) / size

    def known(self) -> bool:
        return all(t > 0 for t in self.per_sample)

    def state_dict(self) -> dict:
        return {"overhead": self.overhead, "per_sample": self.per_sample, "fraction": self.fraction, "last": self.last}

    def load_state_dict(self, state: dict | None) -> None:
        """What a checkpoint's run had learnt, when it had as many processes (a process at the floor of its share learns
        its overhead only from windows at other sizes: started again without it, it could stay there)."""
        if state and len(state["per_sample"]) == len(self.per_sample):
            self.overhead, self.per_sample, self.fraction = list(state["overhead"]), list(state["per_sample"]), list(state["fraction"])
            self.last = [tuple(last) if last else None for last in state["last"]]

    def seconds(self, process: int, size: int) -> float:
        return self.overhead[process] + self.per_sample[process] * size


class KeepingUp:
    """The processes rebalancing cannot keep up with (straggler_action: rebalance), to be left out: one reported slow
    (its step over straggler_factor x the median's for straggler_patience windows) through a window spent at the floor
    of its share, where no fewer samples are left to give it; or one slower a sample than `factor` x the median
    process's for `patience` windows in a row (windows at the floor count only when its step was reported slow too).
    `factor` 0: none is ever left out. The same decision on every process, from the same gathered numbers."""

    def __init__(self, processes: int, factor: float, patience: int, floor: int):
        self.factor, self.patience, self.floor = factor, patience, floor
        self.streak = [0] * processes

    def behind(self, speeds: Speeds, sizes: Sequence[float], slow: Sequence[int]) -> dict[int, str]:
        """After a window: each process to leave out, and why (its window's mean samples a micro-batch: `sizes`)."""
        if not self.factor:
            return {}
        ordered = sorted(speeds.per_sample)
        median = ordered[(len(ordered) - 1) // 2]
        why = {}
        for p, per_sample in enumerate(speeds.per_sample):
            # at the floor a process's time is mostly overhead and its seconds a sample a guess (a process fast again
            # there read 3.5-3.8x the median's): only its step, still the slowest, says it is slow
            measured = sizes[p] > self.floor or p in slow
            over = measured and median > 0 and per_sample > self.factor * median
            self.streak[p] = self.streak[p] + 1 if over else 0
            if self.streak[p] >= self.patience:
                why[p] = f"{per_sample / median:.1f}x the median process's seconds a sample for {self.streak[p]} windows"
            elif p in slow and sizes[p] <= self.floor:
                why[p] = f"still the slowest step at the floor of its share ({self.floor} sample{'s' if self.floor > 1 else ''})"
        return why


def rebalanced(
    current: Sequence[int], speeds: Speeds, floor: int = 1, gain: float = 0.05, caps: Sequence[int] | None = None
) -> list[int] | None:
    """The sizes the speeds call for (fastest_split), when they shorten the predicted micro-step (its slowest process's
    time) by at least `gain` of it; else a probe (`probed`); else None, so that noise does not move samples to and fro.
    None too while a process has no measure yet. `caps`: each process's most samples (what fits in its memory: the
    estimate's, infra.memory.sample_caps), ignored where they could not hold the micro-step."""
    if not speeds.known():
        return None
    total = sum(current)
    caps = [total] * len(current) if caps is None else [max(floor, min(c, total)) for c in caps]
    if sum(caps) < total:
        caps = [total] * len(current)
    sizes = fastest_split(total, speeds.seconds, len(current), floor, caps)
    before = max(speeds.seconds(p, size) for p, size in enumerate(current))
    after = max(speeds.seconds(p, size) for p, size in enumerate(sizes))
    return sizes if sizes != list(current) and after <= (1 - gain) * before else probed(current, speeds, floor, gain, caps)


def rebalanced_line(
    what: str, names: Sequence[str], before: Sequence[int], after: Sequence[int], per_sample: Sequence[float], step: int
) -> str:
    """The line of a change of shares: `what` ("each micro-step's 8 samples"), from `step`, each one's share before and
    after and its seconds a sample, by `names` (ranks and their hosts; replica groups)."""
    was = ", ".join(f"{n} {a} -> {b} ({t * 1000:.1f} ms a sample)" for n, a, b, t in zip(names, before, after, per_sample, strict=True))
    return f"rebalanced: {what} from step {step}: {was}"


def probed(current: Sequence[int], speeds: Speeds, floor: int, gain: float, caps: Sequence[int]) -> list[int] | None:
    """One sample more for the process that finished first by twice `gain`, from the one that finished last, when the
    first holds less than an even share and the split measured is the one in force: what the model would not move
    where a process's time is mostly overhead that it cannot yet tell (a tiny model; a process fast again at the floor
    of its share, whose time there says little of its seconds a sample). The window after, at the new size, tells."""
    if any(last is None or round(last[0]) != size for last, size in zip(speeds.last, current, strict=True)):
        return None  # a change not in force yet, or a window with several sizes
    times = [last[1] for last in speeds.last]  # type: ignore[index]
    first = min(range(len(times)), key=lambda p: (times[p], p))
    last = max(range(len(times)), key=lambda p: (times[p], -p))
    below = current[first] * len(current) < sum(current) and current[first] < caps[first]
    if below and current[last] > floor and times[first] < (1 - 2 * gain) * times[last]:
        sizes = list(current)
        sizes[first], sizes[last] = sizes[first] + 1, sizes[last] - 1
        return sizes
    return None


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


def even_groups(total: int, training: int, processes: int) -> list[int]:
    """Each of `training` groups' samples of a step of `total` under process_share (groups of `processes`)."""
    slots = [len(part) for part in np.array_split(np.arange(total), training * processes)]
    return [sum(slots[g * processes : (g + 1) * processes]) for g in range(training)]


def group_share(ids: np.ndarray, sizes: Sequence[int], rank: int, process: int, processes: int, micro_batch: int) -> list[np.ndarray]:
    """Process `process` (of `processes` in its group)'s micro-batches of a step whose training groups take `sizes[g]`
    samples each, in the order of their ranks in the quorum (a rank past them: a hot spare, nothing): its group's part
    split as `share` splits, the same number of micro-batches in every process of the group (the groups may differ:
    they meet once a step, in the sum across groups)."""
    if rank >= len(sizes):
        return []
    start = sum(sizes[:rank])
    return share(ids[start : start + sizes[rank]], process, processes, micro_batch)
