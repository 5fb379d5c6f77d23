"""A resumable, rank-aware reader over the global sample space.

Order: epoch `e` visits the samples in `EpochOrder(seed, e)`: shards shuffled, then samples
shuffled within windows, a function of (seed, epoch) alone (not of the world size, not of the
worker count). The epoch is cut into global batches of `world_size * batch_size` samples; rank
`r` takes the `r`-th slice of each. A final global batch that would be short is dropped.

Position: one `DataCursor(epoch, samples_consumed)`, advanced when a batch is handed to the
training loop (never by what DataLoader workers prefetched). Restoring it costs one shard shuffle
and one window shuffle, whatever the position: no batch is read and thrown away to get there.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from infra.data.errors import DataError
from infra.shares import SizeSchedule, sliced


class DataCursor:
    """Where the run is in the data, counted at the training loop. Registered for checkpointing."""

    def __init__(self, epoch: int = 0, samples_consumed: int = 0):
        self.epoch = epoch
        self.samples_consumed = samples_consumed

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "samples_consumed": self.samples_consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch = int(state["epoch"])
        self.samples_consumed = int(state["samples_consumed"])

    def __repr__(self) -> str:
        return f"DataCursor(epoch={self.epoch}, samples_consumed={self.samples_consumed})"

    # What a mixture's cursor tells of its sources (infra.data.mixture.MixtureCursor): one source has none of its own.
    segments: tuple = ()

    def taken(self) -> dict[str, int]:
        return {}


class EpochOrder:
    """The global visiting order of one epoch, with locality, computed a window at a time.

    1. The shards are shuffled by `(seed, epoch)`.
    2. Their samples, concatenated in that order, are cut into windows of `window` samples, and
       each window is shuffled by `(seed, epoch, window number)`.

    So at any moment the readers touch about `window / samples_per_shard` shards, one after the
    other, which keeps reads near-sequential on network storage, while a window of many shards
    still mixes documents from far apart. Nothing here depends on the world size or the worker
    count, and nothing is O(dataset): seeking to any position costs one shard shuffle and one
    window shuffle, whether the position is sample 0 or sample 10,000,000.
    """

    def __init__(self, shard_sizes: list[int], seed: int, epoch: int, window: int):
        if window < 1:
            raise ValueError(f"shuffle_window={window} must be >= 1")
        sizes = np.asarray(shard_sizes, dtype=np.int64)
        shard_starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        perm = np.random.default_rng([seed, epoch]).permutation(len(sizes))
        self.seed, self.epoch = seed, epoch
        self.num_samples = int(sizes.sum())
        self.window = min(window, max(self.num_samples, 1))
        self._offsets = np.concatenate([[0], np.cumsum(sizes[perm])])  # where each shuffled shard starts
        self._bases = shard_starts[perm]  # its first global sample id
        self._cache: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self.num_samples

    def _window_ids(self, w: int) -> np.ndarray:
        ids = self._cache.get(w)
        if ids is None:
            lo = w * self.window
            hi = min(lo + self.window, self.num_samples)
            pos = lo + np.random.default_rng([self.seed, self.epoch, w]).permutation(hi - lo)
            shard = np.searchsorted(self._offsets, pos, side="right") - 1
            ids = self._bases[shard] + (pos - self._offsets[shard])
            if len(self._cache) >= 2:  # the reader and the DataLoader's sampler may straddle a boundary
                self._cache.pop(next(iter(self._cache)))
            self._cache[w] = ids
        return ids

    def __getitem__(self, positions: slice) -> np.ndarray:
        """Global sample ids at positions [start, stop) of the epoch."""
        start, stop, _ = positions.indices(self.num_samples)
        if start >= stop:
            return np.empty(0, dtype=np.int64)
        parts = [
            self._window_ids(w)[max(start - w * self.window, 0) : stop - w * self.window]
            for w in range(start // self.window, (stop - 1) // self.window + 1)
        ]
        return np.concatenate(parts) if len(parts) != 1 else parts[0]


class _RankBatches(torch.utils.data.Sampler):
    """This rank's slice of each global batch (its size in the schedule at that batch's position: the even split unless
    changed, infra.shares), from sample `start` of the epoch's order, whose global batch is at position `position`."""

    def __init__(self, order: EpochOrder, start: int, position: int, schedule: SizeSchedule, rank: int):
        self.order, self.start, self.position, self.schedule, self.rank = order, start, position, schedule, rank
        self.global_batch = sum(schedule.even)

    def __iter__(self) -> Iterator[list[int]]:
        for k, s in enumerate(range(self.start, len(self.order) - self.global_batch + 1, self.global_batch)):
            (mine,) = sliced(self.order[s : s + self.global_batch], self.rank, self.schedule.at(self.position + k))
            yield mine.tolist()

    def __len__(self) -> int:
        return max(0, (len(self.order) - self.start) // self.global_batch)


def read_ahead(num_workers: int, depth: int = 0) -> int:
    """Global batches past the one handed out that a loader may have sliced already: the DataLoader's workers prefetch 2
    batches each; a reading thread (infra.data.ahead) holds `depth` more, and one in its hands."""
    return 2 * num_workers + 1 + (depth + 1 if depth else 0)


class Read(NamedTuple):
    """A batch as read: its samples, their global ids, and the epoch it belongs to (ResumableLoader; a mixture's: 0)."""

    batch: Any
    ids: list[int]
    epoch: int


def collate(batch):
    """Datasets with `__getitems__` (PackedDataset) hand over a finished batch: a tensor or a dict of them."""
    finished = isinstance(batch, torch.Tensor) or (isinstance(batch, dict) and all(isinstance(v, torch.Tensor) for v in batch.values()))
    return batch if finished else torch.utils.data.default_collate(batch)


class ResumableLoader:
    """Endless iterator of this rank's batches; epochs roll over by themselves.

    Take a fresh `iter()` after restoring the cursor: an iterator reads the cursor when it starts.
    Each epoch runs a plain `torch.utils.data.DataLoader` with its own generator, so creating it
    draws nothing from the global RNG (that would shift dropout masks after a resume).
    """

    def __init__(
        self,
        dataset: torch.utils.data.Dataset,
        batch_size: int,
        seed: int,
        rank: int,
        world_size: int,
        cursor: DataCursor | None = None,
        num_workers: int = 0,
        pin_memory: bool = False,
        shuffle_window: int = 1 << 18,
    ):
        self.dataset, self.batch_size, self.seed = dataset, batch_size, seed
        self.shard_sizes = list(getattr(dataset, "shard_sizes", [len(dataset)]))
        self.shuffle_window = shuffle_window
        self.rank, self.world_size = rank, world_size
        self.cursor = cursor if cursor is not None else DataCursor()
        self.num_workers, self.pin_memory = num_workers, pin_memory
        self.schedule = SizeSchedule([batch_size] * world_size)  # each rank's samples of each global batch
        self.last_sample_ids: list[int] = []  # global ids of the batch most recently handed out
        self.on_read: Callable[[int], None] | None = None  # told each batch's samples as it is read (the test hooks)
        if len(dataset) < self.global_batch_size:
            raise DataError(
                f"the dataset has {len(dataset)} samples, fewer than one global batch "
                f"({world_size} processes x {batch_size}): prepare more data or lower per_device_train_batch_size"
            )

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.world_size

    @property
    def batches_per_epoch(self) -> int:
        return len(self.dataset) // self.global_batch_size

    def read_ahead(self, depth: int = 0) -> int:
        """Global batches past the one handed out that this loader may have sliced already, read `depth` ahead by a
        thread: a change of the schedule is for a position further on."""
        return read_ahead(self.num_workers, depth)

    @property
    def batches_consumed(self) -> int:
        """Global batches handed out since the first epoch began: a position in the data, whatever the restarts."""
        return self.cursor.epoch * self.batches_per_epoch + self.cursor.samples_consumed // self.global_batch_size

    def source_index(self, ids) -> None:
        """The source of each sample id: a mixture's loader tells (MixtureLoader), one dataset has none."""
        return None

    def source_names(self, ids) -> None:
        return None

    def reading(self) -> Iterator[Read]:
        """This rank's batches from the cursor on, epochs rolling over, read without moving the cursor: `handed` moves it
        as the loop takes each (so a thread may read ahead, infra.data.ahead)."""
        epoch, consumed = self.cursor.epoch, self.cursor.samples_consumed
        while True:
            order = EpochOrder(self.shard_sizes, self.seed, epoch, self.shuffle_window)
            position = epoch * self.batches_per_epoch + consumed // self.global_batch_size
            sampler = _RankBatches(order, consumed, position, self.schedule, self.rank)
            loader = torch.utils.data.DataLoader(
                self.dataset,
                batch_sampler=sampler,
                num_workers=self.num_workers,
                pin_memory=self.pin_memory,
                collate_fn=collate,
                generator=torch.Generator(),
            )
            for batch, ids in zip(loader, sampler, strict=True):
                if self.on_read is not None:
                    self.on_read(len(ids))
                yield Read(batch, ids, epoch)
            epoch, consumed = epoch + 1, 0

    def handed(self, read: Read):
        """`read` handed to the loop: the cursor moves past it (into its epoch first, when it began the next one)."""
        if read.epoch != self.cursor.epoch:
            self.cursor.epoch, self.cursor.samples_consumed = read.epoch, 0
        self.last_sample_ids = read.ids
        self.cursor.samples_consumed += self.global_batch_size
        return read.batch

    def __iter__(self) -> Iterator[torch.Tensor]:
        for read in self.reading():
            yield self.handed(read)


def eval_batches(dataset: torch.utils.data.Dataset, batch_size: int, rank: int, world_size: int) -> Iterator[torch.Tensor]:
    """This rank's share of a held-out set, in order: sample `i` goes to rank `i % world_size`.

    Every rank gets the same number of batches (sharded models run collectives in forward, so an
    extra batch on one rank would hang the others); the last `len % world_size` samples are left out.
    """
    ids = np.arange(len(dataset) - len(dataset) % world_size)[rank::world_size]
    for s in range(0, len(ids), batch_size):
        yield collate(dataset.__getitems__(ids[s : s + batch_size].tolist()))


class SampleTrace:
    """Appends the global sample ids each step consumed on this rank to `OUTPUT_DIR/trace/rank{r}.jsonl`.

    Lines past the step a run resumes from are dropped first: the trace always describes the
    history that led to the weights, so a loss spike can be traced to its exact batch.
    """

    def __init__(self, output_dir: str, rank: int, resume_step: int, world_size: int):
        self.path = Path(output_dir) / "trace" / f"rank{rank}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        cut(self.path, resume_step)
        if rank == 0:  # the ranks a launch on fewer processes lacks wrote steps it does again: no one else cuts them
            for path in self.path.parent.glob("rank*.jsonl"):
                if int(path.stem.removeprefix("rank")) >= world_size:
                    cut(path, resume_step)
        self._file = open(self.path, "a")  # noqa: SIM115 - closed by close()

    def write(self, step: int, ids: list[int], sources: list[str] | None = None) -> None:
        """The step's sample ids on this rank, and with a data_mixture the source of each."""
        line = {"step": step, "ids": ids, **({"sources": sources} if sources is not None else {})}
        self._file.write(json.dumps(line) + "\n")

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def cut(path: Path, step: int) -> None:
    """Drop a trace's lines past `step`."""
    kept = [line for line in path.read_text().splitlines() if traced_step(line) <= step] if path.exists() else []
    path.write_text("".join(line + "\n" for line in kept))


def traced_step(line: str) -> float:
    """The step of a trace line; infinite for the last line of a process killed while writing it (it is dropped)."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError):
        return float("inf")
