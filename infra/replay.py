"""Replay: a suspicious step computed again from the state before it, to tell a machine's transient fault from the data.

A step is suspicious when some process's loss or gradient norm is non-finite, or over `sdc_spike_factor` times the
largest of the last 100 kept steps' (after 10 of them). The ranks agree on it in the step's one all-reduce
(infra.consensus), before the optimizer steps, so the state before the step is still there: the weights and
optimizer state untouched, the samples in memory, the random state taken as the step began. Every process then zeroes
its gradients, restores that random state and runs the step's passes again. Each process's result of each attempt is
reduced to two numbers: the bits of its own summed loss (its forward passes, before any sum across processes) and the
integer sum of the bits of its gradients (as summed across processes: the engine's all-reduce, or its shard of them),
and the four numbers of every process are gathered once:

- a process whose loss changed between the attempts had a transient fault in its forward passes: named;
- a process whose gradients changed while other processes' did not (its loss the same): a fault on it after the
  passes, in its copy of the summed gradients: named;
- every process's gradients changed and no loss did: a fault in some process's backward pass, which cannot be told
  under DDP (the passes sum the gradients), or kernels that are not deterministic (a GPU's atomics: see
  `torch.use_deterministic_algorithms`): not named;
- nothing changed: the step is what the data and the model give, not the machine: a non-finite step goes to the
  non-finite guard as before (skipped, or rolled back past the data), a spike is kept.

Whatever the verdict, the step computed again is the one kept: it is what a run without the fault computes, so a run
with a transient fault ends bit for bit as a run without it. A process named a second time (by a replay or by the
copies' comparison of infra.sdc) is a machine that computes wrong: the run saves (the replayed step is sound) and
leaves it out as infra.sdc does.

Where: DDP, FSDP and one process. Not under DeepSpeed, whose engine steps the optimizer inside the backward pass (the
state before the step is gone when the step is judged), nor with replica groups (a step is the quorum's).
"""

from __future__ import annotations

import math
from collections import Counter, deque
from typing import NamedTuple

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch.distributed.tensor import DTensor

from infra.sdc import bits

HISTORY = 100  # kept steps whose largest loss and gradient norm a spike is measured against
WARMUP = 10  # kept steps before spikes are looked for


class Passes(NamedTuple):
    """One attempt at a step's passes: this process's summed loss (over the items; the same times the items) and the
    gradients' clipped global norm (None when not clipping)."""

    loss: torch.Tensor
    loss_sum: torch.Tensor
    grad_norm: torch.Tensor | None


