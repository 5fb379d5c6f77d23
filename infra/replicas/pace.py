"""Each replica group's share of a step's global batch after its measured speed (straggler_action: rebalance with
fault_tolerance=replicas): a slow group gets a smaller share of the quorum's batch, so that the groups finish their passes
together, and one that rebalancing cannot keep up with leaves the quorum.

- Measured: every try at a step, each group times its own work (reading its share and its passes: everything but the
  waits on the other groups; a group of several processes takes its slowest's) and sends it, with its samples, in the
  step's item count across the quorum (the one all-reduce every step has before its passes: two numbers a group, in its
  slot by rank). So every group holds every group's numbers of its previous try, the same numbers on every group.
- Decided: at the end of every straggler window (a committed step that is a multiple of straggler_window_steps), every
  group the same, from those numbers (infra.shares: Speeds, rebalanced, KeepingUp); in force from the next step. The
  global batch, its samples and the cursor are the even split's; only who trains on which part changes
  (infra.shares.group_share), so the update is the even split's up to the order of the sums.
- Reset: at every change of the quorum (a group lost, back or healed in; a hot spare taking a share) the shares start
  even again and the measures anew: the seats changed, and a group healed in has no history.
- Left out: a group rebalancing cannot keep up with (KeepingUp) leaves the quorum (it ends with exit code 75 and its
  own stopped.json; a hot spare, if any, takes its share at the next quorum), unless fewer than min_replicas groups
  would be left: then it is named and stays.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np
import torch

from infra.shares import KeepingUp, Seat, Speeds, even_groups, rebalanced


class Decision(NamedTuple):
    """A window's end: each training group's samples before and after it (the same when nothing changed), their seconds
    a sample, their step time over the median's, and the groups to leave out, with why."""

    before: list[int]
    after: list[int]
    per_sample: list[float]
    ratios: list[float]
    behind: dict[int, str]


class GroupPace:
    """The training groups' shares of the quorum's step and what is known of their speeds, on every group alike."""

    def __init__(self, args, processes: int):
        self.window, self.floor, self.factor = args.straggler_window_steps, args.straggler_min_samples, args.straggler_factor
        self.patience, self.leave_factor, self.limit = args.straggler_patience, args.straggler_leave_factor, args.training_replicas
        self.total, self.processes = args.global_batch_size, processes
        self.start(-1, 1)
        self.quorum_id: int | None = None  # none yet: the first seat starts its quorum

    def start(self, quorum_id: int, training: int) -> None:
        """A new quorum: even shares, nothing measured."""
        self.quorum_id, self.training = quorum_id, training
        self.even = even_groups(self.total, training, self.processes)
        self.sizes: list[int] | None = None  # None: the even split (infra.shares.process_share, as without rebalancing)
        self.speeds = Speeds(training)
        self.keeping_up = KeepingUp(training, self.leave_factor, self.patience, min(self.floor, max(1, self.total // training)))
        self.streak = [0] * training
        self.sums = np.zeros((training, 3))  # the window's seconds, samples and tries, a training group each
        self.mine: tuple[float, float] | None = None  # this group's last try in this quorum: (seconds, samples)
        self.heard: np.ndarray | None = None  # the groups' numbers sent in this try

    def seat(self, seat: Seat) -> Seat:
        """The seat of a try, with the training groups' shares in force (a new quorum: even)."""
        if seat.id != self.quorum_id:
            self.start(seat.id, seat.training(self.limit))
        self.rank = seat.rank
        return dataclasses.replace(seat, shares=None if self.sizes is None else tuple(self.sizes))

    def samples(self) -> int:
        """This group's samples of the try under way (a hot spare: none)."""
        return (self.sizes or self.even)[self.rank] if self.rank < self.training else 0

    def report(self, size: int) -> torch.Tensor:
        """What this group sends in the try's sum across the quorum of `size` groups: its last try's numbers in its slot."""
        sent = torch.zeros(2 * size, dtype=torch.float64)
        if self.mine is not None:
            sent[2 * self.rank : 2 * self.rank + 2] = torch.tensor(self.mine, dtype=torch.float64)
        return sent

    def received(self, summed: torch.Tensor) -> None:
        self.heard = summed.reshape(-1, 2)[: self.training].cpu().numpy()

    def measured(self, seconds: float) -> None:
        """This group's time of the try under way (its slowest process's), sent with the next try."""
        self.mine = (seconds, float(self.samples())) if self.samples() else None

    def not_committed(self) -> None:
        """A try that did not count: what it heard and measured is dropped (another group's failure may have cut it)."""
        self.heard, self.mine = None, None

    def committed(self, step: int) -> Decision | None:
        """After a committed step: at a window's end, the same decision on every group."""
        heard, self.heard = self.heard, None
        if heard is not None:
            for g, (seconds, samples) in enumerate(heard):
                if samples > 0:
                    self.sums[g] += (seconds, samples, 1)
        if self.window <= 0 or step % self.window:
            return None
        sums, self.sums = self.sums, np.zeros_like(self.sums)
        if self.training < 2 or self.total < self.training or (sums[:, 2] == 0).any():  # alone, too few samples, or
            return None  # a group not measured in this window yet
        floor = min(self.floor, self.total // self.training)  # every group takes part: at least a sample
        sizes, seconds = (sums[:, 1] / sums[:, 2]).tolist(), (sums[:, 0] / sums[:, 2]).tolist()
        median = sorted(seconds)[(len(seconds) - 1) // 2]
        ratios = [s / max(median, 1e-9) for s in seconds]
        self.streak = [streak + 1 if ratio > self.factor else 0 for streak, ratio in zip(self.streak, ratios, strict=True)]
        slow = [g for g, streak in enumerate(self.streak) if streak >= self.patience]
        self.speeds.measured(sizes, seconds)
        behind = self.keeping_up.behind(self.speeds, sizes, slow)
        before = list(self.sizes or self.even)
        after = rebalanced(before, self.speeds, floor)
        if after is not None:
            self.sizes = after
        return Decision(before, after or before, list(self.speeds.per_sample), ratios, behind)
