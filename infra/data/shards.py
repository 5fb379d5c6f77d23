"""Shards of packed, fixed-length samples, and the index that describes them.

On disk (`DATA_DIR/`):

    index.json            format version, sequence length, dtype, tokenizer, fields, one entry per shard
    shard_00000.npy       the primary field (`input_ids`: uint16/uint32 of shape (num_samples, seq_len);
                          or, say, `pixel_values`: uint8 of shape (num_samples, 1, 8, 8)), memory-mapped
    shard_00000.labels.npy  each further field of the samples (labels, ...), row for row
    tokenizer/            the tokenizer the samples were made with (save_pretrained), if any

A data set of token ids alone reads as a LongTensor batch; one with several fields reads as a
dict of tensors named by field. Integer fields are read as int64, except uint8 (pixels, masks),
which stays as stored.

Every file is written under a temporary name and renamed into place; `index.json` is written
last, so a shard the index lists is always complete. The reader opens shards lazily with
`numpy.load(mmap_mode="r")`: memory does not grow with the dataset.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import torch

from infra.data.errors import DataError
from infra.data.remote import RemoteDir, is_remote
from infra.files import atomic_write_text, publish_dir, sha256_file

FORMAT_VERSION = 2  # 2 added fields besides the primary one; version 1 still reads
INDEX_FILE = "index.json"
TOKENIZER_DIR = "tokenizer"


@dataclass
class ShardInfo:
    file: str  # the primary field's
    num_samples: int
    sha256: str
    fields: dict[str, dict[str, str]] = field(default_factory=dict)  # every further field: {"file", "sha256"}

    def files(self, primary: str) -> dict[str, tuple[str, str]]:
        """Every field's (file, sha256), the primary first."""
        return {primary: (self.file, self.sha256), **{k: (v["file"], v["sha256"]) for k, v in self.fields.items()}}


@dataclass
class DataIndex:
    seq_len: int  # tokens per sample (0 where samples are not token sequences)
    dtype: str  # the primary field's
    vocab_size: int
    tokenizer: str  # what the tokenizer was made from: "trained:<corpus>", a path / hub id, or "none"
    source: str
    shards: list[ShardInfo] = field(default_factory=list)
    format_version: int = FORMAT_VERSION
    primary: str = "input_ids"
    sample_shape: list[int] | None = None  # the primary field's shape per sample; None: [seq_len]
    fields: dict[str, dict] = field(default_factory=dict)  # every further field: {"dtype", "shape"} per sample
    labels: list[str] = field(default_factory=list)  # class names, for classification data

    @property
    def num_samples(self) -> int:
        return sum(s.num_samples for s in self.shards)

    def layout(self) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
        """Every field's stored dtype and per-sample shape, the primary first."""
        primary = (np.dtype(self.dtype), tuple(self.sample_shape if self.sample_shape is not None else [self.seq_len]))
        return {self.primary: primary, **{k: (np.dtype(v["dtype"]), tuple(v["shape"])) for k, v in self.fields.items()}}

    def save(self, data_dir: Path) -> None:
        atomic_write_text(data_dir / INDEX_FILE, json.dumps(asdict(self), indent=2))

    def publish(self, work: Path, out: Path) -> None:
        """Write this index last into the finished folder `work`, then rename it to `out` (replacing a leftover)."""
        self.save(work)
        publish_dir(work, out)  # what was at `out` without index.json is an unfinished leftover

    @classmethod
    def load(cls, data_dir: Path) -> DataIndex:
        path = Path(data_dir) / INDEX_FILE
        if not path.is_file():
            raise DataError(f"{path} does not exist: prepare the data first (make data, python -m infra.data.prepare or infra.data.tasks)")
        raw = json.loads(path.read_text())
        if raw.get("format_version") not in (1, FORMAT_VERSION):
            raise DataError(f"{path}: format_version {raw.get('format_version')!r} is not one of the supported 1, {FORMAT_VERSION}")
        raw["shards"] = [ShardInfo(**s) for s in raw["shards"]]
        return cls(**raw)


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32)


