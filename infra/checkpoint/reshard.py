"""Resuming a ZeRO checkpoint on another number of processes, with DeepSpeed's own tools.

A ZeRO checkpoint holds each rank's partition of the flat optimizer state, so it loads only on the world size
that wrote it. DeepSpeed's universal checkpoint holds every parameter's fp32 weights and Adam moments whole, and
loads on any world size. So, on a resume that needs it:

    checkpoints/step_00000100/               as written by 2 ranks (verified before anything is read)
    checkpoints/step_00000100.universal/     made once from it by `deepspeed.checkpoint.ds_to_universal`, in a
                                             `.partial` folder, sealed with its own manifest, then renamed

and the run loads the sibling with DeepSpeed's `load_universal` switched on for that load only. A later restart on
the same new world size finds the sibling whole and converts nothing. The sibling is pruned with its checkpoint.
Everything save_state wrote besides the ZeRO folder (scheduler, every rank's RNG state, registered objects) is copied
as it is; the manifest (step, data cursor, counters) too, plus where it came from.

The same conversion serves a change of ZeRO stage. ds_to_universal writes the files that the source's stage reads;
DeepSpeed's universal loader takes the weights and Adam moments from the per-parameter files, and from the rest only
counters and the optimizer's global state, which stage 3 looks for under other names and keys than stages 1 and 2.
`for_every_stage` adds those (a hard link, small files), so one sibling loads under any stage. From a stage-3 source
it also writes each parameter's tensors again in their shape (stage 3 writes them flat): one more pass over the state.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from accelerate import Accelerator

from infra.checkpoint.integrity import MANIFEST, CheckpointError, fsync_dirs, problem, read_manifest, seal
from infra.files import atomic_write_text, fsync_dir

SUFFIX = ".universal"
ZERO_FOLDER = "pytorch_model"  # accelerate's tag for the DeepSpeed engine's checkpoint
LATEST = "latest"  # DeepSpeed's pointer to the tag; the universal one is "latest_universal"


def universal_path(checkpoint: Path) -> Path:
    return checkpoint.with_name(checkpoint.name + SUFFIX)


def to_universal(checkpoint: Path) -> Path:
    """The universal sibling of a verified ZeRO checkpoint, made now unless a whole one is there. One process only
    (rank 0); raises CheckpointError naming what failed, leaving no sibling behind."""

    def convert(work: Path) -> None:
        workers = str(max(1, min(4, os.cpu_count() or 1)))
        command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal"]
        command += ["--input_folder", str(checkpoint / ZERO_FOLDER), "--output_folder", str(work / ZERO_FOLDER)]
        command += ["--inject_missing_state"]  # what Megatron-DeepSpeed's client state adds: the format's version only
        command += ["--num_extract_workers", workers, "--num_merge_workers", workers]
        done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # its progress bars
        if done.returncode != 0:
            tail = done.stdout.strip().splitlines()[-1:] or ["no output"]
            raise CheckpointError(f"converting {checkpoint} to a universal checkpoint failed ({tail[0]})")
        for_every_stage(work / ZERO_FOLDER)

    what = "a universal checkpoint (DeepSpeed's ds_to_universal)"
    return make_sibling(checkpoint, universal_path(checkpoint), what, convert, {ZERO_FOLDER, LATEST})


def make_sibling(checkpoint: Path, out: Path, what: str, convert, converted: set[str]) -> Path:
    """`out`, a converted copy of the verified `checkpoint`, unless a whole one is there: `convert(work)` writes the
    converted files into a `.partial` folder; the checkpoint's other files (not named in `converted`) are copied as
    they are; a manifest of its own (`converted_from`) is sealed, then the folder renamed. One process only (rank 0);
    raises CheckpointError naming what failed, leaving nothing behind."""
    if out.is_dir() and problem(out, checksums=True) is None:
        return out
    shutil.rmtree(out, ignore_errors=True)
    work = out.with_name(f".{out.name}.partial")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    start = time.monotonic()
    print(f"converting {checkpoint} to {what} ...", flush=True)
    try:
        convert(work)
    except Exception as err:
        shutil.rmtree(work, ignore_errors=True)
        if isinstance(err, CheckpointError):
            raise
        first = next((line.strip() for line in str(err).splitlines() if line.strip()), "")
        raise CheckpointError(f"converting {checkpoint} to {what} failed ({type(err).__name__}: {first})") from err
    for item in checkpoint.iterdir():  # the rest of save_state's files, as they are
        if item.name not in (*converted, MANIFEST) and item.is_file():
            shutil.copy2(item, work / item.name)
    manifest = {**read_manifest(checkpoint), "converted_from": checkpoint.name, "format": what, "files": seal(work)}
    fsync_dirs(work)
    atomic_write_text(work / MANIFEST, json.dumps(manifest, indent=2))
    os.rename(work, out)
    fsync_dir(out.parent)
    print(f"converted in {time.monotonic() - start:.1f} s: {out}", flush=True)
    return out


MODEL_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")  # stages 1-2; stage 3
OPTIMIZER_STATE = Path("zero") / "optimizer_state.pt"


def for_every_stage(folder: Path) -> None:
    """Make a universal checkpoint `folder` loadable under ZeRO stages 1, 2 and 3, whichever wrote it: the counters'
    file under both stages' names, and the rest in the layout the other stages read (below)."""
    present = next(folder / name for name in MODEL_STATES if (folder / name).is_file())
    for name in MODEL_STATES:
        if not (folder / name).exists():
            os.link(present, folder / name)
    state = torch.load(folder / OPTIMIZER_STATE, map_location="cpu", weights_only=False)
    params = [p for p in (folder / "zero").iterdir() if p.is_dir()]
    if "optimizer_state_dict" in state:  # from stage 3
        step = state["optimizer_state_dict"]["state"][0]["step"]
        _from_stage3(state, params, step, torch.load(present, map_location="cpu", weights_only=False))  # small: partitions
    else:  # from stage 1 or 2
        step = torch.load(params[0] / "step.pt", map_location="cpu", weights_only=False)
    # what stage 3 reads here; stage 3's own file also holds rank 0's partition of the weights and moments, which a
    # universal load does not read (and every rank would load)
    state["optimizer_state_dict"] = {"state": {0: {"step": step}}, "param_groups": state["param_groups"]}
    state.pop("fp32_flat_groups", None)
    torch.save(state, folder / OPTIMIZER_STATE)


