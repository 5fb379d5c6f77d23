"""LoRA (peft) for the fine-tuning recipes: low-rank adapters on the pretrained model's linear layers, checkpoints that
hold only what trains, and an export merged into the base model (or the adapter alone).

    model = with_lora(model, model_args, "CAUSAL_LM")     # a recipe's ModelArguments inherit LoraArguments

A checkpoint of an adapted model holds the adapter (and any head peft trains whole, a classifier's), and the optimizer
state of those parameters only: the frozen base is read again from `model_name_or_path` on a resume, so that folder
must not change during a run. Under DDP or one process; ZeRO and FSDP are refused for now.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from infra.config import require
from infra.errors import ModelError, raised_as

EXPORTS = ("merged", "adapter")


@dataclass
class LoraArguments:
    """LoRA fields of a fine-tuning recipe's ModelArguments (the names TRL uses)."""

    use_peft: bool = field(default=False, metadata={"help": "Train LoRA adapters (peft) instead of every weight of the pretrained model."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA scale numerator: the update is scaled by lora_alpha / lora_r."})
    lora_dropout: float = field(default=0.05, metadata={"help": "Dropout on the LoRA branch's input."})
    lora_target_modules: str = field(
        default="all-linear",
        metadata={"help": "Modules that get adapters: all-linear (every linear layer but the output head), or names, comma-separated."},
    )
    lora_export: str = field(
        default="merged",
        metadata={"help": "What final/ holds: merged (the adapter folded into the base, loads with from_pretrained) or adapter (alone)."},
    )

    def __post_init__(self):
        require(self.lora_r >= 1, "lora_r", self.lora_r, "an integer >= 1")
        require(self.lora_alpha > 0, "lora_alpha", self.lora_alpha, "a number > 0")
        require(0 <= self.lora_dropout < 1, "lora_dropout", self.lora_dropout, "a number in [0, 1)")
        require(self.lora_export in EXPORTS, "lora_export", self.lora_export, f"one of {', '.join(EXPORTS)}")
        require(bool(self.lora_target_modules.strip()), "lora_target_modules", self.lora_target_modules, "all-linear or module names")


def with_lora(model: torch.nn.Module, args: LoraArguments, task_type: str) -> torch.nn.Module:
    """`model` with LoRA adapters (peft's task_type: CAUSAL_LM, SEQ_CLS, ...), or `model` itself without use_peft.
    A ModelError names target modules that match nothing."""
    if not args.use_peft:
        return model
    from peft import LoraConfig, get_peft_model

    targets = args.lora_target_modules.strip()
    config = LoraConfig(
        task_type=task_type,
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=targets if targets == "all-linear" else [name.strip() for name in targets.split(",")],
    )
    with raised_as(ModelError, ValueError):  # peft's: target modules the model does not have
        return get_peft_model(model, config)


def is_adapted(model: torch.nn.Module) -> bool:
    """A peft model (peft is imported only by those who made one)."""
    return "peft" in sys.modules and isinstance(model, sys.modules["peft"].PeftModel)


def check_engine(accelerator: Accelerator, model: torch.nn.Module) -> str | None:
    """Why an adapted model cannot train under this engine, or None."""
    if is_adapted(model) and accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP):
        return f"use_peft runs under DDP or one process here, not {accelerator.distributed_type.value}: use cpu.yaml or ddp.yaml"
    return None
