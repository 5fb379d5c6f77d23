"""The lighthouse of a fault-tolerant job (the one process every replica group asks for the quorum of each step), and
a whole job of several groups on one machine.

    python -m infra.replicas lighthouse --port 29510 --min_replicas 1
    python -m infra.replicas local --groups 3 -- --config recipes/configs/pretrain_clm.yaml --global_batch_size 32

Start it before the replica groups, on a host they can all reach (the first node under SLURM), and give its address
to each group: `--lighthouse http://HOST:29510` (or $TORCHFT_LIGHTHOUSE). It keeps no state worth saving: if it dies,
start it again and the groups go on at their next quorum. A group that stops heartbeating for heartbeat_timeout_ms is
left out of the next quorum.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import threading
from pathlib import Path

from infra.errors import ToolParser

# The lighthouse counts a quorum's wait for late groups from the first group waiting, and a group left out of a quorum
# waits from that quorum on: a window shorter than a step lets the next quorum form as soon as one other group
# arrives, which leaves the last one out, and so on at every step (one group healing at every step, for good). A dead,
# frozen or cut-off group stops heartbeating, so heartbeat_timeout_ms, not this, bounds the wait for it.
JOIN_TIMEOUT_MS = 60_000


def main(argv: list[str] | None = None) -> int:
    parser = ToolParser(prog="python -m infra.replicas", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    light = sub.add_parser("lighthouse", help="serve the quorum of the replica groups until stopped (SIGTERM, Ctrl-C)")
    light.add_argument("--port", type=int, default=29510, help="port to listen on, every address (default 29510)")
    light.add_argument("--min_replicas", type=int, default=1, help="replica groups a quorum needs (default 1)")
    light.add_argument(
        "--join_timeout_ms",
        type=int,
        default=JOIN_TIMEOUT_MS,
        help=f"how long a quorum waits for groups alive (heartbeating) but late; above the longest step (default {JOIN_TIMEOUT_MS})",
    )
    light.add_argument(
        "--heartbeat_timeout_ms", type=int, default=3000, help="silence after which a group is taken for dead (default 3000)"
    )
    local = sub.add_parser("local", help="the lighthouse and N replica groups of one process each, on this machine")
    local.add_argument("--groups", type=int, default=3, help="replica groups to start (default 3)")
    local.add_argument("--recipe", default="pretrain_clm", help="recipes/<recipe>.py (default pretrain_clm)")
    local.add_argument("--port", type=int, default=29510, help="the lighthouse's port (default 29510)")
    local.add_argument("recipe_args", nargs=argparse.REMAINDER, help="after --: the recipe's flags (--config, --output_dir, ...)")
    args = parser.parse_args(argv)
    if args.command == "local":
        return run_local(args)
    for name in ("port", "min_replicas", "join_timeout_ms", "heartbeat_timeout_ms"):
        if getattr(args, name) < (0 if name == "port" else 1):
            parser.exit(2, f"lighthouse: {name}={getattr(args, name)} is not accepted: give an integer >= 1\n")
    os.environ.setdefault("RUST_LOG", "warn")  # torchft logs every quorum request at info: RUST_LOG=info to see them
    from torchft._torchft import LighthouseServer

    try:
        server = LighthouseServer(
            bind=f"[::]:{args.port}",
            min_replicas=args.min_replicas,
            join_timeout_ms=args.join_timeout_ms,
            quorum_tick_ms=100,
            heartbeat_timeout_ms=args.heartbeat_timeout_ms,
        )
    except Exception as err:  # the port taken, say
        print(f"lighthouse: cannot listen on port {args.port}: {err}", file=sys.stderr)
        return 1
    print(f"lighthouse: serving at {server.address()} (min_replicas {args.min_replicas})", flush=True)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    server.shutdown()
    return 0


def run_local(args) -> int:
    """The lighthouse and `--groups` groups on this machine, each group's output in its own log: kill one (its pid is
    printed) and start it again with the command printed, and the others go on. Ends when every group has ended."""
    if args.groups < 1:
        print(f"local: groups={args.groups} is not accepted: give an integer >= 1", file=sys.stderr)
        return 2
    extra = [a for a in args.recipe_args if a != "--"]
    output_dir = next((extra[i + 1] for i, a in enumerate(extra[:-1]) if a == "--output_dir"), f"runs/{args.recipe}_replicas")
    logs = Path(output_dir) / "replicas"
    logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.groups)))}
    light = subprocess.Popen([sys.executable, "-m", "infra.replicas", "lighthouse", "--port", str(args.port)], env=env)
    groups = {}
    for g in range(args.groups):
        cmd = [sys.executable, f"recipes/{args.recipe}.py", *extra, "--output_dir", output_dir, "--fault_tolerance", "replicas"]
        cmd += ["--replica_group_id", str(g), "--lighthouse", f"http://127.0.0.1:{args.port}"]
        with open(logs / f"group{g}.log", "a") as log:
            groups[g] = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        print(f"replica group {g}: pid {groups[g].pid}, log {logs / f'group{g}.log'}; to start it again:")
        print(f"    {shlex.join(cmd)} >> {logs / f'group{g}.log'} 2>&1")
    try:
        codes = [proc.wait() for proc in groups.values()]
    except KeyboardInterrupt:
        for proc in groups.values():
            proc.terminate()
        codes = [proc.wait() for proc in groups.values()]
    finally:
        light.terminate()
        light.wait(timeout=10)
    print(f"replica groups ended with {codes}")
    return max(codes, key=abs)


if __name__ == "__main__":
    sys.exit(main())
