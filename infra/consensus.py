"""What every rank must agree on after each optimizer step, in one small all-reduce.

A preemption signal reaches one rank, rank 0's clock decides a timed save, and a non-finite loss
shows on the rank that computed it (it reaches the others through the gradient all-reduce, but not
through the loss, and not at all when clipping is off). Each rank contributes its flags, the
all-reduce takes the maximum, and every rank acts on the same answer at the same step: one
collective and one host synchronisation per step carry all of it. Where the processes hold identical copies of the
summed gradients (DDP), each one's digest of them rides along too (as its maximum and its negated maximum, the
minimum): the copies are apart when the two differ (infra.replay computes the step again).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

import torch
from accelerate import Accelerator

from infra.checkpoint.clock import SaveClock
from infra.preemption import Preemption
from infra.sdc import exact_halves


@dataclass(frozen=True)
class Agreement:
    """The ranks' common view of one step."""

    save_due: bool  # by save_steps, rank 0's clock, or a preemption
    preempted: bool  # a signal reached some rank: save and stop
    signal: str | None  # which: SIGTERM over SIGUSR1 when ranks got different ones
    nonfinite: bool  # some rank's loss or gradient norm is NaN or infinite
    spike: bool = False  # some rank's loss or gradient norm spiked (infra.replay): the step is computed again
    apart: bool = False  # the ranks' copies of the summed gradients differ (infra.replay): the step is computed again
    withdrawn: bool = False  # computed again, a process computes wrong every time (infra.replay): the step is not taken


class StepConsensus:
    def __init__(self, accelerator: Accelerator, clock: SaveClock, preemption: Preemption):
        self.accelerator, self.clock, self.preemption = accelerator, clock, preemption

    def agree(
        self, step: int, nonfinite: torch.Tensor | None = None, spike: torch.Tensor | None = None, digest: torch.Tensor | None = None
    ) -> Agreement:
        """The agreement at the end of `step`; `nonfinite` and `spike` are this rank's flags (0-dim tensors, see
        guard.nonfinite and infra.replay; None: not raised), `digest` its int64 digest of its copy of the summed
        gradients (None: no copies to compare)."""
        due = self.accelerator.is_main_process and self.clock.by_time()
        device = self.accelerator.device
        f64 = torch.float64  # the digest's halves are exact in it (32 bits each)
        flags = [torch.zeros(1, dtype=f64, device=device) if f is None else f.to(device, f64).reshape(1) for f in (nonfinite, spike)]
        halves = torch.zeros(2, dtype=f64, device=device) if digest is None else exact_halves(digest.to(device))
        own = torch.tensor([float(self.preemption.signal or 0), float(due)], dtype=f64, device=device)
        agreed = torch.cat([own, *flags, halves, -halves])
        if self.accelerator.num_processes > 1:
            torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MAX)
        values = agreed.tolist()
        preempted, due = values[0] > 0, values[1] > 0
        return Agreement(
            save_due=preempted or due or self.clock.by_steps(step),
            preempted=preempted,
            signal=signal.Signals(int(values[0])).name if preempted else None,
            nonfinite=values[2] > 0,
            spike=values[3] > 0,
            apart=values[4] != -values[6] or values[5] != -values[7],  # some rank's half over another's
        )
