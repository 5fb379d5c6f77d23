"""This replica group's seat in the quorum: torchft's Manager, and what the loop asks of it.

    group = ReplicaGroup(accelerator, config, state_dict=..., load_state_dict=...)
    seat = group.quorum()          # before a step: the live groups, this group's rank among them; may heal this group
    items = group.sum(items)       # across the quorum (one small all-reduce)
    loss = group.sum_gradients(model, loss)
    if group.commit(): optimizer.step()

The Manager talks to the lighthouse (rank 0 of each group runs its ManagerServer), forms a gloo group across the live
replica groups at every change of quorum (ranks of the same local rank together) and moves state to a group that
heals over HTTP. Each group serves its own store for the cross-group process group; its address is the one this host
uses to reach the lighthouse, so that several hosts behind one hostname (containers, namespaces) stay apart.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NamedTuple
from urllib.parse import urlparse

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, broadcast_object_list
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

from infra.distributed import local
from infra.shares import Seat


class Part(NamedTuple):
    """A sharded tensor (FSDP2's DTensor) as a healing group receives it: the sending process's own part. Process k of
    a group heals from process k of a live one, which holds the same slice, so the part goes into place as it is."""

    local: torch.Tensor


def as_parts(state: Any) -> Any:
    """`state` with every DTensor replaced by this process's part of it (what a heal sends)."""
    return tree_map_only(DTensor, lambda t: Part(t.to_local()), state)


def from_part(value: Any, like: torch.Tensor) -> Any:
    """A received `Part` as a DTensor laid out as `like` (the tensor it replaces); any other value as it is."""
    if not isinstance(value, Part):
        return value
    return DTensor.from_local(value.local, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride())


def route_address(url: str) -> str:
    """The address this host uses to reach `url`'s host: where the other groups can reach it too."""
    parsed = urlparse(url)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((parsed.hostname, parsed.port or 80))  # UDP: no packet is sent, the route is looked up
        return probe.getsockname()[0]


def transport(host: str, timeout: timedelta):
    """torchft's HTTP checkpoint transport, advertising `host` rather than the hostname."""
    from torchft.checkpointing.http_transport import HTTPTransport

    class Transport(HTTPTransport):
        def address(self) -> str:
            return f"http://{host}:{self._server.socket.getsockname()[1]}/checkpoint/"

    return Transport(timeout=timeout, num_chunks=0)


def digest(state: dict[str, Any]) -> str:
    """xxh3 of a group's training state (tensors' dtype, shape and bytes; other values' repr), in key order: equal
    states, equal digests, whatever device or process holds them. Its metrics are left out: their timings differ."""
    import xxhash

    h = xxhash.xxh3_64()

    def add(key: str, value: Any) -> None:
        if isinstance(value, dict):
            for k in sorted(value, key=str):
                add(f"{key}/{k}", value[k])
        elif isinstance(value, list | tuple):
            for i, v in enumerate(value):
                add(f"{key}/{i}", v)
        elif isinstance(value, torch.Tensor):
            t = value.detach().cpu().contiguous()
            h.update(f"{key}:{t.dtype}:{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(f"{key}={value!r}".encode())

    add("", {k: v for k, v in state.items() if k != "metrics"})
    return h.hexdigest()


class Layout(NamedTuple):
    """How a group holds the model: what every group of a quorum must share (process k of each sums its gradients with
    process k of the others, in buffers of one size)."""

    processes: int
    sharded: bool  # FSDP: each process holds a slice; else (DDP, one process) each holds the whole model

    def __str__(self) -> str:
        return f"{self.processes}p-{'fsdp' if self.sharded else 'whole'}"

    def engine(self) -> str:
        return "shards the model (FSDP)" if self.sharded else "holds the whole model in each process (DDP or one process)"


def torchft_id(group: str, layout: Layout) -> str:
    """The replica id this group gives torchft: its layout and its id (torchft numbers the group's ranks by the id's
    trailing digits, which stay the group's own)."""
    return f"{layout}-{group}"


def misfit(replica_ids: list[str], group: str, layout: Layout) -> str | None:
    """Why the groups of a quorum (torchft's replica ids, `torchft_id:uuid`) cannot train together, or None: every group
    runs the same number of processes and the same engine, and no two share a number (torchft's ranks across groups
    come from it)."""
    found = (re.fullmatch(r"(\d+)p-(whole|fsdp)-(.+)", r.split(":")[0]) for r in replica_ids)
    members = [(Layout(int(m[1]), m[2] == "fsdp"), m[3]) for m in found if m]
    for theirs, other in members:
        if theirs.processes != layout.processes:
            return (
                f"replica group {group} runs {layout.processes} process{'es' if layout.processes > 1 else ''} and group "
                f"{other} runs {theirs.processes}: every group must run the same number (process k of each sums its "
                "gradients with process k of the others)"
            )
        if theirs.sharded != layout.sharded:
            return (
                f"replica group {group} {layout.engine()} and group {other} {theirs.engine()}: every group must run the "
                "same engine (process k of each sums the same gradients with process k of the others)"
            )
    numbers: dict[int, str] = {}
    for _, other in members:
        number = int(re.search(r"\d+$", other).group())
        if number in numbers:
            first = numbers[number]
            same = f"two replica groups are named {other}" if first == other else f"replica groups {first} and {other} both end in {number}"
            return f"{same}: torchft numbers a group by the digits its id ends in, so every group needs its own"
        numbers[number] = other
    return None


class Members:
    """torchft's client of this group's quorum server, which looks at each quorum's groups before torchft configures the
    process group across them (groups that do not fit together crash there). A group joining a quorum it does not fit
    (behind the others, or every group at step 0) stops with a LaunchError; a group that has been training waits, up to
    the quorum's timeout, for a quorum without the misfit (it stops at once: the lighthouse drops it at its heartbeat
    timeout)."""

    def __init__(self, client, group: str, layout: Layout, tell: Callable[[str], None]):
        self.client, self.group, self.layout, self.tell = client, group, layout, tell

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    def _quorum(self, **kwargs):
        from infra.distributed import LaunchError

        end, said = time.monotonic() + kwargs["timeout"].total_seconds(), None
        while True:
            quorum = self.client._quorum(**kwargs)
            problem = misfit(quorum.replica_ids, self.group, self.layout)
            if problem is None:
                return quorum
            if kwargs["step"] < quorum.max_step or quorum.max_step == 0 or time.monotonic() > end:
                raise LaunchError(problem)
            if problem != said:
                self.tell(f"a group that does not fit joined ({problem}); waiting for a quorum without it")
                said = problem
            time.sleep(0.5)


class ReplicaGroup:
    """torchft's Manager for this replica group (every process of the group builds one)."""

    def __init__(
        self,
        accelerator: Accelerator,
        config,
        state_dict: Callable[[], dict[str, Any]],
        load_state_dict: Callable[[dict[str, Any]], None],
    ):
        os.environ.setdefault("RUST_LOG", "warn")  # torchft's own server logs every quorum and commit at info
        import torchft
        from torch.distributed import TCPStore

        from infra.replicas.gloo import BoundedGloo

        logging.getLogger("torchft").setLevel(logging.CRITICAL)  # tracebacks of a lost peer: the loop says it in a line

        self.accelerator, self.min_replicas = accelerator, config.min_replicas
        host = route_address(config.lighthouse)
        store = [None]
        if accelerator.is_main_process:  # the group's own store for the cross-group process group: outlives nothing
            self.store = TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
            store = [self.store.port]
        if accelerator.num_processes > 1:
            broadcast_object_list(store)
        timeout = timedelta(seconds=config.replica_timeout_seconds)
        self.loaded: int | None = None  # the step a heal brought, until the loop reads it
        self.id = config.replica_group_id
        # FSDP: each process of the group holds its own part of the state, and heals it from the same process of a peer
        self.parted = accelerator.distributed_type == DistributedType.FSDP
        layout = Layout(accelerator.num_processes, self.parted)

        def send() -> dict[str, Any]:  # to a group that heals, from torchft's quorum thread (the main one waits)
            state = state_dict()
            self.tell(f"sent the state of step {state['train']['step']} (xxh3 {digest(state)})")
            return state

        def load(state: dict[str, Any]) -> None:
            load_state_dict(state)
            self.loaded = int(state["train"]["step"])
            self.loaded_digest = digest(state_dict())  # as this group now holds it: equal to the sender's if exact

        self.manager = torchft.Manager(
            pg=BoundedGloo(timeout=timeout),  # a frozen group's store cannot hold the others up
            load_state_dict=load,
            state_dict=send,
            min_replica_size=config.min_replicas,
            use_async_quorum=False,  # a group that heals does so before its forward pass, and every live group trains
            timeout=timeout,
            quorum_timeout=timedelta(seconds=config.quorum_timeout_seconds),
            connect_timeout=timedelta(seconds=config.quorum_timeout_seconds),
            rank=accelerator.process_index,
            world_size=accelerator.num_processes,
            store_addr=host,
            store_port=int(store[0]),
            lighthouse_addr=config.lighthouse.rstrip("/"),
            replica_id=torchft_id(config.replica_group_id, layout),
            hostname=host,
            checkpoint_transport=transport(host, timeout),
            init_sync=False,  # every group builds the same weights from the seed; a fresh job loads one checkpoint
        )
        self.manager._client = Members(self.manager._client, self.id, layout, self.tell)

    def tell(self, line: str) -> None:
        """A line about this group's state: from its main process, or from every process when each holds a part."""
        if self.parted:
            print(f"replica group {self.id} process {self.accelerator.process_index}: {line}", flush=True)
        elif self.accelerator.is_main_process:
            print(f"replica group {self.id}: {line}", flush=True)

    def quorum(self) -> Seat:
        """The quorum of this step (waits for min_replicas groups); a group behind the others heals here."""
        start = time.monotonic()
        self.manager.start_quorum()
        healed, self.loaded = self.loaded, None
        rank = self.manager.participating_rank()
        if rank is None:  # the quorum could not form (lighthouse gone, a transfer failed): the commit will say no
            rank = 0
        size = max(self.manager.num_participants(), 1)
        return Seat(rank, size, self.manager._quorum_id, healed, time.monotonic() - start)

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` summed over the quorum (in place)."""
        self.manager.allreduce(tensor, reduce_op=torch.distributed.ReduceOp.SUM).wait()
        return tensor

    @torch.no_grad()
    def sum_gradients(self, model: torch.nn.Module, loss: torch.Tensor) -> torch.Tensor:
        """Every trainable parameter's gradient summed over the quorum, and `loss` with them: one all-reduce of one
        flat buffer. Under FSDP each process sums its own part with the same process of the other groups (HSDP: sharded
        inside a group, replicated across groups)."""
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:  # unused in this group's share: a zero contribution
                p.grad = torch.zeros_like(p)
        grads = [local(p.grad) for p in params]
        flat = torch.cat([g.reshape(-1).float() for g in grads] + [loss.reshape(1).float()])
        self.sum(flat)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        return flat[-1]

    def commit(self) -> bool:
        """Whether every group of the quorum finished this step: the optimizer steps only then."""
        return self.manager.should_commit()

    def fail(self, why: str) -> None:
        """This try must not commit, in any group of the quorum (torchft skips the step and reconfigures)."""
        self.manager.report_error(RuntimeError(why))

    def why_not(self) -> str:
        """What kept the last step from committing, in a few words."""
        err = self.manager.errored()
        if err is None:
            return f"fewer than min_replicas={self.min_replicas} groups, or another group failed it"
        cause = err.original_exception
        text = re.sub(r"\[[^\]]*\.(cc|cpp|h):\d+\] ", "", str(cause).splitlines()[0] if str(cause) else "no detail")  # gloo's source line
        return f"{type(cause).__name__}: {text.split('. This is typically')[0][:160]}"

    def set_step(self, step: int) -> None:
        """After this group loaded a checkpoint: the step the quorum compares (and a later group heals to)."""
        self.manager.load_state_dict({"step": step, "batches_committed": self.manager.batches_committed()})

    @property
    def step(self) -> int:
        return self.manager.current_step()

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)