def save_npy(path: Path, array: np.ndarray) -> None:
    """Write `array` to `path` as .npy: to `path.tmp`, fsync, then rename (a listed file is whole)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.save(f, array, allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_shard(data_dir: Path, shard_id: int, samples: np.ndarray | dict[str, np.ndarray]) -> ShardInfo:
    """Write one shard atomically and return its index entry: an array, or a dict of fields (the primary first)."""
    fields = samples if isinstance(samples, dict) else {"": samples}
    if len({len(rows) for rows in fields.values()}) != 1:
        raise ValueError(f"the fields of shard {shard_id} have different numbers of samples: { {k: len(v) for k, v in fields.items()} }")
    written = []
    for name, rows in fields.items():
        path = data_dir / (f"shard_{shard_id:05d}.{name}.npy" if written else f"shard_{shard_id:05d}.npy")
        save_npy(path, rows)
        written.append((name, {"file": path.name, "sha256": sha256_file(path)}))
    (_, first), extra = written[0], dict(written[1:])
    return ShardInfo(file=first["file"], num_samples=len(next(iter(fields.values()))), sha256=first["sha256"], fields=extra)


def verify(data_dir: Path, index: DataIndex, checksums: bool) -> None:
    """Raise DataError naming the first shard that is missing, truncated or (with checksums) altered."""
    if index.num_samples == 0:
        raise DataError(f"{data_dir}: the index lists no samples (was the source empty or shorter than seq_len?)")
    for path, _, check in file_checks(data_dir, index, checksums):
        if not path.is_file():
            raise DataError(f"{path} is listed in {INDEX_FILE} but missing")
        check(path)


def file_checks(
    data_dir: Path, index: DataIndex, checksums: bool, where: str | None = None
) -> list[tuple[Path, int, Callable[[Path], None]]]:
    """(path, bytes its samples take, check) for every file the index lists: check(p) raises DataError unless `p`
    holds what the index says (errors name the file under `where`, the remote URL say, or under data_dir)."""
    layout = index.layout()
    out = []
    for shard in index.shards:
        for name, (file, digest) in shard.files(index.primary).items():
            dtype, shape = layout[name]
            shape = (shard.num_samples, *shape)
            payload = int(np.prod(shape)) * dtype.itemsize
            label = f"{where}/{file}" if where else str(Path(data_dir) / file)
            check = partial(_check_file, label=label, dtype=dtype, shape=shape, payload=payload, digest=digest if checksums else None)
            out.append((Path(data_dir) / file, payload, check))
    return out


def _check_file(path: Path, label: str, dtype: np.dtype, shape: tuple[int, ...], payload: int, digest: str | None) -> None:
    try:
        stored, start = _npy_header(path)
    except ValueError as err:  # not an .npy file at all, or its header is cut
        raise DataError(f"{label} is not a readable .npy file ({err})") from None
    if stored != (dtype, shape):
        raise DataError(f"{label} holds {stored[1]} {stored[0]}, the index says {shape} {dtype}")
    expected = start + payload
    if path.stat().st_size < expected:
        raise DataError(f"{label} is truncated: {path.stat().st_size} bytes, expected {expected}")
    if digest is not None and sha256_file(path) != digest:
        raise DataError(f"{label} does not match the sha256 in {INDEX_FILE}: the file was altered or damaged")


def _npy_header(path: Path) -> tuple[tuple[np.dtype, tuple[int, ...]], int]:
    """((dtype, shape), offset of the data) from a .npy file's header, without reading the data."""
    with open(path, "rb") as f:
        major, _ = np.lib.format.read_magic(f)
        shape, _, dtype = (np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0)(f)
        return (dtype, tuple(shape)), f.tell()


def check_fits_model(index: DataIndex, eos_token_id: int, model_config) -> None:
    """Raise DataError when the model cannot take these samples: too few token ids or positions, or another tokenizer."""
    if model_config.vocab_size < index.vocab_size:
        raise DataError(
            f"the model's vocab_size={model_config.vocab_size} is smaller than the data's {index.vocab_size} "
            f"(tokenizer {index.tokenizer!r}): use a model made for this tokenizer"
        )
    positions = getattr(model_config, "max_position_embeddings", None)
    if positions is not None and positions < index.seq_len:
        raise DataError(f"the data's seq_len={index.seq_len} exceeds the model's max_position_embeddings={positions}")
    model_eos = model_config.eos_token_id
    if model_eos is not None and eos_token_id not in (model_eos if isinstance(model_eos, list) else [model_eos]):
        raise DataError(
            f"the data separates documents with token {eos_token_id} (tokenizer {index.tokenizer!r}) but the model's "
            f"eos_token_id is {model_eos}: the data was tokenized for another model"
        )


