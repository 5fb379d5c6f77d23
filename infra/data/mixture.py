"""Weighted mixtures of prepared datasets: one global order over several sources, exact and O(1) to resume.

    data_mixture:                        # in a recipe's YAML (data_dir alone stays the one-source form)
      - {name: code, data_dir: data/code, weight: 0.7}
      - {name: docs, data_dir: data/docs, weight: 0.3}
    --data_mixture name=code,data_dir=data/code,weight=0.7 name=docs,data_dir=data/docs,weight=0.3

Instead of weights, every source may give `samples: N` or `epochs: E` per global epoch (a proportion of N, or of E x
its size). When these whole numbers, divided by their greatest common divisor, add up to at most 10,000, every global
epoch holds exactly those counts; otherwise they are proportions, like weights.

Order: position `p` of the mixture (0, 1, 2, ... without end) belongs to the source `pattern[p mod S]`. The pattern is
one period of a smooth weighted round robin over the weights as integers `W_k` (their sum `S`, at most 10,000), so in
every prefix of the mixture each source's count is within two samples of `p x weight` (plus `p / 10,000` from the
rounding; tested for random mixtures, where it stayed within 1.2)."""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from infra.data.errors import DataError
from infra.data.loader import EpochOrder, Read, collate, read_ahead
from infra.data.shards import SampleRange, read_rows
from infra.shares import SizeSchedule, sliced

RESOLUTION = 10_000  # the weights as integers summing to at most this (one period of the order)


AMOUNTS = ("weight", "samples", "epochs")  # how much of a source: a proportion, or samples / epochs per global epoch


@dataclass(frozen=True)
class Source:
    name: str
    data_dir: str
    weight: float | None = None  # a proportion of the samples (need not sum to 1)
    samples: int | None = None  # or: this many samples per global epoch
    epochs: float | None = None  # or: this many passes over the source per global epoch


def parse_sources(items: list[str]) -> list[Source]:
    """`name=code,data_dir=data/code,weight=0.7` items (a YAML mapping becomes one such item) -> Sources; raises
    ValueError naming what is wrong. Instead of `weight`, a source may give `samples` or `epochs` per global epoch;
    either every source gives a weight, or every source gives samples or epochs."""
    sources = []
    for item in items:
        fields = dict(part.split("=", 1) for part in str(item).split(",") if "=" in part)
        amounts = [a for a in AMOUNTS if a in fields]
        if len(amounts) != 1 or set(fields) != {"name", "data_dir", *amounts}:
            raise ValueError(
                f"data_mixture item {item!r} is not valid: expected name=..., data_dir=... and one of weight=..., samples=..., epochs=..."
            )
        amount, text = amounts[0], fields[amounts[0]]
        try:
            value = int(text) if amount == "samples" else float(text)
        except ValueError:
            value = -1
        if not value > 0:
            kind = "an integer" if amount == "samples" else "a number"
            raise ValueError(f"data_mixture {amount}={text!r} of {fields['name']!r} is not valid: expected {kind} > 0")
        sources.append(Source(fields["name"].strip(), fields["data_dir"].strip(), **{amount: value}))
    names = [s.name for s in sources]
    if len(set(names)) != len(names) or not all(names):
        raise ValueError(f"data_mixture names {names} are not valid: expected distinct, non-empty names")
    if len({s.weight is None for s in sources}) > 1:
        raise ValueError(
            f"data_mixture {[s.name for s in sources if s.weight is not None]} give a weight and "
            f"{[s.name for s in sources if s.weight is None]} samples or epochs: expected every source to give a weight, "
            "or every source samples or epochs"
        )
    return sources


def shares(sources: list[Source], sizes: list[int]) -> dict[str, float]:
    """Each source's share of the mixture: its weight, or its samples per global epoch (`epochs` x its size)."""
    out = {}
    for s, size in zip(sources, sizes, strict=True):
        out[s.name] = s.weight if s.weight is not None else s.samples if s.samples is not None else s.epochs * size
    return out


