"""The main recipe under real `accelerate launch`: 2 CPU processes in one gloo group, exact resume."""

from __future__ import annotations

import contextlib
import json
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

from infra.checkpoint import read_manifest, share
from infra.data import PackedDataset
from infra.data.loader import EpochOrder
from infra.distributed import FSDP_ON_CPU_ENV
from infra.testing import FAULTS_ENV, PAUSE_ENV
from tests.conftest import BIN, REPO, free_port, launch, launch_command, run_launch

pytestmark = pytest.mark.multiprocess

STEPS = 12
SHUFFLE_WINDOW = 48  # samples_per_shard is 32 in small_data: windows straddle shards
MICRO_BATCH = 4
ACCUMULATION = 2
SEED = 42  # pretrain_clm.yaml's


def recipe_args(data: Path | str, out: Path, max_steps: int, *extra: str) -> list[str]:
    return [
        "--config",
        str(REPO / "recipes" / "configs" / "pretrain_clm.yaml"),
        "--data_dir",
        str(data),
        "--output_dir",
        str(out),
        "--max_steps",
        str(max_steps),
        # warmup longer than the run: the schedule does not depend on max_steps, and is not constant
        "--warmup_steps",
        str(2 * STEPS),
        "--learning_rate",
        "1e-2",
        "--per_device_train_batch_size",
        str(MICRO_BATCH),
        "--gradient_accumulation_steps",
        str(ACCUMULATION),
        "--hidden_size",
        "64",
        "--intermediate_size",
        "128",
        "--attention_dropout",
        "0.1",
        "--logging_steps",
        "2",
        "--save_steps",
        "4",
        "--shuffle_window",
        str(SHUFFLE_WINDOW),
        "--trace_samples",
        "--eval_samples",  # the global-order checks below cover the whole data set
        "0",
        "--mixed_precision",  # bf16 proven on every CPU, emulated or not (auto gives fp32 where it is emulated)
        "bf16",
        *extra,
    ]


def weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "final" / "model.safetensors")


def trace(out: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (out / "trace" / f"rank{rank}.jsonl").read_text().splitlines()]


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), f"{name} differs"


