"""One job per output_dir: a live holder refuses a second job and names itself; a dead one never blocks."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from infra.lock import LOCK_NAME, OutputDirBusy, OutputDirLock
from tests.conftest import REPO

HOLD = "import sys, time\nfrom infra.lock import OutputDirLock\nOutputDirLock(sys.argv[1]).acquire()\nprint('held', flush=True)\n"
HOLD += "time.sleep(600)"


def holding(output_dir) -> subprocess.Popen:
    """Another process that takes the lock and keeps it."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(output_dir)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_live_holder_refuses_a_second_job_and_is_named(tmp_path):
    other = holding(tmp_path / "out")
    try:
        record = (tmp_path / "out" / LOCK_NAME).read_bytes()
        assert json.loads(record)["pid"] == other.pid
        with pytest.raises(OutputDirBusy, match=rf"in use by another job \(pid {other.pid} on {socket.gethostname()} since "):
            OutputDirLock(tmp_path / "out").acquire()
        assert (tmp_path / "out" / LOCK_NAME).read_bytes() == record  # the refused job wrote nothing
        assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [LOCK_NAME]
    finally:
        other.kill()
        other.wait()


def test_a_holder_killed_with_sigkill_never_blocks_the_relaunch(tmp_path):
    other = holding(tmp_path / "out")
    os.kill(other.pid, signal.SIGKILL)
    other.wait()
    lock = OutputDirLock(tmp_path / "out").acquire()  # at once: the kernel dropped the dead process's lock
    assert json.loads((tmp_path / "out" / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()


def test_a_released_lock_is_free_again_in_the_same_process(tmp_path):
    first = OutputDirLock(tmp_path).acquire()
    with pytest.raises(OutputDirBusy):  # flock locks belong to the open file: a second open in one process is refused too
        OutputDirLock(tmp_path).acquire()
    first.release()
    started = time.monotonic()
    OutputDirLock(tmp_path).acquire().release()
    assert time.monotonic() - started < 1