def cannot_replay(accelerator: Accelerator, fault_tolerance: str) -> str | None:
    """Why a step cannot be computed again here, or None."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return "DeepSpeed, whose engine steps the optimizer inside the backward pass (the state before the step is gone)"
    if fault_tolerance == "replicas":
        return "fault_tolerance=replicas (a step is the quorum's, summed across the replica groups)"
    return None


def replay_problem(accelerator: Accelerator, replay: str, fault_tolerance: str) -> str | None:
    """Why `sdc_replay` cannot be served here (asked for explicitly where a step cannot be computed again), or None."""
    why = cannot_replay(accelerator, fault_tolerance)
    if replay != "on" or why is None:
        return None
    return f"sdc_replay='on' is not valid under {why}; expected auto or off"


def grad_bits(model: torch.nn.Module) -> torch.Tensor:
    """The integer sum of the bits of every gradient this process holds (its shard under FSDP), int64 (0-dim)."""
    total = torch.zeros((), dtype=torch.int64, device=next(model.parameters()).device)
    for p in model.parameters():
        if p.grad is not None:
            total += bits(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).to(total.device)
    return total


def float_bits(value: torch.Tensor | float | None) -> int:
    """A float as the int64 of its float64 bits (NaN for None): to travel in an int64 gather."""
    f = float("nan") if value is None else float(value)
    return int(torch.tensor([f], dtype=torch.float64).view(torch.int64).item())


def bits_float(value: int) -> float:
    return float(torch.tensor([value], dtype=torch.int64).view(torch.float64).item())


class Verdict(NamedTuple):
    """What the replay of `step` found: the processes named (a transient fault on each), why, and whether the step
    computed again is non-finite on some process (then the non-finite guard acts)."""

    step: int
    named: list[int]
    finding: str
    nonfinite: bool
    seen: str  # what made the step suspicious, on which processes (their first attempt's loss and gradient norm)

    def line(self) -> str:
        return f"step {self.step} computed again from the state before it ({self.seen}): {self.finding}"


class Replays:
    """Spikes looked for, a suspicious step computed again and judged (the Trainer runs the passes); counts for MLflow."""

    def __init__(self, accelerator: Accelerator, replay: str, factor: float, fault_tolerance: str, named: Counter):
        self.accelerator, self.factor, self.named = accelerator, factor, named
        self.active = replay == "on" or (replay == "auto" and cannot_replay(accelerator, fault_tolerance) is None)
        self.fp16 = accelerator.scaler is not None  # its loss scaler's overflows are no spikes: the gradient norm not looked at
        self.losses: deque[float] = deque(maxlen=HISTORY)
        self.norms: deque[float] = deque(maxlen=HISTORY)
        self.counts = {"sdc/replays": 0, "sdc/transient_faults": 0, "sdc/replay_seconds": 0.0}
        self.twice: list[int] = []  # ranks named a second time: the run leaves them out

    def before(self) -> tuple | None:
        """The random state as a step begins (the passes' dropout draws from it), when a step may be computed again."""
        if not self.active:
            return None
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        return torch.get_rng_state(), cuda

    def restore(self, state: tuple) -> None:
        cpu, cuda = state
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)

    def spike(self, loss: torch.Tensor, grad_norm) -> torch.Tensor | None:
        """This process's flag for the step's agreement: its loss or gradient norm over `factor` times the largest of
        the last kept steps' (a 0-dim tensor left on the device: no synchronisation), or None (not looked for)."""
        if not self.active or not self.factor or len(self.losses) < WARMUP:
            return None
        flag = loss.detach().float().abs() > self.factor * max(self.losses)
        if grad_norm is not None and self.norms and not self.fp16:
            flag = flag | (torch.as_tensor(grad_norm, device=loss.device).float() > self.factor * max(self.norms))
        return flag.float().reshape(())

    def suspect(self, passes: Passes, nonfinite: torch.Tensor) -> torch.Tensor:
        """This process's own view of a step the ranks agreed to compute again: non-finite or spiking here (0-dim)."""
        spike = self.spike(passes.loss, passes.grad_norm)
        return nonfinite if spike is None else torch.maximum(nonfinite, spike.to(nonfinite.device))

    def due(self, nonfinite: bool, spike: bool) -> bool:
        return self.active and (nonfinite or spike)

    def kept(self, passes: Passes) -> None:
        """A finite step's values (after the agreement's synchronisation: no extra wait), for the next spikes."""
        if not self.active:
            return
        loss, norm = abs(float(passes.loss)), None if passes.grad_norm is None else float(passes.grad_norm)
        if math.isfinite(loss):
            self.losses.append(loss)
        if norm is not None and math.isfinite(norm):  # an fp16 step the scaler skips has an infinite norm
            self.norms.append(norm)

    def mine(self, passes: Passes, model: torch.nn.Module) -> list[torch.Tensor]:
        """This process's result of one attempt: its loss's bits, its gradients' bits."""
        return [passes.loss.detach().float().reshape(()).view(torch.int32).to(torch.int64), grad_bits(model)]

    def judge(self, step: int, attempts: tuple[Passes, Passes], results: tuple[list, list], flags: tuple, seconds: float) -> Verdict:
        """Both attempts' results gathered from every process (one collective) and judged (see the module's docstring).
        `flags`: this process's (first attempt suspicious: non-finite or a spike; second attempt non-finite), 0-dim."""
        acc = self.accelerator
        (first, again), device = results, results[0][0].device
        suspect, nonfinite = flags
        values = [float_bits(p.loss) for p in attempts] + [float_bits(p.grad_norm) for p in attempts]
        mine = torch.stack([*first, *again, nonfinite.to(device, torch.int64), suspect.to(device, torch.int64).reshape(())])
        mine = torch.cat([mine, torch.tensor(values, dtype=torch.int64, device=device)]).reshape(1, -1)
        rows = (mine if acc.num_processes == 1 else acc.gather(mine).reshape(acc.num_processes, -1)).cpu().tolist()
        named, finding = judged(rows)
        self.counts["sdc/replays"] += 1
        self.counts["sdc/transient_faults"] += len(named)
        self.counts["sdc/replay_seconds"] += seconds
        self.named.update(named)
        self.twice = [r for r in named if self.named[r] > 1]
        return Verdict(step, named, finding, any(row[NONFINITE] for row in rows), suspicion(rows))


LOSS, GRADS, NONFINITE, SUSPECT, VALUES = 0, 1, 4, 5, 6  # a gathered row: first (loss, grads), again (loss, grads), ...


def judged(rows: list[list[int]]) -> tuple[list[int], str]:
    """The processes named by both attempts' results (a row a process, laid out as above), and the finding in words."""
    loss_changed = [r for r, row in enumerate(rows) if row[LOSS] != row[LOSS + 2]]
    grads_changed = [r for r, row in enumerate(rows) if row[GRADS] != row[GRADS + 2]]
    kept = "; the step computed again is kept"
    if loss_changed:
        return loss_changed, f"{ranks_of(loss_changed)} computed another loss: a transient fault in its forward pass{kept}"
    if grads_changed and (len(grads_changed) < len(rows) or len(rows) == 1):
        return grads_changed, f"{ranks_of(grads_changed)} got other gradients from the same loss: a transient fault after its passes{kept}"
    if grads_changed:
        return [], (
            "every process got other gradients from the same losses: a transient fault in some process's backward pass "
            f"(not told apart: the passes sum the gradients), or kernels that are not deterministic{kept}"
        )
    return [], "the same result on every process: the data or the model, not the machine"


def ranks_of(ranks: list[int]) -> str:
    return ", ".join(f"rank {r}" for r in ranks)


def suspicion(rows: list[list[int]]) -> str:
    """The first attempt's loss and gradient norm on each process that found the step suspicious, one clause."""
    parts = []
    for r, row in enumerate(rows):
        if row[SUSPECT]:
            loss, norm = bits_float(row[VALUES]), bits_float(row[VALUES + 2])
            parts.append(f"rank {r}: loss {loss:.4g}" + ("" if row[VALUES + 2] == float_bits(None) else f", gradient norm {norm:.4g}"))
    return "; ".join(parts) or "no process's own values"
