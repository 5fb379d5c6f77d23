"""bf16 against fp32 on this CPU: what `mixed_precision: auto` should pick here, measured as users run.

    python benchmarks/precision.py              # about 3 minutes on 2 cores
    python benchmarks/precision.py --steps 40 --pairs 3

The default pretraining (recipes/configs/pretrain_clm.yaml, its data prepared by `make data`) on 2 CPU processes for
`--steps` steps, whole processes timed (start-up included: what a user waits for), no checkpoint, no MLflow. Each pair
runs bf16 and fp32 in fresh launches, alternating which goes first; printed: each pair's ratio and their median
(> 1: bf16 takes longer), with the CPU and what `auto` picks on it: whether that is the faster choice here.

Measured on 2 cores of an AMD EPYC with AVX-512-BF16 and no AMX (torch capability AVX512): bf16 0.86x at 120 steps
(pairs 0.83-0.97), 0.95x at 40 steps (0.86-1.03): bf16 is the faster choice there, as `auto` picks. On an Intel Xeon
whose flags show AVX-512-BF16 and no AMX, 40 steps took 1.28x in bf16: the instruction set alone does not decide it.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from infra.precision import cpu_description, resolve  # noqa: E402


def seconds(precision: str, steps: int, work: Path) -> float:
    """Wall seconds of one launch of the default pretraining in `precision`."""
    command = [
        str(Path(sys.executable).parent / "accelerate"),
        "launch",
        "--config_file",
        str(REPO / "accelerate_configs" / "cpu.yaml"),
        str(REPO / "recipes" / "pretrain_clm.py"),
        *("--config", str(REPO / "recipes" / "configs" / "pretrain_clm.yaml")),
        *("--output_dir", str(work / precision), "--max_steps", str(steps), "--mixed_precision", precision),
        *("--report_to", "none", "--preflight", "false", "--save_steps", "0", "--eval_steps", "0", "--eval_samples", "0"),
        *("--resume_from_checkpoint", "none"),
    ]
    start = time.perf_counter()
    subprocess.run(command, cwd=REPO, check=True, capture_output=True, text=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--pairs", type=int, default=3)
    args = parser.parse_args()
    if not (REPO / "data" / "stdlib" / "index.json").is_file():
        raise SystemExit("run `make data` first: the default pretraining's data is missing")
    print(f"CPU: {cpu_description()}; {resolve('auto')}")
    ratios = []
    for pair in range(args.pairs):
        order = ("bf16", "no") if pair % 2 == 0 else ("no", "bf16")
        with tempfile.TemporaryDirectory() as tmp:
            took = {precision: seconds(precision, args.steps, Path(tmp)) for precision in order}
        ratios.append(took["bf16"] / took["no"])
        print(f"pair {pair + 1}: bf16 {took['bf16']:.1f} s, fp32 {took['no']:.1f} s: bf16 takes {ratios[-1]:.2f}x", flush=True)
    print(f"bf16 / fp32 wall time, {args.steps} steps of the default pretraining on 2 processes: median {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
