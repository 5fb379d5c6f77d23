"""Read-ahead: a rank's next batches read by a thread of its own while the step computes, for a rank that waits for its
data (a slow disk, a slow network mount: straggler_action rebalance asks for it, infra.data.steps).

    batches = ReadAhead(loader, depth)      next(batches): the loader's next batch, the cursor moved past it as the
                                            loop takes it (loader.handed), never as the thread reads it
    batches.depth = 4                       hold up to 4 batches read (raised at any time)
    batches.close()                         the thread stopped and joined; what it read and the loop did not take is
                                            dropped (the cursor never counted it)

The thread runs the loader's `reading()` (its DataLoader, workers and all) from the cursor's position when the ReadAhead
was made: the same samples in the same order as the loader's own iterator, only earlier. It waits while `depth` batches
are ready, so it is at most `depth + 1` batches ahead of the loop (`read_ahead(num_workers, depth)` counts it: a change
of the shares is for a position no thread has sliced yet). With DataLoader workers (num_workers) the thread only
waits for their batches; with none it reads them itself, and its waits on the storage (a fetch from a remote data_dir,
a page of a shard not yet in memory) overlap the step.

An error the reading raises is raised by the loop's next `next()`, as without the thread.
"""

from __future__ import annotations

import threading
import traceback
from collections import deque
from typing import Any


class ReadAhead:
    """The loader's batches, read by a thread up to `depth` ahead of the loop (see the module's doc)."""

    CLOSE_WAIT = 10.0  # seconds close() waits for a thread in the middle of a read

    def __init__(self, loader: Any, depth: int):
        self.loader, self._depth = loader, depth
        self._ready: deque = deque()
        self._failed: BaseException | None = None
        self._done = False  # the thread ended: closed, or the reading raised
        self._closing = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(loader.reading(),), name="read-ahead", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        return self._depth

    @depth.setter
    def depth(self, depth: int) -> None:
        with self._changed:
            self._depth = depth
            self._changed.notify_all()

    def _read(self, reading) -> None:
        try:
            for read in reading:
                with self._changed:
                    while len(self._ready) >= self._depth and not self._closing:
                        self._changed.wait()
                    if self._closing:
                        return
                    self._ready.append(read)
                    self._changed.notify_all()
        except BaseException as error:  # noqa: BLE001 - handed to the loop, which raises it
            traceback.clear_frames(error.__traceback__)  # its lines kept; the DataLoader's workers stopped now
            self._failed = error
        finally:
            reading.close()  # its DataLoader's workers stopped here, in the thread that ran it
            with self._changed:
                self._done = True
                self._changed.notify_all()

    def __iter__(self) -> ReadAhead:
        return self

    def __next__(self):
        with self._changed:
            while not self._ready and not self._done:
                self._changed.wait()
            if not self._ready:
                failed, self._failed = self._failed, None  # raised once, and not held in a cycle with its traceback
                if failed is not None:
                    raise failed
                raise StopIteration
            read = self._ready.popleft()
            self._changed.notify_all()
        return self.loader.handed(read)

    def close(self) -> None:
        """The thread told to stop, and joined; one stuck in a read (a storage that stopped answering) is left behind
        after CLOSE_WAIT seconds, a daemon that ends with the read or the process, never holding up the loop's exit."""
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        self._thread.join(timeout=self.CLOSE_WAIT)
        self._ready.clear()
