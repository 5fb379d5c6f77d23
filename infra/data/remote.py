"""Prepared data on object storage (`s3://bucket/prefix`, `gs://...`, any fsspec URL), read through a local cache.

    make train ARGS="--data_dir s3://my-bucket/data/stdlib"     # credentials and endpoint as fsspec/boto find them
    INFRA_DATA_CACHE=/local/nvme/cache make train ...           # where fetched files go (default ~/.cache/infra/data)

Opening the data fetches `index.json` (always: it says what the data is now) and the tokenizer; a
shard file is fetched the first time a sample of it is read, by whichever process reads it
(DataLoader workers included; one process per node downloads it, the others wait on a lock file),
then memory-mapped like a local shard. So a run reads from storage only the shards its order
reaches, each once per node, and a restart reads none again.

The cache folder is named by the URL and the index's own hash: data rewritten under the same URL
gets a new folder, never a mix of old and new files. A file is downloaded under a temporary name,
checked (the .npy header against the index, the size; the sha256 too when checksums are asked
for) and renamed into place, so several ranks fetching one file at once, or a crash midway, never
leave a partial file where a whole one is expected.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
from pathlib import Path

from infra.data.errors import DataError

CACHE_ENV = "INFRA_DATA_CACHE"


def is_remote(path: str | os.PathLike) -> bool:
    """An fsspec URL other than a local file."""
    text = str(path)
    return "://" in text and not text.startswith("file://")


class RemoteDir:
    """A remote data folder and its local cache (picklable: each process opens its own connection)."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self._fs, self._pid = None, None
        base = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "infra" / "data")
        self.base = base / hashlib.sha256(self.url.encode()).hexdigest()[:16]
        self.cache: Path | None = None

    def __getstate__(self):
        return {**self.__dict__, "_fs": None, "_pid": None}

    @property
    def fs(self):
        """This process's filesystem: a DataLoader worker forked from a process that had one makes its own (fsspec's
        async filesystems are not fork-safe)."""
        if self._fs is None or self._pid != os.getpid():
            import fsspec

            self._fs, self._pid = fsspec.core.url_to_fs(self.url, skip_instance_cache=True)[0], os.getpid()
        return self._fs

    def _remote(self, rel: str) -> str:
        return f"{self.url}/{rel}"

    def open(self, index_file: str, folders: tuple[str, ...]) -> Path:
        """Fetch the index and the small `folders` (the tokenizer) into this version's cache folder; returns the folder."""
        try:
            index = self.fs.cat_file(self._remote(index_file))
        except FileNotFoundError:
            raise DataError(f"{self._remote(index_file)} does not exist: prepare the data and upload the folder first") from None
        self.cache = self.base / hashlib.sha256(index).hexdigest()[:16]
        self.cache.mkdir(parents=True, exist_ok=True)
        _write_atomically(self.cache / index_file, index)
        for folder in folders:
            self._fetch_folder(folder)
        return self.cache

    def _fetch_folder(self, folder: str) -> None:
        remote_folder = self._remote(folder)
        if self.fs.isdir(remote_folder):
            for remote in self.fs.find(remote_folder):
                rel = remote[len(self.fs._strip_protocol(remote_folder)) + 1 :]
                target = self.cache / folder / rel
                if not target.is_file():
                    target.parent.mkdir(parents=True, exist_ok=True)
                    _write_atomically(target, self.fs.cat_file(remote))

    def sizes(self) -> dict[str, int]:
        """Every file under the URL and its size, from one listing."""
        root = self.fs._strip_protocol(self.url)
        return {path[len(root) + 1 :]: info["size"] for path, info in self.fs.find(self.url, detail=True).items()}

    def fetch(self, rel: str, check) -> Path:
        """The local copy of `rel`, downloaded and passed through `check(path)` (raises DataError) if not cached yet.

        One process per node downloads a file (a lock file beside it); the others wait and find it cached.
        """
        target = self.cache / rel
        if target.is_file():
            return target
        with open(target.with_name(f".{target.name}.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if target.is_file():  # another process fetched it while this one waited
                return target
            tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
            try:
                self.fs.get_file(self._remote(rel), str(tmp))
                check(tmp)
                os.replace(tmp, target)
            finally:
                tmp.unlink(missing_ok=True)
        return target


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
