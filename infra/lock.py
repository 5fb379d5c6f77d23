"""One running job per output_dir: an OS lock on `OUTPUT_DIR/job.lock`, held by rank 0 for the whole run.

A second job on the same output_dir (a double submit, a requeue that races its predecessor) stops before it writes
anything, in one line naming the holder (host, pid, since when, SLURM job). The lock is the kernel's (`flock`), not a
file's existence, so a holder that died in any way (kill -9, an OOM kill, a lost node) never blocks a relaunch: the
lock goes with its process.

Filesystems:
- local disks: released the moment the holder's process ends.
- NFS (v4, or v3 with lockd): Linux turns `flock` into an NFS byte-range lock that every client sees. A holder on a
  node that was lost keeps it until the server's lease for that node expires (90 s by default), then it is free.
- Lustre mounted without `-o flock` (or with `localflock`, which locks per node only), and some FUSE filesystems,
  refuse or fake locks: the run then prints one warning and goes on unprotected.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from infra.errors import OutputDirError

LOCK_NAME = "job.lock"
UNSUPPORTED = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}


class OutputDirBusy(RuntimeError):
    """Another live process holds the output_dir's lock."""


class OutputDirLock:
    """The lock of one output_dir, held by this process until `release()` or its end."""

    def __init__(self, output_dir: str | os.PathLike):
        self.path = Path(output_dir) / LOCK_NAME
        self.fd: int | None = None
        self.supported = True

    def acquire(self) -> OutputDirLock:
        """Take the lock, or raise OutputDirBusy naming the holder; the holder's record is left as it is."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OutputDirBusy(f"{self.path.parent} is in use by another job ({holder(self.path)})") from None
        except OSError as err:
            if err.errno not in UNSUPPORTED:
                os.close(fd)
                raise
            self.supported = False  # the filesystem has no locks: keep the record, protect nothing
        record = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
        if os.environ.get("SLURM_JOB_ID"):
            record["slurm_job"] = os.environ["SLURM_JOB_ID"]
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the only descriptor releases the flock
            self.fd = None


def holder(path: Path) -> str:
    """The holder's record, in words."""
    try:
        record = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        record = {}
    if not record:
        return "a process that has not written its name yet"
    job = f", SLURM job {record['slurm_job']}" if "slurm_job" in record else ""
    return f"pid {record.get('pid')} on {record.get('host')} since {record.get('since')}{job}"


_held: list[OutputDirLock] = []  # kept for the life of the process: the lock goes when it ends


def claim(accelerator, output_dir: str | os.PathLike) -> None:
    """Rank 0 takes the output_dir's lock for the rest of the process, before the job writes anything; if it cannot,
    every rank exits with rank 0's line."""
    from infra.distributed import gathered

    lock, problem = None, None
    if accelerator.is_main_process:
        try:
            lock = OutputDirLock(output_dir).acquire()
        except OutputDirBusy as err:
            problem = str(err)
        except OSError:  # an output_dir nobody can write needs no lock: the preflight (or the first save) names it
            pass
        if lock is not None and not lock.supported:
            print(f"warning: the filesystem of {output_dir} has no locks: nothing stops a second job from writing there too", flush=True)
    if lock is not None:
        _held.append(lock)
    problem = gathered(accelerator, problem)[0]
    if problem is not None:
        raise OutputDirError(problem)
