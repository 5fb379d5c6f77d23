"""Chaos for replica groups (fault_tolerance=replicas): three groups under a fault every few minutes, and the job's
effective training time ratio, next to `benchmarks/chaos.py`'s for a job that stops at every fault.

    python benchmarks/chaos_replicas.py --minutes 8 --fault_minutes 2      # root: network namespaces, CPU cgroups
    python benchmarks/chaos_replicas.py --spares 1                          # three groups train, a fourth hot spare

Four hosts made of network namespaces (tests/hosts.py): the lighthouse, and three replica groups of one process each,
the default pretraining on the default data (`make data`), 24 samples per step (8 per group). With `--spares N`, N more
groups start as hot spares (`training_replicas: 3`): they step with the others and take a lost group's share at once.
Each host is held to its own share of the cores (`--host_cpus`, a CPU cgroup; by default 90% of the machine split among
the groups), as separate machines are: without it the groups share the machine's cores, a dead group's cores go to the
live ones, and steps with a group missing ran faster than fault-free ones (an ETTR above 1), where on separate machines
they run slower (the same global batch on fewer groups). Faults arrive at random
(exponential gaps of mean `fault_minutes`), each to a random live group, of a kind drawn at random: `kill` (its
process killed), `link` (its interface down), `stop` (its process frozen with SIGSTOP). The scheduler acts once the
others have left the group out: a killed or frozen group is killed and started again, a cut link put back; the group
then heals from a live one.

ETTR here is (committed steps x the median time between two commits) / wall time since the first launch, start-up
included: the share of the wall time the job would have needed had every step taken the time of a fault-free one.
Printed with each fault's time to the survivors' next committed step and the group's heal.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
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
TRAINING = 3  # groups that train; with --spares, more start as hot spares
PORT = 29510


class Job:
    def __init__(self, hosts: Hosts, work: Path, data: str, groups: int, extra: list[str]):
        self.hosts, self.work, self.data, self.groups, self.extra = hosts, work, data, groups, extra
        self.out = work / "out"
        db = f"sqlite:///{work / 'mlflow.db'}"
        self.env = {**os.environ, "MLFLOW_TRACKING_URI": db, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        import mlflow

        mlflow.MlflowClient(db).search_experiments()
        light = [sys.executable, "-m", "infra.replicas", "lighthouse", "--port", str(PORT), "--heartbeat_timeout_ms", "2000"]
        hosts.popen(groups, light, self.env, work / "lighthouse.log", cwd=REPO)
        self.starts = {g: 0 for g in range(groups)}
        for g in range(groups):
            self.start(g)

    def start(self, g: int) -> None:
        self.starts[g] += 1
        cmd = [
            sys.executable,
            str(REPO / "recipes" / "pretrain_clm.py"),
            "--config",
            str(REPO / "recipes" / "configs" / "pretrain_clm.yaml"),
        ]
        cmd += ["--data_dir", self.data, "--output_dir", str(self.out), "--max_steps", "1000000", "--eval_samples", "0"]
        cmd += ["--global_batch_size", str(8 * TRAINING), "--fault_tolerance", "replicas", "--replica_group_id", str(g)]
        cmd += ["--lighthouse", f"http://{self.hosts.addresses[self.groups]}:{PORT}", "--replica_timeout_seconds", "5", "--trace_samples"]
        if self.groups > TRAINING:
            cmd += ["--training_replicas", str(TRAINING)]
        # checkpoints matter only when every group is lost: the planner gets the job's time between such losses (a
        # day, with a group lost every few minutes and back within seconds), not a group's
        cmd += ["--save_every_minutes", "auto", "--mtbf_hours", "24", *self.extra]
        self.hosts.popen(g, cmd, self.env, self.log(g), cwd=REPO)

    def log(self, g: int) -> Path:
        return self.work / f"g{g}_{self.starts[g]}.log"

    def text(self, g: int) -> str:
        try:
            return self.log(g).read_text()
        except OSError:
            return ""

    def step(self) -> int:
        best = 0
        for path in self.out.glob("replicas/*/trace/rank0.jsonl"):
            with open(path, "rb") as f:
                f.seek(max(0, path.stat().st_size - 4096))
                lines = f.read().decode(errors="ignore").splitlines()[1:]
            best = max([best, *(json.loads(line)["step"] for line in lines if line.endswith("}"))])
        return best

    def live(self) -> list[int]:
        return [g for g in range(self.groups) if self.starts[g] == 1 or "healed from a live group" in self.text(g)]


def inject(hosts: Hosts, group: int, kind: str) -> None:
    if kind == "kill":
        hosts.kill(group)
    elif kind == "link":
        hosts.link(group, up=False)
    else:
        hosts.kill(group, signal.SIGSTOP)


def healed(job: Job, fault: dict) -> bool:
    """The group of `fault` healed since the scheduler acted (a group started again logs anew)."""
    since = fault["mark_self"] if fault["kind"] == "link" else 0
    return "healed from a live group" in job.text(fault["group"])[since:]


def lost(commits: list[tuple[float, int]], step_seconds: float, at: float, dropped: float, end: float) -> tuple[float, float]:
    """The wall time a fault cost, in its window (from the fault to the next one): up to the survivors' next commit,
    and after it, each the time less what its committed steps would have taken at the fault-free pace."""

    def cost(start: float, stop: float) -> float:
        inside = [step for t, step in commits if start <= t < stop]
        before = [step for t, step in commits if t < start]
        steps = (inside[-1] - before[-1]) if inside and before else 0
        return (stop - start) - steps * step_seconds

    return cost(at, dropped), cost(dropped, end)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=15.0)
    parser.add_argument("--fault_minutes", type=float, default=2.0)
    parser.add_argument("--data_dir", default=str(REPO / "data" / "stdlib"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--spares", type=int, default=0, help=f"hot spare groups beside the {TRAINING} that train (training_replicas)")
    parser.add_argument("--host_cpus", type=float, help="cores of each host's CPU share (default: 90%% of the machine's, split)")
    parser.add_argument("extra", nargs="*", help="More flags for the recipe.")
    a = parser.parse_args()
    if why := Hosts.unavailable(cpus=True):
        raise SystemExit(f"chaos_replicas: {why}")
    rng = random.Random(a.seed)
    groups = TRAINING + a.spares
    if a.host_cpus is None:
        a.host_cpus = round(0.9 * (os.cpu_count() or 1) / groups, 2)
    work = Path(tempfile.mkdtemp(prefix="chaos-replicas-"))
    commits: list[tuple[float, int]] = []
    faults: list[dict] = []
    with Hosts(groups + 1, cpus=a.host_cpus) as hosts:
        begin = time.time()
        job = Job(hosts, work, a.data_dir, groups, a.extra)
        next_fault = begin + rng.expovariate(1 / (a.fault_minutes * 60))
        pending: dict | None = None
        while time.time() < begin + a.minutes * 60:
            time.sleep(0.05)
            now, step = time.time(), job.step()
            if not commits or step > commits[-1][1]:
                commits.append((now, step))
            if now - commits[-1][0] > 180:
                raise SystemExit(f"chaos_replicas: no step for 3 minutes: see the logs in {work}")
            if pending and "dropped" not in pending:
                others = [g for g in job.live() if g != pending["group"]]
                if any(re.search(r"groups? live \(were \d\)", job.text(g)[pending["marks"].get(g, 0) :]) for g in others):
                    pending["dropped"] = now
                    g = pending["group"]
                    if pending["kind"] == "link":
                        hosts.link(g, up=True)
                    else:
                        hosts.kill(g, signal.SIGKILL)
                        hosts.wait_quiet(g, 10)
                        job.start(g)
                    pending["restarted"] = time.time()
            if pending and "dropped" in pending and healed(job, pending):
                pending["healed"] = time.time()
                faults.append(pending)
                pending = None
            if pending is None and now >= next_fault and len(job.live()) == groups:
                g, kind = rng.randrange(groups), rng.choice(KINDS)
                pending = {"kind": kind, "group": g, "at": now, "marks": {x: len(job.text(x)) for x in range(groups)}}
                pending["mark_self"] = len(job.text(g))
                inject(hosts, g, kind)
                print(f"chaos: {now - begin:6.0f}s  step {step}  {kind} group {g}", flush=True)
                next_fault = now + rng.expovariate(1 / (a.fault_minutes * 60))
        wall = time.time() - begin
    gaps = [b[0] - a_[0] for a_, b in zip(commits[1:], commits[2:], strict=False)]
    per_step = [g / (b[1] - a_[1]) for g, a_, b in zip(gaps, commits[1:], commits[2:], strict=False)]
    step_seconds = statistics.median(per_step)
    steps = commits[-1][1]
    from infra.precision import cpu_description

    print(f"\nCPU: {cpu_description()}; each host held to {a.host_cpus:g} of a core")
    spares = f" and {a.spares} hot spare{'s' if a.spares > 1 else ''}" if a.spares else ""
    print(f"chaos ({TRAINING} replica groups{spares}): {wall / 60:.1f} min, {len(faults)} faults recovered, ", end="")
    print(f"{steps} steps at {step_seconds * 1000:.0f} ms")
    started = commits[1][0] - begin
    print(f"measured ETTR {steps * step_seconds / wall:.3f} (first step after {started:.0f}s of start-up)")
    print(
        f"ETTR from the first step (what a run long enough to spread its start-up tends to): {steps * step_seconds / (wall - started):.3f}"
    )
    print("\nfault  group  to the survivors' next commit  scheduler to healed (s)  lost: to that commit, after it (s)")
    ends = [f["at"] for f in faults[1:]] + [begin + wall]
    for f, end in zip(faults, ends, strict=True):
        to_commit, after = lost(commits, step_seconds, f["at"], f["dropped"], end)
        times = f"{f['dropped'] - f['at']:29.1f}  {f['healed'] - f['restarted']:22.1f}  {to_commit:12.1f}  {after:8.1f}"
        print(f"{f['kind']:5s}  {f['group']:5d}  {times}")
    print(f"lost to the start-up: {started - step_seconds:.1f} s; what a fault costs after the survivors' next commit is the steps")
    print("taken with a group missing (larger shares) and the heal (the quorum that takes the group back in waits for it)")
    print(f"\nlogs: {work}")


if __name__ == "__main__":
    main()
