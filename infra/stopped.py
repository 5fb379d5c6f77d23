"""Why a launch stopped before max_steps: one typed record, its exit code, its line, and `OUTPUT_DIR/stopped.json`.

    Stop(Reason.STRAGGLER, hosts=("node-3",))     # built where the loop decides it (infra.trainer, infra.replicas)
    stop.exit_code, stop.line(step)                # the launch's code and its last line (Trainer.close)
    write_record(output_dir, step, stop)           # for the scheduler; read by `python -m infra.stopped FILE`

The file is written by rank 0 when the job saved and stopped (a preemption, a straggler or a machine that computes wrong
left out, a failed save), or by the first rank to see a lost peer (infra.hangs), and removed when a launch starts. Its
fields are the dataclass's, those left at their defaults omitted. A batch script asks `python -m infra.stopped FILE`
what to do with it (infra/slurm/pretrain.sbatch): `without HOSTS` (requeue without them), `requeue`, or `stay`.

A new reason is a member of `Reason`, its exit code in `EXIT_CODES` when it has one, and its line in `Stop.line`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from infra.errors import USAGE_EXIT_CODE, ToolParser
from infra.files import atomic_write_text, fsync_dir

STOP_RECORD = "stopped.json"

STRAGGLER_EXIT_CODE = 75  # EX_TEMPFAIL: saved and stopped on purpose, to be restarted without the slow rank
PEER_LOST_EXIT_CODE = 76  # a peer lost or a step hung: the job can go on from its newest checkpoint, with or without that host
SDC_EXIT_CODE = 77  # copies disagreed again, or could not be repaired: stopped at the newest sound checkpoint


class Reason(StrEnum):
    PREEMPTED = "preempted"  # SIGUSR1 (the time limit is near: requeue) or SIGTERM (the scheduler decides)
    STRAGGLER = "straggler"  # slow hosts left out: the job goes on without them
    SDC = "sdc"  # a machine that computes wrong left out, or no sound state to repair from (silent data corruption)
    PEER_LOST = "peer_lost"  # a rank gone or hung (infra.hangs): written by the rank that saw it, which exits at once
    SAVE_FAILED = "save_failed"  # a checkpoint could not be written (a full disk): the run stops, no requeue


EXIT_CODES = {Reason.STRAGGLER: STRAGGLER_EXIT_CODE, Reason.SDC: SDC_EXIT_CODE, Reason.PEER_LOST: PEER_LOST_EXIT_CODE}


@dataclass(frozen=True)
class Stop:
    """Why a launch stops, decided on every rank from agreed or gathered values (the same everywhere)."""

    reason: Reason
    hosts: tuple[str, ...] = ()  # the hosts left out (straggler, sdc)
    signal: str | None = None  # preempted: SIGTERM or SIGUSR1
    in_job: bool = False  # the others go on without `hosts` in this launch (infra.leave): no record for the scheduler
    replica_group: int | None = None  # the replica group that leaves the quorum (infra.replicas); the others go on
    ranks: tuple[int, ...] | None = None  # sdc: the processes named
    found_at: int | None = None  # sdc: the step the copies disagreed at
    tensors: tuple[str, ...] | None = None  # sdc: the first tensors that differed
    error: str | None = None  # save_failed: what the save raised
    fault: str | None = None  # peer_lost: how it was seen (infra.hangs)
    lost: tuple[dict, ...] = ()  # peer_lost: {"rank", "host"} of each peer lost
    seen_by: dict | None = None  # peer_lost: {"rank", "host"} of the rank that wrote the record
    message: str | None = None  # peer_lost: its line

    def __post_init__(self):
        object.__setattr__(self, "reason", Reason(self.reason))

    @property
    def exit_code(self) -> int:
        """The launch's exit code: 0 after a preemption (saved: the next launch resumes), else the reason's."""
        return EXIT_CODES.get(self.reason, 0)

    def line(self, step: int) -> str:
        """The launch's line for a stop after `step` was saved (or, sdc, returned to)."""
        code, hosts = self.exit_code, " and ".join(self.hosts)
        if self.reason is Reason.PREEMPTED:
            return f"preempted ({self.signal}): saved step {step}; the next launch resumes from it"
        if self.replica_group is not None:
            return f"{self.reason.value}: replica group {self.replica_group} left the quorum after step {step} (exit code {code})"
        if self.reason is Reason.SDC and self.in_job:
            return f"sdc: {hosts} leaves and the others restart without it from step {step} (exit code {code})"
        if self.reason is Reason.SDC:
            named = ", ".join(f"rank {r}" for r in self.ranks or ())
            return f"sdc: stopped at step {step}, the newest sound checkpoint; start again without {named} (exit code {code})"
        if self.reason is Reason.STRAGGLER and self.in_job:
            return f"straggler: saved step {step}; {hosts} leaves and the others restart without it (exit code {code})"
        if self.reason is Reason.STRAGGLER:
            return f"straggler: saved step {step}; exiting with code {code} so the job restarts without the slow rank"
        return self.message or f"{self.reason.value}: stopped at step {step}" + (f": {self.error}" if self.error else "")

    def record(self, step: int) -> dict:
        """stopped.json's fields: the step, the reason, and every field not at its default."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "reason"}
        defaults = {f.name: f.default for f in dataclasses.fields(self) if f.name != "reason"}
        kept = {k: list(v) if isinstance(v, tuple) else v for k, v in fields.items() if v != defaults[k]}
        return {"step": step, "reason": self.reason.value, **kept}

    def also(self, **fields) -> Stop:
        """This stop with more said (sdc: the ranks named, where found)."""
        return dataclasses.replace(self, **fields)

    def scheduler_action(self) -> tuple[str, tuple[str, ...]]:
        """What a batch scheduler does after this stop: requeue `without` its hosts (a straggler, a machine that computes
        wrong), `requeue` (saved before the time limit: SIGUSR1), or `stay` (a SIGTERM is the scheduler's own to
        decide; a lost peer or a failed save, a person's)."""
        if self.reason in (Reason.STRAGGLER, Reason.SDC) and self.hosts:
            return "without", self.hosts
        if self.reason is Reason.PREEMPTED and self.signal == "SIGUSR1":
            return "requeue", ()
        return "stay", ()


def from_record(record: dict) -> Stop:
    """The Stop of a stopped.json's fields (unknown fields ignored: a newer writer's)."""
    names = {f.name for f in dataclasses.fields(Stop)}
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in record.items() if k in names}
    return Stop(**fields)


