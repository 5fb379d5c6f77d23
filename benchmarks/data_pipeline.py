"""The data pipeline against its anchors, measured side by side in one run.

    make bench                                  # or: python benchmarks/data_pipeline.py [--samples 200000]

1. Loader throughput over one whole epoch, global shuffle, batch 32 of 512 int32 tokens:
   ResumableLoader over PackedDataset versus raw pyarrow reading a memory-mapped Arrow IPC file in a
   globally shuffled order (num_workers=0), and versus the same DataLoader handing out batches it
   did not read at all (num_workers=2: the ceiling of DataLoader's inter-process transfer here).
   Goals: >= 0.5x raw pyarrow; >= 0.8x the ceiling.
2. Resume cost: build the dataset and loader, restore the cursor, get the first batch, at sample 0
   and at sample 10,000,000 of a synthetic 10.5M-sample index (sparse shard files). Goal: flat
   (<= 1.2x) and <= 0.1 s.
3. Prepare throughput: tokens/s of `infra.data.prepare --num_proc 2` (read, tokenize, pack, write
   shards with checksums) versus `datasets.Dataset.map(batched=True, num_proc=2)` doing only the
   tokenization of the same texts with the same tokenizer.
4. Mixtures (infra.data.mixture): a 3-source mixture (weights 0.5/0.3/0.2 over three parts of the
   same shards) versus one source of the same total size, as many batches, workers=0 and 2. Goal: >= 0.9x.
   And its resume cost at position 0 and 10,000,000 of the sparse index cut in three. Goal: flat
   (<= 1.2x) and <= 0.1 s.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from infra.data import DataCursor, DataIndex, PackedDataset, ResumableLoader
from infra.data.shards import SampleRange, ShardInfo, write_shard

SEQ_LEN = 512
BATCH = 32
VOCAB = 100_000  # > 65,536: stored as 4-byte tokens, the same bytes as the int32 Arrow anchor


def synthetic_dataset(root: Path, num_samples: int, samples_per_shard: int = 8192) -> Path:
    """Random tokens as our shards, and the same tokens as one Arrow IPC file (the anchor's layout)."""
    import pyarrow as pa

    data_dir = root / "packed"
    data_dir.mkdir()
    index = DataIndex(seq_len=SEQ_LEN, dtype="uint32", vocab_size=VOCAB, tokenizer="synthetic", source="synthetic")
    rng = np.random.default_rng(0)
    schema = pa.schema([("input_ids", pa.list_(pa.int32(), SEQ_LEN))])
    with pa.OSFile(str(root / "anchor.arrow"), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
        for start in range(0, num_samples, samples_per_shard):
            rows = rng.integers(0, VOCAB, (min(samples_per_shard, num_samples - start), SEQ_LEN), dtype=np.uint32)
            index.shards.append(write_shard(data_dir, len(index.shards), rows))
            flat = pa.array(rows.reshape(-1).astype(np.int32))
            writer.write_batch(pa.record_batch([pa.FixedSizeListArray.from_arrays(flat, SEQ_LEN)], schema=schema))
    index.save(data_dir)
    return data_dir


def samples_per_second(batches, num_samples: int) -> float:
    start = time.perf_counter()
    seen = sum(len(b) for b in batches)
    elapsed = time.perf_counter() - start
    assert seen == num_samples, (seen, num_samples)
    return seen / elapsed


def raw_pyarrow(root: Path, num_samples: int) -> float:
    """The anchor: rows gathered in a global random order from a memory-mapped Arrow IPC file (zero-copy views)."""
    import pyarrow as pa

    reader = pa.ipc.open_file(pa.memory_map(str(root / "anchor.arrow")))
    parts = [
        reader.get_batch(i).column(0).values.to_numpy(zero_copy_only=True).reshape(-1, SEQ_LEN) for i in range(reader.num_record_batches)
    ]
    starts = np.cumsum([0] + [len(p) for p in parts])
    order = np.random.default_rng(1).permutation(num_samples)

    def batches():
        for s in range(0, num_samples - BATCH + 1, BATCH):
            ids = order[s : s + BATCH]
            rows = np.empty((BATCH, SEQ_LEN), dtype=np.int64)
            part = np.searchsorted(starts, ids, side="right") - 1
            for j, (p, i) in enumerate(zip(part, ids - starts[part], strict=True)):
                rows[j] = parts[p][i]
            yield torch.from_numpy(rows)

    return samples_per_second(batches(), num_samples // BATCH * BATCH)


class _Unread(torch.utils.data.Dataset):
    """Hands out batches of the right shape without reading anything: the DataLoader's own ceiling."""

    def __init__(self, dataset: PackedDataset):
        self.shard_sizes, self.n = dataset.shard_sizes, len(dataset)

    def __len__(self):
        return self.n

    def __getitems__(self, ids):
        return torch.zeros((len(ids), SEQ_LEN), dtype=torch.int64)


def one_epoch(dataset, num_workers: int) -> float:
    loader = ResumableLoader(dataset, BATCH, seed=0, rank=0, world_size=1, num_workers=num_workers)
    it = iter(loader)
    return samples_per_second((next(it) for _ in range(loader.batches_per_epoch)), loader.batches_per_epoch * BATCH)


def sparse_index(root: Path, num_shards: int = 160, samples_per_shard: int = 65536) -> Path:
    """A 10.5M-sample index whose shards are sparse files: real sizes, no disk used."""
    data_dir = root / "huge"
    data_dir.mkdir()
    index = DataIndex(seq_len=SEQ_LEN, dtype="uint32", vocab_size=VOCAB, tokenizer="synthetic", source="synthetic")
    for i in range(num_shards):
        name = f"shard_{i:05d}.npy"
        np.lib.format.open_memmap(data_dir / name, mode="w+", dtype=np.uint32, shape=(samples_per_shard, SEQ_LEN)).flush()
        index.shards.append(ShardInfo(file=name, num_samples=samples_per_shard, sha256="not computed"))
    index.save(data_dir)
    return data_dir


def resume_seconds(data_dir: Path, position: int) -> float:
    start = time.perf_counter()
    dataset = PackedDataset(data_dir)
    loader = ResumableLoader(dataset, BATCH, seed=0, rank=0, world_size=1, cursor=DataCursor(0, position))
    next(iter(loader))
    return time.perf_counter() - start


def three_sources(dataset: PackedDataset, position: int = 0, num_workers: int = 0):
    """The dataset cut into three sources, mixed 0.5/0.3/0.2, and a loader from `position`."""
    from infra.data.mixture import MixtureCursor, MixtureDataset, MixtureLoader, Source

    n = len(dataset)
    cuts = [0, n // 2, 3 * n // 4, n]
    parts = [SampleRange(dataset, cuts[i], cuts[i + 1]) for i in range(3)]
    sources = [Source(f"s{i}", "-", w) for i, w in enumerate((0.5, 0.3, 0.2))]
    cursor = MixtureCursor(sources, [len(p) for p in parts])
    cursor.position = position
    mixed = MixtureDataset([s.name for s in sources], parts)
    return MixtureLoader(mixed, cursor, [p.shard_sizes for p in parts], BATCH, 0, 0, 1, num_workers=num_workers)


def mixture_epoch(dataset: PackedDataset, num_workers: int) -> float:
    batches = len(dataset) // BATCH
    it = iter(three_sources(dataset, num_workers=num_workers))
    return samples_per_second((next(it) for _ in range(batches)), batches * BATCH)


def mixture_resume_seconds(data_dir: Path, position: int) -> float:
    start = time.perf_counter()
    next(iter(three_sources(PackedDataset(data_dir), position)))
    return time.perf_counter() - start


def prepare_tokens_per_second(root: Path, max_bytes: int) -> tuple[float, float]:
    import datasets

    from infra.data.prepare import PrepareArguments, load_tokenizer, prepare, train_tokenizer
    from infra.data.sources import iter_texts

    train_tokenizer(iter_texts("stdlib", max_bytes=2_000_000), 4096).save_pretrained(root / "tokenizer")
    start = time.perf_counter()
    index = prepare(PrepareArguments(output_dir=str(root / "prepared"), tokenizer=str(root / "tokenizer"), max_bytes=max_bytes, num_proc=2))
    ours = index.num_samples * index.seq_len / (time.perf_counter() - start)

    tokenizer = load_tokenizer(root / "tokenizer")
    texts = list(iter_texts("stdlib", max_bytes=max_bytes))
    datasets.disable_progress_bars()
    start = time.perf_counter()
    mapped = datasets.Dataset.from_dict({"text": texts}).map(
        lambda b: tokenizer(b["text"], add_special_tokens=False), batched=True, num_proc=2, remove_columns=["text"]
    )
    tokens = sum(len(ids) for ids in mapped["input_ids"])
    return ours, tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=200_000, help="samples in the loader benchmark's dataset")
    parser.add_argument("--prepare_bytes", type=int, default=8_000_000, help="text the prepare benchmark reads")
    args = parser.parse_args()
    scratch = Path(__file__).resolve().parents[1] / ".cache"  # on the project's disk, ignored by git
    scratch.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=scratch) as tmp:
        root = Path(tmp)
        print(f"writing {args.samples:,} samples x {SEQ_LEN} tokens twice (our shards, one Arrow IPC file) ...", flush=True)
        dataset = PackedDataset(synthetic_dataset(root, args.samples))
        one_epoch(dataset, 0)  # warm the page cache for both files
        raw_pyarrow(root, args.samples)
        results = {
            "raw pyarrow, mmap Arrow IPC, global shuffle, workers=0": raw_pyarrow(root, args.samples),
            "ResumableLoader, workers=0": one_epoch(dataset, 0),
            "unread batches (DataLoader ceiling), workers=2": one_epoch(_Unread(dataset), 2),
            "ResumableLoader, workers=2": one_epoch(dataset, 2),
        }
        print("\n1. loader throughput (samples/s, one epoch, batch 32 x 512 tokens)")
        for name, rate in results.items():
            print(f"   {name:<52} {rate:>12,.0f}")
        r0 = results["ResumableLoader, workers=0"] / results["raw pyarrow, mmap Arrow IPC, global shuffle, workers=0"]
        r2 = results["ResumableLoader, workers=2"] / results["unread batches (DataLoader ceiling), workers=2"]
        print(f"   ratio to raw pyarrow (workers=0)     : {r0:.2f}  (goal >= 0.5)")
        print(f"   ratio to the DataLoader ceiling (w=2): {r2:.2f}  (goal >= 0.8)")

        huge = sparse_index(root)
        at0 = statistics.median(resume_seconds(huge, 0) for _ in range(5))
        at10m = statistics.median(resume_seconds(huge, 10_000_000) for _ in range(5))
        print(f"\n2. resume cost over {len(PackedDataset(huge)):,} samples (median of 5)")
        print(f"   at sample 0          : {at0 * 1000:.1f} ms")
        print(f"   at sample 10,000,000 : {at10m * 1000:.1f} ms   ratio {at10m / at0:.2f}  (goal <= 1.2 and <= 100 ms)")

        m0 = statistics.median(mixture_resume_seconds(huge, 0) for _ in range(5))
        m10 = statistics.median(mixture_resume_seconds(huge, 10_000_000) for _ in range(5))
        print("\n4. mixtures: 3 sources (0.5/0.3/0.2) against one source of the same size (samples/s)")
        for workers in (0, 2):
            single, mixed = one_epoch(dataset, workers), mixture_epoch(dataset, workers)
            rates = f"one source {single:>10,.0f}, 3 sources {mixed:>10,.0f}"
            print(f"   workers={workers}: {rates}   ratio {mixed / single:.2f}  (goal >= 0.9)")
        resume = f"at position 0: {m0 * 1000:.1f} ms; at 10,000,000: {m10 * 1000:.1f} ms"
        print(f"   resume {resume}   ratio {m10 / m0:.2f}  (goal <= 1.2, <= 100 ms)")

        ours, hf = prepare_tokens_per_second(root, args.prepare_bytes)
        print(f"\n3. prepare, {args.prepare_bytes / 1e6:.0f} MB of stdlib text, 2 processes (tokens/s)")
        print(f"   infra.data.prepare (read, tokenize, pack, write, checksum) : {ours:>12,.0f}")
        print(f"   datasets.map (tokenize only)                               : {hf:>12,.0f}   ratio {ours / hf:.2f}")


if __name__ == "__main__":
    main()
