"""The exported model: `OUTPUT_DIR/final/`, loadable with `from_pretrained`, with a model card; optionally in MLflow.

Safetensors weights and the processor (tokenizer or image processor) are written to `final.partial/`,
fsynced, then renamed into place: a crash leaves the previous export or none, never half of one.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

from infra.config import to_json
from infra.distributed import all_ranks_ok
from infra.files import atomic_write_text, fsync_tree, publish_dir
from infra.lora import is_adapted
from infra.tracking import log_model


def write_model_card(folder: str | os.PathLike, recipe: str, config: dict, metrics: dict[str, Any]) -> None:
    """`README.md` beside exported weights: how they were made and where training ended."""
    lines = [f"# {Path(folder).parent.name}", "", f"Trained with `recipes/{recipe}.py`.", "", "## Final metrics", ""]
    lines += [f"- {k}: {v:.6g}" if isinstance(v, float) else f"- {k}: {v}" for k, v in sorted(metrics.items())]
    lines += ["", "## Configuration", "", "```json", to_json(config), "```", ""]
    atomic_write_text(Path(folder) / "README.md", "\n".join(lines))


class Exporter:
    """Writes `final/` (every rank takes part: sharded weights are gathered) and logs it to MLflow on request."""

    def __init__(
        self,
        accelerator: Accelerator,
        output_dir: str | os.PathLike,
        recipe: str,
        processor: Any,
        task: str,
        config: dict,
        adapter_only: bool = False,
    ):
        self.accelerator, self.recipe, self.processor, self.task, self.config = accelerator, recipe, processor, task, config
        self.adapter_only = adapter_only  # a LoRA model: its adapter alone; else merged into the base
        self.final = Path(output_dir) / "final"

    def export(self, model: torch.nn.Module, summary: dict[str, Any]) -> Path:
        """The model's weights, the processor and a model card with `summary` (the final metrics); raises SystemExit
        on every rank if rank 0 could not write them."""
        acc = self.accelerator
        work = self.final.with_name("final.partial")
        if acc.is_main_process:
            shutil.rmtree(work, ignore_errors=True)
        acc.wait_for_everyone()
        unwrapped = acc.unwrap_model(model)
        if is_adapted(unwrapped):  # DDP or one process (infra.lora): every rank holds the whole model
            if self.adapter_only:  # adapter_config.json and adapter_model.safetensors: peft's PeftModel.from_pretrained
                unwrapped.save_pretrained(work, is_main_process=acc.is_main_process, safe_serialization=True)
            else:  # the base with the adapter folded in: from_pretrained as any model (the run is over: merged in place)
                unwrapped.merge_and_unload().save_pretrained(work, is_main_process=acc.is_main_process, safe_serialization=True)
        else:
            unwrapped.save_pretrained(
                work,
                state_dict=acc.get_state_dict(model),
                is_main_process=acc.is_main_process,
                save_function=acc.save,
                safe_serialization=True,
            )
        acc.wait_for_everyone()  # every rank is done with the folder (save_pretrained lists it on each)
        error = None
        if acc.is_main_process:
            try:
                self.processor.save_pretrained(work)
                write_model_card(work, self.recipe, self.config, summary)
                fsync_tree(work)
                publish_dir(work, self.final)
            except Exception as err:  # a full disk, say: every rank must hear of it
                error = err
        if not all_ranks_ok(acc, error is None):
            raise SystemExit(
                f"export error: writing {self.final} failed ({error or 'on rank 0'}); the checkpoints are intact: relaunch to export"
            )
        return self.final

    def log_to_mlflow(self, register_model: str | None) -> None:
        """The exported model as an MLflow transformers model of the active run (rank 0), registered under `register_model`."""
        if self.accelerator.is_main_process and (uri := log_model(self.final, self.task, register_model)):
            self.accelerator.print(f"model logged to MLflow as {uri}" + (f", registered as {register_model!r}" if register_model else ""))
