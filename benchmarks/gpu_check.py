"""The presets with their levers, then every GPU launcher config x every recipe for a few bf16 steps: tokens/s,
images/s, MFU, and the export loads.

    make gpu-check                                                    # when a GPU is lent; under 8 minutes
    python benchmarks/gpu_check.py --configs ddp.yaml zero3.yaml --steps 20
    python benchmarks/gpu_check.py --configs cpu.yaml --recipes image_classification   # the same path on CPU

Runs in order of importance: the 125m and 1b presets (pretrain_clm_*.yaml) with torch.compile and
activation checkpointing on, on 2048-token samples, each printing MFU, its compile time and its peak
memory against the preflight's estimate; then DDP for every recipe, pretraining on the other configs,
then the rest. It and starts no run past `--budget_minutes`, so the table is printed in time. Each
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


PRESETS = {"125m": "ddp.yaml", "1b": "fsdp.yaml"}  # the launcher config each preset's comment names
PRESET_DATA = ["python", "-m", "infra.data.prepare", "--output_dir", "data/stdlib_2048", "--seq_len", "2048", "--num_proc", "4"]


def run_preset(name: str, steps: int, scratch: Path) -> dict:
    """A preset as configured, but for its accumulation (1) and its levers (compile and checkpointing on), on every GPU."""
    config, out = PRESETS[name], scratch / f"preset_{name}"
    args = ["--config", f"recipes/configs/pretrain_clm_{name}.yaml", "--data_dir", "data/stdlib_2048", "--output_dir", str(out)]
    args += ["--max_steps", str(steps), "--warmup_steps", "2", "--gradient_accumulation_steps", "1", "--logging_steps", "5"]
    args += ["--eval_samples", "0", "--torch_compile", "true", "--gradient_checkpointing", "true", "--save_steps", str(10 * steps)]
    args += ["--experiment_name", "gpu_check", "--run_name", f"preset:{name}", "--resume_from_checkpoint", "none"]
    result = launch_and_read(config, f"preset {name}", "pretrain_clm", args, scratch, f"preset:{name}")
    if "stdout" in result:
        estimate = [line for line in result.pop("stdout").splitlines() if line.strip().startswith("total ")]
        result["memory"] = f"peak {result.pop('peak', float('nan')):.1f} GiB, estimate {estimate[-1].split()[1] if estimate else '?'} GiB"
    return result


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
    args = ["--config", f"recipes/configs/{recipe}.yaml", "--output_dir", str(out), "--max_steps", str(steps), "--warmup_steps", "2"]
    args += ["--logging_steps", "5", "--eval_steps", str(steps), "--save_steps", str(steps // 2), "--resume_from_checkpoint", "none"]
    args += ["--experiment_name", "gpu_check", "--run_name", f"{config}:{recipe}"]
    if recipe == "sft_clm" and pretrained is not None:
        args += ["--model_name_or_path", str(pretrained)]
    result = launch_and_read(config, config, recipe, args, scratch, f"{config}:{recipe}")
    result.pop("stdout", None)
    return result


def launch_and_read(config: str, label: str, recipe: str, args: list[str], scratch: Path, run_name: str) -> dict:
    """Launch, load the export back, and read the run's figures from MLflow."""
    cmd = [str(BIN / "accelerate"), "launch", "--config_file", f"accelerate_configs/{config}", "--num_processes", str(processes(config))]
    cmd += [f"recipes/{recipe}.py", *args]
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{scratch / 'mlflow.db'}"}
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        code, stdout, tail = proc.returncode, proc.stdout, (proc.stdout + proc.stderr)[-2000:]
    except subprocess.TimeoutExpired:
        code, stdout, tail = "timeout", "", ""
    status = "ok" if code == 0 else f"FAILED ({code})"
    result = {"config": label, "recipe": recipe, "seconds": time.perf_counter() - start, "status": status}
    if code != 0:
        result["tail"] = tail
        return result
    try:
        import transformers

        getattr(transformers, AUTO[recipe]).from_pretrained(Path(args[args.index("--output_dir") + 1]) / "final")
    except Exception as err:
        result["status"] = f"export does not load ({type(err).__name__}: {err})"
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{scratch / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("gpu_check")
    (run,) = client.search_runs([experiment.experiment_id], f"attributes.run_name = '{run_name}'", max_results=1)
    metrics = run.data.metrics
    unit = "images" if recipe == "image_classification" else "tokens"
    result["rate"] = f"{metrics.get(f'perf/{unit}_per_second', float('nan')):,.0f} {unit}/s"
    result["mfu"] = f"{metrics['perf/mfu']:.1%}" if "perf/mfu" in metrics else "-"
    if "perf/compile_seconds" in metrics:
        result["compile"] = f"compile {metrics['perf/compile_seconds']:.0f} s"
    if "perf/max_memory_allocated_gib" in metrics:
        result["peak"] = metrics["perf/max_memory_allocated_gib"]
    result["stdout"] = stdout
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=GPU_CONFIGS)
    parser.add_argument("--recipes", nargs="+", default=RECIPES, choices=RECIPES)
    parser.add_argument("--presets", nargs="*", default=list(PRESETS), choices=list(PRESETS))
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
    if args.presets and not (REPO / "data" / "stdlib_2048" / "index.json").is_file():
        print("preparing the presets' 2048-token data ...", flush=True)
        subprocess.run([sys.executable, *PRESET_DATA[1:]], cwd=REPO, check=True)
    scratch = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    results, pretrained = [], None
    for name in args.presets:
        result = run_preset(name, args.steps, scratch)
        results.append(result)
        extra = f"{result.get('compile', '')}; {result.get('memory', '')}"
        row = f"{result['config']:<20} {'pretrain_clm':<26} {result['status']:<12} {result.get('rate', ''):>22}"
        print(f"{row} {result.get('mfu', ''):>7}  {extra}", flush=True)
        if "tail" in result:
            print(result["tail"], flush=True)
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
        extra = "; ".join(r[k] for k in ("compile", "memory") if k in r)
        print(f"{r['config']:<20} {r['recipe']:<26} {r['status']:<24} {r.get('rate', ''):>22} {r.get('mfu', ''):>7} {seconds:>8}  {extra}")
    print(f"\n{time.perf_counter() - began:.0f} s in all")
    if args.keep:
        print(f"runs kept in {scratch}")
    else:
        shutil.rmtree(scratch, ignore_errors=True)
    if any(not r["status"].startswith(("ok", "not run")) for r in results):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
