"""Rebalancing (`straggler_action: rebalance`): at every window of steps the straggler detector closes, each process's
share of every micro-step after its measured speed, a process slow at its data reading further ahead, and the processes
it cannot keep up with named for the loop to leave out. The same decision on every rank, from the same gathered numbers
(infra.health.Window): no collective of its own. What it has learnt of each process's speed is in every checkpoint.

    rebalancing = Rebalancing(args, hosts, caps, watch)
    behind = rebalancing.window(window, shares, step)   # {rank: why} of those to leave out
    rebalancing.state_dict() / load_state_dict(...)     # the speeds, in the checkpoint's manifest

Replica groups are rebalanced as wholes by their combine (infra.replicas.pace), not here.
"""

from __future__ import annotations

from collections.abc import Sequence

from infra.data.steps import EvenShares, SplitShares
from infra.health import Window, deeper
from infra.observers import Observers
from infra.shares import KeepingUp, Speeds, rebalanced, rebalanced_line


class Rebalancing:
    def __init__(self, args, hosts: Sequence[str], caps: list[int] | None, watch: Observers):
        """`hosts`: each rank's; `caps`: each rank's most samples (what fits its memory: infra.memory.sample_caps), or
        None."""
        self.args, self.hosts, self.caps, self.watch = args, hosts, caps, watch
        self.speeds = Speeds(len(hosts))  # what it learns of each rank's speed, window after window
        patience = args.straggler_patience
        self.keeping_up = KeepingUp(len(hosts), args.straggler_leave_factor, patience, args.straggler_min_samples)

    def state_dict(self) -> dict:
        return self.speeds.state_dict()

    def load_state_dict(self, state: dict | None) -> None:
        self.speeds.load_state_dict(state)

    def window(self, window: Window, shares: EvenShares | SplitShares, step: int) -> dict[int, str]:
        """Each process's share of every micro-step after its speed, when that shortens the step (infra.shares.rebalanced):
        its line, and each process's share (shares/rank_i, the samples of a micro-step) every window. Returns the ranks it
        cannot keep up with (infra.shares.KeepingUp), each named in a line: the job leaves them out."""
        self.speeds.measured(window.sizes, window.seconds)
        behind = self.keeping_up.behind(self.speeds, window.sizes, window.slow)
        for rank, why in behind.items():
            self.watch.say(f"straggler: rank {rank} on {self.hosts[rank]} cannot be kept up with: {why}; left out")
        if self.args.straggler_read_ahead:
            self.read_further(window, shares, step)
        now = shares.sizes(ahead=True)
        sizes = rebalanced(now, self.speeds, self.args.straggler_min_samples, caps=self.caps)
        if sizes is not None:
            steps = shares.resize(sizes)
            names = [f"rank {r} on {host}" for r, host in enumerate(self.hosts)]
            what = f"each micro-step's {sum(sizes)} samples"
            self.watch.say(rebalanced_line(what, names, now, sizes, self.speeds.per_sample, step + steps + 1))
            now = sizes
        self.watch.log({f"shares/rank_{r}": float(size) for r, size in enumerate(now)}, step=step)
        return behind

    def read_further(self, window: Window, shares: EvenShares | SplitShares, step: int) -> None:
        """A process slow at its data (a slow disk) reads ahead in a thread (infra.health.deeper), before a change of the
        shares counts what the loaders read ahead."""
        depths = deeper(shares.depths, window.waits, window.seconds, self.args.gradient_accumulation_steps)
        if depths is None:
            return
        for rank, (old, new) in enumerate(zip(shares.depths, depths, strict=True)):
            if new != old:
                wait, seconds = window.waits[rank], window.seconds[rank]
                self.watch.say(
                    f"read-ahead: rank {rank} on {self.hosts[rank]} waited {wait * 1000:.1f} ms for its data a micro-batch "
                    f"({wait / seconds:.0%} of its time): its loader reads {new} micro-batches ahead from step {step + 1}"
                )
        shares.read_further(depths)