class PackedDataset(torch.utils.data.Dataset):
    """Map-style view of all shards: sample `i` of the global sample space -> LongTensor[seq_len]
    (or, for data with several fields, a dict of tensors).

    Shards are memory-mapped on first touch in each process (DataLoader workers included); at most
    `max_open_shards` stay mapped, the least recently opened are closed first. The loader's order
    touches about `shuffle_window / samples_per_shard` shards at a time, well below that.
    """

    max_open_shards = 512

    def __init__(self, data_dir: str | os.PathLike, verify_checksums: bool = False, hash_fetches: bool = False, check: bool = True):
        self.source = str(data_dir)  # a folder, or an fsspec URL read through a local cache (infra.data.remote)
        self.remote = RemoteDir(self.source) if is_remote(self.source) else None
        self.data_dir = self.remote.open(INDEX_FILE, (TOKENIZER_DIR,)) if self.remote else Path(data_dir)
        self.index = DataIndex.load(self.data_dir)
        if check:  # every file's size and header (and sha256 with verify_checksums); check=False where another process did
            self.check(checksums=verify_checksums)
        # what a shard fetched later must pass (remote data): its header and size, and its sha256 if asked for
        self._fetch_checks = (
            {path.name: check for path, _, check in file_checks(self.data_dir, self.index, hash_fetches, self.remote.url)}
            if self.remote
            else {}
        )
        self._starts = np.cumsum([0] + self.shard_sizes)
        self._maps: dict[tuple[int, str], np.ndarray] = {}
        self._layout = self.index.layout()
        self._tokens_only = list(self._layout) == ["input_ids"]

    def check(self, checksums: bool) -> None:
        """Raise DataError naming the first shard file that is missing, truncated or (with checksums) altered.

        Remote data: one listing shows every file is there; with checksums every file is fetched
        into the cache (a cached copy is hashed, and fetched again if it does not match).
        """
        if self.remote is None:
            return verify(self.data_dir, self.index, checksums)
        listed = self.remote.sizes()
        for path, payload, check in file_checks(self.data_dir, self.index, checksums, self.remote.url):
            url = f"{self.remote.url}/{path.name}"
            if path.name not in listed:
                raise DataError(f"{url} is listed in {INDEX_FILE} but missing")
            if listed[path.name] < payload:
                raise DataError(f"{url} is truncated: {listed[path.name]} bytes, its samples alone take {payload}")
            if checksums and path.is_file():  # the cached copy is what the run reads: hash it, fetch again if it is bad
                try:
                    check(path)
                except (DataError, FileNotFoundError):  # FileNotFoundError: another rank removed it first
                    path.unlink(missing_ok=True)
            if checksums:
                self.remote.fetch(path.name, check)  # checked whole on the way in
        if self.index.num_samples == 0:
            raise DataError(f"{self.source}: the index lists no samples")
        return None

    @property
    def seq_len(self) -> int:
        return self.index.seq_len

    @property
    def shard_sizes(self) -> list[int]:
        return [s.num_samples for s in self.index.shards]

    @property
    def tokenizer_dir(self) -> Path:
        return self.data_dir / TOKENIZER_DIR

    def __len__(self) -> int:
        return int(self._starts[-1])

    @property
    def fields(self) -> list[str]:
        return list(self._layout)

    def _rows(self, shard: int, name: str) -> np.ndarray:
        rows = self._maps.get((shard, name))
        if rows is None:  # a plain ndarray over the map: np.memmap's indexing costs a few µs more per row
            file = self.index.shards[shard].files(self.index.primary)[name][0]
            path = self.remote.fetch(file, self._fetch_checks[file]) if self.remote else self.data_dir / file
            rows = np.load(path, mmap_mode="r").view(np.ndarray)
            if len(self._maps) >= self.max_open_shards:  # each map holds a file descriptor: close the oldest
                del self._maps[next(iter(self._maps))]
            self._maps[(shard, name)] = rows
        return rows

    def __getitem__(self, i: int) -> torch.Tensor | dict[str, torch.Tensor]:
        return _first(self.__getitems__([i]))

    def __getitems__(self, ids: list[int]) -> torch.Tensor | dict[str, torch.Tensor]:
        """A batch as one tensor, or a dict of them (the DataLoader calls this instead of `__getitem__` per sample)."""
        ids = _sample_ids(ids, len(self))
        shards = np.searchsorted(self._starts, ids, side="right") - 1
        batch = self.new_batch(len(ids))
        read_rows(batch, self._rows, shards, ids - self._starts[shards])
        return self.as_batch(batch)

    # A mixture (infra.data.mixture) reads its sources' shards through one table of them, into one batch.
    def new_batch(self, n: int) -> dict[str, np.ndarray]:
        """`n` unfilled rows of each field, in the dtype a batch has (integers widened to int64, bytes kept)."""
        wide = lambda dtype: np.int64 if dtype.kind in "iu" and dtype != np.uint8 else dtype  # noqa: E731
        return {name: np.empty((n, *shape), dtype=wide(dtype)) for name, (dtype, shape) in self._layout.items()}

    def as_batch(self, batch: dict[str, np.ndarray]) -> torch.Tensor | dict[str, torch.Tensor]:
        tensors = {name: torch.from_numpy(out) for name, out in batch.items()}
        return tensors["input_ids"] if self._tokens_only else tensors

    def shard_table(self) -> list[tuple[int, Callable[[str], np.ndarray], int]]:
        """Per shard: its first sample, what gives its rows of a field, and the row of that first sample."""
        return [(int(start), partial(self._rows, shard), 0) for shard, start in enumerate(self._starts[:-1])]

    def __getstate__(self):  # workers reopen their own maps
        state = self.__dict__.copy()
        state["_maps"] = {}
        return state

    def split(self, held_out: int) -> tuple[SampleRange, SampleRange]:
        """(train, eval): the last `held_out` samples of the global sample space are kept out of training.

        The eval samples are the tail of the last shards (the end of the corpus as prepared); the
        training order is then a permutation of the first `len(self) - held_out` samples.
        """
        if not 0 <= held_out < len(self):
            raise DataError(f"eval_samples={held_out} must be >= 0 and leave samples to train on: the data has {len(self)}")
        cut = len(self) - held_out
        return SampleRange(self, 0, cut), SampleRange(self, cut, len(self))


