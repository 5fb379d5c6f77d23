"""DDP's gradient sum at the first step of a new wrapper (what a resumed launch or an in-job restart has) against the
wrapper that has been running, as JSON from rank 0:

    torchrun --nproc_per_node W tests/reduction_order.py rank_ordered|native

A model is trained K steps in one wrapper, and alike K steps then wrapped again (its weights carried over, as a
checkpoint does). Printed: the gradient tensors of the steps after K that differ between the two, and (rank_ordered)
those that differ from the mean computed here from every rank's own gradient, rank 0's + rank 1's + ... in that order.
Sizes are odd, so no bucket divides by the world size; buckets are small, so there are several.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from infra.reduction import in_rank_order, sum_in_rank_order

K = 3


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(129, 129) for _ in range(8)], torch.nn.Linear(129, 7))


def batch(step: int) -> torch.Tensor:
    return torch.randn(8, 129, generator=torch.Generator().manual_seed(1000 * step + dist.get_rank()))


def wrap(module: torch.nn.Module, how: str) -> DDP:
    ddp = DDP(module, bucket_cap_mb=1)
    sum_in_rank_order(ddp, how)
    return ddp


def step(ddp: DDP, optimizer: torch.optim.Optimizer, s: int) -> list[torch.Tensor]:
    optimizer.zero_grad()
    ddp(batch(s)).pow(2).mean().backward()
    grads = [p.grad.clone() for p in ddp.parameters()]
    optimizer.step()
    return grads


def expected(module: torch.nn.Module, s: int) -> list[torch.Tensor]:
    """Step s's mean gradient from each rank's own, summed here in rank order."""
    local = [p.detach().clone().requires_grad_() for p in module.parameters()]
    copy = torch.func.functional_call(module, dict(zip([n for n, _ in module.named_parameters()], local, strict=True)), (batch(s),))
    copy.pow(2).mean().backward()
    world = dist.get_world_size()
    out = []
    for p in local:
        every = [torch.empty_like(p.grad) for _ in range(world)]
        dist.all_gather(every, p.grad)
        out.append(in_rank_order(torch.stack([g / world for g in every])))
    return out


def compare(how: str) -> dict:
    one = wrap(model(), how)
    opt = torch.optim.SGD(one.parameters(), lr=0.01)
    continuous = [step(one, opt, s) for s in range(K + 2)]
    two = wrap(model(), how)
    opt2 = torch.optim.SGD(two.parameters(), lr=0.01)
    for s in range(K):
        step(two, opt2, s)
    three = model()
    three.load_state_dict(two.module.state_dict())
    three = wrap(three, how)
    opt3 = torch.optim.SGD(three.parameters(), lr=0.01)
    report = {"tensors": len(continuous[0]), "differ": [], "off_rank_order": []}
    for s in range(K, K + 2):
        want = expected(three.module, s)
        got = step(three, opt3, s)
        report["differ"].append(sum(not torch.equal(a, b) for a, b in zip(continuous[s], got, strict=True)))
        report["off_rank_order"].append(sum(not torch.equal(a, b) for a, b in zip(want, got, strict=True)))
    return report


def main(how: str) -> None:
    dist.init_process_group("gloo")
    report = compare(how)
    if dist.get_rank() == 0:
        print(json.dumps(report), flush=True)
    dist.destroy_process_group()
    # without the interpreter's teardown, as the recipes leave (infra.recipe.leave): it aborted a process now and then,
    # with or without the hook ("terminate called without an active exception", no Python frame left)
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