def test_refuses_processes_that_do_not_form_a_group(tmp_path):
    """The multi-GPU launcher on CPU starts processes that each believe they are alone (a gather returned 1 row)."""
    script = tmp_path / "alone.py"
    script.write_text("from accelerate import Accelerator\nfrom infra.distributed import check_world\ncheck_world(Accelerator())\n")
    proc = subprocess.run(
        [
            str(BIN / "accelerate"),
            "launch",
            "--config_file",
            str(REPO / "accelerate_configs" / "cpu.yaml"),
            "--main_process_port",
            str(free_port()),
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    assert "the launcher started 2 processes but this one sees a group of 1" in proc.stderr


@pytest.mark.multiprocess
def test_an_fsdp_run_takes_the_steps_of_a_ddp_run_its_preflight_included(small_data, tmp_path):
    """FSDP2 and DDP over 2 processes, the same batches, fp32 at a constant learning rate from step 1: the same weights
    after 2 steps, bit for bit. The preflight's checkpoint round trip must leave the run as it was; torch's sharded optimizer save
    fills an empty optimizer state with a step of zero gradients, which started Adam's step counter at 1 (the first
    update 0.74x: 2.65e-4 off after one step at lr 1e-3)."""
    from infra.distributed import FSDP_ON_CPU_ENV

    extra = ("--warmup_steps", "0", "--lr_scheduler_type", "constant_with_warmup", "--learning_rate", "1e-3")
    extra += ("--attention_dropout", "0", "--mixed_precision", "no", "--save_steps", "0", "--eval_samples", "0")
    weights = {}
    for config in ("cpu.yaml", "fsdp.yaml"):
        out = tmp_path / config
        proc = launch(config, recipe_args(small_data, out, 2, *extra), tmp_path, env={FSDP_ON_CPU_ENV: "1"})
        assert proc.returncode == 0 and "ok    checkpoint" in proc.stdout, proc.stderr[-3000:]
        weights[config] = load_file(out / "final" / "model.safetensors")
    ddp, fsdp = weights["cpu.yaml"], weights["fsdp.yaml"]
    differences = {k: float((fsdp[k] - ddp[k]).abs().max()) for k in ddp}
    assert max(differences.values()) == 0, differences  # bit for bit: the same per-process sums, the same update


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the FSDP config runs")
def test_fsdp_on_cpu_is_refused_in_one_line(small_data, tmp_path):
    """accelerate enables FSDP only for accelerator process groups: on CPU the ranks would silently run unsharded."""
    proc = launch("fsdp.yaml", recipe_args(small_data, tmp_path / "out", STEPS), tmp_path)
    assert proc.returncode != 0
    assert "launch error: the accelerate config asks for FSDP but this process runs NO: accelerate runs FSDP on accelerators" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_two_processes_train_as_one_job(straight, small_data):
    tmp, proc = straight
    out = tmp / "out"
    assert "world size 2" in proc.stdout
    # each step, the two ranks consumed disjoint halves of one global batch
    rank0, rank1 = trace(out, 0), trace(out, 1)
    assert [r["step"] for r in rank0] == [r["step"] for r in rank1] == [s for s in range(1, 2 * STEPS + 1) for _ in range(2)]
    for a, b in zip(rank0, rank1, strict=True):
        assert len(a["ids"]) == len(b["ids"]) == MICRO_BATCH and not set(a["ids"]) & set(b["ids"])
    # together they followed the global order of (seed, epoch), across the epoch end
    assert global_sequence(out, 2) == global_order(small_data, epochs=2, world_size=2)[: 2 * STEPS * 2 * MICRO_BATCH * ACCUMULATION]
    # the copies ended identical (infra.sdc compares them before the export, and at every check and save before)
    assert "copies identical on all 2 ranks: weights and optimizer state, " in proc.stdout
    # quiet: the run's own lines, each once (not once a process), and none of the libraries' (MLflow's INFO lines,
    # accelerate's warning at each save of the tied output embedding, a warning of any kind)
    said = [line.strip() for line in (proc.stdout + proc.stderr).replace("\r", "\n").splitlines()]
    said = [line for line in said if line and not line.startswith("train:")]  # the progress bar's states
    assert len(said) == len(set(said)), [line for line in said if said.count(line) > 1]
    assert not [line for line in said if re.search(r"\bINFO\b|[Ww]arning|Removed shared tensor", line)], said
    # a FINISHED MLflow run with the hyperparameters and a falling loss
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{tmp / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("pretrain_clm").experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.params["TrainingArguments.max_steps"] == str(2 * STEPS)
    tags = run.data.tags
    assert {k: tags[k] for k in ("recipe", "accelerate_config", "distributed_type", "world_size", "num_nodes", "mixed_precision")} == {
        "recipe": "pretrain_clm",
        "accelerate_config": "cpu.yaml",
        "distributed_type": "MULTI_CPU",
        "world_size": "2",
        "num_nodes": "1",
        "mixed_precision": "bf16",
    }
    assert len(tags["git_commit"]) == 40 and tags["git_dirty"] in ("true", "false") and tags["version.torch"]
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "environment.txt", "accelerate_config"} <= artifacts
    assert "learning_rate: 0.01" in mlflow.artifacts.load_text(f"{run.info.artifact_uri}/config.yaml")
    assert {"train/learning_rate", "train/grad_norm", "perf/tokens_per_second", "perf/data_wait", "checkpoint/save_seconds"} <= set(
        run.data.metrics
    )
    assert "perf/mfu" not in run.data.metrics  # no known peak on a CPU: no number
    ettr = run.data.metrics["goodput/ettr"]  # one launch: only start-up, saves and evals kept it from 1
    assert 0.1 < ettr < 1 and proc.stdout.strip().splitlines()[-1].startswith(f"goodput: ETTR {ettr:.2f} of ")
    losses = [m.value for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert len(losses) == STEPS and losses[-1] < losses[0]
    # the exported model loads with from_pretrained
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out / "final")
    assert AutoTokenizer.from_pretrained(out / "final").eos_token is not None
    assert torch.equal(model.model.embed_tokens.weight, weights(out)["model.embed_tokens.weight"])


# synchronous saves resume exactly in the kill -9 and corrupt-checkpoint tests below too: that variant is slow
# the matrix resumes background saves exactly in CI
@pytest.mark.parametrize("async_save", ["false", "true"])
@pytest.mark.slow
def test_resume_is_bit_exact(async_save, straight, small_data, tmp_path):
    """N steps, a new launch that auto-resumes for N more == 2N straight, with dropout on (saves synchronous or in the background)."""
    straight_tmp, _ = straight
    out = tmp_path / "out"
    first = launch("cpu.yaml", recipe_args(small_data, out, STEPS, "--async_save", async_save), tmp_path)
    assert first.returncode == 0
    resume_at = STEPS
    if async_save == "true":  # the last save is synchronous: resume from the one before, written in the background
        shutil.rmtree(out / "checkpoints" / f"step_{STEPS:08d}")
        resume_at = STEPS - 4
    second = launch("cpu.yaml", recipe_args(small_data, out, 2 * STEPS, "--async_save", async_save), tmp_path)
    assert second.returncode == 0
    assert f"resumed at step {resume_at}" in second.stdout
    # the resumed half crossed an epoch end, and saw exactly the batches the straight run saw
    steps_per_epoch = len(PackedDataset(small_data)) // (2 * MICRO_BATCH * ACCUMULATION)
    assert STEPS < steps_per_epoch < 2 * STEPS
    assert_same_weights(straight_tmp / "out", out)
    for rank in (0, 1):
        assert trace(out, rank) == trace(straight_tmp / "out", rank)
    # the resumed launch continued the same MLflow run, with contiguous steps
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("pretrain_clm").experiment_id])
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert steps == list(range(2, 2 * STEPS + 1, 2))
    # retention: the newest save_total_limit checkpoints, each with its manifest
    kept = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert kept == [f"step_{2 * STEPS - 4:08d}", f"step_{2 * STEPS:08d}"]


