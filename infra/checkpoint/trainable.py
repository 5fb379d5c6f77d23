"""Checkpoints of a model with frozen parameters (LoRA adapters on a pretrained base, say) hold the trainable ones only:
the frozen ones are what the recipe loads again on a resume. The optimizer state is of the trainable ones already.
"""

from __future__ import annotations

from pathlib import Path

import torch
from accelerate import Accelerator


def trainable_names(model: torch.nn.Module) -> set[str]:
    return {name for name, p in model.named_parameters() if p.requires_grad}


def has_frozen_parameters(accelerator: Accelerator) -> bool:
    return any(not p.requires_grad for model in accelerator._models for p in model.parameters())


def keep_trainable_only(accelerator: Accelerator) -> None:
    """Make `save_state` (and the background save, which runs the same hooks) write only the trainable parameters, and
    `load_state` refuse a file that holds others or lacks some (loaded with `load_state` below)."""

    def drop_frozen(models, weights, output_dir) -> None:
        for prepared, state in zip(models, weights, strict=True):
            keep = trainable_names(prepared)
            for name in [name for name in state if name not in keep]:
                del state[name]

    def check_saved(models, input_dir) -> None:
        from safetensors import safe_open

        for i, prepared in enumerate(models):
            with safe_open(str(Path(input_dir) / f"model{'' if i == 0 else f'_{i}'}.safetensors"), "pt") as f:
                saved = set(f.keys())
            if saved != (wanted := trainable_names(prepared)):
                raise ValueError(f"it holds {len(saved)} tensors, not the {len(wanted)} trainable ones of this model")

    accelerator.register_save_state_pre_hook(drop_frozen)
    accelerator.register_load_state_pre_hook(check_saved)


def load_state(accelerator: Accelerator, path: str | Path) -> None:
    """`accelerator.load_state`: strict, except for a model with frozen parameters, whose file holds the others only
    (and is checked by `keep_trainable_only`'s hook instead). Accelerate's micro-step counter starts again at 0: it
    restores the one saved, whose gradient accumulation may not be this launch's (another number of processes for the
    same global batch), and a counter that is not a multiple of this launch's accumulation moves every gradient sync to
    the wrong micro-batch and makes the optimizer skip every step (seen: a run of 3 processes resumed on 2 at step 10,
    its weights unchanged to its last step). Every load here is at a whole step."""
    if has_frozen_parameters(accelerator):  # DDP or one process (DeepSpeed's load takes no `strict`)
        accelerator.load_state(str(path), strict=False)
    else:
        accelerator.load_state(str(path))
    accelerator.step = 0
