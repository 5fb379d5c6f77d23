"""Durable file operations: what is renamed into place has reached the disk first."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from pathlib import Path


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def drop_cached(path: Path) -> None:
    """Let the kernel drop `path`'s pages from the page cache (POSIX_FADV_DONTNEED), once they are on disk.

    For checkpoint files after their commit or their verified load: nothing reads them again soon, and
    cached they push the training data out of the cache and, measured on a 2-core VM, slow the next
    save's writes (save_state 1.22 s with the previous checkpoint cached, 0.82 s without). Best effort.
    """
    with contextlib.suppress(OSError, AttributeError):  # AttributeError: no posix_fadvise (macOS)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and folder below `root` (children before parents)."""
    for folder, _, files in os.walk(root, topdown=False):
        for name in files:
            fsync_file(Path(folder) / name)
        fsync_dir(Path(folder))


def atomic_write_text(path: Path, text: str) -> None:
    """Write, flush and fsync `path.tmp`, then rename it over `path`."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def publish_dir(work: Path, out: Path) -> None:
    """Rename the finished folder `work` to `out` (its files are on disk already). What was at `out` is
    renamed aside first and deleted last, so a crash leaves the old folder or the new one, whole."""
    old = out.with_name(out.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        os.rename(out, old)
    os.rename(work, out)
    fsync_dir(out.parent)
    shutil.rmtree(old, ignore_errors=True)


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