def global_sequence(out: Path, world_size: int) -> list[int]:
    """The samples a run consumed in training order: per micro-batch, rank 0's slice, then rank 1's, ..."""
    traces = [trace(out, r) for r in range(world_size)]
    return [i for lines in zip(*traces, strict=True) for line in lines for i in line["ids"]]


def global_order(data: Path, epochs: int, world_size: int) -> list[int]:
    """(seed, epoch) order, each epoch cut to whole global micro-batches (the short tail is dropped)."""
    dataset = PackedDataset(data)
    per_epoch = len(dataset) // (world_size * MICRO_BATCH) * (world_size * MICRO_BATCH)
    return [int(i) for e in range(epochs) for i in EpochOrder(dataset.shard_sizes, SEED, e, SHUFFLE_WINDOW)[0:per_epoch]]


@pytest.mark.slow  # the matrix resumes on the other number of processes in CI, every sample once
@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2)])
def test_elastic_resume_continues_the_global_order(before, after, small_data, tmp_path):
    """Stop on one world size, resume on another: no sample repeated, none skipped."""
    out = tmp_path / "out"
    first = launch("cpu.yaml", recipe_args(small_data, out, STEPS, "--report_to", "none"), tmp_path, num_processes=before)
    assert first.returncode == 0
    consumed = global_sequence(out, before)
    second = launch("cpu.yaml", recipe_args(small_data, out, 2 * STEPS, "--report_to", "none"), tmp_path, num_processes=after)
    assert second.returncode == 0 and f"world size {after}" in second.stdout and f"resumed at step {STEPS}" in second.stdout
    # the trace of the new world: lines up to the resume step are the old run's (rank 0's file), then the new ranks'
    resumed = [line for line in trace(out, 0) if line["step"] > STEPS]
    others = [[line for line in trace(out, r) if line["step"] > STEPS] for r in range(1, after)]
    continued = [i for lines in zip(resumed, *others, strict=True) for line in lines for i in line["ids"]]
    both = consumed + continued
    assert len(both) == STEPS * MICRO_BATCH * ACCUMULATION * (before + after)
    assert len(both) < len(PackedDataset(small_data)) - 2 * MICRO_BATCH  # within epoch 0: no tail was dropped
    assert both == global_order(small_data, epochs=1, world_size=1)[: len(both)]


