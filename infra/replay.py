"""Replay: a suspicious step computed again from the state before it, to tell a machine's transient fault from the data.

A step is suspicious when some process's loss or gradient norm is non-finite, or over `sdc_spike_factor` times the
largest of the last 100 kept steps' (after 10 of them), or, where every process holds a copy of the summed gradients
(DDP), when their digests differ (the integer sum of their bits: any one flipped bit shows, spike or not). The ranks
agree on it in the step's one all-reduce
(infra.consensus), before the optimizer steps, so the state before the step is still there: the weights and
optimizer state untouched, the samples in memory, the random state taken as the step began. Every process then zeroes
its gradients, restores that random state and runs the step's passes again. Each process's result of each attempt
(`Attempt`: its own summed loss, from its forward passes before any sum across processes; the integer sum of the bits
of its gradients as summed across processes, the engine's all-reduce or its shard of it; whether the step looked
suspicious there) is gathered once, and judged:

- copies of the summed gradients apart again: a machine that computes wrong every time: the processes apart from the
  others named (two processes: both);
- suspicious again on some process: the same device computed the same thing twice, which a device wrong every time
  does too. A second opinion (several processes): every process computes the next one's micro-batches forward (rank r's
  by rank r + 1: the same samples and weights, r's random state as the step began, so dropout draws alike; one
  all-gather of the batches, only here). A suspect whose loss another device computed differently, and not suspicious
  there, is a machine that computes wrong every time: named twice, the step not taken (its gradients are in every
  process's sum), and the run leaves it out. Else the step is what the data and the model give: a non-finite step goes
  to the non-finite guard as before (skipped, or rolled back past the data), a spike is kept;
- no longer suspicious: a transient fault, named where it shows: a process whose loss changed (by more than 1e-3 of
  itself: a GPU's kernels that are not deterministic change the last bits only) had it in its forward passes; else a
  process whose copy of the summed gradients changed while other processes' did not had it after its passes; else
  (every copy changed, no loss did) it was in some process's backward pass, which the sum hides: not named.

Whatever the verdict, the step computed again is the one kept: it is what a run without the fault computes, so a run
with a transient fault ends bit for bit as a run without it. A process named a second time (by a replay or by the
copies' comparison of infra.sdc) is a machine that computes wrong: the run saves (the replayed step is sound) and
leaves it out as infra.sdc does.

Where: DDP, FSDP, DeepSpeed ZeRO 1-3 (its step taken by the loop after the agreement: infra.zero_step) and one
process. Not DeepSpeed without ZeRO, whose engine steps inside the backward pass, nor replica groups (a step is the
quorum's).
"""

from __future__ import annotations

import math
from collections import Counter, deque
from typing import NamedTuple

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from infra.distributed import local
from infra.sdc import bits, copies_of, disagreeing
from infra.zero_step import deferrable, scaler_skips_overflows

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
    if why := deferrable(accelerator):
        return why
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
            total += bits(local(p.grad)).to(total.device)
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
    suspects: list[int] = []  # the processes whose second attempt was suspicious too
    losses: list[float] = []  # each process's loss in its second attempt
    withdrawn: bool = False  # a process computes wrong every time (second_opinion): the step is not taken

    def line(self) -> str:
        return f"step {self.step} computed again from the state before it ({self.seen}): {self.finding}"