class SampleRange(torch.utils.data.Dataset):
    """Samples `start..stop` of a PackedDataset, renumbered from 0; its shard sizes are the parent's, cut to the range."""

    def __init__(self, parent: PackedDataset, start: int, stop: int):
        self.parent, self.start, self.stop = parent, start, stop
        starts = parent._starts
        self.shard_sizes = [
            int(min(stop, starts[i + 1]) - max(start, starts[i]))
            for i in range(len(starts) - 1)
            if starts[i + 1] > start and starts[i] < stop
        ]

    @property
    def seq_len(self) -> int:
        return self.parent.seq_len

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, i: int) -> torch.Tensor | dict[str, torch.Tensor]:
        return _first(self.__getitems__([i]))

    def __getitems__(self, ids: list[int]) -> torch.Tensor | dict[str, torch.Tensor]:
        return self.parent.__getitems__(_sample_ids(ids, len(self)) + self.start)

    def new_batch(self, n: int) -> dict[str, np.ndarray]:
        return self.parent.new_batch(n)

    def as_batch(self, batch: dict[str, np.ndarray]) -> torch.Tensor | dict[str, torch.Tensor]:
        return self.parent.as_batch(batch)

    def shard_table(self) -> list[tuple[int, Callable[[str], np.ndarray], int]]:
        """The parent's shard table, cut to the range and renumbered from 0."""
        return [
            (max(first - self.start, 0), rows, max(self.start - first, 0))
            for (first, rows, _), end in zip(self.parent.shard_table(), self.parent._starts[1:], strict=True)
            if end > self.start and first < self.stop
        ]


def read_rows(batch: dict[str, np.ndarray], rows: Callable[[int, str], np.ndarray], shards: np.ndarray, offsets: np.ndarray) -> None:
    """Fill `batch`: its row j of each field is row `offsets[j]` of shard `shards[j]` (`rows(shard, field)`)."""
    pairs = list(zip(shards.tolist(), offsets.tolist(), strict=True))
    for name, out in batch.items():
        for j, (shard, offset) in enumerate(pairs):
            out[j] = rows(shard, name)[offset]


def _first(batch):
    return {k: v[0] for k, v in batch.items()} if isinstance(batch, dict) else batch[0]


def _sample_ids(ids, n: int) -> np.ndarray:
    """`ids` as an int64 array, each checked to lie in [0, n)."""
    ids = np.asarray(ids, dtype=np.int64)
    if len(ids) and (ids.min() < 0 or ids.max() >= n):
        raise IndexError(f"sample ids {ids.min()}..{ids.max()} outside [0, {n})")
    return ids
