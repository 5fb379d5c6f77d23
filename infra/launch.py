"""`accelerate launch` for schedulers: `python -m infra.launch <accelerate launch arguments>`.

What a scheduler does to a job, and what each launcher then reports:

- SIGTERM to the launcher (Kubernetes, `scancel`, `scontrol requeue`, an admin): plain `accelerate launch` (torch
  elastic's agent) passes it to the training processes, which save and exit 0, and then exits 1 itself
  (`SignalException`), so the scheduler records a failure. This launcher forwards it to the training processes,
  waits for them and exits with their code: 0 after a committed save.
- SIGUSR1 (SLURM's `--signal=USR1@180` before the time limit, `scancel --signal=USR1`): plain `accelerate launch`
  dies of it at once (Python's default for the signal). This launcher forwards it too.
- A training process that fails: plain `accelerate launch` prints a traceback of its own after the recipe's one-line
  error (`ChildFailedError`, or `CalledProcessError` for one process). This launcher prints one line naming the ranks
  and exits with their exit code (75 for a straggler, say).
- Several machines: node 0 must hold `--main_process_ip` and the others must reach it, else one line says which and
  the launch exits 1 before anything starts. Plain `accelerate launch` runs torch elastic's static rendezvous whatever
  the config file's `rdzv_backend` says (its command-line default wins over the file), and every attempt of an in-job
  restart then shares one store: a restarted rank can read its peer's address of the attempt before and fail to
  connect. This launcher asks for the c10d rendezvous with a store of its own for each attempt, unless
  `--rdzv_backend` is given (infra.rendezvous). `--min_machines N` (this launcher's) lets the job shrink to N machines
  and grow back within one launch (torch elastic's `N:num_machines` nodes); a straggler the job cannot keep up with
  then leaves in-job: its host's launcher ends with 75 in one line, and the others go on (infra.leave).
- Ranks that stop the job (a straggler) with in-job restarts left: plain `accelerate launch` starts them again, slow
  host included, until its restarts run out. This launcher ends with their code when they ask (infra.leave).

Otherwise it is `accelerate launch`, with the same arguments. The training processes catch both signals themselves
(infra.preemption, infra.consensus): a signal that reaches a process twice (the scheduler signals every process, and this
launcher forwards) counts once.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from infra.errors import USAGE_EXIT_CODE
from infra.hangs import LAUNCH_STATUS_ENV
from infra.leave import ending
from infra.rendezvous import TIMEOUT_ENV, elastic, elastic_problem, flag, node_problem, setting, with_rendezvous
from infra.stopped import PEER_LOST_EXIT_CODE

FORWARDED = (signal.SIGTERM, signal.SIGUSR1)
# torchrun's --signals_to_handle (its default read from this variable): torch elastic's agent turns these signals into
# an exception and stops the ranks; without SIGTERM in the list it leaves SIGTERM to the handler below
ELASTIC_SIGNALS_ENV = "PET_SIGNALS_TO_HANDLE"


def children(pid: int) -> list[int]:
    """The live direct child processes of `pid` (the training processes, under either accelerate launcher); exited ones
    that nobody has waited for yet (zombies) are not counted."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            state, ppid = stat.rsplit(")", 1)[1].split()[:2]
            if int(ppid) == pid and state != "Z":
                found.append(int(entry))
    return found


forwarded: set[int] = set()


def forward(signum: int, frame) -> None:
    """Pass the signal on to the training processes and keep waiting for them (they save and exit)."""
    ranks = children(os.getpid())
    if not ranks:  # nothing started yet, so nothing to save: end as the signal would have
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    if signum not in forwarded:  # a scheduler may signal the launcher twice (directly, and through srun)
        forwarded.add(signum)
        print(f"launch: {signal.Signals(signum).name} forwarded to the training processes; waiting for them to save and exit", flush=True)
    for pid in ranks:
        with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
            os.kill(pid, signum)


def exit_code(code: int) -> int:
    """A process's exit code as a shell reports it (128 + N for a death by signal N)."""
    return 128 - code if code < 0 else code


AGENT_GRACE_SECONDS = 5.0


