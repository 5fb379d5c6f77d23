"""The samples of a step, by global sample id: the `size` positions of the epoch's order at the cursor, read as one
batch. What a replica group reads (infra.replicas): the live groups split the ids among themselves (infra.shares)."""

from __future__ import annotations

import numpy as np

from infra.data.loader import EpochOrder, collate


class GlobalBatches:
    """The samples of a step: `size` positions of the epoch's order from the cursor; an epoch's last positions that do
    not fill a step are left out, as the plain loader leaves out a short last batch."""

    def __init__(self, dataset, seed: int, window: int, size: int):
        self.dataset, self.seed, self.window, self.size = dataset, seed, window, size
        self.shard_sizes = list(getattr(dataset, "shard_sizes", [len(dataset)]))
        self._order: EpochOrder | None = None

    def order(self, epoch: int) -> EpochOrder:
        if self._order is None or self._order.epoch != epoch:
            self._order = EpochOrder(self.shard_sizes, self.seed, epoch, self.window)
        return self._order

    def ids(self, cursor) -> np.ndarray:
        """The global sample ids of the step at `cursor` (rolled over to the next epoch first if the rest is short)."""
        self.roll(cursor)
        return self.order(cursor.epoch)[cursor.samples_consumed : cursor.samples_consumed + self.size]

    def roll(self, cursor) -> None:
        if cursor.samples_consumed + self.size > len(self.dataset):
            cursor.epoch += 1
            cursor.samples_consumed = 0

    def advance(self, cursor) -> None:
        self.roll(cursor)
        cursor.samples_consumed += self.size

    def read(self, ids: np.ndarray):
        get = getattr(self.dataset, "__getitems__", None)
        return collate(get(ids.tolist()) if get else [self.dataset[int(i)] for i in ids])
