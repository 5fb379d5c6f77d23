"""A resumable, rank-aware reader over the global sample space.

Order: epoch `e` visits the samples in `permutation(seed, e)`, a numpy permutation of the whole
dataset that depends on nothing else (not the world size, not the worker count). The epoch is
cut into global batches of `world_size * batch_size` samples; rank `r` takes the `r`-th slice
of each. A final global batch that would be short is dropped.

Position: one `DataCursor(epoch, samples_consumed)`, advanced when a batch is handed to the
training loop (never by what DataLoader workers prefetched). Restoring it costs one permutation,
whatever the position: no batch is read and thrown away to get there.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from infra.data.shards import DataError


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


def epoch_order(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """The global visiting order of one epoch: a permutation of range(num_samples)."""
    return np.random.default_rng([seed, epoch]).permutation(num_samples)


class _RankBatches(torch.utils.data.Sampler):
    """This rank's slice of each global batch, from sample `start` of the epoch's order."""

    def __init__(self, order: np.ndarray, start: int, batch_size: int, rank: int, world_size: int):
        self.order, self.start, self.batch_size, self.rank = order, start, batch_size, rank
        self.global_batch = batch_size * world_size

    def __iter__(self) -> Iterator[list[int]]:
        lo = self.rank * self.batch_size
        for s in range(self.start, len(self.order) - self.global_batch + 1, self.global_batch):
            yield self.order[s + lo : s + lo + self.batch_size].tolist()

    def __len__(self) -> int:
        return max(0, (len(self.order) - self.start) // self.global_batch)


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
    ):
        self.dataset, self.batch_size, self.seed = dataset, batch_size, seed
        self.rank, self.world_size = rank, world_size
        self.cursor = cursor if cursor is not None else DataCursor()
        self.num_workers, self.pin_memory = num_workers, pin_memory
        self.last_sample_ids: list[int] = []  # global ids of the batch most recently handed out
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

    def __iter__(self) -> Iterator[torch.Tensor]:
        while True:
            order = epoch_order(len(self.dataset), self.seed, self.cursor.epoch)
            sampler = _RankBatches(order, self.cursor.samples_consumed, self.batch_size, self.rank, self.world_size)
            loader = torch.utils.data.DataLoader(
                self.dataset,
                batch_sampler=sampler,
                num_workers=self.num_workers,
                pin_memory=self.pin_memory,
                generator=torch.Generator(),
            )
            for batch, ids in zip(loader, sampler, strict=True):
                self.last_sample_ids = ids
                self.cursor.samples_consumed += self.global_batch_size
                yield batch
            self.cursor.epoch += 1
            self.cursor.samples_consumed = 0


class SampleTrace:
    """Appends the global sample ids each step consumed on this rank to `OUTPUT_DIR/trace/rank{r}.jsonl`.

    Lines past the step a run resumes from are dropped first: the trace always describes the
    history that led to the weights, so a loss spike can be traced to its exact batch.
    """

    def __init__(self, output_dir: str, rank: int, resume_step: int):
        self.path = Path(output_dir) / "trace" / f"rank{rank}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if self.path.exists():
            kept = [line for line in self.path.read_text().splitlines() if json.loads(line)["step"] <= resume_step]
        self.path.write_text("".join(line + "\n" for line in kept))
        self._file = open(self.path, "a")  # noqa: SIM115 - closed by close()

    def write(self, step: int, ids: list[int]) -> None:
        self._file.write(json.dumps({"step": step, "ids": ids}) + "\n")

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()
