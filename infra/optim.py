"""The optimizer and its learning-rate schedule: AdamW; a linear warmup, then cosine decay (default), linear decay,
constant, or warmup-stable-decay (transformers' schedulers)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
from transformers import (
    get_constant_schedule_with_warmup,
    get_cosine_with_min_lr_schedule_with_warmup,
    get_linear_schedule_with_warmup,
    get_wsd_schedule,
)

from infra.config import require


@dataclass
class OptimizerConfig:
    """Optimizer flags (part of TrainingArguments)."""

    _argument_group_name = "optimizer and schedule"  # its heading in --help

    learning_rate: float = field(default=1e-3, metadata={"help": "Peak learning rate after warmup."})
    warmup_steps: int = field(default=20, metadata={"help": "Linear warmup steps before the cosine decay."})
    min_lr_ratio: float = field(default=0.1, metadata={"help": "Cosine decay floor, as a fraction of learning_rate."})
    weight_decay: float = field(default=0.1, metadata={"help": "AdamW weight decay (not applied to norms and biases)."})
    adam_beta1: float = field(default=0.9, metadata={"help": "AdamW beta1."})
    adam_beta2: float = field(default=0.95, metadata={"help": "AdamW beta2."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Gradient clipping norm (0 disables clipping)."})
    lr_scheduler_type: Literal["cosine", "linear", "constant_with_warmup", "warmup_stable_decay"] = field(
        default="cosine",
        metadata={
            "help": "cosine: warmup from 0, cosine decay to min_lr_ratio at max_steps. linear: warmup from 0, linear decay to 0 "
            "at max_steps. constant_with_warmup. warmup_stable_decay: warmup from min_lr_ratio, constant, then a linear "
            "decay to min_lr_ratio over the last decay_ratio of max_steps (transformers' schedulers)."
        },
    )
    decay_ratio: float = field(default=0.1, metadata={"help": "warmup_stable_decay: the fraction of max_steps spent decaying."})

    def __post_init__(self):
        require(self.learning_rate > 0, "learning_rate", self.learning_rate, "a number > 0")
        require(self.warmup_steps >= 0, "warmup_steps", self.warmup_steps, "an integer >= 0")
        require(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", self.min_lr_ratio, "a number in [0, 1]")
        require(self.max_grad_norm >= 0, "max_grad_norm", self.max_grad_norm, "a number >= 0")
        require(0 < self.decay_ratio <= 1, "decay_ratio", self.decay_ratio, "a number in (0, 1]")


def is_matrix(p: torch.Tensor) -> bool:
    """A weight matrix (decayed), by its shape as the model made it: a ZeRO-3 parameter made under `zero.Init` holds an
    empty 1-d partition, its shape in `ds_shape`."""
    return len(getattr(p, "ds_shape", p.shape)) >= 2


def parameter_groups(model: torch.nn.Module) -> tuple[list[tuple[str, torch.nn.Parameter]], ...]:
    """The optimizer's groups, named: the trainable matrices (decayed), then the other trainable parameters. Their
    order is each parameter's index in the optimizer's state dict (infra.checkpoint.engines reads it so)."""
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    return [(n, p) for n, p in trainable if is_matrix(p)], [(n, p) for n, p in trainable if not is_matrix(p)]


def build_optimizer(model: torch.nn.Module, config: OptimizerConfig) -> torch.optim.AdamW:
    """AdamW; no weight decay on vectors (norms, biases). torch's fused kernel where it has one for the parameters'
    device (CPU, CUDA), as the Trainer's default `adamw_torch_fused`: one pass over each tensor, about 5x faster on a
    CPU than the multi-tensor one (benchmarks/levers.py)."""
    decay, no_decay = ([p for _, p in group] for group in parameter_groups(model))
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in decay + no_decay)
    return torch.optim.AdamW(groups, lr=config.learning_rate, betas=(config.adam_beta1, config.adam_beta2), fused=fused or None)


def build_scheduler(optimizer, config: OptimizerConfig, max_steps: int):
    """The learning-rate schedule over `max_steps`. Built on the prepared optimizer: ZeRO-3 regroups parameters, and a
    schedule made before `prepare` would no longer match. Its state (the step) is saved with every checkpoint."""
    warmup, kind = config.warmup_steps, config.lr_scheduler_type
    if kind == "cosine":
        return get_cosine_with_min_lr_schedule_with_warmup(optimizer, warmup, max_steps, min_lr_rate=config.min_lr_ratio)
    if kind == "constant_with_warmup":
        return get_constant_schedule_with_warmup(optimizer, warmup)
    if kind == "linear":
        return get_linear_schedule_with_warmup(optimizer, warmup, max_steps)
    decay = max(1, round(config.decay_ratio * max_steps))  # warmup_stable_decay
    stable = max_steps - warmup - decay
    return get_wsd_schedule(optimizer, warmup, decay, num_stable_steps=stable, decay_type="linear", min_lr_ratio=config.min_lr_ratio)
