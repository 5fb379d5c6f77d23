"""What a recipe hands to the Trainer (`Job`), what its loss returns (`LossOutput`), and the frozen models it may use
beside the one it trains (`Companion`).

    reference = Companion(AutoModelForCausalLM.from_pretrained(path), source=path)
    def loss(model, batch, num_items_in_batch, per_sample=False) -> LossOutput:
        ...reference.model(...)...                       # prepared for the engine by the Trainer
        return LossOutput(total, metrics={"rewards/margins": margins.sum()})
    Job("dpo_clm", model, data, loss=loss, companions={"reference": reference}, ...)

A new recipe with a second model is then one recipe file and its config: the Trainer places the companion as the
engine needs (infra.companions), keeps it out of checkpoints (it is rebuilt from `source` at resume; the manifest
records which), counts it in the memory estimate, and logs the loss's `metrics` beside train/loss.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from infra.data import Data

if TYPE_CHECKING:
    from accelerate import Accelerator


Batch = torch.Tensor | dict[str, torch.Tensor]


@dataclass
class LossOutput:
    """The loss of one micro-batch, the same shape for every recipe and flag.

    loss        summed over the micro-batch's items and divided by the Trainer's `num_items_in_batch` (the gradient of
                the step is then that of the mean loss per item over every micro-batch of every rank)
    per_sample  each sample's summed loss and its items, when the Trainer asks (`per_sample=True`: a data_mixture's loss
                per source, train/loss/<name>); None otherwise
    metrics     the recipe's own training metrics, each a 0-dim tensor summed over the micro-batch's samples (no
                gradient needed): logged as train/<name>, their mean per sample over the logging window and every rank,
                from the steps that were taken (a skipped step's are dropped, as its loss is)
    """

    loss: torch.Tensor
    per_sample: tuple[torch.Tensor, torch.Tensor] | None = None
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class Companion:
    """A frozen model a recipe uses beside the one it trains: DPO's reference, a reward or a teacher model. The Trainer
    replaces `model` with the one prepared for the engine before the first step (the recipe's loss reads it from here)."""

    model: torch.nn.Module
    source: str  # what it was loaded from, and is loaded from again at a resume: recorded in every checkpoint's manifest


@dataclass
class Job:
    """What a recipe hands to the Trainer: its model and data, and the few things only it knows."""

    name: str  # the recipe: MLflow experiment (unless set), tags, model card
    model: torch.nn.Module  # not prepared yet: the Trainer builds the optimizer, schedule and loader, then prepares
    data: Data
    # `loss(model, batch, num_items_in_batch, per_sample=False) -> LossOutput` of one micro-batch (see LossOutput)
    loss: Callable[..., LossOutput]
    processor: Any  # tokenizer or image processor, exported next to the weights
    task: str  # MLflow transformers task of the export: text-generation, text-classification, image-classification
    evaluate: Callable[[Accelerator, torch.nn.Module, Iterable[Batch]], dict[str, float]] | None = None
    unit: str = "tokens"  # what throughput counts: perf/{unit}_per_second, train/{unit}_seen
    units_per_sample: int = 1
    flops_per_unit: float | None = None  # training FLOPs per unit, for perf/mfu on known GPUs
    items: Callable[[Batch], torch.Tensor] | None = None  # what `loss` sums over in a micro-batch (tokens, say); None: samples
    adapter_only: bool = False  # a LoRA model's export: the adapter alone, not merged into the base (infra.lora)
    per_sample_losses: bool = False  # the loss gives LossOutput.per_sample when asked: a data_mixture logs each source's
    companions: dict[str, Companion] = field(default_factory=dict)  # frozen models beside `model` (infra.companions)
    # data made once the Trainer holds the output_dir's lock, in place of `data`, given the job's own folder to write in
    # (DPO's reference scores, infra.reference: a replica group's own, infra.replicas); `data` gives its shape until then
    prepare_data: Callable[[str], Data] | None = None


def attention_of(model: torch.nn.Module) -> str | None:
    """The attention kernel a transformers model runs with (None for a model without attention, a ResNet say)."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None)
