"""Several machines: the rendezvous every launch of `python -m infra.launch` asks for, and the checks before it.

- Node 0 serves torch elastic's rendezvous store at `main_process_ip:main_process_port`: that address must be its own.
- Every other node must reach it. It is waited for (up to INFRA_RENDEZVOUS_TIMEOUT seconds, default 300: schedulers
  start the nodes of a job seconds or minutes apart), then the launch stops in one line naming the address and this host,
  instead of torch elastic's wait of many minutes on an address that never answers.
- The rendezvous: c10d, with a store of its own for every attempt of an in-job restart (see infra.launch).
- Elastic size (`--min_machines N`, this launcher's own flag): torch elastic's `N:num_machines` nodes. A node lost makes
  the others restart their group without it (once its rendezvous heartbeat has expired and the last call has passed);
  a node that starts again joins at the restart its arrival causes. Node 0 serves the rendezvous: losing it ends the
  job (the scheduler starts it again).
"""

from __future__ import annotations

import contextlib
import os
import socket
import time

from infra.leave import MIN_MACHINES_ENV, RENDEZVOUS_HOST_ENV

TIMEOUT_ENV = "INFRA_RENDEZVOUS_TIMEOUT"


def flag(args: list[str], name: str) -> str | None:
    """The value of `--name VALUE` or `--name=VALUE` among the launcher's arguments (None if absent)."""
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def setting(args: list[str], name: str, default):
    """A launcher setting: `--name` on the command line, else the config file's `name`, else `default`."""
    if (given := flag(args, f"--{name}")) is not None:
        return given
    if (config := flag(args, "--config_file")) is not None:
        import yaml

        with contextlib.suppress(OSError, ValueError, TypeError, AttributeError), open(config) as f:
            value = yaml.safe_load(f).get(name)
            if value is not None:
                return value
    return default


def machines(args: list[str]) -> int:
    return int(setting(args, "num_machines", 1))


def with_rendezvous(args: list[str]) -> list[str]:
    """Across machines, the c10d rendezvous with a store per attempt (see infra.launch), unless asked otherwise."""
    if machines(args) <= 1 or flag(args, "--rdzv_backend") is not None:
        return args
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    return ["--rdzv_backend", "c10d", *args]


MIN_MACHINES = "--min_machines"


def without(args: list[str], name: str) -> list[str]:
    """The launcher's arguments less `--name VALUE` / `--name=VALUE`."""
    out, skip = [], False
    for i, arg in enumerate(args):
        if skip:
            skip = False
        elif arg == name and i + 1 < len(args):
            skip = True
        elif not arg.startswith(name + "="):
            out.append(arg)
    return out


def elastic_problem(args: list[str]) -> str | None:
    """Why `--min_machines` cannot be used as given (one line), or None."""
    given, most = flag(args, MIN_MACHINES), machines(args)
    if given is None:
        return None
    if not given.isdigit() or not 1 <= int(given) <= most:
        return f"min_machines={given} is not valid: expected an integer from 1 to num_machines={most}"
    if int(given) < most and int(flag(args, "--max_restarts") or 0) == 0:
        return f"min_machines={given} needs --max_restarts >= 1: the job shrinks and grows again by restarting its group"
    if int(given) < most and (flag(args, "--rdzv_backend") or "c10d") != "c10d":
        return f"min_machines={given} needs the c10d rendezvous, not --rdzv_backend {flag(args, '--rdzv_backend')}"
    return None


def elastic(args: list[str]) -> list[str]:
    """Ask torch elastic for `min_machines:num_machines` nodes; the arguments for accelerate launch (which has no such
    flag: it gives torch elastic `nnodes=num_machines`)."""
    least = flag(args, MIN_MACHINES)
    if least is None:
        return args
    if int(least) < machines(args):  # for the training processes: a host may leave in-job (infra.leave)
        os.environ[MIN_MACHINES_ENV] = least
        os.environ[RENDEZVOUS_HOST_ENV] = str(setting(args, "main_process_ip", "127.0.0.1"))
    import torch.distributed.run as elastic_run

    run = elastic_run.run

    def run_between(launch_args):
        launch_args.nnodes = f"{least}:{launch_args.nnodes}"
        return run(launch_args)

    elastic_run.run = run_between  # what accelerate's launchers call, looked up at the call
    return without(args, MIN_MACHINES)


def local_addresses() -> set[str]:
    import psutil

    return {a.address for addrs in psutil.net_if_addrs().values() for a in addrs if a.family == socket.AF_INET}


def node_problem(args: list[str], timeout: float | None = None) -> str | None:
    """Why this machine cannot join the launch (one line), or None."""
    if machines(args) <= 1:
        return None
    ip, port = str(setting(args, "main_process_ip", "127.0.0.1")), int(setting(args, "main_process_port", 29500))
    rank, host = int(setting(args, "machine_rank", 0)), socket.gethostname()
    try:
        address = socket.gethostbyname(ip)
    except OSError:
        return f"main_process_ip={ip} does not resolve on {host}"
    if rank == 0:
        mine = local_addresses()
        if address not in mine:
            return (
                f"main_process_ip={ip} is not an address of this machine ({host}: {', '.join(sorted(mine))}); machine_rank 0 "
                "serves the rendezvous there, so it must run on the machine with that address"
            )
        return None
    timeout = float(os.environ.get(TIMEOUT_ENV, 300)) if timeout is None else timeout
    return (
        None
        if reachable(address, port, timeout, host)
        else (
            f"node 0 at main_process_ip={ip} port {port} did not answer from {host} (machine_rank {rank}) within {timeout:g}s: "
            f"is machine_rank 0 started, is the address right, is the port open? ({TIMEOUT_ENV} sets the wait)"
        )
    )


def reachable(address: str, port: int, timeout: float, host: str) -> bool:
    """True once a TCP connection to address:port succeeds; False after `timeout` seconds, saying so every 30 s."""
    start = time.monotonic()
    said = 0
    while True:
        left = timeout - (time.monotonic() - start)
        if left <= 0:
            return False
        try:
            with socket.create_connection((address, port), timeout=min(5.0, left)):
                return True
        except OSError:
            waited = time.monotonic() - start
            if waited - said >= 30:
                said = waited
                print(f"launch: {host} waiting for node 0 at {address}:{port} ({waited:.0f}s of {timeout:g}s)", flush=True)
            time.sleep(min(1.0, max(0.0, timeout - (time.monotonic() - start))))