class Replays:
    """Spikes looked for, a suspicious step computed again and judged (the Trainer runs the passes); counts for MLflow."""

    def __init__(self, accelerator: Accelerator, replay: str, factor: float, fault_tolerance: str, named: Counter):
        self.accelerator, self.factor, self.named = accelerator, factor, named
        self.active = replay == "on" or (replay == "auto" and cannot_replay(accelerator, fault_tolerance) is None)
        # DDP: every process's copy of the summed gradients is the same (DeepSpeed's and FSDP's are shards)
        self.copies = self.active and accelerator.distributed_type != DistributedType.DEEPSPEED and copies_of(accelerator) is not None
        self.fp16 = scaler_skips_overflows(accelerator)  # its loss scaler's overflows are no spikes: the gradient norm not looked at
        self.losses: deque[float] = deque(maxlen=HISTORY)
        self.norms: deque[float] = deque(maxlen=HISTORY)
        self.counts = {"sdc/replays": 0, "sdc/transient_faults": 0, "sdc/replay_seconds": 0.0, "sdc/second_opinions": 0}
        self.twice: list[int] = []  # ranks named a second time: the run leaves them out

    def before(self) -> tuple | None:
        """The random state as a step begins (the passes' dropout draws from it), when a step may be computed again."""
        if not self.active:
            return None
        cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        return torch.get_rng_state(), cuda  # the CPU's and this process's device's (another process may take them on)

    def restore(self, state: tuple) -> None:
        cpu, cuda = state
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda)

    def spike(self, loss: torch.Tensor, grad_norm) -> torch.Tensor | None:
        """This process's flag for the step's agreement: its loss or gradient norm over `factor` times the largest of
        the last kept steps' (a 0-dim tensor left on the device: no synchronisation), or None (not looked for)."""
        if not self.active or not self.factor or len(self.losses) < WARMUP:
            return None
        flag = loss.detach().float().abs() > self.factor * max(self.losses)
        if grad_norm is not None and self.norms and not self.fp16:
            flag = flag | (torch.as_tensor(grad_norm, device=loss.device).float() > self.factor * max(self.norms))
        return flag.float().reshape(())

    def digest(self, model: torch.nn.Module) -> torch.Tensor | None:
        """This process's digest of its copy of the summed gradients, for the step's agreement (left on the device), or
        None where the processes hold no copies of them."""
        return grad_bits(model) if self.copies else None

    def suspect(self, passes: Passes, nonfinite: torch.Tensor) -> torch.Tensor:
        """This process's own view of a step the ranks agreed to compute again: non-finite or spiking here (0-dim)."""
        spike = self.spike(passes.loss, passes.grad_norm)
        return nonfinite if spike is None else torch.maximum(nonfinite, spike.to(nonfinite.device))

    def due(self, nonfinite: bool, spike: bool, apart: bool) -> bool:
        return self.active and (nonfinite or spike or apart)

    def kept(self, passes: Passes) -> None:
        """A finite step's values (after the agreement's synchronisation: no extra wait), for the next spikes."""
        if not self.active:
            return
        loss, norm = abs(float(passes.loss)), None if passes.grad_norm is None else float(passes.grad_norm)
        if math.isfinite(loss):
            self.losses.append(loss)
        if norm is not None and math.isfinite(norm):  # an fp16 step the scaler skips has an infinite norm
            self.norms.append(norm)

    def attempt(self, passes: Passes, model: torch.nn.Module, nonfinite: torch.Tensor) -> Attempt:
        """This process's result of one attempt; `nonfinite` its flag for the non-finite guard (a synchronisation:
        only in a replay)."""
        loss = passes.loss.detach().float().reshape(())
        norm = None if passes.grad_norm is None else float(passes.grad_norm)
        suspect = bool(self.suspect(passes, nonfinite))
        return Attempt(int(loss.view(torch.int32)), int(grad_bits(model)), bool(nonfinite), suspect, float(loss), norm)

    def judge(self, step: int, first: Attempt, again: Attempt, seconds: float) -> Verdict:
        """Both attempts of every process gathered (one collective) and judged (see the module's docstring)."""
        acc = self.accelerator
        mine = torch.tensor([first.flat() + again.flat()], dtype=torch.int64, device=acc.device)
        rows = (mine if acc.num_processes == 1 else acc.gather(mine)).cpu().tolist()
        width = len(first.flat())
        both = [(Attempt.of(row[:width]), Attempt.of(row[width:])) for row in rows]
        named, finding = judged(both, self.copies)
        self.counts["sdc/replays"] += 1
        self.counts["sdc/transient_faults"] += len(named)
        self.counts["sdc/replay_seconds"] += seconds
        self.named.update(named)
        self.twice = [r for r in named if self.named[r] > 1]
        suspects = [r for r, (_, again) in enumerate(both) if again.suspect]
        nonfinite = any(again.nonfinite for _, again in both)
        return Verdict(step, named, finding, nonfinite, suspicion(both, self.copies), suspects, [again.loss for _, again in both])

    def second_opinion(self, verdict: Verdict, views: list[float]) -> Verdict:
        """A step suspicious again, told apart further by another device: `views[r]` is the loss of process r's
        micro-batches as the next process computed them (its forward passes, from r's random state: the same samples,
        weights and dropout). A suspect whose own loss changed there (by more than LOSS_CHANGE), to one neither
        non-finite nor a spike, is a machine that computes wrong every time: named twice (both of its attempts), the
        step not taken (`withdrawn`: its gradients are in every process's sum), and the run leaves it out as infra.sdc
        does. Else the data or the model, as before, now seen on two devices."""
        self.counts["sdc/second_opinions"] += 1
        n = len(views)
        wrong = [r for r in verdict.suspects if changed(verdict.losses[r], views[r]) and not self.spiking(views[r])]
        if not wrong:
            seen = "; ".join(f"rank {(r + 1) % n} computed rank {r}'s micro-batches alike" for r in verdict.suspects)
            return verdict._replace(finding=f"{verdict.finding} ({seen})")
        for r in wrong:
            self.named[r] += 2
        self.twice = sorted(set(self.twice) | set(wrong))
        told = "; ".join(
            f"rank {(r + 1) % n} computed rank {r}'s micro-batches to loss {views[r]:.4g}, rank {r} to {verdict.losses[r]:.4g} twice"
            for r in wrong
        )
        finding = f"{told}: {ranks_of(wrong)} computes wrong every time; the step is not taken"
        return verdict._replace(named=wrong, finding=finding, withdrawn=True)

    def spiking(self, loss: float) -> bool:
        """Whether a loss would make a step suspicious: non-finite, or a spike against the kept steps'."""
        if not math.isfinite(loss):
            return True
        return bool(self.factor and len(self.losses) >= WARMUP and abs(loss) > self.factor * max(self.losses))


