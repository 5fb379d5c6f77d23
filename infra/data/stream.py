"""The training loop's one view of its data, whether one dataset or a mixture of several.

    loader, cursor = training_stream(train, mixture, data_args, batch_size, seed, rank, world_size, pin_memory)

Both kinds answer the same calls, so the loop asks no question about which it has:

    iter(loader), loader.last_sample_ids, loader.batches_consumed, loader.global_batch_size
    loader.source_index(ids), loader.source_names(ids)      each sample's source; None for one dataset
    cursor.state_dict(), cursor.load_state_dict(), cursor.epoch
    cursor.taken(), cursor.segments                          each source's samples so far, the mixture's segments; empty
    named_parts(held_out)                                     (name, samples) of each source's held-out part; empty

One dataset is read by ResumableLoader at a DataCursor (infra.data.loader), a mixture by MixtureLoader at a
MixtureCursor (infra.data.mixture): each keeps its own order and checkpointed position, so runs and checkpoints made
before this view existed resume as they were.
"""

from __future__ import annotations

import torch

from infra.data.arguments import DataArguments
from infra.data.loader import DataCursor, ResumableLoader
from infra.data.mixture import Mixture, MixtureCursor, MixtureDataset, MixtureLoader


def training_stream(
    train: torch.utils.data.Dataset,
    mixture: Mixture | None,
    data_args: DataArguments,
    batch_size: int,
    seed: int,
    rank: int,
    world_size: int,
    pin_memory: bool,
) -> tuple[ResumableLoader | MixtureLoader, DataCursor | MixtureCursor]:
    """This rank's resumable loader over the training samples, and its cursor (raises DataError: too few samples)."""
    loading = {"num_workers": data_args.num_workers, "shuffle_window": data_args.shuffle_window, "pin_memory": pin_memory}
    if mixture is None:
        cursor = DataCursor()
        return ResumableLoader(train, batch_size, seed, rank, world_size, cursor, **loading), cursor
    cursor = MixtureCursor(mixture.sources, mixture.sizes, allow_new_segment=data_args.new_mixture_segment)
    return MixtureLoader(train, cursor, mixture.shard_sizes, batch_size, seed, rank, world_size, **loading), cursor


def named_parts(held_out: torch.utils.data.Dataset) -> list[tuple[str, torch.utils.data.Dataset]]:
    """Each source's part of a mixture's held-out samples, by name (eval/<metric>/<name>); none for one dataset."""
    if isinstance(held_out, MixtureDataset):
        return list(zip(held_out.names, held_out.parts, strict=True))
    return []
