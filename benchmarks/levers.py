"""The levers at a realistic size for a CPU: the recipe against transformers' Trainer, compiled against eager, and the
peak memory with activation checkpointing against without (and against the memory estimate).

    python benchmarks/levers.py                 # in make bench; about 5 minutes on 2 cores
    python benchmarks/levers.py --steps 40 --levers none compile

The model: a Llama of 6 layers, hidden 512, intermediate 1376, 8 heads, on the default data (256-token
samples), batch 8, one process, the precision mixed_precision=auto picks on this machine, the same
learning rate and warmup. For each set of levers (none, activation checkpointing, torch.compile) both
run in fresh processes: pretrain_clm.py as users run it (checkpoint at the end, MLflow, progress bar)
and transformers' Trainer on the same samples (gradient_checkpointing=True; torch_compile=True, which
compiles the whole model where the recipe compiles each layer). Steady state: the seconds per step of
windows of 5 steps, the first window (start-up, compilation) left out, the median taken. Each arm runs
`--repeats` times, alternating which goes first; the median of the pairs' ratios is printed with their
range (on a shared VM one run's pace can swing 2x). Ratios > 1: the recipe is faster.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL = {"hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 6, "num_attention_heads": 8}
WINDOW = 5
LEVERS = {"none": [], "checkpointing": ["--gradient_checkpointing", "true"], "compile": ["--torch_compile", "true"]}


def recipe_seconds(data_dir: str, steps: int, levers: list[str], work: Path) -> list[float]:
    """Seconds per step of each logged window of pretrain_clm.py."""
    import mlflow

    uri = f"sqlite:///{work / 'mlflow.db'}"
    cmd = [sys.executable, str(REPO / "recipes" / "pretrain_clm.py"), "--config", str(REPO / "recipes" / "configs" / "pretrain_clm.yaml")]
    cmd += ["--data_dir", data_dir, "--output_dir", str(work / "out"), "--max_steps", str(steps), "--logging_steps", str(WINDOW)]
    cmd += ["--eval_samples", "0", "--per_device_train_batch_size", "8", "--resume_from_checkpoint", "none", *levers]
    cmd += [x for k, v in MODEL.items() for x in (f"--{k}", str(v))]
    subprocess.run(cmd, check=True, env={**os.environ, "MLFLOW_TRACKING_URI": uri}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = mlflow.MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("pretrain_clm").experiment_id])
    return [m.value for m in sorted(client.get_metric_history(run.info.run_id, "perf/step_time"), key=lambda m: m.step)]


def trainer_seconds(data_dir: str, steps: int, lever: str, work: Path) -> list[float]:
    """Seconds per step of windows of transformers' Trainer on the same model, samples, batch and precision (in this process)."""
    import torch
    import transformers
    import yaml
    from transformers import AutoTokenizer, TrainerCallback

    sys.path.insert(0, str(REPO / "recipes"))
    from pretrain_clm import ModelArguments, build_model

    from infra.data import PackedDataset
    from infra.precision import resolve

    cfg = yaml.safe_load((REPO / "recipes" / "configs" / "pretrain_clm.yaml").read_text())
    dataset = PackedDataset(data_dir)
    model = build_model(ModelArguments(**MODEL), AutoTokenizer.from_pretrained(dataset.tokenizer_dir), dataset.seq_len)

    class Samples(torch.utils.data.Dataset):
        def __len__(self):
            return len(dataset)

        def __getitem__(self, i):
            ids = torch.as_tensor(dataset[i])
            return {"input_ids": ids, "labels": ids}

    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter())

    bf16 = resolve("auto").value == "bf16"
    args = transformers.TrainingArguments(
        output_dir=str(work / "trainer"),
        max_steps=steps,
        per_device_train_batch_size=8,
        learning_rate=float(cfg["learning_rate"]),
        warmup_steps=int(cfg["warmup_steps"]),
        lr_scheduler_type="cosine",
        weight_decay=float(cfg["weight_decay"]),
        max_grad_norm=1.0,
        bf16=bf16,
        use_cpu=True,
        logging_steps=WINDOW,
        save_strategy="no",
        report_to=[],
        seed=int(cfg["seed"]),
        dataloader_num_workers=0,
        gradient_checkpointing=lever == "checkpointing",
        gradient_checkpointing_kwargs={"use_reentrant": False},
        torch_compile=lever == "compile",
        disable_tqdm=True,
    )
    transformers.Trainer(model=model, args=args, train_dataset=Samples(), callbacks=[Clock()]).train()
    return [(times[i + WINDOW - 1] - times[i - 1]) / WINDOW for i in range(WINDOW, len(times) - WINDOW + 1, WINDOW)]


