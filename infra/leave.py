"""Hosts left out of a running job (a straggler it cannot keep up with), and how its launchers end.

When the job must leave hosts out, every rank has saved the step (infra.trainer). Then, with elastic size
(`python -m infra.launch --min_machines N`), when the job can go on without them in this launch:

- the ranks on a leaving host ask their launcher to end with exit code 75 (a file in the folder infra.launch gives
  them): it ends, and its torch elastic agent with it, which would otherwise start them again and rejoin the host; then
  they exit;
- the other ranks wait (a barrier the leaving ranks never enter: it breaks when they are gone) and exit 75: their agents
  restart the group without the left hosts (the path of a lost host), resumed from the step saved, with the same global
  batch (the data position does not depend on the world size). A left host may join again at a later restart, as a
  lost host does, once its launcher is started again.

Where it cannot (fewer than `--min_machines` machines would be left; a leaving host serves the rendezvous: node 0; an
agent with no in-job restart left; replica groups; a launcher other than infra.launch), every rank exits 75 and
`stopped.json` names the hosts for the scheduler, which starts the job again without them. With in-job restarts
(`--max_restarts`) the launchers end too, rather than start the slow host again.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object

from infra.hangs import LAUNCH_STATUS_ENV, Peer, my_addresses
from infra.stopped import Reason, Stop

MIN_MACHINES_ENV = "INFRA_MIN_MACHINES"  # set by infra.launch for its training processes with --min_machines
RENDEZVOUS_HOST_ENV = "INFRA_RENDEZVOUS_HOST"  # and the address of node 0, which serves the rendezvous
END_FILE = "end_rank{rank}.json"  # a rank's request to its launcher: end with this code, after this line
LAUNCHER_END_SECONDS = 30.0  # how long a rank waits for its launcher to end before it exits anyway


def restarts_left() -> int:
    """This process's torch elastic agent's in-job restarts left (0 when it was not started by one)."""
    return int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)) - int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


class Standing(NamedTuple):
    """What a rank knows of its own launch, for the others to decide with (gathered: no rank resolves another's name)."""

    restarts: int  # its agent's in-job restarts left
    serves_rendezvous: bool  # its machine is node 0, at INFRA_RENDEZVOUS_HOST


def standing() -> Standing:
    """This rank's: its restarts left, and whether INFRA_RENDEZVOUS_HOST (an address or a name, resolved here) is its
    machine."""
    address = os.environ.get(RENDEZVOUS_HOST_ENV)
    serves = False
    if address is not None:
        mine = {socket.gethostname(), *my_addresses()}
        resolved = address
        with contextlib.suppress(OSError):
            resolved = socket.gethostbyname(address)
        serves = address in mine or resolved in mine
    return Standing(restarts_left(), serves)


def in_job_problem(peers: list[Peer], leaving: list[str], standings: list[Standing], replicas: bool) -> str | None:
    """Why the job cannot go on without the `leaving` hosts in this launch (a phrase), or None. `standings`: each rank's
    (gathered: the same answer on every rank)."""
    least, address = os.environ.get(MIN_MACHINES_ENV), os.environ.get(RENDEZVOUS_HOST_ENV)
    if replicas:
        return "replica groups leave the quorum by their group's exit"
    if least is None or address is None or LAUNCH_STATUS_ENV not in os.environ:
        return "the launch is not elastic (python -m infra.launch --min_machines N)"
    machines = int(os.environ.get("GROUP_WORLD_SIZE", 1))
    if (left := machines - len(leaving)) < int(least):
        return f"{left} machine{'s' if left != 1 else ''} would be left, fewer than --min_machines {least}"
    if any(peer.host in leaving and standings[peer.rank].serves_rendezvous for peer in peers):
        return f"it serves the rendezvous at {address} (node 0)"
    if min(standings[peer.rank].restarts for peer in peers if peer.host not in leaving) < 1:
        return "the other machines' agents have no in-job restart left (--max_restarts)"
    return None


def end_launcher(rank: int, code: int, line: str, wait: float = LAUNCHER_END_SECONDS) -> bool:
    """Ask `python -m infra.launch`, which started this process, to print `line` and end with `code` once each of its
    ranks has asked, and wait until it has (True), or `wait` seconds (False: the request withdrawn). Its torch elastic
    agent ends with it: without this, an agent with restarts left starts its ranks again."""
    folder = os.environ.get(LAUNCH_STATUS_ENV)
    if folder is None:
        return False
    parent, path = os.getppid(), Path(folder) / END_FILE.format(rank=rank)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"rank": rank, "code": code, "message": line, "ranks": int(os.environ.get("LOCAL_WORLD_SIZE", 1))}))
    tmp.rename(path)  # whole, or not there
    end = time.monotonic() + wait
    while os.getppid() == parent:
        if time.monotonic() > end:
            path.unlink(missing_ok=True)
            return False
        time.sleep(0.1)
    return True


def ending(folder: Path) -> dict | None:
    """The launcher's side: the end its ranks asked for, once every one of them has (the first's code and line)."""
    asked = []
    for path in sorted(folder.glob(END_FILE.format(rank="*"))):
        with contextlib.suppress(OSError, ValueError):
            asked.append(json.loads(path.read_text()))
    return asked[0] if asked and len(asked) >= asked[0]["ranks"] else None


def leave_out(acc: Accelerator, peers: list[Peer], ranks, reason: Reason, replicas: bool, say: Callable[[str], None]) -> Stop:
    """The stop that leaves the hosts of `ranks` out (a straggler; `sdc`: a machine that computes wrong): in-job where
    the launch is elastic and can go on without them, else by a stop for the scheduler. Its line says which, and why
    not in-job. Every rank calls it (one all-gather of each rank's own view)."""
    hosts = sorted({peers[rank].host for rank in ranks})
    standings = [standing()] if acc.num_processes == 1 else gather_object([standing()])  # each rank's own view
    problem = in_job_problem(peers, hosts, standings, replicas)
    if problem is None:
        say(f"{reason}: {', '.join(hosts)} will leave the job; the others go on without it from this step")
    elif MIN_MACHINES_ENV in os.environ:  # asked for elastic size: say why not this time
        say(f"{reason}: the job cannot go on without {', '.join(hosts)} in this launch: {problem}")
    return Stop(reason, hosts=tuple(hosts), in_job=problem is None)


def part_ways(rank: int, host: str, stop: Stop) -> None:
    """After a stop to leave hosts out (a straggler, a machine that computes wrong), the launchers: in-job, a leaving
    host's ends (and its agent), and the others' agents restart without it once it is gone; else, with in-job restarts
    left, every launcher ends with the stop's code, rather than start that host again."""
    code, hosts = stop.exit_code, " and ".join(stop.hosts)
    if not stop.in_job:
        if restarts_left() > 0:
            end_launcher(rank, code, f"the job stopped to leave {hosts} out: exiting with code {code}")
    elif host in stop.hosts:
        end_launcher(rank, code, f"{host} leaves the job, which goes on without it: exiting with code {code}")
    else:
        with contextlib.suppress(Exception):  # broken once the leaving ranks are gone: then this agent may restart
            torch.distributed.barrier()
