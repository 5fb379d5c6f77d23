"""What the silent-data-corruption checks cost (infra.sdc, infra.replay), what a repair and a replay cost, as ratios
measured in the run.

    make bench                      # or: python benchmarks/sdc.py --steps 120

The default pretraining (recipes/configs/pretrain_clm.yaml), two DDP processes on this machine (accelerate launch with
accelerate_configs/cpu.yaml), in two runs:

- `checks`: a check every 10 steps (to have several); the check's cost is its logged seconds (`sdc/check_seconds`, the
  digests and the all-gather) over the checks, against the median step time (`perf/step_time`): printed as a share of
  the step time at the default interval (a check every 50 steps; target <= 1%) and at every step.
- `repair`: one bit of rank 1's weights flipped after step 30, a checkpoint every 20 steps and a check every 20: caught
  at step 40, back to step 20, 20 steps trained again. Printed: the seconds counted as the repair's (`goodput/repair_
  seconds`: the steps undone) and the run's extra wall time over the `checks` run, in steps.
- `replay`: rank 1's loss multiplied by 1000 at step 30 (a spike): that step computed again from the state before it.
  Printed: its seconds (`sdc/replay_seconds`) in steps' time.
- what being ready to compute a step again costs at every step when nothing is suspicious (the random state copied,
  the spike flag worked out): timed here over 2,000 steps' calls, against the `checks` run's step;
- the digest of a process's copy of the summed gradients that DDP's processes compare at every step (the integer sum of
  their bits): timed here over 200 digests of the default model's gradients, against the `checks` run's step.
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
CONFIG = REPO / "recipes" / "configs" / "pretrain_clm.yaml"
DEFAULT_INTERVAL = 50  # sdc_check_steps' default


def launch(data_dir: str, work: Path, name: str, steps: int, *extra: str, faults: dict | None = None) -> tuple[dict, float]:
    """One run of two processes: its MLflow metrics' histories and its wall seconds."""
    import mlflow

    uri = f"sqlite:///{work / f'{name}.db'}"
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, **({"INFRA_TEST_FAULTS": json.dumps(faults)} if faults else {})}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "accelerate_configs" / "cpu.yaml")]
    cmd += [str(REPO / "recipes" / "pretrain_clm.py"), "--config", str(CONFIG), "--data_dir", data_dir]
    cmd += ["--output_dir", str(work / name), "--max_steps", str(steps), "--logging_steps", "10", *extra]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    wall = time.perf_counter() - start
    client = mlflow.MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("pretrain_clm").experiment_id])
    keys = ("perf/step_time", "sdc/check_seconds", "sdc/checks", "sdc/repairs", "goodput/repair_seconds", "sdc/replay_seconds")
    return {k: [m.value for m in sorted(client.get_metric_history(run.info.run_id, k), key=lambda m: m.step)] for k in keys}, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data_dir", default=str(REPO / "data" / "stdlib"))
    parser.add_argument("--steps", type=int, default=120)
    args = parser.parse_args()
    import torch

    print(f"CPU: {torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} cores; two processes, the default pretraining")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        checks, plain_wall = launch(args.data_dir, work, "checks", args.steps, "--sdc_check_steps", "10", "--save_steps", "20")
        step = statistics.median(checks["perf/step_time"][1:])  # the first window holds the start-up
        per_check = checks["sdc/check_seconds"][-1] / checks["sdc/checks"][-1]
        print(f"checks: {int(checks['sdc/checks'][-1])} checks, {per_check * 1000:.2f} ms each; a step {step * 1000:.1f} ms")
        print(f"  cost at the default interval ({DEFAULT_INTERVAL} steps): {per_check / (DEFAULT_INTERVAL * step):.3%} of step time")
        print(f"  cost at every step: {per_check / step:.2%} of step time")
        flip = {"rank": 1, "flip": {"steps": [30], "what": "weights"}}
        repair, wall = launch(args.data_dir, work, "repair", args.steps, "--sdc_check_steps", "20", "--save_steps", "20", faults=flip)
        redone = repair["goodput/repair_seconds"][-1] if repair["goodput/repair_seconds"] else 0.0
        print(
            f"repair: {int(repair['sdc/repairs'][-1])} repair, {redone:.1f}s of steps undone (goodput/repair_seconds); "
            f"{wall - plain_wall:+.1f}s of wall time over the run with checks alone ({(wall - plain_wall) / step:.0f} steps' time)"
        )
        spike = {"rank": 1, "scale_loss": {"steps": [30], "by": 1000}}
        replay, _ = launch(args.data_dir, work, "replay", args.steps, "--sdc_check_steps", "10", "--save_steps", "20", faults=spike)
        seconds = replay["sdc/replay_seconds"][-1] if replay["sdc/replay_seconds"] else 0.0
        print(f"replay: a step computed again took {seconds:.2f}s ({seconds / step:.1f} steps' time, sdc/replay_seconds)")
        ready = readiness()
        print(f"  ready at every step: {ready * 1e6:.0f} us a step ({ready / step:.4%} of step time)")
        digest = digest_seconds(args.data_dir)
        print(f"  the summed gradients' digest at every step (DDP): {digest * 1e6:.0f} us ({digest / step:.3%} of step time)")


def readiness(steps: int = 2000) -> float:
    """Seconds a step spends being ready for a replay when nothing is suspicious (infra.replay: the random state taken,
    the spike flag, the step's values kept), on this process's CPU."""
    from collections import Counter
    from types import SimpleNamespace

    import torch
    from accelerate.utils import DistributedType

    from infra.replay import Passes, Replays

    plain = SimpleNamespace(distributed_type=DistributedType.MULTI_CPU, scaler=None, num_processes=2)
    replays = Replays(plain, "auto", 10.0, "none", Counter())
    passes = Passes(torch.tensor(2.5), None, torch.tensor(1.5))
    start = time.perf_counter()
    for _ in range(steps):
        replays.before()
        replays.spike(passes.loss, passes.grad_norm)
        replays.kept(passes)
    return (time.perf_counter() - start) / steps


def digest_seconds(data_dir: str, repeats: int = 200) -> float:
    """Seconds of one digest of the default model's gradients (infra.replay.grad_bits), on this process's CPU."""
    import torch
    import yaml
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from infra.replay import grad_bits

    sizes = yaml.safe_load(CONFIG.read_text())
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    vocab = len(AutoTokenizer.from_pretrained(Path(data_dir) / "tokenizer"))
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", vocab_size=vocab, **{k: sizes[k] for k in keys}))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    start = time.perf_counter()
    for _ in range(repeats):
        grad_bits(model)
    return (time.perf_counter() - start) / repeats


if __name__ == "__main__":
    main()
