"""What moving checkpoints costs: uploads to object storage, and converting a ZeRO checkpoint for another world size.

    make bench                          # or: python benchmarks/checkpoint_remote.py [--repeats 3] [--hidden_size 768]

The state is the 110M-parameter Llama of checkpoint_cost.py, with AdamW moments after one step, saved by DeepSpeed
ZeRO-2 in bf16 by one process (the script launches itself under `accelerate launch` with zero2.yaml):

- upload: `RemoteCheckpoints.upload` of the committed checkpoint (every file, the manifest last) against the S3
  server's own put of the same folder (`fs.put(folder, recursive=True)`), to an S3-compatible server (moto) on
  127.0.0.1, alternating. Goal: ours >= 0.8x the bare throughput.
- conversion: `to_universal` (DeepSpeed's ds_to_universal, then sealed) against `load_state` of the same
  checkpoint: reported (the price of coming back on another world size, once).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def serve_s3() -> tuple[object, dict[str, str]]:
    import logging

    from tests.conftest import moto_s3

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request otherwise
    return moto_s3()


def upload(checkpoint: Path, repeats: int) -> None:
    import fsspec

    from infra.checkpoint.remote import RemoteCheckpoints

    server, env = serve_s3()
    os.environ.update(env)
    try:
        fs = fsspec.filesystem("s3", skip_instance_cache=True)
        fs.mkdir("bench")
        size = sum(p.stat().st_size for p in checkpoint.rglob("*") if p.is_file())
        ours, bare = [], []
        for i in range(repeats):
            start = time.perf_counter()
            fs.put(str(checkpoint), f"bench/bare{i}", recursive=True)
            bare.append(time.perf_counter() - start)
            fs.rm(f"bench/bare{i}", recursive=True)
            remote = RemoteCheckpoints(f"s3://bench/ours{i}")
            start = time.perf_counter()
            remote.upload(checkpoint)
            ours.append(time.perf_counter() - start)
            fs.rm(f"bench/ours{i}", recursive=True)
        ratio = statistics.median(b / o for b, o in zip(bare, ours, strict=True))
        print(f"\n1. upload of {size / 2**20:.0f} MiB to S3 (moto on 127.0.0.1), {repeats} pairs")
        print(f"   bare fs.put:          {statistics.median(bare):6.2f} s  ({size / 2**20 / statistics.median(bare):6.1f} MiB/s)")
        print(f"   RemoteCheckpoints:    {statistics.median(ours):6.2f} s  ({size / 2**20 / statistics.median(ours):6.1f} MiB/s)")
        print(f"   throughput ratio (ours / bare), median of pairs: {ratio:.2f}x (goal >= 0.8x)")
    finally:
        server.stop()


def zero_checkpoint(root: Path, hidden_size: int) -> None:
    """Run under `accelerate launch` (zero2.yaml, 1 process): the model after one step, saved by save_state."""
    import torch
    from accelerate import Accelerator

    from benchmarks.checkpoint_cost import build
    from infra.checkpoint.manager import CheckpointManager

    torch.manual_seed(0)
    accelerator = Accelerator(mixed_precision="bf16")
    plugin = accelerator.state.deepspeed_plugin
    plugin.deepspeed_config.update({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": 1})
    build(accelerator, hidden_size)
    CheckpointManager(accelerator, root, {}).save(1, {"distributed_type": "DEEPSPEED", "world_size": 1, "zero_stage": 2})
    start = time.perf_counter()
    accelerator.load_state(str(root / "checkpoints" / "step_00000001"))
    print(f"LOAD_SECONDS {time.perf_counter() - start:.3f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden_size", type=int, default=768)
    parser.add_argument("--_save_to", default=None, help=argparse.SUPPRESS)  # the launched half
    args = parser.parse_args()
    if args._save_to:
        return zero_checkpoint(Path(args._save_to), args.hidden_size)
    scratch = REPO / ".cache"
    scratch.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=scratch) as tmp:
        root = Path(tmp)
        print("saving the 110M model's ZeRO-2 checkpoint (accelerate launch, 1 process) ...", flush=True)
        command = [
            str(Path(sys.executable).parent / "accelerate"),
            "launch",
            "--config_file",
            str(REPO / "accelerate_configs" / "zero2.yaml"),
            "--num_processes",
            "1",
            __file__,
            "--_save_to",
            str(root),
            "--hidden_size",
            str(args.hidden_size),
        ]
        env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(scratch / "torch_extensions")}
        done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO)
        if done.returncode != 0:
            raise SystemExit(done.stdout[-3000:] + done.stderr[-3000:])
        load = float(next(line.split()[1] for line in done.stdout.splitlines() if line.startswith("LOAD_SECONDS")))
        checkpoint = root / "checkpoints" / "step_00000001"
        upload(checkpoint, args.repeats)

        from infra.checkpoint.reshard import to_universal, universal_path

        times = []
        for _ in range(args.repeats):
            shutil.rmtree(universal_path(checkpoint), ignore_errors=True)
            start = time.perf_counter()
            to_universal(checkpoint)
            times.append(time.perf_counter() - start)
        convert = statistics.median(times)
        print("\n2. ZeRO-2 checkpoint for another world size (DeepSpeed's ds_to_universal, sealed)")
        print(f"   load_state of it:      {load:6.2f} s")
        print(f"   conversion, once:      {convert:6.2f} s  ({convert / load:.1f}x the load)")


if __name__ == "__main__":
    main()
