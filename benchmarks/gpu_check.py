"""Every GPU launcher config x every recipe for a few bf16 steps: tokens/s, images/s, MFU, and the export loads.

    make gpu-check                                                    # when a GPU is lent; under 8 minutes
    python benchmarks/gpu_check.py --configs ddp.yaml zero3.yaml --steps 20
    python benchmarks/gpu_check.py --configs cpu.yaml --recipes image_classification   # the same path on CPU

Runs in order of importance (DDP for every recipe first, then pretraining on the other configs,
then the rest) and starts no run past `--budget_minutes`, so the table is printed in time. Each
run trains `--steps` steps, saves a checkpoint halfway and at the end, exports `final/`, which is
loaded back with `from_pretrained` (the export under ZeRO-3 and FSDP is the point). Figures come
from the runs' MLflow metrics (a scratch store): the last `perf/tokens_per_second` or
`perf/images_per_second`, and `perf/mfu` where the GPU's peak is known (infra.metrics).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
GPU_CONFIGS = ["ddp.yaml", "single_gpu.yaml", "zero2.yaml", "zero3.yaml", "zero3_offload.yaml", "fsdp.yaml"]
RECIPES = ["pretrain_clm", "sft_clm", "finetune_classification", "image_classification"]
DATA = {
    "pretrain_clm": ["python", "-m", "infra.data.prepare", "--output_dir", "data/stdlib", "--num_proc", "4"],
    "sft_clm": ["python", "-m", "infra.data.tasks", "--task", "sft", "--output_dir", "data/sft_stdlib"],
    "finetune_classification": [
        "python",
        "-m",
        "infra.data.tasks",
        "--task",
        "text_classification",
        "--output_dir",
        "data/cls_stdlib",
        "--seq_len",
        "128",
    ],
    "image_classification": ["python", "-m", "infra.data.tasks", "--task", "image_classification", "--output_dir", "data/digits"],
}
AUTO = {
    "pretrain_clm": "AutoModelForCausalLM",
    "sft_clm": "AutoModelForCausalLM",
    "finetune_classification": "AutoModelForSequenceClassification",
    "image_classification": "AutoModelForImageClassification",
}


def plan(configs: list[str], recipes: list[str]) -> list[tuple[str, str]]:
    """(config, recipe) in order of importance: the first config for every recipe, then pretraining everywhere, then the rest."""
    first = [(configs[0], r) for r in recipes]
    pretrain = [(c, "pretrain_clm") for c in configs[1:] if "pretrain_clm" in recipes]
    rest = [(c, r) for c in configs[1:] for r in recipes if r != "pretrain_clm"]
    return first + pretrain + rest


def processes(config: str) -> int:
    if config in ("single_gpu.yaml",):
        return 1
    try:
        import torch

        return max(1, torch.cuda.device_count()) if torch.cuda.is_available() else 2
    except ImportError:
        return 2


def run_one(config: str, recipe: str, steps: int, scratch: Path, pretrained: Path | None) -> dict:
    out = scratch / config.removesuffix(".yaml") / recipe
    args = [
        "--config",
        f"recipes/configs/{recipe}.yaml",
        "--output_dir",
        str(out),
        "--max_steps",
        str(steps),
        "--warmup_steps",
        "2",
        "--logging_steps",
        "5",
        "--eval_steps",
        str(steps),
        "--save_steps",
        str(steps // 2),
        "--resume_from_checkpoint",
        "none",
        "--experiment_name",
        "gpu_check",
        "--run_name",
        f"{config}:{recipe}",
    ]
    if recipe == "sft_clm" and pretrained is not None:
        args += ["--model_name_or_path", str(pretrained)]
    cmd = [str(BIN / "accelerate"), "launch", "--config_file", f"accelerate_configs/{config}", "--num_processes", str(processes(config))]
    cmd += [f"recipes/{recipe}.py", *args]
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{scratch / 'mlflow.db'}"}
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
        code, tail = proc.returncode, (proc.stdout + proc.stderr)[-2000:]
    except subprocess.TimeoutExpired:
        code, tail = "timeout", ""
    result = {
        "config": config,
        "recipe": recipe,
        "seconds": time.perf_counter() - start,
        "status": "ok" if code == 0 else f"FAILED ({code})",
    }
    if code != 0:
        result["tail"] = tail
        return result
    try:
        import transformers

        getattr(transformers, AUTO[recipe]).from_pretrained(out / "final")
    except Exception as err:
        result["status"] = f"export does not load ({type(err).__name__}: {err})"
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{scratch / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("gpu_check")
    (run,) = client.search_runs([experiment.experiment_id], f"attributes.run_name = '{config}:{recipe}'", max_results=1)
    metrics = run.data.metrics
    unit = "images" if recipe == "image_classification" else "tokens"
    result["rate"] = f"{metrics.get(f'perf/{unit}_per_second', float('nan')):,.0f} {unit}/s"
    result["mfu"] = f"{metrics['perf/mfu']:.1%}" if "perf/mfu" in metrics else "-"
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=GPU_CONFIGS)
    parser.add_argument("--recipes", nargs="+", default=RECIPES, choices=RECIPES)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--budget_minutes", type=float, default=7.0, help="start no run after this")
    parser.add_argument("--keep", action="store_true", help="keep the runs' folder (printed)")
    args = parser.parse_args()
    began = time.perf_counter()
    for recipe in args.recipes:  # the default data of each recipe, prepared once (kept in data/)
        index = Path(REPO / DATA[recipe][DATA[recipe].index("--output_dir") + 1] / "index.json")
        if not index.is_file():
            print(f"preparing {recipe}'s data ...", flush=True)
            subprocess.run([sys.executable, *DATA[recipe][1:]], cwd=REPO, check=True)
    scratch = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    results, pretrained = [], None
    for config, recipe in plan(args.configs, args.recipes):
        if time.perf_counter() - began > args.budget_minutes * 60:
            results.append({"config": config, "recipe": recipe, "status": "not run (time budget)"})
            continue
        if recipe == "sft_clm" and pretrained is None:
            pretrained = scratch / args.configs[0].removesuffix(".yaml") / "pretrain_clm" / "final"
            if not pretrained.is_dir():
                pretrained = REPO / "runs" / "pretrain_tiny" / "final"
        result = run_one(config, recipe, args.steps, scratch, pretrained)
        results.append(result)
        print(f"{config:<20} {recipe:<26} {result['status']:<12} {result.get('rate', ''):>22} {result.get('mfu', ''):>7}", flush=True)
        if "tail" in result:
            print(result["tail"], flush=True)
    print(f"\n{'config':<20} {'recipe':<26} {'status':<24} {'throughput':>22} {'MFU':>7} {'seconds':>8}")
    for r in results:
        seconds = f"{r['seconds']:.0f}" if "seconds" in r else ""
        print(f"{r['config']:<20} {r['recipe']:<26} {r['status']:<24} {r.get('rate', ''):>22} {r.get('mfu', ''):>7} {seconds:>8}")
    print(f"\n{time.perf_counter() - began:.0f} s in all")
    if args.keep:
        print(f"runs kept in {scratch}")
    else:
        shutil.rmtree(scratch, ignore_errors=True)
    if any(not r["status"].startswith(("ok", "not run")) for r in results):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
