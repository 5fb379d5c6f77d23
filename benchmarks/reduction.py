"""What summing DDP's gradients in rank order costs (infra.reduction), against DDP's own all-reduce, as a ratio in one run.

    python benchmarks/reduction.py                         # 3 processes, gloo on CPU (or NCCL, one GPU a process)
    python benchmarks/reduction.py --processes 4 --steps 40 --hidden 1024

One torchrun job; each process builds the same MLP of `--layers` square layers, and alternates arms in rounds (so a
machine that slows down mid-run slows both): each round wraps the model afresh with DDP's own all-reduce (`native`)
and with the rank-ordered hook, and times `--steps` forward-backward-step iterations of each after one warm-up step.
Printed by rank 0: the median seconds a step of each arm and their ratio (rank_ordered / native; 1.0 = free). On CPU
both arms run the backward and the exchange on the same cores; on GPUs the hook's exchange is not overlapped with the
backward, which DDP's is: measure there with `--device cuda` before relying on the CPU figure.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from infra.reduction import sum_in_rank_order  # noqa: E402


def arm(how: str, args: argparse.Namespace, device: torch.device) -> float:
    """Median seconds a step of a freshly wrapped model."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(args.hidden, args.hidden) for _ in range(args.layers)]
    model = DDP(torch.nn.Sequential(*layers).to(device), device_ids=[device.index] if device.type == "cuda" else None)
    sum_in_rank_order(model, how)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(args.batch, args.hidden, device=device)
    times = []
    for i in range(args.steps + 1):
        start = time.perf_counter()
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i:  # the first step rebuilds DDP's buckets
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def worker(args: argparse.Namespace) -> None:
    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    found: dict[str, list[float]] = {"native": [], "rank_ordered": []}
    for _ in range(args.rounds):
        for how in found:
            found[how].append(arm(how, args, device))
    if dist.get_rank() == 0:
        native, ordered = statistics.median(found["native"]), statistics.median(found["rank_ordered"])
        print(json.dumps({"native_s": native, "rank_ordered_s": ordered, "ratio": ordered / native, "rounds": found}))
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # as the recipes leave: the interpreter's teardown after a gloo group can abort (infra.recipe.leave)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    params = args.layers * (args.hidden * args.hidden + args.hidden)
    print(f"{args.processes} processes ({args.device}), an MLP of {params / 1e6:.1f}M parameters", end=", ")
    print(f"{args.steps} steps an arm, {args.rounds} rounds", flush=True)
    with socket.socket() as s:  # a port free now for the job's store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.processes), "--master_port", str(port)]
    flags = [f"--{k}={v}" for k, v in vars(args).items() if k not in ("worker", "processes")]
    proc = subprocess.run([*torchrun, __file__, "--worker", *flags], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"benchmark failed: {proc.stderr[-2000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    native, ordered = result["native_s"] * 1e3, result["rank_ordered_s"] * 1e3
    print(f"native {native:.1f} ms a step, rank_ordered {ordered:.1f} ms: **{result['ratio']:.2f}x**")


if __name__ == "__main__":
    main()
