"""Facts about the job and the code that ran it: package versions, git state, the machine."""

from __future__ import annotations

import contextlib
import platform
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("torch", "accelerate", "transformers", "deepspeed", "datasets", "mlflow")


def package_versions() -> dict[str, str]:
    versions = {}
    for package in PACKAGES:
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[package] = metadata.version(package)
    return versions


def git_state() -> tuple[str | None, bool | None]:
    """(commit, whether the work tree has uncommitted changes) of the repository, or (None, None)."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, cwd=REPO)
        status = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True, timeout=5, cwd=REPO)
    except (OSError, subprocess.TimeoutExpired):
        return None, None
    if commit.returncode != 0:
        return None, None
    return commit.stdout.strip(), bool(status.stdout.strip())


def environment_report() -> str:
    """`accelerate env`-style facts and the installed packages, as text."""
    import torch

    lines = [
        f"python: {sys.version.split()[0]} ({platform.platform()})",
        f"host: {socket.gethostname()}",
        f"torch: {torch.__version__}, cuda available: {torch.cuda.is_available()}",
    ]
    if torch.cuda.is_available():
        lines += [f"gpu {i}: {torch.cuda.get_device_name(i)}" for i in range(torch.cuda.device_count())]
    lines += ["", "installed packages:"]
    lines += sorted(f"{d.metadata['Name']}=={d.version}" for d in metadata.distributions() if d.metadata["Name"])
    return "\n".join(lines) + "\n"


def zero_stage(accelerator) -> int | None:
    """The ZeRO stage of a DeepSpeed run, else None."""
    plugin = accelerator.state.deepspeed_plugin
    return plugin.zero_stage if plugin is not None else None


def environment_facts(accelerator) -> dict:
    """What a checkpoint records about the job that wrote it (an Accelerator's world, engine and precision)."""
    commit, dirty = git_state()
    return {
        "world_size": accelerator.num_processes,
        "distributed_type": accelerator.distributed_type.value,
        "mixed_precision": accelerator.mixed_precision,
        "zero_stage": zero_stage(accelerator),
        "versions": package_versions(),
        "git_commit": commit,
        "git_dirty": dirty,
    }
