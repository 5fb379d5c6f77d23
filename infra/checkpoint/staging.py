"""Background saves (`async_save`): the state copied to CPU memory at the step, written while training goes on.

`stage()` runs in the training thread: every rank's RNG state goes to the checkpoint folder at once,
and rank 0 copies what `save_state` would write (model, optimizer, scheduler) to CPU buffers. `write()`
then writes those copies from the manager's thread: the files are those of a synchronous save.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from accelerate import Accelerator


class _Frozen:
    """Stands in for an optimizer or scheduler whose state was copied: `state_dict()` returns the copy."""

    def __init__(self, state: dict):
        self._state = state

    def state_dict(self) -> dict:
        return self._state


class CpuStaging:
    """CPU copies of the state, in buffers kept from one background save to the next (on rank 0)."""

    def __init__(self):
        self._buffers: dict[tuple, torch.Tensor] = {}

    def stage(self, accelerator: Accelerator, work: Path):
        """This rank's RNG state to `work` now; on rank 0, CPU copies of what save_state would write."""
        from accelerate.checkpointing import save_accelerator_state

        acc = accelerator
        rng = work / f".rng{acc.process_index}"
        rng.mkdir(parents=True)
        save_accelerator_state(str(rng), [], [], [], [], acc.process_index, acc.step, acc.scaler)  # writes only RNG files
        for f in rng.iterdir():
            os.replace(f, work / f.name)
        rng.rmdir()
        if not acc.is_main_process:
            return None
        # One CPU buffer per tensor view, so tied weights stay tied. The buffers of the previous save
        # are reused (its writer has finished): allocating and first touching 1.3 GB of fresh memory
        # costs more than the copy itself. So rank 0 holds one CPU copy of the state while async_save
        # is on. Pinned for GPU tensors, for an asynchronous device-to-host copy.
        previous, copies = self._buffers, {}
        on_gpu = False

        def to_cpu(value):
            nonlocal on_gpu
            if isinstance(value, torch.Tensor):
                key = (
                    value.device,
                    value.untyped_storage().data_ptr(),
                    value.storage_offset(),
                    value.stride(),
                    tuple(value.shape),
                    value.dtype,
                )
                if key not in copies:
                    buffer = previous.pop(key, None)
                    if buffer is None:
                        buffer = torch.empty(value.shape, dtype=value.dtype, pin_memory=value.is_cuda)
                    copies[key] = buffer.copy_(value.detach(), non_blocking=value.is_cuda)
                    on_gpu |= value.is_cuda
                return copies[key]
            if isinstance(value, dict):  # keeps OrderedDict: accelerate de-duplicates tied weights only in one
                return type(value)((k, to_cpu(v)) for k, v in value.items())
            if isinstance(value, list | tuple):
                return type(value)(to_cpu(v) for v in value)
            return value

        weights = [acc.get_state_dict(m, unwrap=False) for m in acc._models]
        for hook in acc._save_model_state_pre_hook.values():  # as save_state runs them (infra.checkpoint.trainable's)
            hook(acc._models, weights, str(work))
        weights = [to_cpu(w) for w in weights]
        optimizers = [_Frozen(to_cpu(o.state_dict())) for o in acc._optimizers]
        schedulers = [_Frozen(to_cpu(s.state_dict())) for s in acc._schedulers]
        if on_gpu:
            torch.cuda.synchronize()  # the non-blocking copies have landed before training changes the source
        self._buffers = copies
        return weights, optimizers, schedulers

    @staticmethod
    def write(accelerator: Accelerator, work: Path, staged) -> None:
        """What save_state would have written at the step, from the staged copies (rank 0, in a thread)."""
        from accelerate.checkpointing import RNG_STATE_NAME, save_accelerator_state

        acc = accelerator
        weights, optimizers, schedulers = staged
        rng = work / f"{RNG_STATE_NAME}_{acc.process_index}.pkl"
        kept = rng.read_bytes()  # save_accelerator_state writes the RNG as it is now: put back the staged one
        save_accelerator_state(str(work), weights, optimizers, schedulers, [], acc.process_index, acc.step, None)
        rng.write_bytes(kept)