def _from_stage3(state: dict, params: list[Path], step, model_states: dict) -> None:
    """What stages 1 and 2 read and stage 3 does not write: the DeepSpeed version in the optimizer's state, each
    parameter's step, and its tensors in their shape (stage 3 writes them flat, and reads either)."""
    state.setdefault("ds_version", model_states["ds_version"])
    shapes = {name: shape for group in model_states["param_shapes"] for name, shape in group.items()}
    for param in params:
        torch.save(step, param / "step.pt")
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            value = torch.load(param / f"{key}.pt", map_location="cpu", weights_only=False)
            if torch.is_tensor(value):
                torch.save({"param": value.view(shapes[param.name])}, param / f"{key}.pt")


def load_universal(accelerator: Accelerator, path: Path, load) -> None:
    """`load(accelerator, path)` with the DeepSpeed engine reading a universal checkpoint (its config's
    `checkpoint.load_universal`, which the engine reads at load time), for this load only. Then every parameter
    group's hyperparameters as saved: stage 3's universal loader gives all groups the first one's (weight decay
    on the norms)."""
    engine = accelerator.deepspeed_engine_wrapped.engine
    engine._config.load_universal_checkpoint = True
    try:
        load(accelerator, path)
    finally:
        engine._config.load_universal_checkpoint = False
    saved = torch.load(path / ZERO_FOLDER / OPTIMIZER_STATE, map_location="cpu", weights_only=False)["param_groups"]
    groups = engine.optimizer.optimizer.param_groups
    if len(saved) != len(groups):
        raise CheckpointError(f"{path} holds {len(saved)} optimizer parameter groups and this run has {len(groups)}")
    for group, hyper in zip(groups, saved, strict=True):
        group.update({key: value for key, value in hyper.items() if key != "params"})
