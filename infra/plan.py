"""Capacity and checkpoint-interval planning: what a job will cost before it runs, and after.

    python -m infra.plan --gpus 64 --per_gpu_batch 32 --step_seconds 1.2 \\
        --checkpoint_minutes 2 --interval_minutes 30 --mtbf_hours_per_node 2000
    python -m infra.plan --run_id <mlflow run id> --gpus 64 --mtbf_hours_per_node 2000   # measured step time and save cost
    python -m infra.plan ... --simulate --output runs/plan.png                           # Monte Carlo of checkpoint policies

The model: node failures are independent and exponential, so the job fails at rate
nodes / MTBF_node. Work is done in segments of `interval` minutes of training followed by a save of
`checkpoint_minutes`; a failure loses everything since the last committed save and costs
`restart_minutes` (reschedule, rendezvous, reload). The first-order cost of an interval T is
C/T (time spent saving) + (T/2 + R)/M (work redone and restarts), minimised by Young's
T* = sqrt(2 C M); Daly's higher-order optimum, exact for this model up to O(C/M), is printed beside it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from infra.config import ConfigError, parse_config, require


@dataclass
class PlanArguments:
    gpus: int = field(default=8, metadata={"help": "GPUs in the job."})
    gpus_per_node: int = field(default=8, metadata={"help": "GPUs per node (failures are counted per node)."})
    per_gpu_batch: int | None = field(
        default=None, metadata={"help": "Samples per GPU per optimizer step, micro-batch x accumulation (default: from --run_id, else 8)."}
    )
    step_seconds: float = field(default=0.0, metadata={"help": "Seconds per optimizer step (0: read from --run_id)."})
    checkpoint_minutes: float = field(
        default=0.0, metadata={"help": "Minutes one checkpoint save stalls training (0: read from --run_id)."}
    )
    interval_minutes: float = field(default=30.0, metadata={"help": "The checkpoint interval to evaluate (save_every_minutes)."})
    mtbf_hours_per_node: float = field(default=2000.0, metadata={"help": "Mean time between failures of one node, in hours."})
    restart_minutes: float = field(default=5.0, metadata={"help": "Minutes from a failure to training again: restart, rendezvous, reload."})
    run_hours: float = field(default=168.0, metadata={"help": "Hours of useful training the job needs (for totals and the simulation)."})
    run_id: str | None = field(
        default=None, metadata={"help": "A finished MLflow run: its measured step time, save cost and batch fill in."}
    )
    simulate: bool = field(
        default=False, metadata={"help": "Also run the Monte Carlo of checkpoint policies and plot goodput against interval."}
    )
    trials: int = field(default=200, metadata={"help": "Simulated runs per policy."})
    seed: int = field(default=0, metadata={"help": "Seed of the simulation."})
    output: str = field(default="runs/plan_goodput.png", metadata={"help": "Where --simulate writes its plot."})

    def __post_init__(self):
        for name in ("gpus", "gpus_per_node", "trials"):
            require(getattr(self, name) >= 1, name, getattr(self, name), "an integer >= 1")
        for name in ("step_seconds", "checkpoint_minutes", "restart_minutes"):
            require(getattr(self, name) >= 0, name, getattr(self, name), "a number >= 0")
        for name in ("interval_minutes", "mtbf_hours_per_node", "run_hours"):
            require(getattr(self, name) > 0, name, getattr(self, name), "a number > 0")


# ---------------------------------------------------------------------------------------------
# Closed forms (minutes throughout)


def young_interval(checkpoint: float, mtbf: float) -> float:
    """Young (1974): the interval minimising C/T + T/(2M)."""
    return math.sqrt(2 * checkpoint * mtbf)


def daly_interval(checkpoint: float, mtbf: float) -> float:
    """Daly (2006), higher-order optimum of the segment model below (valid for C < 2M)."""
    if checkpoint >= 2 * mtbf:
        return mtbf
    x = math.sqrt(checkpoint / (2 * mtbf))
    return math.sqrt(2 * checkpoint * mtbf) * (1 + x / 3 + x * x / 9) - checkpoint


def expected_try_minutes(length: float, restart: float, mtbf: float) -> float:
    """Expected wall time until a try of `length` minutes (a segment of work plus its save) outlives the next failure.

    It succeeds with probability exp(-L/M); each failed try costs the time to the failure (an
    exponential cut at L) plus the restart: E = (M + R)(exp(L/M) - 1).
    """
    return (mtbf + restart) * math.expm1(min(length / mtbf, 700))


def segments(work: float, interval: float | None, checkpoint: float) -> list[float]:
    """The tries' lengths: each interval of work plus its save (the last one shorter); no checkpoints: one try of it all."""
    if interval is None:
        return [work]
    full = int(work // interval)
    return [interval + checkpoint] * full + ([work - interval * full + checkpoint] if work > interval * full else [])


def expected_wall_minutes(work: float, interval: float | None, checkpoint: float, restart: float, mtbf: float) -> float:
    """Expected wall time of a run of `work` minutes of training, failures, restarts and saves included."""
    return sum(expected_try_minutes(length, restart, mtbf) for length in segments(work, interval, checkpoint))


def first_order_loss(interval: float, checkpoint: float, restart: float, mtbf: float) -> tuple[float, float]:
    """(fraction of time saving, fraction lost to failures) to first order: C/T, (T/2 + C + R)/M."""
    return checkpoint / interval, (interval / 2 + checkpoint + restart) / mtbf


# ---------------------------------------------------------------------------------------------
# Monte Carlo


def simulate(
    work: float, interval: float | None, checkpoint: float, restart: float, mtbf: float, trials: int, seed: int
) -> tuple[float, float]:
    """Simulate `trials` runs needing `work` minutes of training; returns (mean goodput, mean minutes lost per run).

    Each segment (interval of work + save; the whole run when `interval` is None) is tried until a
    try outlives the time to the next failure, drawn from Exp(mtbf); a failed try costs the time
    to the failure plus `restart`. The same seed gives every policy the same random stream.
    """
    rng = np.random.default_rng(seed)
    lengths = segments(work, interval, checkpoint)
    walls = np.zeros(trials)
    for length in lengths:
        p_fail = -math.expm1(-length / mtbf)
        if p_fail > 1 - 1e-9:  # practically never completes: the expectation, not a draw that would never end
            walls += expected_try_minutes(length, restart, mtbf)
            continue
        failures = rng.geometric(1 - p_fail, size=trials) - 1  # failed tries before the one that succeeds
        # time to failure given failure before `length`: inverse CDF of the cut exponential
        total = failures.sum()
        u = rng.random(total)
        lost = -mtbf * np.log1p(-u * p_fail)
        per_trial = np.bincount(np.repeat(np.arange(trials), failures), weights=lost, minlength=trials)
        walls += length + per_trial + failures * restart
    saving = 0.0 if interval is None else checkpoint * len(lengths)
    return float(work / np.mean(walls)), float(np.mean(walls - work - saving))


def best_simulated_interval(
    work: float, checkpoint: float, restart: float, mtbf: float, trials: int, seed: int, also: float | None = None
) -> tuple[float, np.ndarray, np.ndarray]:
    """Sweep intervals around Young's (and `also`), simulate each, and fit a parabola in log(T) to the goodput peak."""
    centre = young_interval(checkpoint, mtbf)
    lo, hi = min(centre, also or centre) / 3, max(centre, also or centre) * 3
    grid = np.geomspace(lo, hi, 41)
    goodput = np.array([simulate(work, t, checkpoint, restart, mtbf, trials, seed)[0] for t in grid])
    top = int(np.argmax(goodput))
    lo, hi = max(0, top - 4), min(len(grid), top + 5)
    a, b, _ = np.polyfit(np.log(grid[lo:hi]), goodput[lo:hi], 2)
    best = min(max(math.exp(-b / (2 * a)), grid[lo]), grid[hi - 1]) if a < 0 else float(grid[top])  # the vertex, within the fit
    return best, grid, goodput


# ---------------------------------------------------------------------------------------------
# The report


@dataclass
class Plan:
    global_batch: int
    samples_per_second: float
    nodes: int
    job_mtbf_minutes: float
    young_minutes: float
    daly_minutes: float
    worst_lost_minutes: float
    saving_fraction: float
    failure_fraction: float
    goodput: float
    young_goodput: float


def plan(a: PlanArguments) -> Plan:
    nodes = math.ceil(a.gpus / a.gpus_per_node)
    mtbf = a.mtbf_hours_per_node * 60 / nodes
    c, t, r, work = a.checkpoint_minutes, a.interval_minutes, a.restart_minutes, a.run_hours * 60
    saving, failing = first_order_loss(t, c, r, mtbf)
    young = young_interval(c, mtbf) if c > 0 else math.inf
    return Plan(
        global_batch=a.gpus * a.per_gpu_batch,
        samples_per_second=a.gpus * a.per_gpu_batch / a.step_seconds,
        nodes=nodes,
        job_mtbf_minutes=mtbf,
        young_minutes=young,
        daly_minutes=daly_interval(c, mtbf) if c > 0 else math.inf,
        worst_lost_minutes=t,
        saving_fraction=saving,
        failure_fraction=failing,
        goodput=work / expected_wall_minutes(work, t, c, r, mtbf),
        young_goodput=work / expected_wall_minutes(work, young if c > 0 else t, c, r, mtbf),
    )


def report(a: PlanArguments, p: Plan) -> str:
    hours = a.run_hours
    lines = [
        f"throughput      {p.samples_per_second:,.0f} samples/s: global batch {p.global_batch:,} = {a.gpus} GPUs x {a.per_gpu_batch}, "
        f"{a.step_seconds:g} s/step ({hours * 3600 / a.step_seconds:,.0f} steps in {hours:g} h of training)",
        f"failures        {p.nodes} nodes of {a.gpus_per_node} GPUs; a node fails every {a.mtbf_hours_per_node:g} h, "
        f"so the job every {p.job_mtbf_minutes / 60:.1f} h: ~{hours * 60 / p.job_mtbf_minutes:.1f} failures in {hours:g} h",
        f"per failure     at most {a.interval_minutes:g} min of work lost (expected {a.interval_minutes / 2:g}), "
        f"plus {a.restart_minutes:g} min to restart and reload",
        f"checkpoints     every {a.interval_minutes:g} min, {a.checkpoint_minutes:g} min each: "
        f"{100 * p.saving_fraction:.1f}% of the time saving, {100 * p.failure_fraction:.1f}% lost to failures; "
        f"goodput {100 * p.goodput:.1f}%",
    ]
    if a.checkpoint_minutes > 0:
        lines.append(
            f"best interval   Young sqrt(2 x {a.checkpoint_minutes:g} min x {p.job_mtbf_minutes / 60:.1f} h) = {p.young_minutes:.0f} min "
            f"(Daly {p.daly_minutes:.0f} min): goodput {100 * p.young_goodput:.1f}%; "
            f"save_every_minutes=auto with mtbf_hours={p.job_mtbf_minutes / 60:.3g} picks it from measured saves"
        )
    wall = hours / p.goodput
    lines.append(f"wall time       {wall:.1f} h for {hours:g} h of training at the chosen interval ({wall - hours:.1f} h lost)")
    return "\n".join(lines)


def simulation_report(a: PlanArguments, p: Plan) -> str:
    """Compare policies by simulated goodput and plot goodput against the interval."""
    work, c, r, m = a.run_hours * 60, a.checkpoint_minutes, a.restart_minutes, p.job_mtbf_minutes
    require(c > 0, "checkpoint_minutes", c, "a save cost > 0 to simulate checkpoint policies")
    policies = {
        f"fixed {a.interval_minutes:g} min": a.interval_minutes,
        f"Young/Daly {p.daly_minutes:.0f} min": p.daly_minutes,
        "none": None,
    }
    lines = [f"simulated {a.trials} runs of {a.run_hours:g} h of training per policy (seed {a.seed}):"]
    for name, interval in policies.items():
        goodput, lost = simulate(work, interval, c, r, m, a.trials, a.seed)
        lines.append(f"  {name:<22} goodput {100 * goodput:6.2f}%   {lost / 60:10.1f} h per run lost to failures")
    sweep_trials = min(20_000, max(a.trials, math.ceil(20_000 * m / work)))  # ~20,000 failures: the optimum is flat, noise is not
    best, grid, goodput = best_simulated_interval(work, c, r, m, sweep_trials, a.seed, also=a.interval_minutes)
    lines.append(f"  best simulated interval {best:.1f} min; Daly {p.daly_minutes:.1f} min, Young {p.young_minutes:.1f} min")

    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(grid, 100 * goodput, "o-", ms=3, label="simulated")
    ax.plot(grid, [100 * work / expected_wall_minutes(work, t, c, r, m) for t in grid], "--", label="expected (closed form)")
    ax.axvline(p.daly_minutes, color="g", lw=1, label=f"Young/Daly {p.daly_minutes:.0f} min")
    ax.axvline(a.interval_minutes, color="r", lw=1, label=f"configured {a.interval_minutes:g} min")
    ax.set(
        xscale="log",
        xlabel="checkpoint interval (minutes)",
        ylabel="goodput (%)",
        title=f"{a.gpus} GPUs, save {c:g} min, job MTBF {m / 60:.1f} h",
    )
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.legend()
    from pathlib import Path

    Path(a.output).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.output, dpi=120, bbox_inches="tight")
    lines.append(f"  plot: {a.output}")
    return "\n".join(lines)


