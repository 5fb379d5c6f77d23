"""A slow host in a synchronous job: throughput without rebalancing, with it, and the ideal, as ratios in one run.

    python benchmarks/stragglers.py                      # 2 and 4 hosts, 160 steps an arm (root: network namespaces)
    python benchmarks/stragglers.py --hosts 2 --steps 240 --repeats 3

Hosts made of network namespaces (tests/hosts.py), each with a CPU cgroup of its own holding it to an equal share of
this machine's cores (70% of them split evenly: each host's speed is then its quota's, not what the others leave it),
one process a host (multi_node.yaml through `python -m infra.launch`, DDP over gloo), the default pretraining in fp32
with one thread a process, micro-batches of 8 samples a process. Host 1 is the slow one: held to half its share for
the whole run, or its disk slow. Seven arms, each a fresh job:

- `free`: no host slowed (straggler_action: warn, today's default);
- `free+rebalance`: no host slowed, straggler_action: rebalance (what rebalancing costs when nothing is slow);
- `slow`: host 1 at half its share, straggler_action: warn (every step waits for it);
- `slow+rebalance`: the same with straggler_action: rebalance;
- `disk`: host 1's reads `--disk_ms` slower a sample (the test hooks' slow_reads: a sleep where the loader reads, as a
  read waiting on its storage; the benchmark's data stays in the page cache), straggler_action: warn;
- `disk+shares`: the same, rebalanced by the shares alone (straggler_read_ahead: false);
- `disk+rebalance`: the same, rebalanced: the shares, and host 1 reading two steps ahead in a thread.

The ideal is the sum of the hosts' speeds: `free` x (n - 1/2) / n with a slow CPU; `free` with a slow disk whose reads
take less than a step's compute, which reading ahead can hide. A run's throughput is its global batch over the
median of its `perf/step_time` windows after the first third of the run (where the shares have settled: windows of
`--window` steps). Printed: each arm's throughput and its ratio to `free` and to the ideal; the shares the rebalanced
run settled on; a PNG of each rebalanced run's shares over its steps (shares/rank_i). Targets: one of 2 hosts slow,
rebalanced >= 0.9 of the ideal (>= 0.675 of free); one of 4 slow, >= 0.9 of the ideal (>= 0.79 of free); nothing
slow, rebalancing costs <= 1%.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from infra.testing import FAULTS_ENV  # noqa: E402
from tests.hosts import Hosts  # noqa: E402

TITLES = {"free": "no host slowed", "slow": "host 1 at half its CPU share", "disk": "host 1's disk slow"}
ARMS = ("free", "free+rebalance", "slow", "slow+rebalance", "disk", "disk+shares", "disk+rebalance")
MICRO_BATCH = 8
PORT = 29500
# the machine's cores the hosts hold in all: below 1, so that each host's speed is its quota's, not what the others
# leave it (the launchers, gloo's threads and MLflow's sampler run beside the training processes)
HOST_SHARE = 0.7


def run(n: int, arm: str, steps: int, window: int, data: str, work: Path, disk_ms: float) -> dict:
    """One arm: a fresh n-host job; its throughput (samples/s) and, rebalanced, its shares by step."""
    work.mkdir(parents=True, exist_ok=True)
    out, db = work / f"{n}_{arm}", f"sqlite:///{work / f'{n}_{arm}.db'}"
    share = HOST_SHARE * (os.cpu_count() or 1) / n
    env = {**os.environ, "MLFLOW_TRACKING_URI": db, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if arm.startswith("disk"):  # host 1's reads slower, for the whole run
        env[FAULTS_ENV] = json.dumps({"rank": 1, "slow_reads": [[disk_ms / 1000, 0, 1 << 30]]})
    action = "rebalance" if arm.endswith(("rebalance", "shares")) else "warn"
    read_ahead = "false" if arm.endswith("shares") else "true"
    with Hosts(n, cpus=share) as hosts:
        if arm.startswith("slow"):
            hosts.set_cpus(1, share / 2)
        procs = []
        for rank in range(n):
            cmd = [
                sys.executable, "-m", "infra.launch",
                "--config_file", str(REPO / "accelerate_configs" / "multi_node.yaml"),
                "--num_processes", str(n), "--num_machines", str(n), "--machine_rank", str(rank),
                "--main_process_ip", hosts.addresses[0], "--main_process_port", str(PORT),
                str(REPO / "recipes" / "pretrain_clm.py"),
                "--config", str(REPO / "recipes" / "configs" / "pretrain_clm.yaml"),
                "--data_dir", data, "--output_dir", str(out), "--max_steps", str(steps),
                "--mixed_precision", "no", "--preflight", "false", "--eval_samples", "0", "--save_steps", "0",
                "--per_device_train_batch_size", str(MICRO_BATCH), "--logging_steps", str(window),
                "--straggler_window_steps", str(window), "--straggler_action", action, "--straggler_read_ahead", read_ahead,
            ]  # fmt: skip
            procs.append(hosts.popen(rank, cmd, env, work / f"{n}_{arm}_h{rank}.log", cwd=REPO))
        for rank, proc in enumerate(procs):
            if proc.wait(timeout=30 * 60) != 0:
                log = (work / f"{n}_{arm}_h{rank}.log").read_text()
                raise SystemExit(f"stragglers: the {arm} job failed on host {rank}:\n{log[-3000:]}")
    history = histories(db, ["perf/step_time", *(f"shares/rank_{r}" for r in range(n))])
    settled = [v for step, v in history["perf/step_time"] if step > steps // 3]
    return {
        "throughput": n * MICRO_BATCH / statistics.median(settled),
        "shares": {r: history[f"shares/rank_{r}"] for r in range(n) if history[f"shares/rank_{r}"]},
    }


def histories(db: str, keys: list[str]) -> dict[str, list[tuple[int, float]]]:
    """Each key's (step, value) points of the job's one run, by step."""
    import mlflow

    client = mlflow.MlflowClient(db)
    (run,) = client.search_runs([client.get_experiment_by_name("pretrain_clm").experiment_id])
    return {key: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)) for key in keys}


def plot(results: dict[int, dict[str, dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(n, arm) for n, arms in results.items() for arm in arms if arm.endswith(("rebalance", "shares"))]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 3.5), squeeze=False)
    for ax, (n, arm) in zip(axes[0], panels, strict=True):
        for rank, points in results[n][arm]["shares"].items():
            label = f"rank {rank}" + (" (slow host)" if rank == 1 and not arm.startswith("free") else "")
            ax.plot([s for s, _ in points], [v for _, v in points], label=label)
        ax.set(title=f"{n} hosts, {TITLES[arm.split('+')[0]]}, {arm}", xlabel="step", ylabel="samples of a micro-step")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, nargs="+", default=[2, 4], help="Host counts to run (each >= 2).")
    parser.add_argument("--steps", type=int, default=160, help="Steps of each arm's job.")
    parser.add_argument("--window", type=int, default=10, help="straggler_window_steps (and logging_steps) of every arm.")
    parser.add_argument("--disk_ms", type=float, default=25.0, help="How much slower host 1 reads a sample in the disk arms.")
    parser.add_argument("--data_dir", default=str(REPO / "data" / "stdlib"))
    parser.add_argument("--png", default=str(REPO / "docs" / "stragglers.png"), help="Where the plot of the shares goes.")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS), help="Arms to run, in this order (free is the anchor).")
    parser.add_argument("--repeats", type=int, default=1, help="Runs of every arm (the median is taken), the order turned round each time.")
    parser.add_argument("--if_possible", action="store_true", help="Where hosts cannot be made (not root), say why and exit 0.")
    parser.add_argument("--keep", default="", help="A folder to keep every job's logs and output in (default: a temporary one, removed).")
    a = parser.parse_args()
    if why := Hosts.unavailable(cpus=True):
        if a.if_possible:
            print(f"stragglers: skipped: {why}")
            return
        raise SystemExit(f"stragglers: {why}")
    if not (Path(a.data_dir) / "index.json").is_file():
        raise SystemExit(f"stragglers: data_dir={a.data_dir} holds no prepared data: run `make data` first")
    if a.disk_ms <= 0:
        raise SystemExit(f"stragglers: --disk_ms {a.disk_ms:g} is not accepted: give milliseconds > 0")
    if a.repeats < 1 or a.steps < 3 * a.window:
        raise SystemExit(f"stragglers: --repeats {a.repeats} --steps {a.steps} is not accepted: give repeats >= 1, steps >= 3 windows")
    if "free" not in a.arms:
        raise SystemExit(f"stragglers: --arms {' '.join(a.arms)} is not accepted: the free arm is every ratio's anchor")
    if min(a.hosts) < 2:
        raise SystemExit(f"stragglers: --hosts {a.hosts} is not accepted: give host counts of at least 2")
    from infra.precision import cpu_description

    results: dict[int, dict[str, dict]] = {}
    with contextlib.nullcontext(a.keep) if a.keep else tempfile.TemporaryDirectory(prefix="stragglers-") as tmp:
        for n in a.hosts:
            runs: dict[str, list[dict]] = {arm: [] for arm in a.arms}
            for repeat in range(a.repeats):  # the order turned round each time: a drift of the machine falls on every arm
                for arm in a.arms if repeat % 2 == 0 else a.arms[::-1]:
                    began = time.monotonic()
                    runs[arm].append(run(n, arm, a.steps, a.window, a.data_dir, Path(tmp) / str(repeat), a.disk_ms))
                    took = time.monotonic() - began
                    print(f"{n} hosts, {arm}: {runs[arm][-1]['throughput']:.1f} samples/s ({took:.0f} s)", flush=True)
            results[n] = {arm: median_run(each) for arm, each in runs.items()}
    print(f"\nCPU: {cpu_description()}; {a.steps} steps an arm, windows of {a.window} steps, micro-batches of {MICRO_BATCH}")
    for n, arms in results.items():
        free = arms["free"]["throughput"]
        ideals = {"free": free, "slow": free * (n - 0.5) / n, "disk": free}
        cores = HOST_SHARE * (os.cpu_count() or 1) / n
        slowed = f"host 1 at half, or reading {a.disk_ms:g} ms a sample slower"
        print(f"{n} hosts (each {cores:.2f} cores; {slowed}): the ideal {ideals['slow'] / free:.3f} of free, of a slow disk 1")
        for arm, measured in arms.items():
            t, ideal = measured["throughput"], ideals[arm.split("+")[0]]
            print(f"  {arm:<15} {t:8.1f} samples/s   {t / free:.3f} of free   {t / ideal:.3f} of the ideal")
            if measured["shares"]:
                print(f"  {'':<15} shares by window (rank: samples of a micro-step): {shares_line(measured['shares'])}")
        if "free+rebalance" in arms and arms["free+rebalance"]["shares"]:
            # what rebalancing costs where nothing is slow, in this run: its decisions' time against a window's, and
            # the windows whose shares it moved off even (the only other work it adds)
            uneven, windows = uneven_windows(arms["free+rebalance"]["shares"])
            decide, window = deciding_seconds(), a.window * n * MICRO_BATCH / free
            print(
                f"  nothing slow, rebalancing: shares uneven in {uneven} of {windows} windows; its decisions "
                f"{decide * 1e6:.0f} us a window of 64 processes = {decide / window:.4%} of a window of {a.window} steps here"
            )
    if any(arm.endswith(("rebalance", "shares")) for arm in a.arms):
        plot(results, Path(a.png))
        print(f"shares over the run: {a.png}")


def uneven_windows(shares: dict[int, list[tuple[int, float]]]) -> tuple[int, int]:
    """Of a run's straggler windows, how many had shares other than even (the work of a plain run), and how many."""
    by_window = list(zip(*(points for points in shares.values()), strict=True))
    return sum(len({v for _, v in window}) > 1 for window in by_window), len(by_window)


