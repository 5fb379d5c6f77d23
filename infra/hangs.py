"""A lost peer or a hung step ends this process within a bound, in one line that names the host and rank.

What a cluster does to a job and what each rank sees of it (measured over two hosts made of network namespaces):

- a host lost (its processes killed): the survivors' next collective fails within seconds with gloo's "Connection
  reset/closed by peer [address]". `Watchdog.explaining()` turns that into `lost peer: rank 1 on h1 (10.0.0.11) ...
  (connection reset)`.
- a dead link (processes alive, network gone), or a frozen process (SIGSTOP, a hung driver): no error at all. The
  collectives wait for the process group's timeout, and with a dead link a store request may never return. A thread
  of each rank, the watchdog, ends the process once no step has finished for the silence deadline, max(8 s, 5 x the
  slowest of the recent steps), if a peer does not answer (below); else, a step alive but stuck, at the step deadline:
  `ddp_step_timeout`, or by default max(30 s, 5 x the slowest recent step). The first step, saves, loads and
  evaluations get the start-up timeout `ddp_timeout` instead. It never waits on the network for more than a few
  seconds itself.

Before it exits a rank says which rank is silent and why, as far as it can tell from the launcher's key-value store:
each rank writes its last finished step there after every step, and its watchdog writes a stamp every few seconds
while the process lives. A rank behind the others with a fresh stamp is alive and stuck in its step; a stale stamp is
a rank that does not answer (frozen, its link down, or its host lost); a store that does not answer is a host that
cannot reach rank 0's host. Then:

- `OUTPUT_DIR/hangs/step<N>_rank<R>_<host>.txt`: the line, what the rank was doing (the last collective it entered,
  its step, for how long) and every thread's Python stack; logged to the MLflow run as artifacts (by the next launch
  that resumes the run, or at once by a surviving rank 0);
- `OUTPUT_DIR/stopped.json`: the first rank to write it names the fault for batch scripts (`reason: peer_lost`);
- exit code `PEER_LOST_EXIT_CODE` (76, infra.stopped).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from accelerate import Accelerator

from infra.errors import RunError
from infra.stopped import PEER_LOST_EXIT_CODE, Reason, Stop, write_first_record

AUTO_FLOOR_SECONDS = 30.0  # ddp_step_timeout 0: never less than this
AUTO_FACTOR = 5.0  # ... nor less than this x the slowest recent step
RECENT_STEPS = 100
STAMP_SECONDS = 2.0  # how often each rank's watchdog writes its stamp
SILENT_AFTER = 4 * STAMP_SECONDS  # a stamp older than this: that rank does not answer
# a step this late (and AUTO_FACTOR x the slowest) ends if a peer does not answer: no stamp is stale before this anyway
SILENT_FLOOR_SECONDS = SILENT_AFTER
STORE_WAIT = 4.0  # the most the watchdog waits for one store request
HANGS = "hangs"

RESET = re.compile(r"connection (?:reset|closed) by peer|broken pipe|connection refused", re.I)
ADDRESS = re.compile(r"\[([0-9a-f.:]+)\]:\d+")


@dataclass(frozen=True)
class Peer:
    """Where a rank runs: its host's name and addresses (gathered once at start)."""

    rank: int
    host: str
    addresses: tuple[str, ...]

    def __str__(self) -> str:
        return f"rank {self.rank} on {self.host}"


def my_addresses() -> tuple[str, ...]:
    """This host's IPv4 addresses other than loopback (those a peer's error message names)."""
    import psutil

    found = []
    for addrs in psutil.net_if_addrs().values():
        found += [a.address for a in addrs if a.family == socket.AF_INET and not a.address.startswith("127.")]
    return tuple(found)


def roster(accelerator: Accelerator) -> list[Peer]:
    """Every rank's host and addresses, in rank order (one all-gather; no collective with one process)."""
    mine = (socket.gethostname(), my_addresses())
    if accelerator.num_processes == 1:
        return [Peer(0, *mine)]
    from accelerate.utils import gather_object

    return [Peer(rank, host, tuple(addrs)) for rank, (host, addrs) in enumerate(gather_object([mine]))]


def bounded(call: Callable[[], object], seconds: float) -> tuple[bool, object]:
    """(True, call()) if it returns within `seconds`, else (False, None): a store request over a dead link may never
    return, and the thread left waiting dies with the process."""
    box: list = []
    worker = threading.Thread(target=lambda: box.append(_catch(call)), daemon=True)
    worker.start()
    worker.join(seconds)
    if not box:
        return False, None
    ok, value = box[0]
    return ok, value


