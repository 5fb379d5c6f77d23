"""DDP's gradient sum in one order, whatever DDP's buckets: every element is rank 0's share + rank 1's + ... in rank order.

Why. Floating-point sums of three or more terms depend on their order. A ring all-reduce adds each element in an order
set by the element's offset inside the flat bucket it travels in, and DDP does not keep one bucket layout: a freshly
wrapped model reduces its first step in one bucket holding every gradient, then rebuilds its buckets from the order the
gradients became ready and keeps that layout. A resumed launch (or an in-job restart) wraps the model afresh, so its
first step summed in another order than the uninterrupted run's step at that point: at 3 or more processes the weights
parted in their last bits, at 2 (`a + b`, exact either way) they never did. NCCL adds more orders of its own (ring or
tree by message size, the rings it builds on a given topology).

How. A DDP communication hook (DDP's own extension point) replaces the all-reduce of each bucket by two movements that
copy and never add, and one local sum in a fixed order:

    all_to_all     process p receives slice p of every process's bucket (rank 0's first, then rank 1's, ...)
    sum            slice p = sum over ranks r = 0, 1, ..., W-1 of their slice p, added one rank at a time
    all_gather     every process receives every summed slice

The bytes each process sends are those of a ring all-reduce (a reduce-scatter then an all-gather); the sum's order no
longer depends on the bucket layout, the backend's algorithm or the machines' topology, only on the world size. Each
process's gradient is divided by the world size first, as DDP's own hook does.
"""

from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist

RANK_ORDERED = "rank_ordered"


@dataclass
class ReductionConfig:
    """How DDP sums the gradients (part of TrainingArguments)."""

    _argument_group_name = "gradient sum across processes"  # its heading in --help

    gradient_sum: Literal["rank_ordered", "native"] = field(
        default=RANK_ORDERED,
        metadata={
            "help": "rank_ordered: under DDP every gradient element is summed rank 0 + rank 1 + ... in that order, so a "
            "resumed or restarted run of the same world size repeats the uninterrupted one bit for bit at any number of "
            "processes; native: DDP's own all-reduce (overlapped whole with the backward; from 3 processes on, the first "
            "step after each launch sums in another order and a resumed run differs in the last bits). ZeRO and FSDP: no effect."
        },
    )


def in_rank_order(parts: torch.Tensor) -> torch.Tensor:
    """The rows of `parts` (one per rank) added one at a time, rank 0 first: the same bits for every element wherever it
    sits, since an element-wise add is exact to the last bit on every device."""
    total = parts[0].clone()
    for row in parts[1:]:
        total.add_(row)
    return total


def rank_ordered_hook(group: dist.ProcessGroup | None, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the bucket's mean over the group's processes, summed in rank order (module docstring)."""
    group = group if group is not None else dist.group.WORLD
    world = group.size()
    flat = bucket.buffer()
    flat.div_(world)
    n = flat.numel()
    per = -(-n // world)  # each process sums one slice of the bucket; the last is padded with zeros
    send = flat if per * world == n else torch.cat([flat, flat.new_zeros(per * world - n)])
    received = torch.empty_like(send)
    # Synchronous, issued in bucket order from the backward's thread: a collective launched from another's completion
    # callback (gloo completes them on its own threads) reached the processes in different orders and hung them.
    dist.all_to_all_single(received, send, group=group)
    mine = in_rank_order(received.view(world, per))
    dist.all_gather_single(send, mine, group=group)  # send was read: reused for the result
    if send is not flat:
        flat.copy_(send[:n])
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(flat)
    return done


def sum_in_rank_order(model: torch.nn.Module, how: str = RANK_ORDERED) -> None:
    """Make a DDP model's gradient all-reduce the rank-ordered sum (`how` = rank_ordered). Nothing changes under another
    engine, in one process, or with `native` (DDP's own all-reduce, whose first step after a new launch sums in another
    order than later steps)."""
    ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    if how == RANK_ORDERED and ddp and model.process_group.size() > 1:
        model.register_comm_hook(model.process_group, rank_ordered_hook)
