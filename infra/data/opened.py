"""A recipe's data opened: the prepared shards (one dataset, or every source of a data_mixture), checked and split into
the part trained on and the held-out part, as `Data`, what a `Job` carries.

    data = open_datasets(data_args, preflight_hashes=False, fields=("input_ids", "labels"), made_by="make data")
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from infra.data.arguments import DataArguments
from infra.data.errors import DataError
from infra.data.mixture import Mixture, MixtureDataset, parse_sources
from infra.data.shards import PackedDataset
from infra.errors import raised_as
from infra.files import sha256_file


@dataclass
class Data:
    """A recipe's data: the shards, the part trained on, the held-out part (may be empty), and who hashes the shards.
    With a mixture, `dataset` is its first source (the tokenizer, the sequence length: every source has the same)."""

    dataset: PackedDataset
    train: torch.utils.data.Dataset
    held_out: torch.utils.data.Dataset
    preflight_hashes: bool  # the preflight sha256es them (else they were checked when opened, if asked)
    mixture: Mixture | None = None


def open_datasets(
    data_args: DataArguments,
    preflight_hashes: bool,
    fields: tuple[str, ...] = ("input_ids",),
    made_by: str = "make data",
    optional: tuple[str, ...] = (),
) -> Data:
    """The shards, split: sizes checked now; sha256 now unless `preflight_hashes` (the preflight will hash them).

    The data must hold `fields` (the recipe's inputs), as `made_by` prepares them, and may hold `optional` ones. With a
    data_mixture, every source is opened so, and must hold the same fields, sequence length and tokenizer.
    """
    if not data_args.data_mixture:
        dataset, train_set, held_out = open_one(data_args.data_dir, data_args, preflight_hashes, fields, made_by, optional)
        return Data(dataset, train_set, held_out, preflight_hashes)
    sources = parse_sources(data_args.data_mixture)
    opened = [open_one(s.data_dir, data_args, preflight_hashes, fields, made_by, optional) for s in sources]
    first = opened[0][0]
    for source, (dataset, _, _) in zip(sources[1:], opened[1:], strict=True):
        if (mine := alike(dataset)) != (theirs := alike(first)):
            raise DataError(
                f"data_mixture source {source.name!r} ({source.data_dir}) has {mine}, and {sources[0].name!r} "
                f"has {theirs}: every source must be prepared alike"
            )
    names = [s.name for s in sources]
    mixture = Mixture(sources, [len(train) for _, train, _ in opened], [list(train.shard_sizes) for _, train, _ in opened])
    train_set = MixtureDataset(names, [train for _, train, _ in opened])
    return Data(first, train_set, MixtureDataset(names, [held for _, _, held in opened]), preflight_hashes, mixture)


def alike(dataset: PackedDataset) -> dict:
    """What the sources of a mixture must share: fields, sequence length, vocabulary and tokenizer (its file's sha256)."""
    tokenizer = dataset.tokenizer_dir / "tokenizer.json"
    digest = sha256_file(tokenizer)[:12] if tokenizer.is_file() else None
    return {"fields": dataset.fields, "seq_len": dataset.seq_len, "vocab_size": dataset.index.vocab_size, "tokenizer": digest}


def open_one(data_dir: str, data_args: DataArguments, preflight_hashes: bool, fields, made_by: str, optional):
    """One prepared dataset, checked, its fields the recipe's, split into (dataset, train, held-out)."""
    with raised_as(DataError, ValueError):
        dataset = PackedDataset(
            data_dir,
            verify_checksums=data_args.verify_data_checksums and not preflight_hashes,
            hash_fetches=data_args.verify_data_checksums,  # remote data: every rank hashes what it fetches later
            # one process per machine reads every shard's header (10k shards: 1.0 s here, from local disk), not
            # every rank: on network storage 64 ranks would open every file 64 times at once. Per machine, not
            # once per job, as data may be copied to each machine's disk. A bad file stops that rank; the
            # launcher then stops the others.
            check=int(os.environ.get("LOCAL_RANK", "0")) == 0,
        )
        train_set, held_out = dataset.split(data_args.eval_samples)
    if not set(fields) <= set(dataset.fields) <= set(fields) | set(optional):
        reads = list(fields) + [f"{name} (optional)" for name in optional]
        raise DataError(f"{data_dir} holds {dataset.fields}, this recipe reads {reads} ({made_by})")
    return dataset, train_set, held_out
