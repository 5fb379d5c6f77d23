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
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

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
    out = universal_path(checkpoint)
    if out.is_dir() and problem(out, checksums=True) is None:
        return out
    shutil.rmtree(out, ignore_errors=True)
    work = out.with_name(f".{out.name}.partial")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    start = time.monotonic()
    print(f"converting {checkpoint} to a universal checkpoint (DeepSpeed's ds_to_universal) ...", flush=True)
    command = [
        sys.executable,
        "-m",
        "deepspeed.checkpoint.ds_to_universal",
        "--input_folder",
        str(checkpoint / ZERO_FOLDER),
        "--output_folder",
        str(work / ZERO_FOLDER),
        "--inject_missing_state",  # what Megatron-DeepSpeed's client state adds: the format's version, nothing else
        "--num_extract_workers",
        str(max(1, min(4, os.cpu_count() or 1))),
        "--num_merge_workers",
        str(max(1, min(4, os.cpu_count() or 1))),
    ]
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # its progress bars
    if done.returncode != 0:
        shutil.rmtree(work, ignore_errors=True)
        tail = done.stdout.strip().splitlines()[-1:] or ["no output"]
        raise CheckpointError(f"converting {checkpoint} to a universal checkpoint failed ({tail[0]})")
    for item in checkpoint.iterdir():  # the rest of save_state's files, as they are
        if item.name not in (ZERO_FOLDER, MANIFEST, LATEST) and item.is_file():
            shutil.copy2(item, work / item.name)
    manifest = read_manifest(checkpoint)
    manifest = {**manifest, "converted_from": checkpoint.name, "format": "deepspeed universal", "files": seal(work)}
    fsync_dirs(work)
    atomic_write_text(work / MANIFEST, json.dumps(manifest, indent=2))
    os.rename(work, out)
    fsync_dir(out.parent)
    print(f"converted in {time.monotonic() - start:.1f} s: {out}", flush=True)
    return out


def load_universal(accelerator: Accelerator, path: Path, load) -> None:
    """`load(accelerator, path)` with the DeepSpeed engine reading a universal checkpoint (its config's
    `checkpoint.load_universal`, which the engine reads at load time), for this load only."""
    config = accelerator.deepspeed_engine_wrapped.engine._config
    config.load_universal_checkpoint = True
    try:
        load(accelerator, path)
    finally:
        config.load_universal_checkpoint = False