def start(args: list[str], tmp_path: Path, launcher: tuple[str, ...] | None = None, **env) -> subprocess.Popen:
    """A launch in its own process group (so the test can kill all of it), output to files."""
    cmd, base_env = launch_command("cpu.yaml", args, tmp_path, **({"launcher": launcher} if launcher else {}))
    tmp_path.mkdir(parents=True, exist_ok=True)
    log = tmp_path / f"launch{len(list(tmp_path.glob('launch*.log')))}.log"
    with open(log, "w") as f:
        return subprocess.Popen(cmd, cwd=REPO, env={**base_env, **env}, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def wait_for(condition, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the launch ended (rc {proc.returncode}) before the moment the test waits for"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def kill_all(proc: subprocess.Popen) -> None:
    """kill -9 of the launcher and every training process, as when a machine dies (torch elastic starts the ranks in
    sessions of their own: killing the launcher's process group would leave them running, holding the output_dir)."""
    import psutil

    launcher = psutil.Process(proc.pid)
    every = [launcher, *launcher.children(recursive=True)]
    for p in every:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    proc.wait()
    psutil.wait_procs(every, timeout=30)


def test_killed_launches_and_a_corrupt_newest_checkpoint_resume_to_the_same_weights(straight, small_data, tmp_path):
    """kill -9 of the whole launch, once inside a save and once between saves, then the newest checkpoint corrupted (one
    bit of a file that rank 1 verifies, so rank 0 must hear of it): relaunching falls back to the checkpoint before and
    ends as the straight run."""
    out, ckpts = tmp_path / "out", tmp_path / "out" / "checkpoints"
    args = recipe_args(small_data, out, 2 * STEPS)

    paused = start(args, tmp_path, **{PAUSE_ENV: "60"})  # every save stops between save_state and its commit
    wait_for(lambda: (ckpts / ".step_00000004.partial" / "model.safetensors").exists(), paused)
    time.sleep(0.5)
    kill_all(paused)
    assert not list(ckpts.glob("step_*"))  # the cut save was never committed

    second = start(args, tmp_path)
    wait_for(lambda: (ckpts / "step_00000008" / "manifest.json").exists(), second)
    kill_all(second)

    *_, before, newest = sorted(ckpts.glob("step_*"))  # the kill may come after the next save's commit
    files = read_manifest(newest)["files"]
    assert "model.safetensors" in share({rel: e["size"] for rel, e in files.items()}, 2)[1]  # rank 1 checks it
    raw = bytearray((newest / "model.safetensors").read_bytes())
    raw[-100] ^= 0x10
    (newest / "model.safetensors").write_bytes(bytes(raw))

    last = launch("cpu.yaml", args, tmp_path)
    assert last.returncode == 0
    assert f"skipping checkpoint {newest}: model.safetensors does not match its checksum" in last.stdout
    assert f"resumed at step {int(before.name.removeprefix('step_'))}" in last.stdout
    assert_same_weights(straight[0] / "out", out)
    for rank in (0, 1):
        assert trace(out, rank) == trace(straight[0] / "out", rank)
    # one MLflow run across the three launches: every logged step once, FINISHED
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("pretrain_clm").experiment_id])
    assert run.info.status == "FINISHED"
    assert [m.step for m in sorted(client.get_metric_history(run.info.run_id, "train/loss"), key=lambda m: m.step)] == list(
        range(2, 2 * STEPS + 1, 2)
    )


@pytest.mark.slow  # minutes: out of the quick suite; CI runs it after the matrix (make test-ci-slow)
@pytest.mark.ci
def test_sigterm_to_the_launcher_saves_exits_zero_and_resumes_exactly(small_data, tmp_path):
    """What Kubernetes, `scancel` and `scontrol requeue` do: SIGTERM to the launcher. infra.launch forwards it to the
    ranks and exits with their code, 0 after the save (plain `accelerate launch` exits 1 there). While it runs, a
    second job on its output_dir is refused."""
    long_run = ["--warmup_steps", "100000"]  # the schedule then does not depend on max_steps
    a, b = tmp_path / "a", tmp_path / "b"
    proc = start(recipe_args(small_data, a / "out", 100000, *long_run), a, launcher=(str(BIN / "python"), "-m", "infra.launch"))
    try:
        wait_for(lambda: (a / "out" / "checkpoints" / "step_00000004" / "manifest.json").exists(), proc)
        # a second job on the same output_dir (a double submit) stops in one line naming the first, and writes nothing
        listing = sorted(p.name for p in (a / "out").iterdir())
        twice = launch("cpu.yaml", recipe_args(small_data, a / "out", 100000, *long_run), tmp_path / "twice")
        assert twice.returncode == 1 and "output_dir error: " in twice.stderr and "is in use by another job (pid " in twice.stderr
        assert "starting fresh" not in twice.stdout and "resumed" not in twice.stdout
        assert sorted(p.name for p in (a / "out").iterdir()) == listing and proc.poll() is None
        proc.send_signal(signal.SIGTERM)  # the launcher only: the ranks run in sessions of their own
        assert proc.wait(timeout=120) == 0, (a / "launch0.log").read_text()[-3000:]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    log = (a / "launch0.log").read_text()
    assert "launch: SIGTERM forwarded to the training processes" in log and "preempted (SIGTERM): saved step" in log
    saved = int(sorted((a / "out" / "checkpoints").glob("step_*"))[-1].name[len("step_") :])
    assert saved > 4 and not (a / "out" / "final").exists()

    end = saved + 4
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{a / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("pretrain_clm").experiment_id])
    assert run.info.status == "KILLED"
    resumed = launch("cpu.yaml", recipe_args(small_data, a / "out", end, *long_run), a)
    assert resumed.returncode == 0 and f"resumed at step {saved}" in resumed.stdout
    (run,) = client.search_runs([client.get_experiment_by_name("pretrain_clm").experiment_id])  # the same run, finished
    assert run.info.status == "FINISHED"
    assert launch("cpu.yaml", recipe_args(small_data, b / "out", end, "--report_to", "none", *long_run), b).returncode == 0
    assert_same_weights(a / "out", b / "out")


