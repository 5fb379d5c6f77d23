"""The stop record (infra.stopped): what stopped.json holds for each reason, the exit code and line of each, what a batch
script is told to do with it, and that the first of several ranks to write it wins."""

import json
import subprocess

import pytest

from infra import stopped
from infra.stopped import Reason, Stop
from tests.conftest import BIN, REPO

STEP = 12

# Each stop the loop builds, the record a scheduler reads (the fields of the untyped dicts it replaced), its exit code,
# its line and what infra/slurm/pretrain.sbatch does with it.
CASES = [
    (
        Stop(Reason.PREEMPTED, signal="SIGUSR1"),
        {"step": STEP, "reason": "preempted", "signal": "SIGUSR1"},
        0,
        "preempted (SIGUSR1): saved step 12; the next launch resumes from it",
        "requeue - preempted",
    ),
    (
        Stop(Reason.PREEMPTED, signal="SIGTERM"),
        {"step": STEP, "reason": "preempted", "signal": "SIGTERM"},
        0,
        "preempted (SIGTERM): saved step 12; the next launch resumes from it",
        "stay - preempted",
    ),
    (
        Stop(Reason.STRAGGLER, hosts=("n3",)),
        {"step": STEP, "reason": "straggler", "hosts": ["n3"]},
        75,
        "straggler: saved step 12; exiting with code 75 so the job restarts without the slow rank",
        "without n3 straggler",
    ),
    (
        Stop(Reason.STRAGGLER, hosts=("n3", "n4"), in_job=True),
        {"step": STEP, "reason": "straggler", "hosts": ["n3", "n4"], "in_job": True},
        75,
        "straggler: saved step 12; n3 and n4 leaves and the others restart without it (exit code 75)",
        "without n3,n4 straggler",
    ),
    (
        Stop(Reason.SDC, hosts=("n1",)).also(ranks=(1,), found_at=14, tensors=("w",)),
        {"step": STEP, "reason": "sdc", "hosts": ["n1"], "ranks": [1], "found_at": 14, "tensors": ["w"]},
        77,
        "sdc: stopped at step 12, the newest sound checkpoint; start again without rank 1 (exit code 77)",
        "without n1 sdc",
    ),
    (
        Stop(Reason.SDC, hosts=("n1",), in_job=True).also(ranks=(1, 2), found_at=12, tensors=()),
        {"step": STEP, "reason": "sdc", "hosts": ["n1"], "in_job": True, "ranks": [1, 2], "found_at": 12, "tensors": []},
        77,
        "sdc: n1 leaves and the others restart without it from step 12 (exit code 77)",
        "without n1 sdc",
    ),
    (
        Stop(Reason.STRAGGLER, hosts=("g2",), replica_group=2),
        {"step": STEP, "reason": "straggler", "hosts": ["g2"], "replica_group": 2},
        75,
        "straggler: replica group 2 left the quorum after step 12 (exit code 75)",
        "without g2 straggler",
    ),
    (
        Stop(Reason.SAVE_FAILED, error="No space left on device"),
        {"step": STEP, "reason": "save_failed", "error": "No space left on device"},
        0,
        "save_failed: stopped at step 12: No space left on device",
        "stay - save_failed",
    ),
    (
        Stop(Reason.PEER_LOST, fault="no answer", lost=({"rank": 1, "host": "h1"},), seen_by={"rank": 0, "host": "h0"}, message="m"),
        {
            "step": STEP,
            "reason": "peer_lost",
            "fault": "no answer",
            "lost": [{"rank": 1, "host": "h1"}],
            "seen_by": {"rank": 0, "host": "h0"},
            "message": "m",
        },
        76,
        "m",
        "stay - peer_lost",
    ),
]


@pytest.mark.parametrize(("stop", "record", "code", "line", "action"), CASES)
def test_each_stop_has_its_record_exit_code_line_and_scheduler_action(tmp_path, stop, record, code, line, action):
    stopped.write_record(tmp_path, STEP, stop)
    path = tmp_path / stopped.STOP_RECORD
    assert json.loads(path.read_text()) == record
    assert stopped.read_record(path) == (STEP, stop)  # read back whole, typed
    assert stop.exit_code == code and stop.line(STEP) == line
    assert stopped.main([str(path)]) == 0
    stopped.clear_record(tmp_path)
    assert not path.exists()
    stopped.clear_record(tmp_path)  # nothing to clear: no error


def test_the_batch_script_reads_one_line_and_a_damaged_record_is_one_line_and_exit_2(tmp_path):
    path = tmp_path / stopped.STOP_RECORD
    stopped.write_record(tmp_path, STEP, CASES[3][0])
    proc = subprocess.run([str(BIN / "python"), "-m", "infra.stopped", str(path)], cwd=REPO, capture_output=True, text=True)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "without n3,n4 straggler\n", "")
    path.write_text('{"step": 3, "reason": "tired"}')
    proc = subprocess.run([str(BIN / "python"), "-m", "infra.stopped", str(path)], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stdout == "" and len(proc.stderr.splitlines()) == 1
    assert "is not a stop record (ValueError: 'tired' is not a valid Reason)" in proc.stderr


def test_a_newer_writers_fields_are_ignored_when_read():
    assert stopped.from_record({"reason": "straggler", "hosts": ["a"], "by_a_later_version": 1}) == Stop(Reason.STRAGGLER, hosts=("a",))


def test_the_first_rank_to_record_the_stop_wins(tmp_path):
    first = Stop(Reason.PEER_LOST, seen_by={"rank": 0})
    assert stopped.write_first_record(tmp_path, 7, first)
    assert not stopped.write_first_record(tmp_path, 7, first.also(seen_by={"rank": 1}))
    assert json.loads((tmp_path / "stopped.json").read_text())["seen_by"] == {"rank": 0}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stopped.json"]