def own_line(line: str) -> str:
    """`line`, after a line break when a progress bar of this process is drawn: a bar ends its line only when it is
    drawn again, and a line printed from another thread as the process exits was glued to the bar's last state."""
    from tqdm import tqdm

    drawn = any(not bar.disable for bar in list(getattr(tqdm, "_instances", ())))
    return f"\n{line}" if drawn else line


def _catch(call):
    try:
        return True, call()
    except Exception as err:  # a store that refused or timed out: reported as no answer
        return False, err


def step_deadline(configured: float, recent: deque) -> float:
    """Seconds without a finished step before a rank is declared hung: `configured`, or (0) the automatic rule."""
    if configured > 0:
        return configured
    return max(AUTO_FLOOR_SECONDS, AUTO_FACTOR * max(recent, default=0.0))


def silence_deadline(configured: float, recent: deque) -> float:
    """Seconds without a finished step after which a peer that does not answer (stale stamp, or a store out of reach)
    ends the step: the evidence of a fault that a step merely slow lacks, so it need not wait for the step deadline."""
    return min(step_deadline(configured, recent), max(SILENT_FLOOR_SECONDS, AUTO_FACTOR * max(recent, default=0.0)))


class Watchdog:
    """Each rank's guard against a peer lost or a step that never ends (see the module's docstring).

    `beat(step, seconds)` after every step; `relaxed()` around saves, loads and evaluations; `entering(name)` before
    each collective of the step; `explaining()` around the loop turns a peer's lost connection into one line.
    """

    STEP = "infra/step/{}"
    STAMP = "infra/alive/{}"

    def __init__(self, accelerator: Accelerator, output_dir: str, start_timeout: float, step_timeout: float, peers: list[Peer]):
        self.accelerator, self.output_dir, self.peers = accelerator, Path(output_dir), peers
        self.rank = accelerator.process_index
        self.start_timeout, self.step_timeout = start_timeout, step_timeout
        self.recent: deque = deque(maxlen=RECENT_STEPS)
        self.step = 0
        self.doing = ("start-up", 0, time.monotonic())  # the last collective entered: (name, step, since)
        self.started = self._relaxed = False
        # the least either deadline may be: a replica group's ranks also wait on the other groups (infra.replicas)
        self.floor = 0.0
        self._last = time.monotonic()
        self._fired = threading.Lock()
        self._pending_stamp = False
        self._asked = -float("inf")  # when the store was last asked whether every peer answers
        self.on_exit: Callable[[str], None] | None = None  # set by the Trainer: what else to do before the exit
        self.store = None
        if accelerator.num_processes > 1:
            from torch.distributed.distributed_c10d import _get_default_store

            self.store = _get_default_store()
            self._stop = threading.Event()
            threading.Thread(target=self._watch, name="watchdog", daemon=True).start()

    # -- what the loop calls ---------------------------------------------------------------------------------------------

    def beat(self, step: int, seconds: float) -> None:
        """After each step: its duration joins the recent ones (the first step's, with its start-up, does not)."""
        now = time.monotonic()
        if self.started:
            self.recent.append(seconds)
        self.step, self._last, self.started = step, now, True
        if self.store is not None:
            self.store.set(self.STEP.format(self.rank), str(step))

    def entering(self, name: str) -> None:
        """Before a collective of the next step: what forensics report if it never returns."""
        self.doing = (name, self.step + 1, time.monotonic())

    def deadline(self) -> float:
        if self._relaxed or not self.started:
            return self.start_timeout
        return max(self.floor, step_deadline(self.step_timeout, self.recent))

    def silence(self) -> float:
        """When a late step starts to be checked for a silent peer (not during start-up, saves, loads, evaluations: a
        peer busy in one may starve its stamp thread)."""
        if self._relaxed or not self.started:
            return self.start_timeout
        return max(self.floor, silence_deadline(self.step_timeout, self.recent))

    @contextlib.contextmanager
    def relaxed(self, what: str = "checkpoint or evaluation") -> Iterator[None]:
        """The start-up timeout for work that may keep ranks waiting long (a save, a load, an evaluation)."""
        was, self._relaxed = self._relaxed, True
        self.entering(f"{what} (relaxed timeout)")
        try:
            yield
        finally:
            self._relaxed, self._last = was, time.monotonic()

    def stop(self) -> None:
        """The loop is over: nothing more to watch."""
        if self.store is not None:
            self._stop.set()

    @contextlib.contextmanager
    def explaining(self) -> Iterator[None]:
        """A collective that fails inside because a peer is gone, or timed out, ends the process in one line."""
        try:
            yield
        except RuntimeError as err:  # what torch.distributed raises (DistError and its kinds); a data timeout is not one
            text = str(err)
            ours = isinstance(err, RunError)  # a CheckpointError, say: said in its own line by the recipe's entry point
            if ours or self.store is None or not (RESET.search(text) or "timed out" in text.lower() or "timeout" in text.lower()):
                raise
            self.fire(self.from_error(text), join=False)

    # -- the watch -------------------------------------------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._stop.wait(1.0):
            self._stamp()
            if (finding := self.check(time.monotonic() - self._last)) is not None:
                self.fire(finding, join=True)

    def check(self, idle: float) -> Stop | None:
        """What ends the process after `idle` seconds without a finished step, if anything: past the step deadline
        whatever the store says; past the silence deadline, a peer that does not answer."""
        if idle > self.deadline():
            return self.silent(idle, self.deadline())
        if idle > self.silence() and time.monotonic() - self._asked >= STAMP_SECONDS:  # every rank asks; not too often
            self._asked = time.monotonic()
            finding = self.silent(idle, self.silence())
            return finding if finding.fault == "no answer" else None
        return None

    def _stamp(self) -> None:
        """Write this rank's stamp unless the last write has not returned yet (a dead link)."""
        if self._pending_stamp:
            return
        self._pending_stamp = True

        def write():
            self.store.set(self.STAMP.format(self.rank), f"{time.time():.3f}")
            self._pending_stamp = False

        threading.Thread(target=write, daemon=True).start()

    # -- diagnosis ---------------------------------------------------------------------------------------------------------

    def from_error(self, text: str) -> Stop:
        """A collective's error: a peer that reset its connection (named by its address), or a timeout."""
        if RESET.search(text):
            found = ADDRESS.search(text)
            address = found.group(1) if found else None
            who = [p for p in self.peers if address in p.addresses and p.rank != self.rank]
            named = ", ".join(map(str, who)) if who else f"the peer at {address}" if address else "a peer"
            where = f" ({address})" if who else ""
            return self.finding(f"{named}{where} closed its connection: its process died or its host is gone", "connection reset", who)
        return self.silent(time.monotonic() - self._last, self.deadline())

    def silent(self, idle: float, deadline: float) -> Stop:
        """No step finished here for `idle` seconds: who does not answer, from the store (a few seconds at most)."""
        ok, found = bounded(self._read_store, STORE_WAIT)
        if not ok:
            server = self.peers[0]
            return self.finding(
                f"the job's store on {server.host} (rank 0's host) does not answer from {self.peers[self.rank].host}: "
                f"{server.host} is lost or frozen, or the link between the hosts is down",
                "no answer",
                [p for p in self.peers if p.host == server.host],
                (idle, deadline),
            )
        steps, stamps, now = found
        silent = [p for p in self.peers if p.rank != self.rank and now - stamps.get(p.rank, 0.0) > SILENT_AFTER]
        if silent:
            ages = ", ".join(f"{p} for {now - stamps[p.rank]:.0f}s" if p.rank in stamps else f"{p} ever" for p in silent)
            return self.finding(f"no answer from {ages}: frozen, its link down, or its host lost", "no answer", silent, (idle, deadline))
        ahead = max(steps.values(), default=self.step)
        behind = [p for p in self.peers if steps.get(p.rank, -1) < ahead]
        if behind:
            where = ", ".join(f"{p} at step {steps.get(p.rank, -1)}" for p in behind)
            return self.finding(
                f"{where} while the others finished step {ahead}: alive but stuck in its step", "hung step", behind, (idle, deadline)
            )
        what = f"every rank is alive and finished step {ahead}, yet step {ahead + 1} does not end"
        return self.finding(what, "hung step", [], (idle, deadline))

    def _read_store(self) -> tuple[dict[int, int], dict[int, float], float]:
        """Every rank's step and stamp: in one request when all are there (every rank asks, a thousand ranks share the
        store), else key by key (a rank that has not finished a step or written a stamp yet). Nothing waits for a key:
        `check` answers at once, so the store's timeout, which the process group shares, is left as it is."""
        ranks = range(len(self.peers))
        keys = [self.STEP.format(r) for r in ranks] + [self.STAMP.format(r) for r in ranks]
        if self.store.check(keys):
            values = dict(zip(keys, self.store.multi_get(keys), strict=True))
        else:
            values = {key: self.store.get(key) for key in keys if self.store.check([key])}
        steps = {r: int(values[self.STEP.format(r)]) for r in ranks if self.STEP.format(r) in values}
        stamps = {r: float(values[self.STAMP.format(r)]) for r in ranks if self.STAMP.format(r) in values}
        return steps, stamps, time.time()

    def finding(self, what: str, kind: str, who: list[Peer], waited: tuple[float, float] | None = None) -> Stop:
        """The stop record and its line; `waited`: (seconds without a step, the deadline passed)."""
        me = self.peers[self.rank]
        waited = f"no step finished for {waited[0]:.0f}s (deadline {waited[1]:.0f}s); " if waited is not None else ""
        line = f"peer lost ({kind}): {me}, after step {self.step}: {waited}{what}"
        lost = tuple({"rank": p.rank, "host": p.host} for p in who)
        return Stop(Reason.PEER_LOST, fault=kind, lost=lost, seen_by={"rank": me.rank, "host": me.host}, message=line)

    # -- the exit ----------------------------------------------------------------------------------------------------------

    def fire(self, finding: Stop, join: bool) -> None:
        """Forensics, the stop record, one line, and the exit: once per process, whichever thread gets here first."""
        if not self._fired.acquire(blocking=False):
            if join:  # the main thread is exiting already
                return
            time.sleep(3600)
        line = finding.message
        with contextlib.suppress(Exception):
            self.write_forensics(line)
        with contextlib.suppress(Exception):
            write_first_record(self.output_dir, self.step, finding)
        if self.on_exit is not None:
            with contextlib.suppress(Exception):
                bounded(lambda: self.on_exit(line), STORE_WAIT)
        print(own_line(line), file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):
            tell_launcher(self.rank, PEER_LOST_EXIT_CODE, line)
        os._exit(PEER_LOST_EXIT_CODE)

    def write_forensics(self, line: str) -> Path:
        """`hangs/step<N>_rank<R>_<host>.txt`: the line, the last collective entered and every thread's stack."""
        name, step, since = self.doing
        frames = sys._current_frames()
        threads = {t.ident: t.name for t in threading.enumerate()}
        parts = [
            line,
            f"last collective entered: {name} (step {step}), {time.monotonic() - since:.1f}s ago",
            f"recent step seconds: {', '.join(f'{s:.3f}' for s in list(self.recent)[-5:]) or 'none'}",
            "",
        ]
        for ident, frame in frames.items():
            parts.append(f"--- thread {threads.get(ident, ident)}")
            parts.append("".join(traceback.format_stack(frame)))
        folder = self.output_dir / HANGS
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"step{self.step:08d}_rank{self.rank}_{self.peers[self.rank].host}.txt"
        path.write_text("\n".join(parts))
        return path


LAUNCH_STATUS_ENV = "INFRA_LAUNCH_STATUS"  # a folder infra.launch watches: a rank's exit for a lost peer


def tell_launcher(rank: int, code: int, line: str) -> None:
    """Tell `python -m infra.launch` (if it started this process) why this rank exits: over a dead link torch elastic's
    agent can wait forever on its rendezvous store after its workers are gone, and the launcher then ends it."""
    if folder := os.environ.get(LAUNCH_STATUS_ENV):
        (Path(folder) / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "code": code, "message": line}))


def log_forensics(run_id: str | None, output_dir: str | os.PathLike) -> int:
    """The forensics files not logged yet, as artifacts `hangs/<file>` of the MLflow run, then moved to hangs/logged/
    (rank 0; a tracking store that fails leaves them for the next try). How many were logged."""
    folder = Path(output_dir) / HANGS
    if run_id is None or not folder.is_dir():
        return 0
    import mlflow

    client = mlflow.MlflowClient()
    logged = 0
    for path in sorted(folder.glob("*.txt")):
        client.log_artifact(run_id, str(path), HANGS)
        (folder / "logged").mkdir(exist_ok=True)
        os.replace(path, folder / "logged" / path.name)
        logged += 1
    return logged