def test_a_signal_to_every_process_of_the_job_saves_and_exits_zero(small_data, tmp_path):
    """SLURM's `--signal=USR1@T` signals every process of the job step, the launcher too: infra.launch forwards it
    (Python's default would end it at once), each rank counts the signal it got twice once, and all save and exit 0."""
    out = tmp_path / "out"
    args = recipe_args(small_data, out, 100000, "--warmup_steps", "100000", "--report_to", "none")
    import psutil

    proc = start(args, tmp_path, launcher=(str(BIN / "python"), "-m", "infra.launch"))
    launcher = psutil.Process(proc.pid)
    workers = []
    try:
        wait_for(lambda: (out / "checkpoints" / "step_00000004" / "manifest.json").exists(), proc)
        workers = launcher.children(recursive=True)
        for p in [launcher, *workers]:  # what SLURM's cgroup tracking signals: every process
            p.send_signal(signal.SIGUSR1)
        assert proc.wait(timeout=120) == 0
    finally:  # torch elastic starts the ranks in sessions of their own: a failed test must not leave them running
        for p in [launcher, *workers]:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
    assert "preempted (SIGUSR1): saved step" in (tmp_path / "launch0.log").read_text()
    assert json.loads((out / "stopped.json").read_text())["signal"] == "SIGUSR1"  # the batch script requeues on it
    assert int(sorted((out / "checkpoints").glob("step_*"))[-1].name[len("step_") :]) > 4


def elastic_restart(small_data, tmp_path, die_at_step: int) -> subprocess.CompletedProcess:
    """`accelerate launch --max_restarts 2` where rank 1 dies once, at `die_at_step`."""
    cmd, env = launch_command(
        "cpu.yaml", recipe_args(small_data, tmp_path / "out", 2 * STEPS), tmp_path, launcher_args=("--max_restarts", "2")
    )
    env[FAULTS_ENV] = json.dumps({"rank": 1, "die_at_step": die_at_step})
    return run_launch(cmd, env, timeout=240)


def test_three_processes_resume_and_restart_in_the_job_bit_for_bit(small_data, tmp_path):
    """Sums of three terms depend on their order (two processes hide it: a + b is exact either way). At 3 processes a
    launch killed after a checkpoint and launched again, and a launch one of whose workers dies and is restarted by
    infra.launch in the same job, end as the uninterrupted 3-process run: every weight and every sample, bit for bit
    (under DDP's own all-reduce both differ in the last bits: tests/test_reduction.py)."""
    three = {"num_processes": 3}
    straight = launch("cpu.yaml", recipe_args(small_data, tmp_path / "straight", 2 * STEPS), tmp_path, **three)
    assert straight.returncode == 0 and "world size 3" in straight.stdout

    relaunched = tmp_path / "relaunched"
    assert launch("cpu.yaml", recipe_args(small_data, relaunched, STEPS), tmp_path, **three).returncode == 0
    second = launch("cpu.yaml", recipe_args(small_data, relaunched, 2 * STEPS), tmp_path, **three)
    assert second.returncode == 0 and f"resumed at step {STEPS}" in second.stdout

    restarted = tmp_path / "restarted"
    restart_in_the_job(recipe_args(small_data, restarted, 2 * STEPS), tmp_path, 3, rank=2, die_at_step=10, resumed_at=8)
    for out in (relaunched, restarted):
        assert_same_run(tmp_path / "straight", out, 3)


