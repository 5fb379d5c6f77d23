"""Non-finite steps: skipped, then after `max_bad_steps` in a row a rollback to the newest checkpoint (or a stop).

Every rank decides from the same agreed flag (StepConsensus), so all skip, roll back or stop together.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from infra.checkpoint import CheckpointManager
from infra.config import require
from infra.data import DataCursor
from infra.data.mixture import MixtureCursor
from infra.errors import HealthError
from infra.observers import say
from infra.zero_step import deferrable, scaler_skips_overflows


def nonfinite(loss: torch.Tensor, grad_norm: torch.Tensor | float | None) -> torch.Tensor:
    """1.0 where this rank's loss (or gradient norm) is NaN or infinite, as a 0-dim tensor on the loss's device.

    Left on the device so that it can join the step's one all-reduce (StepConsensus): one
    rank's NaN reaches the others through the gradient all-reduce, but not through the loss, and
    not at all when clipping is off; agreeing on the flag makes every rank skip (or roll back) together.
    """
    bad = ~torch.isfinite(loss.detach().float())
    if grad_norm is not None:
        bad = bad | ~torch.isfinite(torch.as_tensor(grad_norm, device=loss.device, dtype=torch.float32))
    return bad.float().reshape(())


@dataclass
class NonFiniteConfig:
    """Non-finite step flags (part of TrainingArguments)."""

    _argument_group_name = "non-finite steps"  # its heading in --help

    max_bad_steps: int = field(
        default=3, metadata={"help": "Non-finite steps in a row (each skipped: no optimizer step) before on_bad_steps acts."}
    )
    on_bad_steps: Literal["rollback", "stop"] = field(
        default="rollback",
        metadata={"help": "rollback: reload the newest checkpoint and skip the data since it; stop: end the run with a message."},
    )
    max_rollbacks: int = field(default=3, metadata={"help": "Rollbacks allowed in one run before it stops."})

    def __post_init__(self):
        require(self.max_bad_steps >= 1, "max_bad_steps", self.max_bad_steps, "an integer >= 1")
        require(self.max_rollbacks >= 0, "max_rollbacks", self.max_rollbacks, "an integer >= 0")


class NonFiniteGuard:
    """Owns what happens on a non-finite loss or gradient: skip the optimizer step, roll back, or stop.

    fp16: the loss scaler skips steps with inf/NaN gradients and lowers its scale by itself, so only the
    loss counts and the optimizer still steps (the scaler skips inside). DeepSpeed without ZeRO steps inside
    `accelerator.backward`: too late to skip, a rollback undoes it (ZeRO's step waits for the loop: infra.zero_step).
    """

    def __init__(self, accelerator: Accelerator, config: NonFiniteConfig, checkpoints: CheckpointManager, verify_checksums: bool):
        self.accelerator, self.config, self.checkpoints, self.verify_checksums = accelerator, config, checkpoints, verify_checksums
        self.fp16 = scaler_skips_overflows(accelerator)
        self.in_a_row = 0
        self.note = (
            "counted; DeepSpeed already stepped, a rollback undoes it"
            if accelerator.distributed_type == DistributedType.DEEPSPEED and deferrable(accelerator)
            else "optimizer step skipped"
        )

    def flag(self, loss: torch.Tensor, grad_norm) -> torch.Tensor:
        """This rank's flag for StepConsensus."""
        return nonfinite(loss, None if self.fp16 else grad_norm)

    def record(self, skipped: bool, state) -> bool:
        """After the agreement on the step being taken (state.step + 1): counts it; returns whether the optimizer steps."""
        self.in_a_row = self.in_a_row + 1 if skipped else 0
        if skipped:
            state.skipped_steps += 1
            say(self.accelerator.is_main_process, f"health: non-finite loss or gradients at step {state.step + 1}: {self.note}")
        return not skipped or self.fp16

    @property
    def clean(self) -> bool:
        """No non-finite step since the last finite one: a scheduled save may go ahead (a rollback target stays clean)."""
        return self.in_a_row == 0

    def must_act(self) -> bool:
        return self.in_a_row >= self.config.max_bad_steps

    def act(self, state, cursor: DataCursor | MixtureCursor, relaxed: Callable[[], Any] = contextlib.nullcontext) -> dict[str, Any]:
        """Stop (on_bad_steps=stop), or roll back: the newest checkpoint's weights, optimizer and counters, but the data
        cursor stays where it is, so the batches since that checkpoint (the offending ones among them) are skipped.
        Returns the manifest rolled back to."""
        c = self.config
        if c.on_bad_steps == "stop":
            raise HealthError(f"{self.in_a_row} non-finite steps in a row at step {state.step} (on_bad_steps=stop)")
        if state.rollbacks >= c.max_rollbacks:
            raise HealthError(f"non-finite steps again after {state.rollbacks} rollbacks (max_rollbacks={c.max_rollbacks})")
        bad_step, position = state.step, repr(cursor)
        with relaxed():
            self.checkpoints.wait()
            path, manifest = self.checkpoints.resume("auto", checksums=self.verify_checksums)
        if path is None:
            raise HealthError(f"{c.max_bad_steps} non-finite steps in a row at step {bad_step} and no checkpoint to roll back to")
        state.load_state_dict({**manifest, "skipped_steps": state.skipped_steps, "rollbacks": state.rollbacks + 1})
        saved = copy.deepcopy(cursor)  # the cursor's own kind (one source or a mixture) at the checkpoint's position
        saved.load_state_dict(manifest["cursor"])
        say(
            self.accelerator.is_main_process,
            f"health: {c.max_bad_steps} non-finite steps in a row at step {bad_step}: rolled back to {path.name}; "
            f"the data from {saved} to {position} is skipped",
        )
        self.in_a_row = 0
        return manifest
