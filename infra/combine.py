"""How the processes' gradients are combined, and whether a step counts: one of two, by `fault_tolerance`.

    EngineSum    (none)      the engine's own: DDP's all-reduce in the last micro-batch's backward, ZeRO's and FSDP's
                             reduce-scatter in each; every step counts
    QuorumSum    (replicas)  infra.replicas.combine: inside the group as EngineSum, then torchft's sum over the quorum of
                             live replica groups; a step counts only when the quorum commits it, else it is done again

The Trainer (infra.trainer) calls them at the same points, in this order, on every process:

    combine.bind(loop)                          once built: the loop's calls it may make (`Loop` below: never the Trainer)
    path, manifest = combine.restore(load)      where the run starts (QuorumSum: the first quorum, or a heal)
    seat = combine.begin()                      each try at a step: its seat among the groups that split it
    items = combine.count(items)                the step's items, summed over every process that trains on it
    with combine.micro_batch(last): ...         each micro-batch's forward and backward
    loss, loss_sum = combine.gradients(step_loss, num_items_in_batch)    the gradients combined
    if combine.commit(): ... combine.committed(seat)   else combine.not_committed(seat), and the step again
    stop = combine.stop()                       after a committed step: this process's stop it calls for, or None
    combine.saves, combine.export(export), combine.rolled_back(), combine.close()

A new way of combining (torchft's LocalSGD or DiLoCo, say) is one new class with these calls, chosen in infra.run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from infra.shares import ALONE, Seat
from infra.stopped import Stop

if TYPE_CHECKING:  # the loop's parts, named in the Loop's annotations only (infra.arguments imports infra.replicas)
    from accelerate import Accelerator

    from infra.arguments import TrainingArguments
    from infra.checkpoint import CheckpointManager
    from infra.observers import Observers


class Loop(Protocol):
    """What a combine may ask of the training loop (infra.trainer.Trainer is one): the combine holds this, never the
    Trainer, reads what is here and changes the loop only through these calls."""

    accelerator: Accelerator
    args: TrainingArguments
    model: torch.nn.Module  # as prepared (DDP, DeepSpeed's engine, FSDP2's root)
    optimizer: torch.optim.Optimizer
    checkpoints: CheckpointManager
    latest: dict[str, float]  # the latest of each metric
    step_started: float  # when the try at the step under way began (time.monotonic)
    watch: Observers  # say, log, entering (a collective), relaxed (a wait that is no hang), allow_waits

    @property
    def at_step(self) -> int: ...  # the steps taken (the last one committed)
    @property
    def hosts(self) -> list[str]: ...  # each rank's host
    @property
    def samples_per_step(self) -> int: ...
    @property
    def samples_read(self) -> int: ...  # this process's samples of the try under way
    def live_state(self) -> dict: ...  # everything another copy needs to train on as this one (state dicts)
    def load_live_state(self, state: dict, placed: Callable[[Any, torch.Tensor], Any]) -> None: ...
    def healed(self) -> None: ...  # its state was replaced by a live copy's (load_live_state): the observers and hooks told
    def go_back(self, which: str) -> str | None: ...  # back to a checkpoint, its data position included (a repair)


class Combine(Protocol):
    """The calls above; `bind` takes the loop (`Loop`)."""

    items_where: str  # what the watchdog says a rank waits on while the items are counted, and in the passes
    backward_where: str
    saves: bool  # whether this process's job writes the checkpoints

    def bind(self, loop: Loop) -> None: ...
    def restore(self, load: Callable[[], tuple[str | None, dict]]) -> tuple[str | None, dict]: ...
    def who(self) -> str: ...
    def batch(self) -> str: ...
    def begin(self) -> Seat: ...
    def count(self, items: torch.Tensor) -> torch.Tensor: ...
    def micro_batch(self, last: bool) -> contextlib.AbstractContextManager: ...
    def gradients(self, step_loss: torch.Tensor, num_items_in_batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...
    def commit(self) -> bool: ...
    def committed(self, seat: Seat) -> None: ...
    def not_committed(self, seat: Seat) -> None: ...
    def stop(self) -> Stop | None: ...
    def rolled_back(self) -> None: ...
    def export(self, export: Callable[[], None]) -> None: ...
    def close(self) -> None: ...


class EngineSum:
    """A plain job's: the engine sums the gradients (accelerate's accumulate syncs on a step's last micro-batch, and
    divides each micro-batch's loss by the accumulation steps); every step counts; its main process saves and exports."""

    items_where = "the item count's all-reduce"
    backward_where = "forward and backward (the gradient all-reduce)"
    saves = True

    def bind(self, loop: Loop) -> None:
        self.loop = loop

    def restore(self, load):
        return load()

    def who(self) -> str:
        acc = self.loop.accelerator
        return f"world size {acc.num_processes} ({acc.distributed_type.value})"

    def batch(self) -> str:
        steps = self.loop.args.gradient_accumulation_steps
        return f"{self.loop.samples_per_step} samples per step ({steps} micro-step{'s' if steps > 1 else ''})"

    def begin(self) -> Seat:
        return ALONE

    def count(self, items: torch.Tensor) -> torch.Tensor:
        return items

    def micro_batch(self, last: bool) -> contextlib.AbstractContextManager:
        return self.loop.accelerator.accumulate(self.loop.model)

    def gradients(self, step_loss: torch.Tensor, num_items_in_batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(this rank's summed loss of the step, over the items; the same times the items): summed already."""
        return step_loss, step_loss * num_items_in_batch

    def commit(self) -> bool:
        return True

    def committed(self, seat: Seat) -> None:
        pass

    def not_committed(self, seat: Seat) -> None:
        raise AssertionError("every step of a plain job counts")

    def stop(self) -> Stop | None:
        return None

    def rolled_back(self) -> None:
        pass

    def export(self, export) -> None:
        export()

    def close(self) -> None:
        pass
