"""Compare the runs of an experiment without a browser: a table on stdout and a PNG of the loss curves.

make compare                                    # experiment pretrain_clm, store as `make ui` serves it
python -m infra.compare --experiment pretrain_clm --metric train/loss --output runs/compare.png
"""

from __future__ import annotations

import sys
from pathlib import Path

from infra.errors import ToolParser
from infra.tracking import tracking_uri

COLUMNS = ("run", "status", "learning_rate", "samples/step", "steps", "final loss", "eval loss", "throughput", "ETTR", "run id")


def _param(run, name: str) -> str:
    return next((v for k, v in run.data.params.items() if k.endswith("." + name)), "-")


def _samples_per_step(run) -> str:
    """The step's global batch, as the run said it ("64 samples per step"): global_batch_size, else every process's
    micro-batches of a step."""
    fixed = _param(run, "global_batch_size")
    if fixed not in ("-", "0"):
        return fixed
    try:
        world = int(run.data.tags.get("world_size", "1"))
        return str(int(_param(run, "per_device_train_batch_size")) * int(_param(run, "gradient_accumulation_steps")) * world)
    except ValueError:  # a run logged without them
        return "-"


def rows(client, runs, metric: str) -> list[tuple[str, ...]]:
    out = []
    for run in runs:
        last = run.data.metrics
        loss = last.get(metric)
        unit, rate = next(((k[5:-11], v) for k, v in last.items() if k.startswith("perf/") and k.endswith("_per_second")), ("", None))
        batch = _samples_per_step(run)
        out.append(
            (
                run.info.run_name or "-",
                run.info.status,
                _param(run, "learning_rate"),
                batch,
                _param(run, "max_steps"),
                f"{loss:.4f}" if loss is not None else "-",
                f"{last['eval/loss']:.4f}" if "eval/loss" in last else "-",
                f"{rate:,.0f} {unit}/s" if rate is not None else "-",
                f"{last['goodput/ettr']:.2f}" if "goodput/ettr" in last else "-",
                run.info.run_id[:8],
            )
        )
    return out


def table(lines: list[tuple[str, ...]]) -> str:
    """Each column as wide as its widest cell: nothing is cut."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(COLUMNS, *lines, strict=True)]
    header, *body = (
        "  ".join(str(cell).ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip() for line in [COLUMNS, *lines]
    )
    return "\n".join([header, "-" * len(header), *body])


def plot(client, runs, metric: str, output: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    for run in runs:
        history = sorted(client.get_metric_history(run.info.run_id, metric), key=lambda m: m.step)
        ax.plot([m.step for m in history], [m.value for m in history], label=run.info.run_name or run.info.run_id[:8])
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(output.name + ".tmp.png")
    fig.savefig(tmp, bbox_inches="tight")
    plt.close(fig)
    tmp.replace(output)


def main(argv: list[str] | None = None) -> None:
    parser = ToolParser(prog="python -m infra.compare", description=__doc__.splitlines()[0])
    parser.add_argument("--experiment", default="pretrain_clm", help="MLflow experiment name")
    parser.add_argument("--metric", default="train/loss", help="metric for the last column and the plot")
    parser.add_argument("--output", default="runs/compare.png", help="where the PNG goes")
    args = parser.parse_args(argv)

    import mlflow

    client = mlflow.MlflowClient(tracking_uri())
    experiment = client.get_experiment_by_name(args.experiment)
    if experiment is None:
        names = sorted(e.name for e in client.search_experiments())
        print(f"compare error: experiment={args.experiment!r} is not in {tracking_uri()}; it has {names}", file=sys.stderr)
        raise SystemExit(2)
    runs = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"])
    print(f"{len(runs)} runs of experiment {args.experiment!r} in {tracking_uri()}\n")
    print(table(rows(client, runs, args.metric)))
    if runs:
        plot(client, runs, args.metric, Path(args.output))
        print(f"\n{args.metric} curves: {args.output}")


if __name__ == "__main__":
    main()
