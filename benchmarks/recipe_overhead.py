"""Tokens/s of recipes/pretrain_clm.py with all infra on, against a bare Accelerate loop.

    make bench                      # or: python benchmarks/recipe_overhead.py --steps 120 --repeats 3

Both train the same model (the default tiny Llama) on the same prepared data with the same batch,
bf16 autocast, one process each, in fresh processes, alternating bare and recipe so that drifts of
the machine hit both alike. Each measures tokens/s over windows of 10 optimizer steps; the first
window (start-up) is left out. A run's rate is the upper quartile of its windows: noise on a shared
machine only ever slows a window down, while overhead the recipe adds (logging, checkpoints, the
progress bar) is in every window it happens in. The ratio is taken per pair of neighbouring runs and
its median printed (goal: recipe / bare >= 0.99), next to the ratio of the plain window medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "recipes" / "configs" / "pretrain_clm.yaml"
WINDOW = 10


def upper_quartile(values: list[float]) -> float:
    return statistics.quantiles(values, n=4)[2]


def bare_loop(data_dir: str, steps: int, batch_size: int) -> list[float]:
    """The reference: the shortest correct Accelerate loop over the same model and data."""
    import torch
    import yaml
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from transformers import AutoTokenizer

    sys.path.insert(0, str(REPO / "recipes"))
    from pretrain_clm import ModelArguments, build_model

    from infra.data import PackedDataset
    from infra.precision import resolve

    cfg = yaml.safe_load(CONFIG.read_text())
    accelerator = Accelerator(mixed_precision=resolve("auto").value)  # what the recipe's default picks on this machine
    set_seed(cfg["seed"])
    dataset = PackedDataset(data_dir)
    model_args = ModelArguments(**{k: cfg[k] for k in ModelArguments.__dataclass_fields__ if k in cfg})
    model = build_model(model_args, AutoTokenizer.from_pretrained(dataset.tokenizer_dir), dataset.seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=float(cfg["learning_rate"]), fused=True)  # as the recipe (infra.optim)
    # PackedDataset.__getitems__ hands the DataLoader a finished batch tensor: nothing to collate
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=True, collate_fn=lambda batch: batch)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    rates, batches = [], iter(loader)
    start = time.perf_counter()
    for step in range(1, steps + 1):
        batch = next(batches)
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % WINDOW == 0:
            loss.item()
            now = time.perf_counter()
            rates.append(WINDOW * batch.numel() / (now - start))
            start = now
    return rates


def recipe(data_dir: str, steps: int, batch_size: int, work: Path) -> list[float]:
    """The recipe as users run it (checkpoints, MLflow, progress bar), its logged tokens/s windows."""
    import mlflow

    uri = f"sqlite:///{work / 'mlflow.db'}"
    subprocess.run(
        [
            sys.executable,
            str(REPO / "recipes" / "pretrain_clm.py"),
            "--config",
            str(CONFIG),
            "--data_dir",
            data_dir,
            "--output_dir",
            str(work / "out"),
            "--max_steps",
            str(steps),
            "--logging_steps",
            str(WINDOW),
            "--per_device_train_batch_size",
            str(batch_size),
            "--resume_from_checkpoint",
            "none",
        ],
        check=True,
        env={**os.environ, "MLFLOW_TRACKING_URI": uri},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = mlflow.MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("pretrain_clm").experiment_id])
    return [m.value for m in sorted(client.get_metric_history(run.info.run_id, "perf/tokens_per_second"), key=lambda m: m.step)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data_dir", default=str(REPO / "data" / "stdlib"))
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bare", action="store_true", help=argparse.SUPPRESS)  # internal: one bare run
    args = parser.parse_args()
    if args.bare:
        print(" ".join(map(str, bare_loop(args.data_dir, args.steps, args.batch_size))))
        return

    bare, full, bare_median, full_median = [], [], [], []
    for i in range(args.repeats):
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--bare",
                "--data_dir",
                args.data_dir,
                "--steps",
                str(args.steps),
                "--batch_size",
                str(args.batch_size),
            ],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.split()
        windows = [float(x) for x in out[1:]]
        bare.append(upper_quartile(windows))
        bare_median.append(statistics.median(windows))
        with tempfile.TemporaryDirectory() as work:
            windows = recipe(args.data_dir, args.steps, args.batch_size, Path(work))[1:]
        full.append(upper_quartile(windows))
        full_median.append(statistics.median(windows))
        print(f"repeat {i + 1}/{args.repeats}: bare {bare[-1]:,.0f} tokens/s, recipe {full[-1]:,.0f} tokens/s", flush=True)
    ratios = [f / b for f, b in zip(full, bare, strict=True)]
    median_ratio = statistics.median(full_median) / statistics.median(bare_median)
    print(f"\nbare Accelerate loop : {statistics.median(bare):,.0f} tokens/s (upper quartile of windows, median of {args.repeats} runs)")
    print(f"pretrain_clm.py      : {statistics.median(full):,.0f} tokens/s")
    print(f"ratio recipe / bare  : {statistics.median(ratios):.3f}  (paired runs {min(ratios):.3f}-{max(ratios):.3f}; goal >= 0.99)")
    print(f"ratio of medians     : {median_ratio:.3f}  (window medians, more exposed to machine noise)")


if __name__ == "__main__":
    main()