class Pattern:
    """One period of the interleave of sources with these weights: which source each slot is, and its count so far."""

    def __init__(self, weights: list[float]):
        w = np.asarray(weights, dtype=np.float64)
        whole = (w == np.round(w)).all() and w.sum() < 2**53
        if whole and w.sum() / np.gcd.reduce(w.astype(np.int64)) <= RESOLUTION:
            ints = w.astype(np.int64)  # whole numbers (samples per global epoch, say): kept exactly
        else:
            quota = w / w.sum() * RESOLUTION
            ints = np.maximum(np.floor(quota).astype(np.int64), 1)
            for k in np.argsort(-(quota - np.floor(quota)), kind="stable")[: max(0, RESOLUTION - int(ints.sum()))]:
                ints[k] += 1  # largest remainders first
        ints //= np.gcd.reduce(ints)
        self.counts, self.period = ints, int(ints.sum())
        current = np.zeros(len(ints), dtype=np.int64)
        self.source = np.empty(self.period, dtype=np.int64)
        self.rank = np.empty(self.period, dtype=np.int64)  # the slot's count within its source, in the period
        self.before = np.zeros((self.period + 1, len(ints)), dtype=np.int64)  # each source's count before each slot
        for i in range(self.period):  # smooth weighted round robin: the source furthest behind its share goes next
            current += ints
            k = int(np.argmax(current))
            current[k] -= self.period
            self.source[i], self.rank[i] = k, self.before[i, k]
            self.before[i + 1] = self.before[i]
            self.before[i + 1, k] += 1

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The source of each position, and that sample's number within its source."""
        rounds, slot = np.divmod(positions, self.period)
        source = self.source[slot]
        return source, rounds * self.counts[source] + self.rank[slot]

    def taken(self, position: int) -> np.ndarray:
        """Each source's count in positions [0, position)."""
        rounds, slot = divmod(position, self.period)
        return rounds * self.counts + self.before[slot]


def source_seed(seed: int, name: str) -> list[int]:
    """A source's order depends on the run's seed and its name (not on its place in the list)."""
    return [seed, zlib.crc32(name.encode())]


@dataclass
class Mixture:
    """The sources of a data_mixture as opened: their training samples and shard sizes, in order."""

    sources: list[Source]
    sizes: list[int]
    shard_sizes: list[list[int]]


