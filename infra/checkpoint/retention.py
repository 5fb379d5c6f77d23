"""Which checkpoints are kept: the one retention policy, used both to prune and to size the disk before training.

A new retention rule is a field of `RetentionConfig` (a command-line flag and a YAML key by that) and a
few lines in `RetentionPolicy.keep` and `RetentionPolicy.most_kept`, tested in tests/test_checkpoint.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infra.config import require


@dataclass
class RetentionConfig:
    """Retention flags (part of TrainingArguments)."""

    _argument_group_name = "checkpoints: what to keep"  # its heading in --help

    save_total_limit: int | None = field(default=2, metadata={"help": "Keep the newest N checkpoints (None keeps all)."})
    keep_best: int = field(default=0, metadata={"help": "Also keep the best N checkpoints by metric_for_best_model (0: off)."})
    metric_for_best_model: str = field(default="train/loss", metadata={"help": "Logged metric that ranks checkpoints for keep_best."})
    greater_is_better: bool = field(default=False, metadata={"help": "Whether a larger metric_for_best_model is better."})
    save_milestone_steps: int = field(default=0, metadata={"help": "Keep every checkpoint whose step is a multiple of N forever (0: off)."})

    def __post_init__(self):
        for name in ("keep_best", "save_milestone_steps"):
            require(getattr(self, name) >= 0, name, getattr(self, name), "an integer >= 0")
        require(
            self.save_total_limit is None or self.save_total_limit >= 1,
            "save_total_limit",
            self.save_total_limit,
            "an integer >= 1 or null",
        )


class RetentionPolicy:
    """The newest `save_total_limit`, the best `keep_best` by a logged metric, and every milestone."""

    def __init__(self, config: RetentionConfig):
        self.config = config

    def keep(self, checkpoints: list[tuple[int, Path]], manifest: Callable[[Path], dict[str, Any]]) -> set[Path]:
        """Of the committed `checkpoints` ((step, folder), oldest first), those to keep; `manifest(folder)` reads one's metrics."""
        c = self.config
        folders = [folder for _, folder in checkpoints]
        kept = set(folders if c.save_total_limit is None else folders[-c.save_total_limit :])
        if c.save_milestone_steps:
            kept |= {folder for step, folder in checkpoints if step % c.save_milestone_steps == 0}
        if c.keep_best:
            scored = []
            for folder in folders:
                with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                    scored.append((float(manifest(folder)["metrics"][c.metric_for_best_model]), folder))
            scored.sort(key=lambda sp: sp[0], reverse=c.greater_is_better)
            kept |= {folder for _, folder in scored[: c.keep_best]}
        return kept

    def most_kept(self, max_steps: int, save_steps: int) -> int:
        """How many checkpoints this policy keeps at most over a run of `max_steps` saving every `save_steps` (for the disk preflight)."""
        c = self.config
        saves = max_steps // save_steps + 1 if save_steps else 1
        kept = min(c.save_total_limit, saves) if c.save_total_limit is not None else saves
        milestones = max_steps // c.save_milestone_steps if c.save_milestone_steps else 0
        return min(saves, kept + c.keep_best + milestones)
