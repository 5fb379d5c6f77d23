"""Shared machinery for the training recipes: data, checkpoints, tracking, health.

What a recipe needs comes from here, in one import:

    from infra import DataArguments, Job, LossOutput, TrainingArguments, open_data, parse_config, run_recipe, start, train

Each name is imported from its module on first use (PEP 562), so `import infra.config` or `python -m infra.plan` does not
load torch, and no module of the package imports this one: the modules import each other directly, lower floors first.
"""

from __future__ import annotations

import importlib

PUBLIC = {
    # what a recipe hands to the Trainer, and what its loss returns
    "Batch": "infra.job",
    "Companion": "infra.job",
    "Job": "infra.job",
    "LossOutput": "infra.job",
    # the flags, parsed together from YAML and the command line
    "ConfigError": "infra.config",
    "DataArguments": "infra.data",
    "TrainingArguments": "infra.arguments",
    "check_data_and_training": "infra.arguments",
    "parse_config": "infra.config",
    "require": "infra.config",
    "resolved": "infra.config",
    # the recipe's data, model and launch
    "AttentionArguments": "infra.recipe",
    "Data": "infra.data",
    "DataError": "infra.data",
    "ModelError": "infra.errors",
    "causal_lm_flops": "infra.recipe",
    "class_losses": "infra.recipe",
    "load_pretrained": "infra.recipe",
    "open_data": "infra.recipe",
    "predicted_tokens": "infra.recipe",
    "run_recipe": "infra.recipe",
    "start": "infra.recipe",
    "token_losses": "infra.recipe",
    "LoraArguments": "infra.lora",
    "is_adapted": "infra.lora",
    "with_lora": "infra.lora",
    "evaluate_classifier": "infra.metrics",
    # the run
    "Trainer": "infra.trainer",
    "train": "infra.run",
}

__all__ = sorted(PUBLIC)


def __getattr__(name: str):
    if name not in PUBLIC:
        raise AttributeError(f"module 'infra' has no attribute {name!r}")
    value = getattr(importlib.import_module(PUBLIC[name]), name)
    globals()[name] = value  # once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(PUBLIC))