def fill_from_run(a: PlanArguments) -> None:
    """Measured step time, save cost and batch per GPU from a finished MLflow run (values given on the command line win)."""
    import mlflow

    from infra.tracking import tracking_uri

    client = mlflow.MlflowClient(tracking_uri())
    try:
        run = client.get_run(a.run_id)
    except Exception as err:
        raise ConfigError(f"run_id={a.run_id!r} is not valid: no such run in {tracking_uri()} ({type(err).__name__})") from None

    def mean(key: str) -> float | None:
        history = [m.value for m in client.get_metric_history(a.run_id, key)]
        return sum(history[1:] or history) / len(history[1:] or history) if history else None  # the first window holds warm-up

    if not a.step_seconds and (step := mean("perf/step_time")):
        a.step_seconds = step
    if not a.checkpoint_minutes and (save := mean("checkpoint/save_seconds")):
        a.checkpoint_minutes = save / 60
    params = run.data.params
    if a.per_gpu_batch is None and "TrainingArguments.per_device_train_batch_size" in params:
        a.per_gpu_batch = int(params["TrainingArguments.per_device_train_batch_size"]) * int(
            params.get("TrainingArguments.gradient_accumulation_steps", 1)
        )


def main(argv: list[str] | None = None) -> None:
    (a,) = parse_config((PlanArguments,), argv)
    try:
        if a.run_id:
            fill_from_run(a)
        a.per_gpu_batch = a.per_gpu_batch or 8
        require(a.per_gpu_batch >= 1, "per_gpu_batch", a.per_gpu_batch, "an integer >= 1")
        require(a.step_seconds > 0, "step_seconds", a.step_seconds, "seconds per step > 0 (or a --run_id that logged perf/step_time)")
        p = plan(a)
        print(report(a, p))
        if a.simulate:
            print(simulation_report(a, p))
    except ConfigError as err:
        raise SystemExit(f"config error: {err}") from None


if __name__ == "__main__":
    main()
