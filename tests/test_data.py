"""Data: prepare packs what the tokenizer says; the loader's order and cursor are exact."""

from __future__ import annotations

import itertools
import json
import shutil

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from infra.data import DataCursor, DataError, PackedDataset, ResumableLoader, eval_batches
from infra.data.loader import EpochOrder, SampleTrace
from infra.data.prepare import PrepareArguments, prepare
from infra.data.shards import INDEX_FILE


class Numbers(torch.utils.data.Dataset):
    """Sample i is the tensor [i]: batches then show exactly which samples they hold."""

    def __init__(self, n: int, shard_sizes: list[int] | None = None):
        self.n = n
        self.shard_sizes = shard_sizes or [n]
        assert sum(self.shard_sizes) == n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor([i])


def take(loader: ResumableLoader, n: int) -> list[list[int]]:
    return [b.flatten().tolist() for b in itertools.islice(iter(loader), n)]


def epoch_of(loader: ResumableLoader, rank_loaders: list[ResumableLoader]) -> list[int]:
    """One epoch as the training loop sees it: each global batch is rank 0's slice, then rank 1's, ..."""
    per_epoch = loader.batches_per_epoch
    slices = [take(r, per_epoch) for r in rank_loaders]
    return [s for step in zip(*slices, strict=True) for part in step for s in part]


@given(
    shard_sizes=st.lists(st.integers(1, 80), min_size=1, max_size=6),
    window=st.integers(1, 200),
    world=st.integers(1, 4),
    batch=st.integers(1, 8),
    workers=st.integers(0, 3),
    epoch=st.integers(0, 3),
    seed=st.integers(0, 2**31),
)
@settings(max_examples=30, deadline=None)
def test_every_sample_once_per_epoch_across_ranks_and_workers(shard_sizes, window, world, batch, workers, epoch, seed):
    n = sum(shard_sizes)
    data = Numbers(n, shard_sizes)
    if n < world * batch:
        with pytest.raises(DataError, match="fewer than one global batch"):
            ResumableLoader(data, batch, seed, 0, world)
        return

    def run(epoch: int, workers: int) -> list[int]:
        ranks = [
            ResumableLoader(data, batch, seed, r, world, DataCursor(epoch, 0), num_workers=workers, shuffle_window=window)
            for r in range(world)
        ]
        return epoch_of(ranks[0], ranks)

    seen = run(epoch, workers)
    assert len(seen) == len(set(seen)) == n // (world * batch) * world * batch  # none twice; only the short tail dropped
    assert set(seen) <= set(range(n))
    assert run(epoch, 0) == seen  # the same again, whatever the worker count
    one_rank = ResumableLoader(data, batch * world, seed, 0, 1, DataCursor(epoch, 0), shuffle_window=window)
    assert epoch_of(one_rank, [one_rank]) == seen  # and whatever the world size
    if min(window, n) >= 20:  # enough freedom that two epochs coinciding would be a bug, not luck
        assert run(epoch + 1, 0) != seen