def restart_in_the_job(args: list[str], tmp_path: Path, processes: int, rank: int, die_at_step: int, resumed_at: int) -> None:
    """A launch by python -m infra.launch --max_restarts 1 whose `rank` dies once, at `die_at_step`: it must recover in
    the same job, from the checkpoint of `resumed_at`."""
    launcher = (str(BIN / "python"), "-m", "infra.launch")
    cmd, env = launch_command("cpu.yaml", args, tmp_path, num_processes=processes, launcher=launcher, launcher_args=("--max_restarts", "1"))
    env[FAULTS_ENV] = json.dumps({"rank": rank, "die_at_step": die_at_step})
    proc = run_launch(cmd, env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"test fault: rank dies at step {die_at_step}" in proc.stdout and f"resumed at step {resumed_at}" in proc.stdout


def assert_same_run(a: Path, b: Path, processes: int) -> None:
    """The same final weights and, on every rank, the same samples at every step."""
    assert_same_weights(a, b)
    for rank in range(processes):
        assert trace(b, rank) == trace(a, rank)


@pytest.mark.slow  # about a minute each: make test-slow (the matrix resumes every engine at 4 processes in CI)
@pytest.mark.parametrize("config", ["zero2.yaml", "zero3.yaml", "fsdp.yaml"])
def test_three_processes_resume_bit_for_bit_under_each_sharded_engine(config, small_data, tmp_path):
    """ZeRO-2, ZeRO-3 and FSDP2 at 3 processes, where their reduce-scatters add three terms: a launch stopped at the
    checkpoint of step 4 and launched again ends with the uninterrupted run's weights and samples, bit for bit."""
    kw = {"num_processes": 3, "env": {FSDP_ON_CPU_ENV: "1"}}
    straight = launch(config, recipe_args(small_data, tmp_path / "straight", 8), tmp_path, **kw)
    assert straight.returncode == 0 and "world size 3" in straight.stdout
    resumed = tmp_path / "resumed"
    assert launch(config, recipe_args(small_data, resumed, 4), tmp_path, **kw).returncode == 0
    second = launch(config, recipe_args(small_data, resumed, 8), tmp_path, **kw)
    assert second.returncode == 0 and "resumed at step 4" in second.stdout
    assert_same_run(tmp_path / "straight", resumed, 3)


@pytest.mark.slow  # five minutes on 2 cores (32 processes start up at once): make test-slow, not CI
def test_thirty_two_processes_restarted_in_the_job_end_as_the_uninterrupted_run(small_data, tmp_path):
    """The seed's scale once, on one machine: 32 DDP processes (about 250 MB each), one sample each a step; a worker
    killed after the checkpoint of step 4 is restarted by python -m infra.launch in the same job, which ends with the
    uninterrupted 32-process run's weights and samples, bit for bit."""
    scale = ("--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "1", "--logging_steps", "4")
    straight = launch("cpu.yaml", recipe_args(small_data, tmp_path / "straight", 8, *scale), tmp_path, timeout=900, num_processes=32)
    assert straight.returncode == 0 and "world size 32" in straight.stdout
    restart_in_the_job(recipe_args(small_data, tmp_path / "restarted", 8, *scale), tmp_path, 32, rank=17, die_at_step=6, resumed_at=4)
    assert_same_run(tmp_path / "straight", tmp_path / "restarted", 32)


# Torch elastic's restarted gloo groups used to hang or refuse their first collective; with lazy gloo init they do not
# (test_elastic_restarts_stress: 10 of 10). CI restarts in the job over two hosts (tests/test_network.py).
@pytest.mark.slow
def test_an_elastic_restart_resumes_by_itself_to_the_same_weights(straight, small_data, tmp_path):
    proc = elastic_restart(small_data, tmp_path, die_at_step=10)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "test fault: rank dies at step 10" in proc.stdout and "resumed at step 8" in proc.stdout
    assert_same_weights(straight[0] / "out", tmp_path / "out")
    for rank in (0, 1):
        assert trace(tmp_path / "out", rank) == trace(straight[0] / "out", rank)


@pytest.mark.slow
@pytest.mark.parametrize("repetition", range(10))
def test_elastic_restarts_stress(straight, small_data, tmp_path, repetition):
    """Restarted gloo groups used to hang (14 of 19 ran); with lazy gloo init every one must finish, exactly."""
    proc = elastic_restart(small_data, tmp_path, die_at_step=3 + 2 * repetition)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_weights(straight[0] / "out", tmp_path / "out")


def test_data_and_checkpoints_on_object_storage_resume_on_an_empty_disk(straight, small_data, s3, tmp_path):
    """Data served from an S3-compatible server (moto on 127.0.0.1), fetched and verified; each checkpoint uploaded
    there and pruned there as here; the newest remote one truncated, the local output_dir deleted: a fresh launch
    reports the truncated one, downloads the one before, and ends bit for bit where the uninterrupted run did, each
    step on the samples it took."""
    fs, bucket = s3
    fs.put(str(small_data), f"{bucket}/small", recursive=True)
    url, out = f"s3://{bucket}/run/checkpoints", tmp_path / "out"

    def args(steps: int) -> list[str]:
        data = f"s3://{bucket}/small"
        return recipe_args(
            data, out, steps, "--num_workers", "1", "--verify_data_checksums", "--checkpoint_upload_dir", url, "--report_to", "none"
        )

    first = launch("cpu.yaml", args(STEPS), tmp_path)
    assert first.returncode == 0 and f"uploaded step_{STEPS:08d} to {url}" in first.stdout
    assert "sizes and sha256 verified" in first.stdout  # the preflight fetched and hashed every shard
    local = sorted(p.name for p in (out / "checkpoints").glob("step_*"))
    assert local == [f"step_{STEPS - 4:08d}", f"step_{STEPS:08d}"]  # save_total_limit: 2
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{bucket}/run/checkpoints")) == local
    before = [trace(out, rank) for rank in (0, 1)]
    newest = f"{bucket}/run/checkpoints/step_{STEPS:08d}/model.safetensors"
    fs.pipe(newest, fs.cat(newest)[:1000])
    shutil.rmtree(out)
    second = launch("cpu.yaml", args(2 * STEPS), tmp_path)
    assert second.returncode == 0
    assert f"warning: skipping remote checkpoint {url}/step_{STEPS:08d}: model.safetensors has 1000 bytes" in second.stdout
    assert f"resumed at step {STEPS - 4}" in second.stdout
    assert_same_weights(straight[0] / "out", out)
    for rank in (0, 1):
        expected = trace(straight[0] / "out", rank)
        assert before[rank] == expected[: len(before[rank])] and before[rank][-1]["step"] == STEPS
        assert trace(out, rank) == [line for line in expected if line["step"] > STEPS - 4]


# Weighted data mixtures (infra.data.mixture; the order itself: tests/test_mixture.py)


def mixture_args(tiny_data: Path, small_data: Path, out: Path, max_steps: int, weights=(0.7, 0.3), *extra: str) -> list[str]:
    """Two sources with the same tokenizer and 64-token samples: the larger tiny_data, the smaller small_data."""
    mixture = [f"name=big,data_dir={tiny_data},weight={weights[0]}", f"name=small,data_dir={small_data},weight={weights[1]}"]
    return [*recipe_args(small_data, out, max_steps, "--report_to", "none", *extra), "--data_mixture", *mixture]


def mixture_sequence(out: Path, world_size: int, after: int = 0, through: int = 1 << 30) -> list[tuple[int, str]]:
    """(id, source) in training order over steps after..through: per micro-batch, the ranks' slices in rank order."""
    traces = [[line for line in trace(out, r) if after < line["step"] <= through] for r in range(world_size)]
    return [pair for lines in zip(*traces, strict=True) for line in lines for pair in zip(line["ids"], line["sources"], strict=True)]


@pytest.mark.slow  # the matrix resumes a mixture in CI
def test_a_mixture_resumes_exactly(tiny_data, small_data, tmp_path):
    """2 processes over a 0.7/0.3 mixture: N steps, then N more in a new launch == 2N straight, bit for bit; the trace
    names each sample's source, in the proportions."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert launch("cpu.yaml", mixture_args(tiny_data, small_data, straight, 2 * STEPS), tmp_path).returncode == 0
    assert launch("cpu.yaml", mixture_args(tiny_data, small_data, resumed, STEPS), tmp_path).returncode == 0
    second = launch("cpu.yaml", mixture_args(tiny_data, small_data, resumed, 2 * STEPS), tmp_path)
    assert second.returncode == 0 and f"resumed at step {STEPS}" in second.stdout
    assert_same_weights(straight, resumed)
    order = mixture_sequence(straight, 2)
    assert order == mixture_sequence(resumed, 2)
    sources = [s for _, s in order]
    assert abs(sources.count("small") / len(sources) - 0.3) <= 1 / len(sources) + 1e-9
    changed = launch("cpu.yaml", mixture_args(tiny_data, small_data, resumed, 3 * STEPS, (0.5, 0.5)), tmp_path)
    assert changed.returncode == 1 and "data error: data_mixture" in changed.stderr and "new_mixture_segment" in changed.stderr


@pytest.mark.slow  # the matrix changes a mixture's world size between 1 and 2 in CI
@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 3)])
def test_a_mixture_continues_its_order_on_another_world_size(before, after, tiny_data, small_data, tmp_path):
    """N steps on one world size, N more on another: the samples are those of one process's uninterrupted order."""
    straight, changed = tmp_path / "straight", tmp_path / "changed"
    one = launch("cpu.yaml", mixture_args(tiny_data, small_data, straight, STEPS * (before + after)), tmp_path, num_processes=1)
    assert one.returncode == 0  # as many samples in one process as the two world sizes together
    assert launch("cpu.yaml", mixture_args(tiny_data, small_data, changed, STEPS), tmp_path, num_processes=before).returncode == 0
    second = launch("cpu.yaml", mixture_args(tiny_data, small_data, changed, 2 * STEPS), tmp_path, num_processes=after)
    assert second.returncode == 0 and f"world size {after}" in second.stdout
    both = mixture_sequence(changed, before, through=STEPS) + mixture_sequence(changed, after, after=STEPS)
    assert len(both) == STEPS * MICRO_BATCH * ACCUMULATION * (before + after)
    assert both == mixture_sequence(straight, 1)[: len(both)]


def test_the_loss_per_source_is_that_of_its_samples(tiny_data, small_data, tmp_path):
    """One step, one process, fp32, no dropout: train/loss/<name> equals the token loss of that source's samples in the
    trace, recomputed from the initial weights; train/loss is the token-weighted mean of the sources'; eval/loss/<name>
    is the exported model's loss on that source's held-out samples; the MLflow run is tagged with the segment."""
    import mlflow
    from transformers import AutoTokenizer

    from infra.recipe import token_losses
    from recipes.pretrain_clm import ModelArguments, build_model

    out = tmp_path / "out"
    extra = ("--max_steps", "1", "--logging_steps", "1", "--mixed_precision", "no", "--attention_dropout", "0.0")
    args = mixture_args(tiny_data, small_data, out, 1, (0.5, 0.5), *extra)
    args[args.index("--report_to") + 1] = "mlflow"
    args[args.index("--eval_samples") + 1] = "8"  # held out of each source
    assert launch("cpu.yaml", args, tmp_path, num_processes=1).returncode == 0
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("pretrain_clm").experiment_id])
    logged = run.data.metrics
    assert json.loads(run.data.tags["data_mixture_segments"]) == [{"start": 0, "weights": {"big": 0.5, "small": 0.5}}]

    from accelerate.utils import set_seed

    set_seed(SEED)  # what the recipe's start() does before it builds the model
    dataset = PackedDataset(small_data)
    model = build_model(ModelArguments(hidden_size=64, intermediate_size=128), AutoTokenizer.from_pretrained(dataset.tokenizer_dir), 64)
    sources = {"big": PackedDataset(tiny_data), "small": dataset}
    offsets = {"big": 0, "small": len(sources["big"]) - 8}  # each source's last 8 samples are held out
    totals = {name: [0.0, 0.0] for name in sources}
    with torch.no_grad():
        for line in trace(out, 0):
            for i, name in zip(line["ids"], line["sources"], strict=True):
                ids = sources[name][i - offsets[name]].unsqueeze(0)
                loss, tokens = token_losses(model(input_ids=ids).logits, ids)
                totals[name][0] += float(loss)
                totals[name][1] += float(tokens)
    for name, (loss, tokens) in totals.items():
        assert logged[f"train/loss/{name}"] == pytest.approx(loss / tokens, rel=1e-5)
    all_loss = sum(t[0] for t in totals.values()) / sum(t[1] for t in totals.values())
    assert logged["train/loss"] == pytest.approx(all_loss, rel=1e-5)
    assert logged["train/samples/big"] + logged["train/samples/small"] == MICRO_BATCH * ACCUMULATION
    from transformers import AutoModelForCausalLM

    final = AutoModelForCausalLM.from_pretrained(out / "final")
    for name, data in sources.items():
        held = torch.stack([data[i] for i in range(len(data) - 8, len(data))])
        with torch.no_grad():
            loss, tokens = token_losses(final(input_ids=held).logits, held)
        assert logged[f"eval/loss/{name}"] == pytest.approx(float(loss.sum() / tokens.sum()), rel=1e-5)


