"""Checkpoints through `accelerator.save_state`, committed atomically and resumed automatically.

Layout:

    OUTPUT_DIR/checkpoints/step_00000100/     what save_state writes (model, optimizer, scheduler,
        ...                                   every rank's RNG, registered objects) plus
        config.json                           the resolved configuration
        manifest.json                         step, tokens, data cursor, file sizes, versions, run id

A save goes to `.step_XXXXXXXX.partial/`; when every rank has written its part, rank 0 fsyncs the
files, writes `manifest.json` last and renames the folder into place. A folder without a manifest
is never loaded. Old checkpoints are pruned only after the new one is committed (accelerate's own
`total_limit` prunes before saving, and its counter breaks after a resume).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from accelerate import Accelerator

from infra.config import to_json
from infra.files import atomic_write_text, fsync_dir, fsync_tree

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
CONFIG = "config.json"
PREFIX = "step_"


class TrainState:
    """Loop counters that must survive a restart. Registered for checkpointing."""

    def __init__(self):
        self.step = 0
        self.tokens_seen = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])


class CheckpointError(RuntimeError):
    """A checkpoint that was asked for explicitly cannot be used."""


def read_manifest(path: Path) -> dict[str, Any]:
    return json.loads((Path(path) / MANIFEST).read_text())


def problem(path: Path) -> str | None:
    """Why `path` is not a usable checkpoint, or None if it is whole (every listed file at its size)."""
    manifest_path = Path(path) / MANIFEST
    if not manifest_path.is_file():
        return "no manifest.json (the save never completed)"
    try:
        files = read_manifest(path)["files"]
    except (ValueError, KeyError) as err:
        return f"unreadable manifest.json ({err})"
    for rel, size in files.items():
        f = Path(path) / rel
        if not f.is_file():
            return f"{rel} is missing"
        if f.stat().st_size != size:
            return f"{rel} has {f.stat().st_size} bytes, the manifest says {size}"
    return None


class CheckpointManager:
    def __init__(self, accelerator: Accelerator, output_dir: str | os.PathLike, save_total_limit: int | None, config: dict):
        self.accelerator = accelerator
        self.root = Path(output_dir) / "checkpoints"
        self.save_total_limit = save_total_limit
        self.config = config
        if accelerator.is_main_process:
            self.root.mkdir(parents=True, exist_ok=True)
            for leftover in self.root.glob(f".{PREFIX}*.partial"):
                log.warning("removing %s, left by a save that did not finish", leftover)
                shutil.rmtree(leftover, ignore_errors=True)
        accelerator.wait_for_everyone()

    def path(self, step: int) -> Path:
        return self.root / f"{PREFIX}{step:08d}"

    def checkpoints(self) -> list[Path]:
        """Committed checkpoint folders, oldest first."""
        found = [p for p in self.root.glob(f"{PREFIX}*") if p.is_dir() and p.name[len(PREFIX) :].isdigit()]
        return sorted(found, key=lambda p: int(p.name[len(PREFIX) :]))

    def resolve(self, resume_from_checkpoint: str) -> Path | None:
        """The checkpoint to resume from: 'none', 'auto' (newest that verifies) or an explicit path."""
        if resume_from_checkpoint == "none":
            return None
        if resume_from_checkpoint != "auto":
            path = Path(resume_from_checkpoint)
            if (why := problem(path)) is not None:
                raise CheckpointError(f"resume_from_checkpoint={str(path)!r} cannot be used: {why}")
            return path
        for path in reversed(self.checkpoints()):
            why = problem(path)
            if why is None:
                return path
            if self.accelerator.is_main_process:
                log.warning("skipping checkpoint %s: %s", path, why)
        return None

    def load(self, path: Path) -> dict[str, Any]:
        """Restore everything save_state wrote; returns the manifest."""
        self.accelerator.load_state(str(path))
        return read_manifest(path)

    def save(self, step: int, manifest: dict[str, Any]) -> Path:
        """Save, commit (manifest last, then rename), then prune. Called on every rank."""
        final = self.path(step)
        if final.exists():  # this step is already committed (a resume at the final step, say)
            return final
        work = self.root / f".{PREFIX}{step:08d}.partial"
        acc = self.accelerator
        start = time.perf_counter()
        if acc.is_main_process:
            shutil.rmtree(work, ignore_errors=True)
        acc.wait_for_everyone()
        acc.save_state(str(work))
        acc.wait_for_everyone()
        if acc.is_main_process:
            (work / CONFIG).write_text(to_json(self.config))
            fsync_tree(work)
            files = {str(p.relative_to(work)): p.stat().st_size for p in sorted(work.rglob("*")) if p.is_file()}
            atomic_write_text(work / MANIFEST, json.dumps({**manifest, "step": step, "files": files}, indent=2))
            os.rename(work, final)
            fsync_dir(self.root)
            self.prune()
            log.info("saved %s in %.2fs", final, time.perf_counter() - start)
        acc.wait_for_everyone()
        return final

    def prune(self) -> None:
        if self.save_total_limit is None:
            return
        for old in self.checkpoints()[: -self.save_total_limit]:
            shutil.rmtree(old, ignore_errors=True)


def environment_facts(accelerator: Accelerator) -> dict[str, Any]:
    """What a checkpoint records about the job that wrote it."""
    versions = {}
    for package in ("torch", "accelerate", "transformers", "deepspeed", "datasets"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[package] = metadata.version(package)
    return {
        "world_size": accelerator.num_processes,
        "distributed_type": accelerator.distributed_type.value,
        "mixed_precision": accelerator.mixed_precision,
        "versions": versions,
        "git_commit": git_commit(),
    }


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, cwd=Path(__file__).parent)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None