def test_shuffle_keeps_locality():
    """Shards are shuffled, then samples within windows: a window draws from a few shards only."""
    shard_sizes = [100] * 50
    order = EpochOrder(shard_sizes, seed=3, epoch=0, window=250)
    ids = order[0 : len(order)]
    assert sorted(ids.tolist()) == list(range(5000)) and ids.tolist() != list(range(5000))
    for w in range(0, 5000, 250):
        shards = set((ids[w : w + 250] // 100).tolist())
        assert len(shards) <= 4  # 250 samples of consecutive shuffled shards span at most 4 of them
    first_shards = [int(i // 100) for i in ids[::250]]
    assert first_shards != sorted(first_shards)  # and the shards themselves come in shuffled order


def test_seeking_costs_a_window_not_the_dataset():
    """O(1) restore: a trillion samples (10^6 shards of 10^6) are addressed without an O(N) array."""
    order = EpochOrder([10**6] * 10**6, seed=0, epoch=5, window=1 << 16)
    at = 10**12 - 10**9 + 12_345
    ids = order[at : at + 32]
    assert len(ids) == 32 == len(set(ids.tolist())) and ids.min() >= 0 and ids.max() < 10**12
    assert np.array_equal(EpochOrder([10**6] * 10**6, seed=0, epoch=5, window=1 << 16)[at : at + 32], ids)


def test_order_depends_on_seed_and_epoch_not_on_world_size():
    one = take(ResumableLoader(Numbers(64), 8, 0, 0, 1), 8)  # epoch 0, one rank, 8 per batch
    two = [take(ResumableLoader(Numbers(64), 4, 0, r, 2), 8) for r in range(2)]
    assert [a + b for a, b in zip(*two, strict=True)] == one
    next_epoch = take(ResumableLoader(Numbers(64), 8, 0, 0, 1, DataCursor(1, 0)), 8)
    assert sorted(sum(next_epoch, [])) == sorted(sum(one, [])) and next_epoch != one
    assert take(ResumableLoader(Numbers(64), 8, 1, 0, 1), 8) != one


def test_cursor_resume_and_world_size_change_continue_the_same_order():
    straight = sum(take(ResumableLoader(Numbers(100), 5, 7, 0, 1), 30), [])  # crosses two epoch ends
    cursor = DataCursor()
    ranks = [ResumableLoader(Numbers(100), 5, 7, r, 2, cursor if r == 0 else DataCursor()) for r in range(2)]
    first = [sum(pair, []) for pair in zip(*(take(loader, 3) for loader in ranks), strict=True)]
    assert cursor.state_dict() == {"epoch": 0, "samples_consumed": 30}
    resumed = ResumableLoader(Numbers(100), 5, 7, 0, 1, DataCursor(**cursor.state_dict()))  # 2 ranks -> 1
    assert sum(first, []) + sum(take(resumed, 24), []) == straight


def test_prepare_packs_local_files_exactly_as_the_tokenizer_encodes(tmp_path, tiny_data):
    docs = [f"def f{i}(x):\n    return x * {i}\n" * (i + 1) for i in range(40)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in docs))
    out = tmp_path / "prepared"
    index = prepare(
        PrepareArguments(
            output_dir=str(out),
            source=str(tmp_path / "a.jsonl"),
            text_column="body",
            tokenizer=str(tiny_data / "tokenizer"),
            seq_len=16,
            samples_per_shard=7,
        )
    )
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_data / "tokenizer")
    stream = [t for d in docs for t in [*tok(d, add_special_tokens=False)["input_ids"], tok.eos_token_id]]
    expected = np.asarray(stream[: len(stream) // 16 * 16]).reshape(-1, 16)
    dataset = PackedDataset(out, verify_checksums=True)
    assert index.num_samples == len(dataset) == len(expected) and len(index.shards) == -(-len(expected) // 7)
    assert np.array_equal(np.stack([dataset[i].numpy() for i in range(len(dataset))]), expected)
    # parquet through datasets gives the same samples
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": docs}), tmp_path / "a.parquet")
    prepare(
        PrepareArguments(
            output_dir=str(tmp_path / "pq"),
            source=str(tmp_path / "a.parquet"),
            text_column="body",
            tokenizer=str(tiny_data / "tokenizer"),
            seq_len=16,
        )
    )
    assert np.array_equal(np.stack([PackedDataset(tmp_path / "pq")[i].numpy() for i in range(len(dataset))]), expected)


def test_damaged_data_is_refused_before_training(tmp_path, tiny_data):
    import shutil

    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    PackedDataset(data, verify_checksums=True)
    shard = data / "shard_00001.npy"
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 0xFF
    shard.write_bytes(bytes(raw))
    PackedDataset(data)  # same size: only the checksum can tell
    with pytest.raises(DataError, match="shard_00001.npy does not match the sha256"):
        PackedDataset(data, verify_checksums=True)
    shard.write_bytes(bytes(raw[: len(raw) // 2]))
    with pytest.raises(DataError, match="shard_00001.npy is truncated"):
        PackedDataset(data)
    shard.unlink()
    with pytest.raises(DataError, match="shard_00001.npy is listed in index.json but missing"):
        PackedDataset(data)
    (data / INDEX_FILE).unlink()
    with pytest.raises(DataError, match="prepare the data first"):
        PackedDataset(data)


def test_prepare_refuses_an_empty_source(tmp_path, tiny_data):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="gave no sample"):
        prepare(
            PrepareArguments(output_dir=str(tmp_path / "out"), source=str(tmp_path / "empty.txt"), tokenizer=str(tiny_data / "tokenizer"))
        )
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def shard_digests(data) -> list[tuple[str, int, str]]:
    return [(s["file"], s["num_samples"], s["sha256"]) for s in json.loads((data / INDEX_FILE).read_text())["shards"]]


def test_prepare_is_parallel_and_resumable(tmp_path, tiny_data, monkeypatch):
    """Killed mid-way, prepare continues from its finished chunks; any num_proc gives the same shards."""
    import infra.data.prepare as prep

    args = dict(
        source="stdlib", max_bytes=120_000, tokenizer=str(tiny_data / "tokenizer"), seq_len=32, samples_per_shard=100, chunk_bytes=10_000
    )
    reference = tmp_path / "reference"
    prepare(PrepareArguments(output_dir=str(reference), **args))
    parallel = tmp_path / "parallel"
    prepare(PrepareArguments(output_dir=str(parallel), num_proc=2, **args))
    assert shard_digests(parallel) == shard_digests(reference)

    calls = []
    real = prep.tokenize_chunk

    def crash_after_three(work, chunk_id, texts, batch_documents):
        if len(calls) == 3:
            (work / "tokens" / "chunk_000099.npy.tmp").write_bytes(b"torn")  # a write the crash cut short
            raise KeyboardInterrupt
        calls.append(chunk_id)
        return real(work, chunk_id, texts, batch_documents)

    out = tmp_path / "out"
    monkeypatch.setattr(prep, "tokenize_chunk", crash_after_three)
    with pytest.raises(KeyboardInterrupt):
        prepare(PrepareArguments(output_dir=str(out), **args))
    assert not out.exists() and len(list((tmp_path / "out.partial" / "tokens").glob("chunk_*.npy"))) == 3

    resumed = []
    monkeypatch.setattr(prep, "tokenize_chunk", lambda work, chunk_id, *a: resumed.append(chunk_id) or real(work, chunk_id, *a))
    prepare(PrepareArguments(output_dir=str(out), **args))
    assert resumed and not set(resumed) & set(calls)  # only what was left was tokenized
    assert shard_digests(out) == shard_digests(reference)
    assert not (tmp_path / "out.partial").exists() and sorted(p.name for p in out.iterdir() if not p.name.startswith("shard_")) == [
        "index.json",
        "tokenizer",
    ]


def test_data_that_does_not_fit_the_model_is_refused(tiny_data):
    from transformers import AutoConfig

    from infra.data import check_fits_model

    index = PackedDataset(tiny_data).index
    fits = dict(vocab_size=index.vocab_size, max_position_embeddings=index.seq_len, eos_token_id=0)
    check_fits_model(index, 0, AutoConfig.for_model("llama", **fits))
    with pytest.raises(DataError, match="vocab_size=100 is smaller than the data's 512"):
        check_fits_model(index, 0, AutoConfig.for_model("llama", **{**fits, "vocab_size": 100}))
    with pytest.raises(DataError, match="seq_len=64 exceeds the model's max_position_embeddings=32"):
        check_fits_model(index, 0, AutoConfig.for_model("llama", **{**fits, "max_position_embeddings": 32}))
    with pytest.raises(DataError, match="eos_token_id is 2: the data was tokenized for another model"):
        check_fits_model(index, 0, AutoConfig.for_model("llama", **{**fits, "eos_token_id": 2}))


def test_packed_dataset_reads_the_same_through_workers_and_bounds_open_shards(tiny_data, monkeypatch):
    dataset = PackedDataset(tiny_data)
    direct = np.concatenate([np.load(tiny_data / s.file) for s in dataset.index.shards])
    batches = {w: take(ResumableLoader(dataset, 16, 5, 0, 1, shuffle_window=100, num_workers=w), 20) for w in (0, 2)}
    assert batches[0] == batches[2]
    loader = ResumableLoader(dataset, 16, 5, 0, 1, shuffle_window=100)
    for batch in itertools.islice(iter(loader), 20):
        assert np.array_equal(batch.numpy(), direct[loader.last_sample_ids])  # the rows the ids name
    monkeypatch.setattr(PackedDataset, "max_open_shards", 2)
    small = PackedDataset(tiny_data)
    assert np.array_equal(small.__getitems__(list(range(len(small)))).numpy(), direct)
    assert len(small._maps) == 2


def test_the_recipe_refuses_damaged_data_and_writes_nothing(tmp_path, tiny_data):
    import shutil

    from tests import recipe_forks
    from tests.conftest import REPO

    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    (data / "shard_00002.npy").unlink()
    proc = recipe_forks.run(
        REPO / "recipes" / "pretrain_clm.py",
        ["--data_dir", str(data), "--output_dir", str(tmp_path / "out")],
        env={"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == f"data error: {data / 'shard_00002.npy'} is listed in index.json but missing"
    assert not (tmp_path / "out").exists() and not (tmp_path / "mlflow.db").exists()

    # 2 processes: only local rank 0 reads the shards' headers; its refusal stops the launch, nobody waits for it
    from tests.conftest import launch

    launched = launch("cpu.yaml", ["--data_dir", str(data), "--output_dir", str(tmp_path / "out")], tmp_path, timeout=120)
    assert launched.returncode != 0 and f"data error: {data / 'shard_00002.npy'} is listed" in launched.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_held_out_samples_never_reach_training_and_every_rank_evaluates_alike(small_data, world):
    dataset = PackedDataset(small_data)
    train, held_out = dataset.split(50)
    assert len(train) + len(held_out) == len(dataset) and sum(train.shard_sizes) == len(train)
    everything = dataset.__getitems__(list(range(len(dataset))))
    assert torch.equal(held_out.__getitems__(list(range(50))), everything[-50:])

    # a whole epoch of training, every rank: only samples before the cut, each once
    seen = []
    for rank in range(world):
        loader = ResumableLoader(train, 4, seed=3, rank=rank, world_size=world, shuffle_window=48)
        for batch in itertools.islice(loader, loader.batches_per_epoch):
            seen += [bytes(row.numpy()) for row in batch]
    rows = {bytes(row.numpy()): i for i, row in enumerate(everything)}
    ids = sorted(rows[r] for r in seen)
    assert len(ids) == len(set(ids)) == loader.batches_per_epoch * 4 * world and ids[-1] < len(train)

    # eval: the same number of batches on every rank (sharded forwards are collectives), each sample once
    shares = [list(eval_batches(held_out, 8, rank, world)) for rank in range(world)]
    assert len({len(share) for share in shares}) == 1
    evaluated = torch.cat([b for share in shares for b in share])
    assert len(evaluated) == 50 - 50 % world
    assert sorted(rows[bytes(r.numpy())] for r in evaluated) == list(range(len(dataset) - 50, len(dataset) - 50 % world))

    with pytest.raises(DataError, match="eval_samples=315"):
        dataset.split(len(dataset))


def test_shards_with_several_fields_read_row_for_row_and_are_verified(tmp_path):
    """Images and labels (or tokens and masked labels) travel in one shard set; every field is checked."""
    from infra.data.shards import DataIndex, write_shard

    rng = np.random.default_rng(0)
    index = DataIndex(
        seq_len=0,
        dtype="uint8",
        vocab_size=0,
        tokenizer="none",
        source="test",
        primary="pixel_values",
        sample_shape=[1, 4, 4],
        fields={"labels": {"dtype": "int16", "shape": []}},
        labels=["a", "b", "c"],
    )
    pixels, labels = rng.integers(0, 17, (10, 1, 4, 4), dtype=np.uint8), np.arange(10, dtype=np.int16) % 3
    for shard, rows in enumerate((slice(0, 6), slice(6, 10))):
        index.shards.append(write_shard(tmp_path, shard, {"pixel_values": pixels[rows], "labels": labels[rows]}))
    index.save(tmp_path)

    dataset = PackedDataset(tmp_path, verify_checksums=True)
    assert dataset.fields == ["pixel_values", "labels"] and DataIndex.load(tmp_path).labels == ["a", "b", "c"]
    batch = dataset.__getitems__([7, 2, 9])
    assert batch["pixel_values"].dtype == torch.uint8 and batch["labels"].dtype == torch.int64  # pixels as stored
    assert torch.equal(batch["pixel_values"], torch.from_numpy(pixels[[7, 2, 9]]))
    assert batch["labels"].tolist() == [1, 2, 0]
    (train, held_out) = dataset.split(3)
    loader = ResumableLoader(train, 2, seed=0, rank=0, world_size=1)
    first = next(iter(loader))
    assert set(first) == {"pixel_values", "labels"} and first["labels"].shape == (2,)
    assert [s["labels"].item() for s in (held_out[i] for i in range(3))] == [1, 2, 0]

    labels_file = tmp_path / "shard_00001.labels.npy"
    labels_file.write_bytes(labels_file.read_bytes()[:-8])
    with pytest.raises(DataError, match="shard_00001.labels.npy is truncated"):
        PackedDataset(tmp_path)
    labels_file.unlink()
    with pytest.raises(DataError, match="shard_00001.labels.npy is listed in index.json but missing"):
        PackedDataset(tmp_path)


def test_version_1_indexes_still_read(small_data, tmp_path):
    """Data prepared before fields existed (format_version 1, no fields) reads as before."""
    old = tmp_path / "old"
    shutil.copytree(small_data, old)
    raw = json.loads((old / INDEX_FILE).read_text())
    for key in ("primary", "sample_shape", "fields", "labels"):
        raw.pop(key)
    for shard in raw["shards"]:
        shard.pop("fields")
    raw["format_version"] = 1
    (old / INDEX_FILE).write_text(json.dumps(raw))
    assert torch.equal(PackedDataset(old, verify_checksums=True).__getitems__([0, 5]), PackedDataset(small_data).__getitems__([0, 5]))


def test_shards_on_object_storage_read_through_a_checked_cache(s3, small_data, tmp_path):
    """s3:// data reads as the local copy does; shards are fetched on first touch; a damaged one is refused by name."""
    fs, bucket = s3
    fs.put(str(small_data), f"{bucket}/small", recursive=True)
    url = f"s3://{bucket}/small"
    local, remote = PackedDataset(small_data), PackedDataset(url)
    assert len(remote) == len(local) and remote.fields == local.fields
    cache = remote.data_dir
    assert cache.is_relative_to(tmp_path / "cache") and not list(cache.glob("shard_*.npy"))  # nothing fetched yet
    ids = [0, 33, len(local) - 1]
    assert torch.equal(remote.__getitems__(ids), local.__getitems__(ids))
    assert len(list(cache.glob("shard_*.npy"))) == 3  # the three shards those samples live in, no more
    assert (remote.tokenizer_dir / "tokenizer.json").is_file()
    loader = ResumableLoader(remote.split(0)[0], 4, seed=0, rank=0, world_size=1, num_workers=2)  # workers fetch too
    assert torch.equal(next(iter(loader)), next(iter(ResumableLoader(local.split(0)[0], 4, seed=0, rank=0, world_size=1))))

    name = local.index.shards[1].file
    raw = bytearray((small_data / name).read_bytes())
    raw[-1] ^= 0xFF
    fs.pipe(f"{bucket}/small/{name}", bytes(raw))  # same size, altered: the index is unchanged, so is the cache folder
    (cache / name).unlink(missing_ok=True)
    with pytest.raises(DataError, match=f"s3://{bucket}/small/{name} does not match the sha256"):
        PackedDataset(url, verify_checksums=True)
    fs.pipe(f"{bucket}/small/{name}", bytes(len(raw)))  # the right size, but not an .npy file: caught on the way in
    with pytest.raises(DataError, match=f"s3://{bucket}/small/{name} is not a readable .npy file"):
        PackedDataset(url).__getitems__([32])
    assert not list(cache.glob("*.tmp")) and not (cache / name).exists()  # nothing half-fetched or refused left behind
    fs.pipe(f"{bucket}/small/{name}", bytes(raw[:200]))  # cut short: the listing shows it when the data is opened
    with pytest.raises(DataError, match=f"s3://{bucket}/small/{name} is truncated: 200 bytes"):
        PackedDataset(url)
    fs.rm(f"{bucket}/small/{name}")
    with pytest.raises(DataError, match=f"s3://{bucket}/small/{name} is listed in index.json but missing"):
        PackedDataset(url)


def test_a_trace_keeps_only_the_history_behind_the_resumed_weights(tmp_path):
    """Lines past the resumed step are dropped, of this rank's trace and, by rank 0, of the ranks a smaller launch
    lacks (a job shrunk from 2 processes to 1 does rank 1's steps again on rank 0); a line cut by a kill is dropped."""
    folder = tmp_path / "trace"
    folder.mkdir()
    for rank in (0, 1):
        lines = [json.dumps({"step": s, "ids": [2 * s + rank]}) for s in range(1, 7)]
        (folder / f"rank{rank}.jsonl").write_text("\n".join(lines) + '\n{"step": 7, "id')
    trace = SampleTrace(str(tmp_path), 0, 4, world_size=1)
    trace.write(5, [10, 11])
    trace.close()
    steps = {r: [json.loads(line)["step"] for line in (folder / f"rank{r}.jsonl").read_text().splitlines()] for r in (0, 1)}
    assert steps == {0: [1, 2, 3, 4, 5], 1: [1, 2, 3, 4]}
    SampleTrace(str(tmp_path), 1, 2, world_size=2).close()  # a rank other than 0 cuts only its own
    assert len((folder / "rank0.jsonl").read_text().splitlines()) == 5
    assert len((folder / "rank1.jsonl").read_text().splitlines()) == 2