class Attempt(NamedTuple):
    """One process's result of one attempt at a step: the bits of its summed loss and of its gradients (as summed
    across processes; its shard under FSDP), whether it is non-finite for the non-finite guard, whether the step looked
    suspicious here (non-finite or a spike), and its loss and gradient norm."""

    loss_bits: int
    grad_bits: int
    nonfinite: bool
    suspect: bool
    loss: float
    norm: float | None

    def flat(self) -> list[int]:
        """As int64s, to be gathered (the floats by their float64 bits)."""
        return [self.loss_bits, self.grad_bits, int(self.nonfinite), int(self.suspect), float_bits(self.loss), float_bits(self.norm)]

    @classmethod
    def of(cls, flat: list[int]) -> Attempt:
        norm = None if flat[5] == float_bits(None) else bits_float(flat[5])
        return cls(flat[0], flat[1], bool(flat[2]), bool(flat[3]), bits_float(flat[4]), norm)


LOSS_CHANGE = 1e-3  # relative: a loss that changed by less is the same loss (a GPU's kernels may differ in the last bits)


def judged(both: list[tuple[Attempt, Attempt]], copies: bool = False) -> tuple[list[int], str]:
    """The processes named by their two attempts at a step (a pair a process), and the finding in words. `copies`: the
    processes hold copies of the summed gradients (DDP), which must be the same. Copies apart again are a machine that
    computes wrong every time; a step still suspicious when computed again is the data or the model; one that is not
    had a transient fault, named where it shows: a process whose loss changed (its forward pass), or whose copy of the
    summed gradients changed while the others' did not (after its passes; a process alone: its own)."""
    if copies and (apart := apart_from_others([again.grad_bits for _, again in both])):
        return apart, (
            f"{ranks_of(apart)} summed other gradients than the others again, from the same state and samples: a machine "
            "that computes wrong every time; the step computed again is kept"
        )
    if any(again.suspect for _, again in both):
        return [], "suspicious again: the data or the model, not the machine"
    kept = "; the step computed again is kept"
    loss_changed = [r for r, (a, b) in enumerate(both) if changed(a.loss, b.loss)]
    grads_changed = [r for r, (a, b) in enumerate(both) if a.grad_bits != b.grad_bits]
    if loss_changed:
        return loss_changed, f"{ranks_of(loss_changed)} computed another loss: a transient fault in its forward pass{kept}"
    if grads_changed and (len(grads_changed) < len(both) or len(both) == 1):
        return grads_changed, f"{ranks_of(grads_changed)} got other gradients from the same loss: a transient fault after its passes{kept}"
    return [], (
        "no longer suspicious, with every process's loss the same: a transient fault in some process's backward pass "
        f"(not told apart: the passes sum the gradients){kept}"
    )


def changed(a: float, b: float) -> bool:
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.isfinite(a) != math.isfinite(b) or (a != b and not (math.isnan(a) and math.isnan(b)))
    return abs(a - b) > LOSS_CHANGE * max(abs(a), abs(b))


def ranks_of(ranks: list[int]) -> str:
    return ", ".join(f"rank {r}" for r in ranks)


def apart_from_others(digests: list[int]) -> list[int]:
    """The processes whose digest differs from a majority's (every process when there is none)."""
    return disagreeing(torch.tensor(digests, dtype=torch.int64).reshape(-1, 1))[0]


def suspicion(both: list[tuple[Attempt, Attempt]], copies: bool = False) -> str:
    """The first attempt's loss and gradient norm on each process that found the step suspicious, and copies of the
    summed gradients apart, one clause."""
    parts = []
    if copies and (apart := apart_from_others([first.grad_bits for first, _ in both])):
        parts.append(f"{ranks_of(apart)}: summed gradients apart from the others'")
    for r, (first, _) in enumerate(both):
        if first.suspect:
            parts.append(f"rank {r}: loss {first.loss:.4g}" + ("" if first.norm is None else f", gradient norm {first.norm:.4g}"))
    return "; ".join(parts) or "no process's own values"
