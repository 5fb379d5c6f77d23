"""The exported model: `OUTPUT_DIR/final/`, loadable with `from_pretrained`, with a model card; optionally in MLflow.

Safetensors weights and the processor (tokenizer or image processor) are written to `final.partial/`,
fsynced, then renamed into place: a crash leaves the previous export or none, never half of one.

Any checkpoint to such a folder, in one process, without the launcher or the run's engine:

    python -m infra.export --checkpoint OUTPUT_DIR/checkpoints/step_00001000 --output DIR

Every checkpoint holds `model/` (the model's transformers config, its processor, the recipe), written by
`Exporter.describe`; the weights come from whatever the engine saved (infra.checkpoint.weights).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

from infra.config import to_json
from infra.distributed import all_ranks_ok
from infra.errors import ToolParser
from infra.files import atomic_write_text, fsync_tree, publish_dir
from infra.lora import is_adapted
from infra.tracking import log_model

DESCRIPTION = "model"  # in each checkpoint: the model's config and processor (Exporter.describe)
RECIPE = "recipe.json"


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

    def describe(self, model: torch.nn.Module, folder: Path) -> None:
        """What `python -m infra.export` needs besides a checkpoint's weights, into `folder/model/` (rank 0): the
        model's config (its class named), the processor and the recipe."""
        base = self.accelerator.unwrap_model(model)
        base = base.get_base_model() if is_adapted(base) else base
        config = copy.deepcopy(base.config)
        import transformers

        # FSDP2 makes a subclass of the model's (FSDPLlamaForCausalLM): the transformers class is the one to name
        config.architectures = [next(c.__name__ for c in type(base).__mro__ if getattr(transformers, c.__name__, None) is c)]
        target = Path(folder) / DESCRIPTION
        config.save_pretrained(target)
        self.processor.save_pretrained(target)
        recipe = {"recipe": self.recipe, "task": self.task, "lora": is_adapted(self.accelerator.unwrap_model(model))}
        atomic_write_text(target / RECIPE, json.dumps(recipe))

    def log_to_mlflow(self, register_model: str | None) -> None:
        """The exported model as an MLflow transformers model of the active run (rank 0), registered under `register_model`."""
        if self.accelerator.is_main_process and (uri := log_model(self.final, self.task, register_model)):
            self.accelerator.print(f"model logged to MLflow as {uri}" + (f", registered as {register_model!r}" if register_model else ""))


def export_checkpoint(checkpoint: Path, output: Path, dtype: str = "auto") -> Path:
    """A checkpoint (verified first) as a `from_pretrained` folder at `output` (written beside it as `.partial`, then
    renamed). Raises ValueError naming what is wrong."""
    from transformers import AutoConfig

    from infra.checkpoint import CheckpointError, problem, read_manifest
    from infra.checkpoint.weights import full_state_dict

    described = checkpoint / DESCRIPTION
    if output.exists():
        raise ValueError(f"--output {output} exists: give a new folder")
    try:
        why = problem(checkpoint, checksums=True)
    except CheckpointError as err:
        why = str(err)
    if why is not None:
        raise ValueError(f"{checkpoint} is not a usable checkpoint: {why}")
    if not (described / RECIPE).is_file():
        raise ValueError(f"{checkpoint} has no {DESCRIPTION}/ (checkpoints written before this version lack it): export a newer one")
    recipe = json.loads((described / RECIPE).read_text())
    if recipe["lora"]:
        raise ValueError(f"{checkpoint} holds a LoRA adapter without its base model: export the run's final/ instead")
    config = AutoConfig.from_pretrained(described)
    print(f"reading the weights of {checkpoint} ({read_manifest(checkpoint).get('distributed_type')}) ...", flush=True)
    output.parent.mkdir(parents=True, exist_ok=True)
    weights = full_state_dict(checkpoint, output.parent)
    import transformers

    model = getattr(transformers, config.architectures[0])._from_config(config)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = _tied(model, missing, weights)
    if unexpected or set(missing) - tied:
        raise ValueError(
            f"{checkpoint}'s weights do not fit {config.architectures[0]}: missing {sorted(set(missing) - tied)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    if dtype != "auto":
        model = model.to(getattr(torch, dtype))
    work = output.with_name(f".{output.name}.partial")
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(described, work, ignore=shutil.ignore_patterns(RECIPE))  # the processor's files
    model.save_pretrained(work, safe_serialization=True)
    manifest = read_manifest(checkpoint)
    train_config = json.loads((checkpoint / "config.json").read_text()) if (checkpoint / "config.json").is_file() else {}
    write_model_card(work, recipe["recipe"], train_config, {"step": manifest["step"], **manifest.get("metrics", {})})
    fsync_tree(work)
    publish_dir(work, output)
    return output


def _tied(model: torch.nn.Module, missing: list[str], loaded: dict) -> set[str]:
    """The missing names that are one tensor with a loaded one (an LM head tied to the input embedding, saved once)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    return {name for name in missing if name in params and any(params[name] is params.get(other) for other in loaded)}


def main(argv: list[str] | None = None) -> None:
    parser = ToolParser(prog="python -m infra.export", description="A checkpoint as a from_pretrained folder.")
    parser.add_argument("--checkpoint", required=True, help="OUTPUT_DIR/checkpoints/step_XXXXXXXX (DDP, ZeRO or FSDP)")
    parser.add_argument("--output", required=True, help="a new folder")
    parser.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"], help="auto: as saved (fp32 master weights)"
    )
    args = parser.parse_args(argv)
    try:
        out = export_checkpoint(Path(args.checkpoint), Path(args.output), args.dtype)
    except (ValueError, OSError) as err:
        print(f"export error: {err}", file=sys.stderr)
        raise SystemExit(1) from None
    print(f"exported to {out}")


if __name__ == "__main__":
    main()