class MixtureCursor:
    """Where the run is in the mixture: its position, and the segment it is in (weights, start, each source's count at
    the start). Saved in every checkpoint's manifest."""

    def __init__(self, sources: list[Source], sizes: list[int], allow_new_segment: bool = False):
        self.names, self.sizes = [s.name for s in sources], sizes
        self.weights = shares(sources, sizes)
        self.allow_new_segment = allow_new_segment
        self.position, self.start = 0, 0
        self.base = dict.fromkeys(self.names, 0)
        self.segments: list[dict] = [{"start": 0, "weights": self.weights}]
        self.pattern = Pattern(list(self.weights.values()))

    def taken(self, position: int | None = None) -> dict[str, int]:
        """Each source's samples handed out before `position` (default: the cursor's)."""
        counts = self.pattern.taken((self.position if position is None else position) - self.start)
        return {name: self.base[name] + int(c) for name, c in zip(self.names, counts, strict=True)}

    @property
    def epoch(self) -> int:
        """The epochs every source has completed (the least repeated one's)."""
        taken = self.taken()
        return min(taken[name] // size for name, size in zip(self.names, self.sizes, strict=True))

    def state_dict(self) -> dict:
        taken = self.taken()
        sources = {n: {"samples": taken[n], "epoch": taken[n] // s} for n, s in zip(self.names, self.sizes, strict=True)}
        return {"position": self.position, "start": self.start, "base": self.base, "segments": self.segments, "sources": sources}

    def load_state_dict(self, state: dict) -> None:
        if "position" not in state:
            raise DataError("the checkpoint was written by a run on one data_dir, not a data_mixture: resume it with its data_dir")
        saved = state["segments"][-1]["weights"]
        self.position = int(state["position"])
        if saved == self.weights:
            self.start, self.base, self.segments = int(state["start"]), dict(state["base"]), list(state["segments"])
            return
        if not self.allow_new_segment:
            raise DataError(
                f"data_mixture {self.weights} differs from the checkpoint's {saved}: set new_mixture_segment: true to go on "
                f"from its position {self.position} with the new one (recorded), or resume with the checkpoint's mixture"
            )
        old = Pattern(list(saved.values()))
        counts = old.taken(self.position - int(state["start"]))
        reached = {name: int(state["base"][name]) + int(c) for name, c in zip(saved, counts, strict=True)}
        self.start, self.base = self.position, {name: reached.get(name, 0) for name in self.names}
        self.segments = [*state["segments"], {"start": self.position, "weights": self.weights}]

    def __repr__(self) -> str:
        return f"MixtureCursor(position={self.position}, samples={self.taken()})"


class MixtureDataset(torch.utils.data.Dataset):
    """The sources' training samples as one sample space: source `k`'s sample `i` is global id `offsets[k] + i`.

    A batch is read as from one dataset: the sources' shards form one table (each shard's first global id, what gives
    its rows, the row of that id), so a batch costs one search over it and one copy per sample, whichever sources its
    samples come from. The parts give `shard_table`, `new_batch` and `as_batch` (PackedDataset and SampleRange do)."""

    def __init__(self, names: list[str], parts: list[SampleRange]):
        self.names, self.parts = names, parts
        self.offsets = np.concatenate([[0], np.cumsum([len(p) for p in parts])])
        table = [(int(self.offsets[k]) + first, rows, row) for k, part in enumerate(parts) for first, rows, row in part.shard_table()]
        self._firsts = np.asarray([first for first, _, _ in table], dtype=np.int64)
        self._rows = [rows for _, rows, _ in table]
        self._row0 = np.asarray([row for _, _, row in table], dtype=np.int64)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def source_index(self, ids) -> np.ndarray:
        """The source (its number) of each global sample id."""
        return np.searchsorted(self.offsets, np.asarray(ids), side="right") - 1

    def source_of(self, ids) -> list[str]:
        return [self.names[k] for k in self.source_index(ids)]

    def __getitems__(self, ids: list[int]):
        ids = np.asarray(ids, dtype=np.int64)
        if len(ids) and (ids.min() < 0 or ids.max() >= len(self)):
            raise IndexError(f"sample ids {ids.min()}..{ids.max()} outside [0, {len(self)})")
        shard = np.searchsorted(self._firsts, ids, side="right") - 1
        batch = self.parts[0].new_batch(len(ids))
        read_rows(batch, lambda k, name: self._rows[k](name), shard, self._row0[shard] + ids - self._firsts[shard])
        return self.parts[0].as_batch(batch)


def grouped(which: np.ndarray, n: int) -> Iterator[tuple[int, np.ndarray]]:
    """(k, the indices i where which[i] == k, ascending) for each k in [0, n) that occurs."""
    order = np.argsort(which, kind="stable")
    ends = np.cumsum(np.bincount(which, minlength=n)).tolist()
    lo = 0
    for k, hi in enumerate(ends):
        if hi > lo:
            yield k, order[lo:hi]
        lo = hi


class MixtureOrder:
    """Global sample ids of mixture positions, for the cursor's segment."""

    def __init__(self, dataset: MixtureDataset, cursor: MixtureCursor, shard_sizes: list[list[int]], seed: int, window: int):
        self.dataset, self.cursor, self.seed, self.window = dataset, cursor, seed, window
        self.shard_sizes = shard_sizes
        self._orders: dict[tuple[int, int], EpochOrder] = {}

    def _order(self, k: int, epoch: int) -> EpochOrder:
        order = self._orders.get((k, epoch))
        if order is None:
            order = EpochOrder(self.shard_sizes[k], source_seed(self.seed, self.cursor.names[k]), epoch, self.window)
            if len(self._orders) >= 2 * len(self.shard_sizes):
                self._orders.pop(next(iter(self._orders)))
            self._orders[(k, epoch)] = order
        return order

    def __getitem__(self, positions: slice) -> np.ndarray:
        c = self.cursor
        sources, numbers = c.pattern.locate(np.arange(positions.start - c.start, positions.stop - c.start))
        ids = np.empty(len(sources), dtype=np.int64)
        for k, sel in grouped(sources, len(c.names)):
            # a source's samples in a run of positions are consecutive: its next len(sel), maybe across an epoch's end
            n, size, done = int(numbers[sel[0]]) + c.base[c.names[k]], c.sizes[k], 0
            while done < len(sel):
                epoch, first = divmod(n + done, size)
                count = min(len(sel) - done, size - first)
                ids[sel[done : done + count]] = self.dataset.offsets[k] + self._order(k, epoch)[first : first + count]
                done += count
        return ids


class _MixtureBatches(torch.utils.data.Sampler):
    """This rank's slice of each global batch of mixture positions (its size in the schedule: the even split unless
    changed, infra.shares), from the cursor's, without end. The ids are worked out BLOCK global batches at a time (the
    interleave's cost is per call, not per sample)."""

    BLOCK = 64

    def __init__(self, order: MixtureOrder, start: int, schedule: SizeSchedule, rank: int):
        self.order, self.start, self.schedule, self.rank = order, start, schedule, rank
        self.global_batch = sum(schedule.even)
        self._blocks: dict[int, np.ndarray] = {}

    def _block(self, s: int) -> np.ndarray:
        """The ids of positions [s, s + BLOCK x global batch): the DataLoader's and the loop's iterators each walk them."""
        ids = self._blocks.get(s)
        if ids is None:
            ids = self._blocks[s] = self.order[slice(s, s + self.BLOCK * self.global_batch)]
            if len(self._blocks) > 2:  # the DataLoader's prefetch runs less than a block ahead (else one is worked out again)
                self._blocks.pop(next(iter(self._blocks)))
        return ids

    def __iter__(self) -> Iterator[list[int]]:
        s = self.start
        while True:
            block = self._block(s)
            for k in range(len(block) // self.global_batch):
                (mine,) = sliced(
                    block[k * self.global_batch : (k + 1) * self.global_batch], self.rank, self.schedule.at(s // self.global_batch + k)
                )
                yield mine.tolist()
            s += self.BLOCK * self.global_batch


class MixtureLoader:
    """Endless iterator of this rank's batches over a mixture (ResumableLoader's interface)."""

    def __init__(self, dataset: MixtureDataset, cursor: MixtureCursor, shard_sizes, batch_size, seed, rank, world_size, **loader):
        self.dataset, self.cursor, self.batch_size = dataset, cursor, batch_size
        self.shard_sizes, self.seed, self.rank, self.world_size = shard_sizes, seed, rank, world_size
        self.shuffle_window = loader.pop("shuffle_window", 1 << 18)
        self.loader_args = loader  # num_workers, pin_memory
        self.schedule = SizeSchedule([batch_size] * world_size)  # each rank's samples of each global batch
        self.last_sample_ids: list[int] = []
        self.on_read: Callable[[int], None] | None = None

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.world_size

    @property
    def batches_consumed(self) -> int:
        return self.cursor.position // self.global_batch_size

    def read_ahead(self, depth: int = 0) -> int:
        """As ResumableLoader.read_ahead."""
        return read_ahead(self.loader_args.get("num_workers", 0), depth)

    def source_index(self, ids) -> np.ndarray:
        """The source (its number) of each sample id."""
        return self.dataset.source_index(ids)

    def source_names(self, ids) -> list[str]:
        return self.dataset.source_of(ids)

    def reading(self) -> Iterator[Read]:
        """As ResumableLoader.reading (the cursor's segment read, never its position)."""
        order = MixtureOrder(self.dataset, self.cursor, self.shard_sizes, self.seed, self.shuffle_window)
        sampler = _MixtureBatches(order, self.cursor.position, self.schedule, self.rank)
        loader = torch.utils.data.DataLoader(
            self.dataset, batch_sampler=sampler, collate_fn=collate, generator=torch.Generator(), **self.loader_args
        )
        for batch, ids in zip(loader, sampler, strict=False):
            if self.on_read is not None:
                self.on_read(len(ids))
            yield Read(batch, ids, 0)

    def handed(self, read: Read):
        self.last_sample_ids = read.ids
        self.cursor.position += self.global_batch_size
        return read.batch

    def __iter__(self):
        for read in self.reading():
            yield self.handed(read)