def steady(seconds: list[float]) -> float:
    """The median seconds per step, the first window left out."""
    return statistics.median(seconds[1:])


def peak_memory(checkpointing: bool) -> dict[str, float]:
    """The measured peak of two training steps at this size (fp32) and the estimate (tests/memory_step.py)."""
    sys.path.insert(0, str(REPO))
    from tests.test_memory import measured_step

    size = [str(MODEL[k]) for k in ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads")]
    return measured_step(*size, "8", "256", "on" if checkpointing else "off", "fp32")


def run_arm(arm: str, lever: str, args, work: Path) -> list[float]:
    if arm == "recipe":
        return recipe_seconds(args.data_dir, args.steps, LEVERS[lever], work)
    cmd = [sys.executable, __file__, "--trainer", lever, "--data_dir", args.data_dir, "--steps", str(args.steps), "--work", str(work)]
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=REPO).stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data_dir", default=str(REPO / "data" / "stdlib"))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--levers", nargs="+", default=list(LEVERS), choices=list(LEVERS))
    parser.add_argument("--repeats", type=int, default=3, help="runs of each arm, alternating; the median of the pairs' ratios")
    parser.add_argument("--trainer", choices=list(LEVERS), help=argparse.SUPPRESS)  # internal: one Trainer run
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trainer:
        print(json.dumps(trainer_seconds(args.data_dir, args.steps, args.trainer, Path(args.work))))
        return
    import torch

    print(f"CPU: torch capability {torch.backends.cpu.get_cpu_capability()}; one process; {MODEL}, batch 8 x 256 tokens")
    recipe: dict[str, list[float]] = {lever: [] for lever in args.levers}
    trainer: dict[str, list[float]] = {lever: [] for lever in args.levers}
    for repeat in range(args.repeats):  # alternating which goes first, so that drifts of the machine hit both alike
        for lever in args.levers:
            arms = [("recipe", recipe), ("trainer", trainer)]
            for arm, into in arms if repeat % 2 == 0 else arms[::-1]:
                with tempfile.TemporaryDirectory() as work:
                    into[lever].append(steady(run_arm(arm, lever, args, Path(work))))
    for lever in args.levers:
        pairs = [t / r for r, t in zip(recipe[lever], trainer[lever], strict=True)]
        seconds = f"recipe {statistics.median(recipe[lever]):.3f} s/step, Trainer {statistics.median(trainer[lever]):.3f} s/step"
        print(f"{lever:<14} {seconds}: {statistics.median(pairs):.2f}x (pairs {min(pairs):.2f}-{max(pairs):.2f}; goal >= 1.0)")
    if "compile" in recipe and "none" in recipe:
        pairs = [e / c for e, c in zip(recipe["none"], recipe["compile"], strict=True)]
        spread = f"pairs {min(pairs):.2f}-{max(pairs):.2f}"
        print(f"compiled / eager, recipe: {statistics.median(pairs):.2f}x tokens/s ({spread}; goal >= 1.1 on CPU)")
    off, on = peak_memory(False), peak_memory(True)
    mib = f"{on['measured'] / 2**20:.0f} / {off['measured'] / 2**20:.0f} MiB"
    print(f"peak memory, checkpointing on / off: {on['measured'] / off['measured']:.2f}x (goal <= 0.6; {mib})")
    for name, arm in (("off", off), ("on", on)):
        print(f"memory estimate / measured peak, checkpointing {name}: {arm['estimate'] / arm['measured']:.2f} (goal within 0.85-1.15)")


if __name__ == "__main__":
    main()
