"""Checkpoints mirrored to object storage: `checkpoint_upload_dir: s3://bucket/prefix` (any fsspec URL).

    s3://bucket/prefix/step_00000100/...             every file of the committed local checkpoint,
    s3://bucket/prefix/step_00000100/manifest.json   uploaded last: a folder without it is never resumed from

Each checkpoint is uploaded by rank 0 after its local commit and pruning, from a thread, while training goes on (the
next save waits for the upload before it prunes: uploads slower than saves hold training back instead of piling up).
Then the remote copies of checkpoints no longer kept locally are deleted, manifest first. A failed upload is reported
in one line and the run goes on; the next checkpoint is uploaded as usual.

On resume, a remote checkpoint newer than every local one is downloaded (to a `.partial` folder, verified against its
manifest, then renamed into place): so a new machine with an empty disk resumes from the newest remote checkpoint
that verifies. A remote checkpoint with a missing, truncated or altered file is reported and the one before it tried.
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

from infra.checkpoint.integrity import MANIFEST, CheckpointError, problem, read_manifest

STEP = re.compile(r"step_(\d{8})$")


class RemoteCheckpoints:
    """The checkpoints under one fsspec URL."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self._fs = None

    @property
    def fs(self):
        if self._fs is None:
            import fsspec

            self._fs = fsspec.core.url_to_fs(self.url)[0]
        return self._fs

    def _folder(self, step: int) -> str:
        return f"{self.url}/step_{step:08d}"

    def steps(self) -> list[int]:
        """The steps of the committed remote checkpoints (those with a manifest), oldest first."""
        found = self.fs.glob(f"{self.url}/step_*/{MANIFEST}")
        return sorted(int(m.group(1)) for path in found if (m := STEP.search(path.rsplit("/", 2)[-2])))

    def upload(self, local: Path) -> int:
        """Every file of a committed local checkpoint, the manifest last; the bytes sent."""
        step = int(STEP.search(local.name).group(1))
        files = sorted(read_manifest(local)["files"])
        remote = self._folder(step)
        self.fs.put([str(local / rel) for rel in files], [f"{remote}/{rel}" for rel in files])
        self.fs.put_file(str(local / MANIFEST), f"{remote}/{MANIFEST}")
        return sum((local / rel).stat().st_size for rel in [*files, MANIFEST])

    def prune(self, keep: set[int]) -> None:
        """Delete every remote checkpoint whose step is not in `keep` (its manifest first, so it is never listed half
        deleted), and what interrupted uploads left."""
        for path in self.fs.glob(f"{self.url}/step_*"):
            m = STEP.search(path.rstrip("/").rsplit("/", 1)[-1])
            if m is None or int(m.group(1)) in keep:
                continue
            if self.fs.exists(f"{path}/{MANIFEST}"):
                self.fs.rm(f"{path}/{MANIFEST}")
            self.fs.rm(path, recursive=True)

    def download(self, step: int, root: Path, checksums: bool = True) -> str | None:
        """The remote checkpoint of `step` into `root/step_XXXXXXXX`, verified; why it is unusable, or None."""
        final = root / f"step_{step:08d}"
        work = root / f".step_{step:08d}.partial"
        shutil.rmtree(work, ignore_errors=True)
        start = time.monotonic()
        print(f"downloading {self._folder(step)} ...", flush=True)
        try:
            self.fs.get(f"{self._folder(step)}/", str(work), recursive=True)
            why = problem(work, checksums=checksums)
        except (OSError, CheckpointError, ValueError) as err:
            why = f"its download failed ({err})"
        if why is not None:
            shutil.rmtree(work, ignore_errors=True)
            return why
        shutil.rmtree(final, ignore_errors=True)  # a local copy that did not verify
        work.rename(final)
        size = sum(p.stat().st_size for p in final.rglob("*") if p.is_file())
        print(f"downloaded {size / 2**20:.1f} MiB in {time.monotonic() - start:.1f} s", flush=True)
        return None
