"""Chaos: a two-host job under a fault every few minutes, restarted like a scheduler would, and its measured goodput
against what `infra.plan` predicts for the same fault rate, checkpoint cost and restart cost.

    make chaos                                     # 15 minutes, a fault every ~2 minutes (root: network namespaces)
    python benchmarks/chaos.py --minutes 8 --fault_minutes 2

Two hosts made of network namespaces (tests/hosts.py), one `python -m infra.launch` each (multi_node.yaml, one
process per host), the default pretraining recipe on the default data (`make data`). Faults arrive at random (a
Poisson process: exponential gaps of mean `fault_minutes`, the planner's model), each of a kind drawn at random:

- `kill`: every process of host 1 killed (a host lost);
- `link`: host 1's interface down (a dead link), up again when the job has stopped;
- `stop`: the training process of host 1 frozen with SIGSTOP.

The scheduler: when a launcher exits non-zero, every process of the job is killed (as `srun --kill-on-bad-exit`
does), the link is put back, and the job is launched again; it resumes from its newest checkpoint. Checkpoints are
saved at the Young/Daly interval for an MTBF of `fault_minutes` (`--save_every_minutes auto`).

Printed: the measured ETTR and its parts (from the run's own goodput metrics), the planner's prediction for the
measured save cost, interval, restart cost and fault rate, and for each fault the time to the next kept step, split
into detection (fault to the job's exit), the scheduler's relaunch, and start-up (launch to the first step).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.hosts import Hosts  # noqa: E402

KINDS = ("kill", "link", "stop")


class Job:
    """One launch of the two-host job, and when it started and first trained."""

    def __init__(self, hosts: Hosts, out: Path, data: str, logs: Path, number: int, fault_minutes: float, extra: list[str]):
        self.hosts, self.out, self.started = hosts, out, time.time()
        self.procs = []
        env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{out.parent / 'mlflow.db'}", "PYTHONUNBUFFERED": "1"}
        for rank in (0, 1):
            cmd = [
                sys.executable, "-m", "infra.launch",
                "--config_file", str(REPO / "accelerate_configs" / "multi_node.yaml"),
                "--num_processes", "2", "--num_machines", "2", "--machine_rank", str(rank),
                "--main_process_ip", hosts.addresses[0], "--main_process_port", "29500",
                str(REPO / "recipes" / "pretrain_clm.py"),
                "--config", str(REPO / "recipes" / "configs" / "pretrain_clm.yaml"),
                "--data_dir", data, "--output_dir", str(out), "--max_steps", "1000000", "--logging_steps", "1",
                "--save_every_minutes", "auto", "--mtbf_hours", f"{fault_minutes / 60:g}", "--save_steps", "0",
                "--eval_samples", "0", *extra,
            ]  # fmt: skip
            self.procs.append(hosts.popen(rank, cmd, env, logs / f"launch{number}_h{rank}.log", cwd=REPO))

    def failed(self) -> bool:
        return any(p.poll() not in (None, 0) for p in self.procs)

    def training(self) -> bool:
        """Whether this launch has trained a step (rank 0 writes goodput.json at every logged step)."""
        return (alive := last_alive(self.out)) is not None and alive > self.started

    def end(self) -> None:
        for host in (0, 1):
            self.hosts.kill(host)
        for p in self.procs:
            with contextlib.suppress(Exception):
                p.wait(timeout=30)


def last_alive(out: Path) -> float | None:
    try:
        return json.loads((out / "goodput.json").read_text())["last_alive"]
    except (OSError, ValueError, KeyError):
        return None


def inject(hosts: Hosts, kind: str) -> None:
    import psutil

    if kind == "kill":
        hosts.kill(1)
    elif kind == "link":
        hosts.link(1, up=False)
    else:
        for pid in hosts.pids(1):
            cmdline = " ".join(psutil.Process(pid).cmdline())
            if "pretrain_clm.py" in cmdline and "infra.launch" not in cmdline:
                os.kill(pid, signal.SIGSTOP)


def goodput_metrics(out: Path) -> dict[str, float]:
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{out.parent / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("pretrain_clm").experiment_id])
    history = {key: client.get_metric_history(run.info.run_id, key) for key in ("checkpoint/save_seconds", "checkpoint/interval_minutes")}
    # the newest value of each (a step done again after a fault logs it again: MLflow's latest is by step)
    m = {
        k: max(client.get_metric_history(run.info.run_id, k), key=lambda p: p.timestamp).value
        for k in run.data.metrics
        if k.startswith("goodput/")
    }
    m["save_seconds"] = statistics.median(p.value for p in history["checkpoint/save_seconds"])
    m["interval_minutes"] = history["checkpoint/interval_minutes"][-1].value
    return m


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=15.0, help="How long the job runs under faults.")
    parser.add_argument("--fault_minutes", type=float, default=2.0, help="Mean minutes between faults.")
    parser.add_argument("--data_dir", default=str(REPO / "data" / "stdlib"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("extra", nargs="*", help="More flags for the recipe.")
    a = parser.parse_args()
    if why := Hosts.unavailable():
        raise SystemExit(f"chaos: {why}")
    if not (Path(a.data_dir) / "index.json").is_file():
        raise SystemExit(f"chaos: data_dir={a.data_dir} holds no prepared data: run `make data` first")
    rng = random.Random(a.seed)
    work = Path(tempfile.mkdtemp(prefix="chaos-"))
    out, logs = work / "out", work / "logs"
    logs.mkdir()
    faults: list[dict] = []
    with Hosts(2) as hosts:
        begin = time.time()
        end = begin + a.minutes * 60
        launches = 1
        job = Job(hosts, out, a.data_dir, logs, launches, a.fault_minutes, a.extra)
        next_fault = begin + rng.expovariate(1 / (a.fault_minutes * 60))
        pending: dict | None = None  # the last fault, until the next kept step
        while time.time() < end:
            time.sleep(0.2)
            now = time.time()
            if pending and "exited" not in pending and job.failed():
                pending["exited"] = now
            if pending and "exited" in pending and "relaunched" not in pending:
                job.end()
                hosts.link(1, up=True)
                launches += 1
                job = Job(hosts, out, a.data_dir, logs, launches, a.fault_minutes, a.extra)
                pending["relaunched"] = time.time()
                print(f"chaos: {now - begin:6.0f}s  relaunch {launches}", flush=True)
            if pending and "relaunched" in pending and job.training():
                pending["trained"] = last_alive(out)
                faults.append(pending)
                pending = None
            if pending is None and now >= next_fault and job.training():
                kind = rng.choice(KINDS)
                inject(hosts, kind)
                pending = {"kind": kind, "at": now}
                print(f"chaos: {now - begin:6.0f}s  fault: {kind}", flush=True)
                next_fault = now + rng.expovariate(1 / (a.fault_minutes * 60))
            elif job.failed() and pending is None:
                raise SystemExit(f"chaos: the job failed without a fault: see {logs}")
        time.sleep(2)  # the last logged step's goodput
        m = goodput_metrics(out)
        job.end()

    from infra.plan import expected_wall_minutes

    recovered = [f for f in faults if "trained" in f]
    restart = statistics.mean(f["trained"] - f["at"] for f in recovered) if recovered else 0.0
    train_minutes = m["goodput/train_seconds"] / 60
    wall = m["goodput/wall_seconds"]

    def planner(mtbf_minutes: float) -> float:
        cost = expected_wall_minutes(train_minutes, m["interval_minutes"], m["save_seconds"] / 60, restart / 60, mtbf_minutes)
        return train_minutes / cost

    rates = [(f"the rate asked (one every {a.fault_minutes:g} min)", a.fault_minutes)]
    if faults:
        realized = wall / 60 / len(faults)
        rates.insert(0, (f"the faults' realized rate (one every {realized:.1f} min)", realized))
    print(f"\nchaos: {wall / 60:.1f} min, {len(faults)} faults recovered ({', '.join(f['kind'] for f in faults)}), {launches} launches")
    parts = ", ".join(f"{k} {m[f'goodput/{k}_seconds'] / wall:.0%}" for k in ("train", "startup", "checkpoint", "restart", "lost"))
    print(f"measured ETTR   {m['goodput/ettr']:.3f}  ({parts})")
    predictions = ", ".join(f"{planner(mtbf):.3f} at {label}" for label, mtbf in rates)
    print(
        f"planner         {predictions}; save {m['save_seconds']:.2f}s every {m['interval_minutes']:.2f} min, "
        f"fault to next kept step {restart:.1f}s"
    )
    print("\nfault   to exit   relaunch   start-up   to the next kept step (s)")
    for f in recovered:
        detection, relaunch = f["exited"] - f["at"], f["relaunched"] - f["exited"]
        print(f"{f['kind']:6s}  {detection:8.1f}  {relaunch:9.1f}  {f['trained'] - f['relaunched']:9.1f}  {f['trained'] - f['at']:9.1f}")
    for kind in KINDS:
        times = [f["exited"] - f["at"] for f in recovered if f["kind"] == kind]
        if times:
            print(f"detection of {kind}: median {statistics.median(times):.1f}s over {len(times)}")
    print(f"\nlogs and run: {work}")
    if os.environ.get("CHAOS_KEEP") != "1":
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