def test_a_run_resumed_at_an_odd_step_on_fewer_processes_updates_its_weights_at_every_step(small_data, tmp_path):
    """Two processes of two micro-steps stopped at step 3, resumed on one process of four micro-steps for the same global
    batch. accelerate's load_state restores its micro-step counter (6, from 3 steps of 2), which is no multiple of 4: left
    so, every gradient sync fell on the wrong micro-batch and the optimizer skipped every step, the weights frozen at
    step 3 to the end of the run. Every checkpoint after the resume must hold new weights."""
    out, every = tmp_path / "out", ("--save_steps", "1", "--save_total_limit", "10", "--report_to", "none")
    global_batch = ("--global_batch_size", str(2 * MICRO_BATCH * ACCUMULATION))
    assert launch("cpu.yaml", recipe_args(small_data, out, 3, *every, *global_batch), tmp_path, num_processes=2).returncode == 0
    resumed = launch("cpu.yaml", recipe_args(small_data, out, 6, *every, *global_batch), tmp_path, num_processes=1)
    assert resumed.returncode == 0 and "resumed at step 3" in resumed.stdout, resumed.stderr[-3000:]
    digests = {}
    for manifest in sorted(out.glob("checkpoints/step_*/manifest.json")):
        m = json.loads(manifest.read_text())
        digests[m["step"]] = m["files"]["model.safetensors"]["xxh3_64"]
    assert sorted(digests) == [1, 2, 3, 4, 5, 6] and len(set(digests.values())) == 6, digests
