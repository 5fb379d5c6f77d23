"""torchft's reconfigurable gloo process group across replica groups, with its reconfiguration bounded in time.

At every change of quorum each group connects to the store one group of the quorum serves and meets the others there
(gloo's rendezvous). torch's TCPStore client waits for the store's answer to its first ping with no timeout at all, so
when the group that serves the store froze (SIGSTOP, a hung host) after it joined the quorum, every other group would
stop inside that connection for as long as the freeze lasts, its own watchdog included (measured: no return in 120 s
from a client of a stopped store). Here the reconfiguration runs in a thread and the step waits for it
`replica_timeout_seconds` at most; past that it fails as a collective that timed out does, and the next quorum leaves
the frozen group out. The thread ends once the frozen process goes on or dies; what it built by then is dropped.
"""

from __future__ import annotations

import threading

import torchft


class BoundedGloo(torchft.ProcessGroupGloo):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._generation = 0  # the reconfiguration under way: one that ends after a newer began builds nothing
        self._current = threading.local()

    def configure(self, store_addr: str, *args, **kwargs) -> None:
        self._generation += 1
        generation, failed, done = self._generation, [], threading.Event()

        def run() -> None:
            self._current.generation = generation
            try:
                super(BoundedGloo, self).configure(store_addr, *args, **kwargs)
            except Exception as e:  # raised in the step's thread below
                failed.append(e)
            finally:
                done.set()

        threading.Thread(target=run, name=f"gloo-configure-{generation}", daemon=True).start()
        if not done.wait(self._timeout.total_seconds()):
            self._generation += 1  # the late one's process group is dropped
            self._pg = None
            host = store_addr.partition("/")[0]
            raise TimeoutError(f"the quorum's store at {host} did not answer in {self._timeout.total_seconds():g}s")
        if failed:
            raise failed[0]

    def _create_pg(self, store, rank: int, world_size: int):
        pg = super()._create_pg(store, rank, world_size)
        if getattr(self._current, "generation", None) != self._generation:
            raise TimeoutError("a reconfiguration that ended after its time: its process group is dropped")
        return pg