def watch_agent(grace: float, restarts: bool) -> None:
    """End this launcher at once when its training processes ask it to (they leave the job, or stop it with restarts
    left: infra.leave), or once they have exited for a lost peer (they say so in a folder this launcher gives them)
    and torch elastic's agent has neither returned nor started them again `grace` seconds later. Its
    rendezvous store on node 0 bounds no wait of its own: over a dead link the agent waited on it 300 s and more, and
    with a frozen node 0 (its kernel still accepts connections) an agent with restarts left waited on it for good. With
    restarts the grace is the rendezvous timeout: a new group that forms within it goes on."""
    folder = tempfile.mkdtemp(prefix="infra-launch-")
    os.environ[LAUNCH_STATUS_ENV] = folder
    atexit.register(shutil.rmtree, folder, True)

    def watch():
        since = running = None
        while True:
            time.sleep(0.5)
            if (end := ending(Path(folder))) is not None:  # its ranks leave the job, or stop it (infra.leave)
                print(f"launch: {end['message']}", file=sys.stderr, flush=True)
                shutil.rmtree(folder, ignore_errors=True)
                os._exit(end["code"])
            if children(os.getpid()):
                running = running or time.time()
                for path in Path(folder).glob("rank*.json"):  # an earlier attempt's: its processes were started again
                    if path.stat().st_mtime < running:
                        path.unlink(missing_ok=True)
                since = None
                continue
            running = None
            told = sorted(Path(folder).glob("rank*.json"))
            if not told:
                since = None
                continue
            since = since or time.monotonic()
            if time.monotonic() - since >= grace:
                status = json.loads(told[0].read_text())
                ranks = ", ".join(f"rank {json.loads(p.read_text())['rank']}" for p in told)
                agent = "did not start them again" if restarts else "did not return"
                print(
                    f"launch: {ranks} exited with code {status['code']} (a peer lost); torch elastic's agent {agent} "
                    f"within {grace:g}s (its rendezvous store does not answer): exiting",
                    file=sys.stderr,
                    flush=True,
                )
                shutil.rmtree(folder, ignore_errors=True)
                os._exit(status["code"])

    threading.Thread(target=watch, name="agent-watch", daemon=True).start()


def said_below(record: logging.LogRecord) -> bool:
    """torch elastic's line on a worker that exited with a usage error ("failed (exitcode: 2) local_rank: 0 ..."), which
    the recipe said in one line, and on the others it stops then ("Sending process N closing signal SIGTERM"). A worker
    that failed otherwise keeps its line: with in-job restarts it is the launch's only word of which rank died."""
    return not record.getMessage().startswith((f"failed (exitcode: {USAGE_EXIT_CODE})", "Sending process"))


def main(argv: list[str] | None = None) -> int:
    os.environ[ELASTIC_SIGNALS_ENV] = "SIGINT,SIGHUP,SIGQUIT"
    for signum in FORWARDED:
        signal.signal(signum, forward)
    from accelerate.commands.accelerate_cli import main as accelerate
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    args = sys.argv[1:] if argv is None else argv
    if (config := flag(args, "--config_file")) is not None and not os.path.isfile(config):
        print(f"launch error: --config_file {config}: no such file (accelerate_configs/ has one per engine)", file=sys.stderr)
        return USAGE_EXIT_CODE
    if (problem := elastic_problem(args) or node_problem(args)) is not None:
        print(f"launch error: {problem}", file=sys.stderr)
        return 1
    sys.argv = ["accelerate", "launch", *with_rendezvous(elastic(args))]
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(said_below)
    restarts = int(flag(args, "--max_restarts") or 0) > 0
    watch_agent(float(os.environ.get(TIMEOUT_ENV, 300)) + AGENT_GRACE_SECONDS if restarts else AGENT_GRACE_SECONDS, restarts)
    try:
        accelerate()
    except subprocess.CalledProcessError as err:  # one process (accelerate's simple launcher): it printed its own error
        return exit_code(err.returncode)
    except ChildFailedError as err:  # torch elastic: every rank that failed, with its code
        code = exit_code(err.get_first_failure()[1].exitcode)  # the root cause's; the recipes' agreed exits share one code
        if code != USAGE_EXIT_CODE:  # a mistake in the configuration: the recipe said it in one line
            codes = ", ".join(f"rank {rank} exited with code {exit_code(f.exitcode)}" for rank, f in sorted(err.failures.items()))
            print(f"launch: {codes}", file=sys.stderr)
        return code
    except RendezvousError as err:  # the agent's store on node 0 is gone (node 0 lost, or the link to it): no group forms
        where = f"{setting(args, 'main_process_ip', '127.0.0.1')}:{setting(args, 'main_process_port', 29500)}"
        print(
            f"launch: the rendezvous at {where} (node 0) cannot be reached ({type(err).__name__}): node 0 is lost or cut off, "
            "and no group can form without it; start the job again",
            file=sys.stderr,
        )
        return PEER_LOST_EXIT_CODE
    return 0


if __name__ == "__main__":
    sys.exit(main())
