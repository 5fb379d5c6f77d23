"""Fault injection for the tests: hooks the Trainer calls at a few points, inert unless a test sets an environment variable.

The launch tests start real recipes, so the faults travel in the environment:

- `INFRA_TEST_FAULTS` holds JSON such as `{"rank": 1, "nan_batches": [5, 11], "slow_seconds": 0.2,
  "hang_at_step": 6, "die_at_step": 7}`. `nan_batches` poison the loss at those global micro-batches since
  the run began (a property of the data position, so a rollback that moves past them does not meet them
  again; wherever they are computed: infra.replay's second opinion too); `"spike_batches": {"batches": [25],
  "by": 1000.0}` multiply it (the data's spike, not a machine's); the others act on `rank` only: a slower forward
  pass, a rank that stops forever at a step, or one that dies at a step (in the first incarnation of the group only,
  so that an elastic restart gets past it).
  `"slow_per_sample": [seconds, first, last]`: a forward pass slower by `seconds` a sample of its micro-batch, from
  micro-batch `first` through `last` since the run began (a slow process, whose time grows with its share).
  `"slow_steps": [[seconds, first, last], ...]`: the same by steps, `first` through `last` (the step after the last one
  this process ended: a replica group numbers its micro-batches by step, whatever its share).
  `"slow_reads": [[seconds, first, last], ...]`: its loader's reads slower by `seconds` a sample while the loop is at
  steps `first` through `last` (a slow disk: the wait for data grows with the share; a thread that reads ahead, infra.data.ahead,
  is slowed in its place).
  `"flip": {"steps": [7], "what": "weights", "bit": 20}`: one bit of the first element of the first parameter
  (`weights`, after the update), of its first optimizer moment (`optimizer`, after the update) or of its gradient
  (`gradient`: summed across processes, before clipping) flipped, at each of those steps once in the process's life (a
  transient fault, as a flipped bit in memory is: a step trained or computed again is not hit again).
  `"scale_loss": {"steps": [12], "by": 1000.0}`: the loss of the process's first micro-batch of each of those steps
  multiplied, once in its life (a core that miscomputes its forward pass once); with `"every": true` at each attempt
  at the step (a machine that computes that micro-batch wrong every time; another process computing it is not hit).
- `INFRA_TEST_PAUSE_IN_SAVE`: seconds to pause after save_state and before the commit, so a test can kill a
  save midway.
- `INFRA_TEST_DUMP_GRADS`: a folder where rank 0 writes `step1.pt` before the first optimizer step: the gradient
  norm, and the whole gradients (DDP, one process; FSDP2's gathered; none under DeepSpeed, whose gradients are ZeRO's partitions by then).
  Rank 0 also writes `{saved,resumed}_{step}_ws{world size}.pt` there after each save and resume: the whole Adam
  moments of every parameter (gathered from ZeRO's or FSDP's shards).

Production runs get `Hooks()`, whose methods do nothing.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from infra.distributed import local
from infra.hooks import Hooks

FAULTS_ENV = "INFRA_TEST_FAULTS"
PAUSE_ENV = "INFRA_TEST_PAUSE_IN_SAVE"
GRADS_ENV = "INFRA_TEST_DUMP_GRADS"


class Faults(Hooks):
    def __init__(self, rank: int, spec: dict, pause_in_save: float = 0.0, grads_dir: str = ""):
        self.rank, self.grads_dir = rank, grads_dir
        active = spec.get("rank", 1) in (rank, "all")
        self.nan_batches = set(spec.get("nan_batches", [])) if active else set()
        spike = dict(spec.get("spike_batches", {})) if active else {}
        self.spike_batches, self.spike_by = set(spike.get("batches", [])), float(spike.get("by", 1000.0))
        self.slow_seconds = float(spec.get("slow_seconds", 0)) if active else 0.0
        self.slow_per_sample = tuple(spec.get("slow_per_sample", (0.0, 0, 0))) if active else (0.0, 0, 0)
        self.slow_steps = [tuple(phase) for phase in spec.get("slow_steps", [])] if active else []
        self.slow_reads = [tuple(phase) for phase in spec.get("slow_reads", [])] if active else []
        self.flip = dict(spec.get("flip", {})) if active else {}
        self.flipped: set[int] = set()  # the steps flipped already
        self.scale_loss = dict(spec.get("scale_loss", {})) if active else {}
        self.scaled: dict[int, int] = {}  # the steps whose loss was scaled already: the micro-batch scaled
        self.step = 0  # the last step ended in this process
        self.hang_at_step = spec.get("hang_at_step") if active else None
        # only in the first incarnation of the group: torch elastic counts its restarts
        first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        self.die_at_step = spec.get("die_at_step") if active and first else None
        self.pause_in_save = pause_in_save

    def on_loss(self, loss: torch.Tensor, batch: int, samples: int) -> torch.Tensor:
        if self.slow_seconds:
            time.sleep(self.slow_seconds)
        seconds, first, last = self.slow_per_sample
        if seconds and first <= batch <= last:
            time.sleep(seconds * samples)
        for seconds, first, last in self.slow_steps:
            if first <= self.step + 1 <= last:
                time.sleep(seconds * samples)
        step = self.step + 1
        every = self.scale_loss.get("every", False)  # a machine wrong every time: each attempt at the step
        if step in self.scale_loss.get("steps", []) and (step not in self.scaled or (every and self.scaled[step] == batch)):
            self.scaled.setdefault(step, batch)
            by = float(self.scale_loss.get("by", 1000.0))
            print(f"test fault: rank {self.rank} scaled its loss by {by:g} at step {step}", flush=True)
            loss = loss * by
        return loss * self.in_data(batch)

    def in_data(self, batch: int) -> float:
        if batch in self.nan_batches:
            return float("nan")
        return self.spike_by if batch in self.spike_batches else 1.0

    def on_read(self, samples: int) -> None:
        for seconds, first, last in self.slow_reads:
            if first <= self.step + 1 <= last:
                time.sleep(seconds * samples)

    def on_step_end(self, step: int) -> None:
        self.step = step
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

    def flip_bit(self, step: int, what: str, model: torch.nn.Module, optimizer=None) -> None:
        """The fault `flip` asks for at `step` (what: weights, optimizer, gradient), once."""
        if self.flip.get("what", "weights") != what or step not in self.flip.get("steps", []) or step in self.flipped:
            return
        self.flipped.add(step)
        inner = getattr(model, "module", model)
        p = next(p for p in inner.parameters() if p.requires_grad)
        tensor = {"weights": p.data, "gradient": p.grad, "optimizer": optimizer.state[p]["exp_avg"] if optimizer else None}[what]
        tensor = local(tensor)  # FSDP2: this process's own slice
        width = {2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
        bit = min(int(self.flip.get("bit", 20)), 8 * tensor.element_size() - 2)
        tensor.view(width).view(-1)[:1].bitwise_xor_(1 << bit)
        print(f"test fault: rank {self.rank} flipped bit {bit} of its {what} at step {step}", flush=True)

    def on_update(self, step: int, model: torch.nn.Module, optimizer) -> None:
        self.flip_bit(step, "weights", model)
        self.flip_bit(step, "optimizer", model, optimizer)

    def on_gradients(self, step: int, model: torch.nn.Module) -> None:
        self.flip_bit(step, "gradient", model)

    def before_optimizer_step(self, step: int, model: torch.nn.Module, grad_norm) -> None:
        if not self.grads_dir or step != 1:
            return
        from torch.distributed.tensor import DTensor

        inner = getattr(model, "module", model)  # DDP's wrapped model: parameter names as the model has them
        grads = {}
        for name, p in inner.named_parameters():
            if p.grad is not None:  # FSDP2's are sharded: gathered, a collective every rank joins
                grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                grads[name] = grad.detach().float().cpu().clone()
        if self.rank == 0:
            norm = None if grad_norm is None else float(grad_norm)
            torch.save({"grad_norm": norm, "grads": grads}, Path(self.grads_dir) / "step1.pt")

    def on_state(self, event: str, step: int, model: torch.nn.Module, optimizer) -> None:
        if not self.grads_dir:
            return
        state = full_state(model, optimizer)
        groups = [{key: group[key] for key in HYPERPARAMETERS} for group in optimizer.param_groups]
        if self.rank == 0:
            world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
            torch.save({"state": state, "groups": groups}, Path(self.grads_dir) / f"{event}_{step}_ws{world}.pt")


HYPERPARAMETERS = ("lr", "weight_decay", "betas", "eps")  # each optimizer parameter group's, dumped by on_state


def full_state(model: torch.nn.Module, optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """Each parameter's fp32 weights and Adam moments, whole, under any engine (a collective under ZeRO and FSDP: every
    rank calls it)."""
    from torch.distributed.tensor import DTensor

    if hasattr(model, "zero_optimization_stage") and model.zero_optimization_stage() in (1, 2):
        return zero12_state(model)
    inner = getattr(model, "module", model)
    out = {}
    for name, p in inner.named_parameters():
        out[name] = {}
        for key in STATE:
            if hasattr(model, "zero_optimization_stage"):  # ZeRO-3
                from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

                value = safe_get_full_fp32_param(p) if key == "fp32" else safe_get_full_optimizer_state(p, key)
            else:
                value = p if key == "fp32" else optimizer.optimizer.state[p][key]
                value = value.full_tensor() if isinstance(value, DTensor) else value
            out[name][key] = value.detach().float().cpu().clone()
    return out


STATE = ("fp32", "exp_avg", "exp_avg_sq")


def zero12_state(engine) -> dict[str, dict[str, torch.Tensor]]:
    """ZeRO-1/2: each rank's fragment of each parameter (its place in the rank's flat partition, from the optimizer's
    `param_slice_mappings`), gathered and put end to end in rank order."""
    sd = engine.optimizer.state_dict()
    mine = {}
    for group, mapping in enumerate(sd["param_slice_mappings"]):
        state = {**sd["base_optimizer_state"]["state"][group], "fp32": sd["single_partition_of_fp32_groups"][group]}
        for name, fragment in mapping.items():
            mine[name] = {key: state[key].narrow(0, fragment.start, fragment.numel).float().cpu() for key in STATE}
    ranks = [None] * torch.distributed.get_world_size() if torch.distributed.is_initialized() else [mine]
    if torch.distributed.is_initialized():
        torch.distributed.all_gather_object(ranks, mine)
    shapes = {name: p.shape for name, p in engine.module.named_parameters()}
    return {
        name: {key: torch.cat([r[name][key] for r in ranks if name in r]).reshape(shape) for key in STATE} for name, shape in shapes.items()
    }


def hooks_from_env(rank: int) -> Hooks:
    """Faults when a test asked for them in the environment, else the inert Hooks()."""
    spec = os.environ.get(FAULTS_ENV, "")
    pause = float(os.environ.get(PAUSE_ENV, 0) or 0)
    grads_dir = os.environ.get(GRADS_ENV, "")
    if not spec and not pause and not grads_dir:
        return Hooks()
    return Faults(rank, json.loads(spec or "{}"), pause, grads_dir)
