"""Data: prepare packs what the tokenizer says; the loader's order and cursor are exact."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from infra.data import DataCursor, DataError, PackedDataset, ResumableLoader
from infra.data.prepare import PrepareArguments, prepare
from infra.data.shards import INDEX_FILE


class Numbers(torch.utils.data.Dataset):
    """Sample i is the tensor [i]: batches then show exactly which samples they hold."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor([i])


def take(loader: ResumableLoader, n: int) -> list[list[int]]:
    return [b.flatten().tolist() for b in itertools.islice(iter(loader), n)]


@given(
    n=st.integers(1, 300),
    world=st.integers(1, 4),
    batch=st.integers(1, 8),
    workers=st.sampled_from([0, 2]),
    epoch=st.integers(0, 3),
    seed=st.integers(0, 2**31),
)
@settings(max_examples=25, deadline=None)
def test_every_sample_once_per_epoch_across_ranks(n, world, batch, workers, epoch, seed):
    if n < world * batch:
        with pytest.raises(DataError, match="fewer than one global batch"):
            ResumableLoader(Numbers(n), batch, seed, 0, world)
        return
    per_epoch = n // (world * batch)
    seen = []
    for rank in range(world):
        loader = ResumableLoader(Numbers(n), batch, seed, rank, world, DataCursor(epoch, 0), num_workers=workers if n > 50 else 0)
        seen += [s for b in take(loader, per_epoch) for s in b]
    assert len(seen) == len(set(seen)) == per_epoch * world * batch  # none twice; only the short tail dropped
    assert n - len(seen) < world * batch


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