def clear_record(output_dir: str | os.PathLike) -> None:
    """At the start of a launch (rank 0): this one has not stopped. An unwritable folder is the preflight's to report."""
    with contextlib.suppress(OSError):
        (Path(output_dir) / STOP_RECORD).unlink()


def write_record(output_dir: str | os.PathLike, step: int, stop: Stop) -> None:
    """stopped.json, atomically (rank 0 after an agreed stop)."""
    atomic_write_text(Path(output_dir) / STOP_RECORD, json.dumps(stop.record(step)))


def write_first_record(output_dir: str | os.PathLike, step: int, stop: Stop) -> bool:
    """stopped.json, unless another rank wrote it first in this launch (True if this one did): a lost peer is seen by
    several ranks at once, each in its own process."""
    path = Path(output_dir) / STOP_RECORD
    tmp = path.with_name(f"stopped.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(stop.record(step)))
    try:
        os.link(tmp, path)
        fsync_dir(path.parent)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


def read_record(path: str | os.PathLike) -> tuple[int, Stop]:
    """A stopped.json's step and Stop."""
    record = json.loads(Path(path).read_text())
    return int(record.pop("step")), from_record(record)


def main(argv: list[str] | None = None) -> int:
    """`python -m infra.stopped FILE`: one line for a batch script, `ACTION HOSTS REASON` (hosts comma-separated, `-`
    for none)."""
    parser = ToolParser(
        prog="python -m infra.stopped",
        description="What a batch script does with a stop record, in one line: ACTION HOSTS REASON, the action "
        "`without` (requeue without HOSTS), `requeue` or `stay`.",
    )
    parser.add_argument("record", metavar="FILE", help="the stop record, OUTPUT_DIR/stopped.json")
    path = parser.parse_args(argv).record
    try:
        _, stop = read_record(path)
    except (OSError, ValueError, KeyError, TypeError) as err:
        print(f"{parser.prog}: {path} is not a stop record ({type(err).__name__}: {err})", file=sys.stderr)
        return USAGE_EXIT_CODE
    action, hosts = stop.scheduler_action()
    print(action, ",".join(hosts) or "-", stop.reason.value)
    return 0


if __name__ == "__main__":
    sys.exit(main())
