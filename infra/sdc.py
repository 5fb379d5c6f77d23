"""Silent data corruption: the copies of the training state that processes must hold identically, compared during the
run, so that a machine computing wrong is caught before its numbers spread or reach a checkpoint.

What is compared (`copies_of`): under DDP every process holds the whole weights and optimizer state; under ZeRO-1/2 the
weights (the optimizer state is partitioned: one copy). Under ZeRO-3 and FSDP alone no process holds another's state,
so there is nothing to compare (`sdc_action: auto` checks nothing there; asked for explicitly, refused).

How: each process reduces every tensor to one number, the integer sum of its bits (the tensor viewed as integers of its
width, summed in int64 on its device: exact, whatever the order, no copy to the host, and changed by any one flipped bit),
and the vectors are all-gathered (a number a tensor a process). A tensor whose number differs between processes names
the processes that differ from the others (with two processes both: two copies cannot tell which one is wrong).

When: every `sdc_check_steps` steps and before every checkpoint is written (`Trainer.save`), so a checkpoint is never
committed while copies disagree: every committed checkpoint is sound. On a mismatch (`sdc_action: repair`, the default
where there are copies), the run rolls back to the newest checkpoint, data position and random state included, and
trains the steps since again on the same samples: a transient fault gone, the run ends as a run without it would, bit
for bit. A process named a second time (a machine that computes wrong), or `sdc_action: stop`, or no checkpoint to
return to: the run stops at its newest sound checkpoint, with exit code 77 and `stopped.json` naming the processes, their
hosts and the tensors that differed, for the scheduler to start it again without that machine.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from infra.config import require
from infra.distributed import local
from infra.environment import zero_stage
from infra.health import DesyncError


@dataclass
class SdcConfig:
    """Silent-data-corruption flags (part of TrainingArguments)."""

    _argument_group_name = "silent data corruption"  # its heading in --help

    sdc_check_steps: int = field(
        default=50,
        metadata={
            "help": "Every N steps, and before every checkpoint is written, compare the copies of the state that processes "
            "hold identically (DDP: weights and optimizer state; ZeRO-1/2: weights)."
        },
    )
    sdc_action: Literal["auto", "repair", "stop", "off"] = field(
        default="auto",
        metadata={
            "help": "repair: on a mismatch, roll back to the newest checkpoint and train the steps since again (a process "
            "named twice stops the run, exit code 77); stop: stop at once; off: no check; auto: repair where processes hold "
            "copies, off where none does (ZeRO-3, FSDP, one process)."
        },
    )

    sdc_replay: Literal["auto", "on", "off"] = field(
        default="auto",
        metadata={
            "help": "Compute a suspicious step (some process's loss or gradient norm non-finite or spiking; under DDP, the "
            "processes' copies of the summed gradients apart) again from the "
            "state before it, with the same samples and random state, and compare each process's results: a process whose "
            "result changed had a transient fault (named; the step computed again is kept), a step suspicious again is the "
            "data or the model. auto: where the engine allows it (DDP, FSDP, DeepSpeed ZeRO 1-3, one process; not replica groups)."
        },
    )
    sdc_spike_factor: float = field(
        default=10.0,
        metadata={
            "help": "A loss or gradient norm over this many times the largest of the last 100 kept steps' is a spike: the "
            "step is computed again (sdc_replay). 0: only non-finite values are."
        },
    )

    def __post_init__(self):
        require(self.sdc_check_steps >= 1, "sdc_check_steps", self.sdc_check_steps, "an integer >= 1 (sdc_action=off: no check)")
        factor = self.sdc_spike_factor
        require(factor == 0 or factor > 1, "sdc_spike_factor", factor, "0 (no spike check) or a number > 1")


def copies_of(accelerator: Accelerator) -> str | None:
    """What each process holds that the others hold identically, or None (a process alone, ZeRO-3, FSDP)."""
    if accelerator.num_processes == 1 or accelerator.distributed_type == DistributedType.FSDP:
        return None
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return "weights" if zero_stage(accelerator) in (0, 1, 2) else None
    return "weights and optimizer state"


def sdc_problem(accelerator: Accelerator, action: str) -> str | None:
    """Why `sdc_action` cannot be served here (asked for explicitly where no process holds another's copy), or None."""
    if action not in ("repair", "stop") or copies_of(accelerator) is not None:
        return None
    where = "one process" if accelerator.num_processes == 1 else "ZeRO-3 or FSDP, where each process holds its own part"
    return f"sdc_action={action!r} is not valid under {where}: no process holds a copy of another's state to compare; expected auto or off"


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The integer sum of a tensor's bits: its elements viewed as integers of their width, summed in int64 (0-dim)."""
    t = tensor.detach().contiguous()
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(width).sum(dtype=torch.int64)


class Mismatch(NamedTuple):
    """Copies that disagree: the processes that differ from the others, and the tensors where (their names)."""

    step: int
    ranks: list[int]
    tensors: list[str]


class Copies:
    """This process's copies and their comparison across processes; counts kept for MLflow (sdc/*)."""

    def __init__(self, accelerator: Accelerator, model, optimizer, config: SdcConfig):
        self.accelerator, self.model, self.optimizer, self.every = accelerator, model, optimizer, config.sdc_check_steps
        self.action = config.sdc_action
        self.scope = None if self.action == "off" else copies_of(accelerator)
        self.counts = {"sdc/checks": 0, "sdc/mismatches": 0, "sdc/repairs": 0, "sdc/check_seconds": 0.0}
        self.named = Counter()  # how often each rank was named

    def due(self, step: int, saving: bool) -> bool:
        return self.scope is not None and (saving or step % self.every == 0)

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every tensor in scope, named, in the same order on every process."""
        return named_state(self.accelerator, self.model, self.optimizer, self.scope == "weights and optimizer state")

    def compare(self, step: int) -> Mismatch | None:
        """Every process's numbers gathered and compared (a collective: every process calls it at the same step)."""
        start = time.perf_counter()
        named = self.tensors()
        mine = torch.stack([bits(t) for _, t in named]).to(self.accelerator.device)
        rows = self.accelerator.gather(mine.reshape(1, -1)).reshape(self.accelerator.num_processes, -1).cpu()
        self.counts["sdc/checks"] += 1
        self.counts["sdc/check_seconds"] += time.perf_counter() - start
        ranks, columns = disagreeing(rows)
        if not columns:
            return None
        self.counts["sdc/mismatches"] += 1
        found = Mismatch(step, ranks, [named[c][0] for c in columns])
        self.named.update(found.ranks)
        return found

    def again(self, found: Mismatch) -> list[int]:
        """The ranks of `found` named before too (a machine that computes wrong, not a transient fault)."""
        return [r for r in found.ranks if self.named[r] > 1]

    def final(self, step: int) -> str | None:
        """Before the export: the copies compared once more; their line, or a DesyncError naming the processes and
        tensors (None: nothing to compare)."""
        if self.scope is None:
            return None
        if (found := self.compare(step)) is not None:
            raise DesyncError(describe(found))
        count = len(self.tensors())
        return f"copies identical on all {self.accelerator.num_processes} ranks: {self.scope}, {count} tensors"


def named_state(accelerator: Accelerator, model, optimizer, optimizer_state: bool = True) -> list[tuple[str, torch.Tensor]]:
    """This process's weights (and optimizer state), named, in the same order on every process: each tensor as this
    process holds it (its own part of a sharded one)."""
    inner = accelerator.unwrap_model(model)
    named = [(f"model.{n}", local(p)) for n, p in inner.named_parameters()]
    if optimizer_state:
        names = {id(p): n for n, p in inner.named_parameters()}
        for group in optimizer.param_groups:
            for p in group["params"]:
                for key, value in sorted(optimizer.state.get(p, {}).items()):
                    if torch.is_tensor(value):
                        named.append((f"optimizer.{names.get(id(p), '?')}.{key}", local(value)))
    return named


def state_bits(accelerator: Accelerator, model, optimizer) -> int:
    """The integer sum of the bits of every tensor of this process's weights and optimizer state (int64, wrapping)."""
    named = named_state(accelerator, model, optimizer)
    return int(torch.stack([bits(t) for _, t in named]).sum()) if named else 0  # one copy to the host


def exact_halves(value: torch.Tensor) -> torch.Tensor:
    """An int64 (0-dim) as float64 [high 32 bits (signed), low 32 bits (0 to 2**32 - 1)]: each exact, also in a sum
    across processes where the others send zeros (a slot); `whole` reads them back."""
    value = value.reshape(())
    return torch.stack([torch.div(value, 1 << 32, rounding_mode="floor"), torch.remainder(value, 1 << 32)]).to(torch.float64)


def whole(halves: torch.Tensor) -> torch.Tensor:
    """The int64s of float64 halves (the last dimension, 2) as `exact_halves` made them."""
    h = halves.to(torch.int64)
    return (h[..., 0] << 32) | h[..., 1]


def disagreeing(rows: torch.Tensor) -> tuple[list[int], list[int]]:
    """Of the processes' numbers (a row a process, a column a tensor): the processes that differ from a majority in some
    column (every process of a column with no majority: two copies cannot tell which is wrong), and those columns."""
    columns = (rows != rows[0]).any(dim=0).nonzero().flatten().tolist()
    ranks: set[int] = set()
    for column in columns:
        common, count = Counter(rows[:, column].tolist()).most_common(1)[0]
        if count * 2 > len(rows):
            ranks |= {r for r in range(len(rows)) if rows[r, column] != common}
        else:
            ranks |= set(range(len(rows)))
    return sorted(ranks), columns


def describe(found: Mismatch, hosts: list[str] | None = None) -> str:
    """One line: which copies disagree, where."""
    who = ", ".join(f"rank {r}" + (f" on {hosts[r]}" if hosts else "") for r in found.ranks)
    more = f" and {len(found.tensors) - 3} more" if len(found.tensors) > 3 else ""
    return f"copies disagree at step {found.step}: {who} differ in {', '.join(found.tensors[:3])}{more}"
