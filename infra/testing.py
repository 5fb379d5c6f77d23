"""Fault injection for the tests: hooks the Trainer calls at a few points, inert unless a test sets an environment variable.

The launch tests start real recipes, so the faults travel in the environment:

- `INFRA_TEST_FAULTS` holds JSON such as `{"rank": 1, "nan_batches": [5, 11], "slow_seconds": 0.2,
  "hang_at_step": 6, "die_at_step": 7}`. `nan_batches` poison the loss at those global micro-batches since
  the run began (a property of the data position, so a rollback that moves past them does not meet them
  again); the others act on `rank` only: a slower forward pass, a rank that stops forever at a step, or one
  that dies at a step (in the first incarnation of the group only, so that an elastic restart gets past it).
- `INFRA_TEST_PAUSE_IN_SAVE`: seconds to pause after save_state and before the commit, so a test can kill a
  save midway.

Production runs get `Hooks()`, whose methods do nothing.
"""

from __future__ import annotations

import json
import os
import time

import torch

from infra.trainer import Hooks

FAULTS_ENV = "INFRA_TEST_FAULTS"
PAUSE_ENV = "INFRA_TEST_PAUSE_IN_SAVE"


class Faults(Hooks):
    def __init__(self, rank: int, spec: dict, pause_in_save: float = 0.0):
        active = spec.get("rank", 1) == rank
        self.nan_batches = set(spec.get("nan_batches", [])) if active else set()
        self.slow_seconds = float(spec.get("slow_seconds", 0)) if active else 0.0
        self.hang_at_step = spec.get("hang_at_step") if active else None
        # only in the first incarnation of the group: torch elastic counts its restarts
        first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        self.die_at_step = spec.get("die_at_step") if active and first else None
        self.pause_in_save = pause_in_save

    def on_loss(self, loss: torch.Tensor, batch: int) -> torch.Tensor:
        if self.slow_seconds:
            time.sleep(self.slow_seconds)
        return loss * float("nan") if batch in self.nan_batches else loss

    def on_step_end(self, step: int) -> None:
        if self.hang_at_step is not None and step == self.hang_at_step:
            print(f"test fault: rank stops at step {step}", flush=True)
            while True:
                time.sleep(3600)
        if self.die_at_step is not None and step == self.die_at_step:
            print(f"test fault: rank dies at step {step}", flush=True)
            os._exit(1)

    def before_commit(self, step: int) -> None:
        if self.pause_in_save:
            time.sleep(self.pause_in_save)


def hooks_from_env(rank: int) -> Hooks:
    """Faults when a test asked for them in the environment, else the inert Hooks()."""
    spec = os.environ.get(FAULTS_ENV, "")
    pause = float(os.environ.get(PAUSE_ENV, 0) or 0)
    if not spec and not pause:
        return Hooks()
    return Faults(rank, json.loads(spec or "{}"), pause)
