"""Points where a test acts on the training loop (infra.testing.Faults implements them); a normal run's do nothing.
Their own module: infra.testing builds them and infra.trainer calls them, with no import cycle between the two."""

from __future__ import annotations

import torch


class Hooks:
    """Points where a test acts on the loop (infra.testing.Faults); these do nothing."""

    def on_loss(self, loss: torch.Tensor, batch: int, samples: int) -> torch.Tensor:
        """The loss of the `batch`-th micro-batch since the run began (of `samples`), inside the timed forward pass."""
        return loss

    def in_data(self, batch: int) -> float:
        """What the data of the `batch`-th micro-batch since the run began does to its loss wherever it is computed,
        as a factor (a test's poisoned samples: NaN; also when another process computes them: infra.replay's second
        opinion)."""
        return 1.0

    def on_read(self, samples: int) -> None:
        """As this process's loader reads a batch of its share (`samples`): inside the loop's timed wait for data, or in
        the thread that reads ahead (infra.data.ahead)."""

    def on_step_end(self, step: int) -> None:
        """After optimizer step `step`, before the watchdog hears of it."""

    def before_commit(self, step: int) -> None:
        """Between a synchronous save_state and its commit."""

    def on_gradients(self, step: int, model: torch.nn.Module) -> None:
        """After the passes of `step` (its gradients summed across processes), before clipping; again if it is computed again."""

    def before_optimizer_step(self, step: int, model: torch.nn.Module, grad_norm) -> None:
        """After the backward passes and clipping of `step`, before the optimizer steps (DeepSpeed without ZeRO has stepped
        already)."""

    def on_update(self, step: int, model: torch.nn.Module, optimizer) -> None:
        """After the update of `step` (the optimizer stepped), on every rank."""

    def on_state(self, event: str, step: int, model: torch.nn.Module, optimizer) -> None:
        """On every rank, once the state of `step` is saved ("saved") or loaded ("resumed")."""
