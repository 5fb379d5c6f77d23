"""A checkpoint of DDP (or of one process) resumed under DeepSpeed ZeRO, and the reverse, through every parameter's
full state. DeepSpeed's universal checkpoint is that state (per parameter: the fp32 weights, the Adam moments, the
step), and every ZeRO stage loads it on any world size (reshard.py), so:

    DDP  -> ZeRO   rank 0 writes the universal sibling `step_X.universal/` itself, from save_state's
                   model.safetensors and optimizer.bin; it loads as one made by ds_to_universal;
    ZeRO -> DDP    the ZeRO checkpoint is converted to its universal sibling (reshard.py), and from that rank 0
                   writes save_state's files into `step_X.ddp/`: model.safetensors, optimizer.bin.

Both are made once, verified and sealed like any sibling (reshard.make_sibling); the scheduler, every rank's RNG
state and the manifest are the checkpoint's own. A torch optimizer's state is indexed by each parameter's place in
its groups: `infra.optim.parameter_groups` gives that place on both sides, and the shapes are checked against it.
Not carried: persistent buffers that training changes (BatchNorm statistics), which a universal checkpoint does not
hold (the recipes' default models have none).
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import save
from safetensors.torch import load_file

from infra.checkpoint.integrity import CheckpointError, read_manifest
from infra.checkpoint.reshard import MODEL_STATES, OPTIMIZER_STATE, ZERO_FOLDER, for_every_stage, make_sibling, to_universal, universal_path
from infra.optim import parameter_groups

DDP_SUFFIX = ".ddp"
WEIGHTS, OPTIMIZER = "model.safetensors", "optimizer.bin"  # save_state's files of the first model and optimizer
MOMENTS = ("exp_avg", "exp_avg_sq")


def ddp_path(checkpoint: Path) -> Path:
    return checkpoint.with_name(checkpoint.name + DDP_SUFFIX)


def canonical_names(model: torch.nn.Module) -> dict[str, str]:
    """Every name of each parameter (tied weights have several) -> the one `named_parameters` gives."""
    first = {id(p): name for name, p in model.named_parameters()}
    return {name: first[id(p)] for name, p in model.named_parameters(remove_duplicate=False)}


def from_ddp(checkpoint: Path, accelerator: Accelerator) -> Path:
    """The universal sibling of a verified DDP checkpoint, for this DeepSpeed run (on rank 0)."""
    manifest, model = read_manifest(checkpoint), accelerator.deepspeed_engine_wrapped.engine.module

    def convert(work: Path) -> None:
        aliases = canonical_names(model)
        named = {aliases.get(key.removeprefix("module."), key): value for key, value in load_file(checkpoint / WEIGHTS).items()}
        optimizer = torch.load(checkpoint / OPTIMIZER, map_location="cpu", weights_only=True)
        names = [name for group in parameter_groups(model) for name, _ in group]
        if len(optimizer["state"]) != len(names):
            held = len(optimizer["state"])
            raise CheckpointError(f"{checkpoint}'s optimizer holds the state of {held} parameters and this model trains {len(names)}")
        zero = work / ZERO_FOLDER / "zero"
        for index, name in enumerate(names):
            state, weight = optimizer["state"][index], named[name].float()
            if any(state[key].shape != weight.shape for key in MOMENTS):
                raise CheckpointError(f"{checkpoint}'s optimizer state {index} does not have the shape of {name} {tuple(weight.shape)}")
            (zero / name).mkdir(parents=True)
            torch.save({"param": weight}, zero / name / "fp32.pt")
            for key in MOMENTS:
                torch.save({"param": state[key].float()}, zero / name / f"{key}.pt")
            torch.save(state["step"], zero / name / "step.pt")
        write_universal_globals(work / ZERO_FOLDER, optimizer["param_groups"], manifest)

    what = "a universal checkpoint (from DDP's full state)"
    return make_sibling(checkpoint, universal_path(checkpoint), what, convert, {WEIGHTS, OPTIMIZER})


def write_universal_globals(folder: Path, groups: list[dict], manifest: dict) -> None:
    """What DeepSpeed's universal loader reads besides the parameters, as ds_to_universal writes it from a stage-1/2
    checkpoint (the optimizer's groups, the engine's counters), then completed for every stage (reshard.py)."""
    import deepspeed

    torch.save({"param_groups": groups, "ds_version": deepspeed.__version__}, folder / OPTIMIZER_STATE)
    counters = {"dp_world_size": manifest.get("world_size", 1), "mp_world_size": 1, "global_steps": manifest["step"]}
    counters |= {"skipped_steps": 0, "lr_scheduler": None, "module": {}, "ds_version": deepspeed.__version__}
    torch.save(counters, folder / MODEL_STATES[0])
    for_every_stage(folder)


def to_ddp(checkpoint: Path, accelerator: Accelerator) -> Path:
    """The DDP sibling of a verified ZeRO checkpoint, through its universal one, for this DDP (or one-process) run:
    its files named and shaped as this run's save_state writes them (on rank 0; the run's state is not changed)."""
    universal = to_universal(checkpoint) / ZERO_FOLDER
    prepared, optimizer = accelerator._models[0], accelerator._optimizers[0].optimizer
    model = accelerator.unwrap_model(prepared)

    def convert(work: Path) -> None:
        saved_groups = torch.load(universal / OPTIMIZER_STATE, map_location="cpu", weights_only=False)["param_groups"]
        if len(saved_groups) != len(optimizer.param_groups):
            raise CheckpointError(f"{checkpoint} holds {len(saved_groups)} optimizer groups and this run has {len(optimizer.param_groups)}")
        weights, state, groups, index = {}, {}, [], 0
        for saved, group in zip(saved_groups, parameter_groups(model), strict=True):
            groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": list(range(index, index + len(group)))})
            for name, p in group:
                read = {key: _tensor(universal / "zero" / name / f"{key}.pt").view(p.shape) for key in ("fp32", *MOMENTS)}
                weights[name] = read.pop("fp32").to(p.dtype)
                state[index] = {"step": torch.load(universal / "zero" / name / "step.pt", weights_only=False), **read}
                index += 1
        names = canonical_names(model)
        template = accelerator.get_state_dict(prepared, unwrap=False)  # what save_state writes: buffers as they are now
        full = OrderedDict((key, weights.get(names.get(key.removeprefix("module."), ""), value)) for key, value in template.items())
        save(full, work / WEIGHTS, safe_serialization=True)  # as save_state writes it (an OrderedDict: tied weights once)
        torch.save({"state": state, "param_groups": groups}, work / OPTIMIZER)

    return make_sibling(checkpoint, ddp_path(checkpoint), "a DDP checkpoint (from its universal one)", convert, {ZERO_FOLDER, "latest"})


def _tensor(path: Path) -> torch.Tensor:
    """A universal checkpoint's tensor file: {"param": tensor} (stages 1-2, DDP), or the tensor (stage 3)."""
    value = torch.load(path, map_location="cpu", weights_only=False)
    return value["param"] if isinstance(value, dict) else value