def deciding_seconds(processes: int = 64, windows: int = 200) -> float:
    """What rebalancing adds to a window where nothing is slow, beside the detector's all-gather that runs under warn
    too: its decisions (the speeds learnt, who cannot keep up, who reads ahead, the split), timed on equal processes
    whose times differ by up to 5% at random; seconds a window."""
    import random

    from infra.health import deeper
    from infra.shares import KeepingUp, Speeds, rebalanced

    rng = random.Random(0)
    speeds, keeping_up = Speeds(processes), KeepingUp(processes, 4.0, 3, 1)
    sizes, depths = [MICRO_BATCH] * processes, [0] * processes
    began = time.perf_counter()
    for _ in range(windows):
        seconds = [0.1 * (1 + 0.05 * rng.random()) for _ in range(processes)]
        waits = [0.001 * rng.random() for _ in range(processes)]
        speeds.measured(sizes, seconds)
        keeping_up.behind(speeds, sizes, [])
        deeper(depths, waits, seconds, 1)
        sizes = rebalanced(sizes, speeds) or sizes
    return (time.perf_counter() - began) / windows


def median_run(runs: list[dict]) -> dict:
    """Of an arm's runs, the one of median throughput (the lower of the middle two)."""
    return sorted(runs, key=lambda r: r["throughput"])[(len(runs) - 1) // 2]


def shares_line(shares: dict[int, list[tuple[int, float]]]) -> str:
    return "; ".join(f"{rank}: " + " ".join(f"{v:g}" for _, v in points) for rank, points in shares.items())


if __name__ == "__main__":
    main()
