"""DeepSpeed ZeRO's optimizer step taken by the loop, after the step is judged, as under every other engine.

accelerate's `DeepSpeedEngineWrapper.backward` runs the engine's `step()` inside the last micro-batch's backward: by the
time the loop knows the step's loss and gradient norm, the weights have moved. Here the last backward only reduces the
gradients (the engine told it is the accumulation boundary, as accelerate does) and the step waits for the loop:

    defer_zero_step(accelerator, optimizer)   after prepare (DeepSpeed with ZeRO 1-3): the engine's wrapper and the
                                              optimizer's replaced; returns the optimizer the loop holds
    accelerator.backward(loss)                the engine's backward, gradients reduced at the boundary, no step
    accelerator.clip_grad_norm_(...)          the reduced gradients' global norm, before the step (ZeRO's own sum,
                                              the one its step clips with)
    optimizer.step()                          the engine's step: clip, update, zero the gradients (the step agreed on)
    optimizer.zero_grad()                     a step not taken (non-finite, or computed again: infra.replay): the
                                              reduced gradients dropped as ZeRO drops an fp16 overflow's, the weights
                                              and optimizer state untouched, the next backward writes afresh

So the non-finite guard skips a step under ZeRO as under DDP, and a suspicious step is computed again from the state
before it. The engine's counters (its global_steps) count steps taken. Not for DeepSpeed without ZeRO (stage 0), whose
optimizer is the plain one's: `deferrable` says why.
"""

from __future__ import annotations

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from accelerate.utils.deepspeed import DeepSpeedEngineWrapper, DeepSpeedOptimizerWrapper

from infra.environment import zero_stage


def deferrable(accelerator: Accelerator) -> str | None:
    """Why the step of this DeepSpeed run cannot wait for the loop (None: it can, or it is not DeepSpeed)."""
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return None
    if zero_stage(accelerator) not in (1, 2, 3):
        return f"DeepSpeed without ZeRO (zero_stage {zero_stage(accelerator)}), whose engine steps inside the backward pass"
    return None


def scaler_skips_overflows(accelerator: Accelerator) -> bool:
    """fp16: a loss scaler skips a step whose gradients overflowed, and lowers its scale, by itself (accelerate's, or
    DeepSpeed's own, inside the engine's step): such a step must still reach the optimizer's step, and its infinite
    gradient norm is no fault."""
    deepspeed_fp16 = accelerator.distributed_type == DistributedType.DEEPSPEED and accelerator.mixed_precision == "fp16"
    return accelerator.scaler is not None or deepspeed_fp16


class DeferredStep(DeepSpeedEngineWrapper):
    """accelerate's DeepSpeedEngineWrapper with the step left to the loop: backward reduces, `step` steps, `drop`
    forgets the reduced gradients (see the module's doc)."""

    def __init__(self, engine, stage: int):
        super().__init__(engine)
        self.stage = stage  # ZeRO's: 3 keeps its gradients in other buffers than 1 and 2
        self.pending = False  # a boundary's reduced gradients not yet stepped or dropped

    def backward(self, loss: torch.Tensor, sync_gradients: bool = True, **kwargs) -> None:
        self.engine.set_gradient_accumulation_boundary(is_boundary=sync_gradients)
        self.engine.backward(loss, **kwargs)
        self.pending = self.pending or sync_gradients

    def get_global_grad_norm(self) -> torch.Tensor:
        """The reduced gradients' global norm before the step (ZeRO's sum over every process's partition)."""
        optimizer = self.engine.optimizer
        if self.stage == 3:
            from deepspeed.runtime.utils import combine_grad_norm_groups

            norm = combine_grad_norm_groups(optimizer._get_norm_groups())
        else:
            norm = optimizer.scaled_global_norm()
        norm = torch.as_tensor(norm, dtype=torch.float32)
        # ZeRO's norm helpers give -1 for a non-finite norm (an fp16 overflow, which its step then skips)
        return torch.where(norm < 0, torch.inf, norm) / optimizer.loss_scale

    def step(self) -> None:
        self.engine.step()
        self.pending = False

    def drop(self) -> None:
        """The reduced gradients forgotten without a step: what ZeRO's step does on an fp16 overflow."""
        optimizer = self.engine.optimizer
        if self.stage == 3:
            optimizer.zero_grad(set_to_none=True)  # its micro-step back to 0: the next backward copies, not adds
            optimizer._overflow_clean_up(optimizer.loss_scale)
            for bucket in optimizer.ipg_buckets.values():
                bucket.clear_params()
        else:
            from deepspeed.runtime.zero.stage_1_and_2 import INITIAL_MICRO_STEP_ID

            optimizer.zero_grad(set_to_none=True)
            optimizer._release_preflattened_grad_buffers()
            if optimizer.cpu_offload:
                optimizer.reset_cpu_buffers()
            else:
                for group in optimizer.averaged_gradients:
                    optimizer.averaged_gradients[group] = None
                    optimizer.all_grad_tensors[group] = None
            optimizer.micro_step_id = INITIAL_MICRO_STEP_ID
        self.pending = False


class DeferredOptimizer(DeepSpeedOptimizerWrapper):
    """The optimizer the loop holds under ZeRO: `step` is the engine's, `zero_grad` drops a step not taken."""

    def __init__(self, optimizer, deferred: DeferredStep):
        super().__init__(optimizer)
        self.deferred = deferred

    def step(self, closure=None) -> None:
        self.deferred.step()

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        if self.deferred.pending:
            self.deferred.drop()


def defer_zero_step(accelerator: Accelerator, optimizer):
    """Under DeepSpeed with ZeRO: the engine's step left to the loop (the module's doc); the optimizer to hold in place
    of `optimizer` (accelerate's, which it replaces in the accelerator's list too). Else `optimizer`, unchanged."""
    if accelerator.distributed_type != DistributedType.DEEPSPEED or deferrable(accelerator):
        return optimizer
    deferred = DeferredStep(accelerator.deepspeed_engine_wrapped.engine, zero_stage(accelerator))
    accelerator.deepspeed_engine_wrapped = deferred
    held = DeferredOptimizer(optimizer.optimizer, deferred)
    accelerator._optimizers = [held if o is optimizer else o for o in accelerator._optimizers]
    return held
