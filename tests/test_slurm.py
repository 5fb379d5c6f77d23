"""infra/slurm/pretrain.sbatch under a real one-node SLURM (tests/slurm/one_node.sh): a CPU-only job that completes,
and one that gets SIGUSR1 mid-run, saves, requeues itself, resumes and ends with the weights of an uninterrupted run;
infra/slurm/replicas.sbatch with a replica group killed mid-run.

SLURM is started where it can be (root, with slurmctld installed or apt-get to install it); elsewhere these tests are
skipped with the reason. A requeued job waits about 2 minutes before it may start again, so they are slow.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

CPU_JOB = ["--nodes", "1", "--gpus-per-node=0", "--cpus-per-task=2"]  # the README's form for a CPU-only cluster
TRAIN = ["--max_steps", "300", "--hidden_size", "64", "--intermediate_size", "128", "--save_steps", "10", "--eval_samples", "0"]
TRAIN += ["--report_to", "none", "--mixed_precision", "no", "--logging_steps", "50"]  # 300 steps: the signal comes mid-run


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("starting SLURM needs root")
    if not shutil.which("slurmctld") and not shutil.which("apt-get"):
        pytest.skip("no SLURM installed and no apt-get to install it")
    if (os.cpu_count() or 1) < 2:
        pytest.skip("the jobs ask for 2 CPUs")
    state = tmp_path_factory.mktemp("slurm")
    up = subprocess.run(
        ["bash", str(REPO / "tests" / "slurm" / "one_node.sh"), "up", str(state)], capture_output=True, text=True, timeout=600
    )
    if up.returncode != 0:
        pytest.skip(f"SLURM did not start: {up.stderr.strip()[-500:]}")
    yield
    subprocess.run(["bash", str(REPO / "tests" / "slurm" / "one_node.sh"), "down", str(state)], capture_output=True, timeout=60)


def submit(data: Path, out: Path, log: Path, *extra: str) -> str:
    cmd = [
        "sbatch",
        "--parsable",
        *CPU_JOB,
        f"--output={log}",
        "--job-name",
        out.parent.name,
        str(REPO / "infra" / "slurm" / "pretrain.sbatch"),
    ]
    env = {**os.environ, "OUTPUT_DIR": str(out)}
    proc = subprocess.run([*cmd, "--data_dir", str(data), *TRAIN, *extra], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    return proc.stdout.strip().split(";")[0]


def job(job_id: str) -> dict[str, str]:
    text = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, check=True).stdout
    return dict(re.findall(r"(\w+)=(\S*)", text))


def wait_for(condition, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_a_cpu_job_completes_and_a_usr1_mid_run_requeues_to_the_same_weights(slurm, small_data, tmp_path):
    straight_out, straight_log = tmp_path / "straight" / "out", tmp_path / "straight.log"
    straight = submit(small_data, straight_out, straight_log)
    wait_for(lambda: job(straight)["JobState"] in ("COMPLETED", "FAILED", "CANCELLED"), "the first job", 300)
    assert job(straight)["JobState"] == "COMPLETED" and job(straight)["ExitCode"] == "0:0", straight_log.read_text()[-3000:]
    assert "1 x 2 processes" in straight_log.read_text()  # one training process per allocated CPU

    out, log = tmp_path / "preempted" / "out", tmp_path / "preempted.log"
    preempted = submit(small_data, out, log)
    wait_for(lambda: any((out / "checkpoints").glob("step_*/manifest.json")), "the first checkpoint", 300)
    subprocess.run(["scancel", "--full", "--signal=USR1", preempted], check=True)  # the batch shell too: it must survive
    wait_for(lambda: "requeued" in log.read_text(), "the requeue", 120)
    assert int(job(preempted)["Restarts"]) == 1
    wait_for(lambda: job(preempted)["JobState"] in ("COMPLETED", "FAILED", "CANCELLED"), "the requeued job", 420)
    text = log.read_text()
    assert job(preempted)["JobState"] == "COMPLETED" and job(preempted)["ExitCode"] == "0:0", text[-3000:]
    assert "preempted (SIGUSR1): saved step" in text and "resumed at step" in text
    assert re.findall(r"training step exited with (\d+)", text) == ["0", "0"]  # both starts, every step exited 0
    a, b = load_file(straight_out / "final" / "model.safetensors"), load_file(out / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_replica_groups_under_slurm_go_on_when_one_dies_and_its_node_starts_it_again(slurm, small_data, tmp_path):
    """infra/slurm/replicas.sbatch with two groups on the one node (GROUPS_PER_NODE=2, one process each): group 1's
    training process killed mid-run; the node's loop starts it again, it heals from group 0, which never stopped, and
    the job completes with both groups in the same state."""
    out, log = tmp_path / "out", tmp_path / "replicas.log"
    cmd = ["sbatch", "--parsable", *CPU_JOB, f"--output={log}", "--job-name", "replicas", str(REPO / "infra" / "slurm" / "replicas.sbatch")]
    env = {**os.environ, "OUTPUT_DIR": str(out), "GROUPS_PER_NODE": "2", "PROCS_PER_NODE": "1", "GLOBAL_BATCH_SIZE": "16"}
    train = ["--data_dir", str(small_data), *TRAIN, "--trace_samples"]
    job_id = subprocess.run([*cmd, *train], cwd=REPO, env=env, capture_output=True, text=True, check=True).stdout.strip().split(";")[0]
    trace = out / "replicas" / "1" / "trace" / "rank0.jsonl"
    wait_for(lambda: trace.exists() and len(trace.read_text().splitlines()) > 20, "group 1's step 20", 300)
    try:
        os.kill(training_process("1", out), signal.SIGKILL)
        wait_for(lambda: job(job_id)["JobState"] in ("COMPLETED", "FAILED", "CANCELLED"), "the job", 420)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
    text = log.read_text(errors="replace")  # two groups write to one log: their bars can cut a character
    assert job(job_id)["JobState"] == "COMPLETED" and job(job_id)["ExitCode"] == "0:0", text[-3000:]
    assert "replica group 1 exited with" in text and "started again (1 of 100)" in text
    assert "replica group 1: healed from a live group to step" in text
    assert "replica group 0: 1 group live (were 2)" in text
    assert len(set(re.findall(r"final state of step 300 \(xxh3 (\w+)\)", text))) == 1


def training_process(group: str, out: Path) -> int:
    """The recipe process of replica group `group` writing to `out` (under accelerate launch, which the node's loop
    runs)."""
    import psutil

    found = []
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            cmdline = proc.info["cmdline"] or []
            recipe = any(a.endswith("pretrain_clm.py") for a in cmdline) and not any(a.endswith("accelerate") for a in cmdline[:2])
            if recipe and proc.environ().get("REPLICA_GROUP_ID") == group and str(out) in cmdline:
                found.append(proc.pid)
    (pid,) = found
    return pid
