"""The per-step cost of fault tolerance across replica groups (fault_tolerance=replicas) against plain DDP at the same
world size and global batch, fault-free, and what it is made of.

    python benchmarks/replicas.py                       # 2 x 1 process, 120 steps, 3 pairs
    python benchmarks/replicas.py --groups 2 --steps 200 --repeats 3

Arm `ddp`: `accelerate launch --num_processes G` of the default pretraining. Arm `replicas`: the lighthouse and G
replica groups of one process each (python -m infra.replicas local). Same model, data, global batch (G x 8), fp32,
one thread per process, in fresh processes, alternating the arms. A run's step time is the median of its
`perf/step_time` windows (10 steps each) without the first; the ratio is taken per pair and its median printed, with
the replica groups' own split of a step: the quorum's wait, the gradient sum across groups, the commit.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "recipes" / "configs" / "pretrain_clm.yaml"


def metric(db: str, name: str) -> list[float]:
    """Every run's history of `name`, first window left out, all runs together."""
    import mlflow

    client = mlflow.MlflowClient(db)
    values = []
    for exp in client.search_experiments():
        for run in client.search_runs([exp.experiment_id]):
            history = sorted(client.get_metric_history(run.info.run_id, name), key=lambda m: m.step)
            values += [m.value for m in history[1:]]
    return values


def run(arm: str, groups: int, steps: int, tmp: Path) -> dict[str, float]:
    out, db = tmp / arm, f"sqlite:///{tmp / arm}.db"
    env = {**os.environ, "MLFLOW_TRACKING_URI": db, "OMP_NUM_THREADS": "1"}
    common = ["--config", str(CONFIG), "--max_steps", str(steps), "--eval_samples", "0", "--save_steps", str(10 * steps)]
    common += ["--mixed_precision", "no", "--preflight", "false", "--per_device_train_batch_size", "8", "--logging_steps", "10"]
    common += ["--global_batch_size", str(8 * groups), "--output_dir", str(out)]
    if arm == "ddp":
        cmd = [str(REPO / ".venv" / "bin" / "accelerate"), "launch", "--config_file", str(REPO / "accelerate_configs" / "cpu.yaml")]
        cmd += ["--num_processes", str(groups), str(REPO / "recipes" / "pretrain_clm.py"), *common]
    else:
        cmd = [sys.executable, "-m", "infra.replicas", "local", "--groups", str(groups), "--port", "29517", "--", *common]
    subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True)
    parts = {"step_time": statistics.median(metric(db, "perf/step_time"))}
    if arm == "replicas":
        for name in ("ft/quorum_seconds", "ft/gradient_sum_seconds", "ft/commit_seconds"):
            parts[name] = statistics.median(metric(db, name))
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    ratios, parts = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            ddp = run("ddp", args.groups, args.steps, Path(tmp) / f"{i}")
            ft = run("replicas", args.groups, args.steps, Path(tmp) / f"{i}")
            ratios.append(ft["step_time"] / ddp["step_time"])
            parts.append(ft)
            print(f"pair {i}: ddp {ddp['step_time'] * 1000:.1f} ms/step, replica groups {ft['step_time'] * 1000:.1f} ms/step")
    from infra.precision import cpu_description

    med = {k: statistics.median(p[k] for p in parts) for k in parts[0]}
    print(f"CPU: {cpu_description()}")
    print(f"{args.groups} replica groups x 1 process against DDP over {args.groups} processes, global batch {8 * args.groups}:")
    print(f"  step time ratio {statistics.median(ratios):.3f} (median of {args.repeats} pairs; goal <= 1.10)")
    print(
        "  a replica group's step: "
        f"quorum {med['ft/quorum_seconds'] * 1000:.1f} ms, gradient sum {med['ft/gradient_sum_seconds'] * 1000:.1f} ms, "
        f"commit {med['ft/commit_seconds'] * 1000:.1f} ms of {med['step_time'] * 1000:.1f} ms"
    )


if __name__ == "__main__":
    main()
