"""What safety costs: committed, verified checkpoints against a bare `save_state` + fsync, in one run.

    make bench                          # or: python benchmarks/checkpoint_cost.py [--repeats 3] [--hidden_size 768]

The state is a 110M-parameter Llama (tied embeddings) with AdamW moments after one step, as in
BASELINES.md (1.31 GB). Alternating, in the same process:

- save: `accelerator.save_state` followed by an fsync of every file (durable, as a bare loop would
  have to be), against `CheckpointManager.save` (the same save_state into a temporary folder, a
  CRC-32 of every file computed while it is fsynced, manifest, atomic rename, pruning).
  Goal: ours >= 0.9x the bare throughput.
- async: the training stall of `CheckpointManager.save(background=True)` (copy to CPU memory, RNG
  written, rank 0 writes from a thread) against the synchronous committed save. Goal: <= 0.1x.
- resume: `accelerator.load_state` against `CheckpointManager.resume("auto")` (sizes, then
  checksums of every file while loading). Goal: ours <= 1.2x the bare time.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from transformers import AutoConfig, AutoModelForCausalLM

from infra.checkpoint import CheckpointManager
from infra.files import fsync_tree


def build(accelerator: Accelerator, hidden_size: int):
    config = AutoConfig.for_model(
        "llama",
        vocab_size=32000,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 8 // 3,
        num_hidden_layers=12,
        num_attention_heads=12,
        tie_word_embeddings=True,
    )
    model = AutoModelForCausalLM.from_config(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    ids = torch.randint(0, 32000, (1, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    return sum(p.numel() for p in model.parameters())


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden_size", type=int, default=768)
    args = parser.parse_args()
    accelerator = Accelerator()
    params = build(accelerator, args.hidden_size)
    scratch = Path(__file__).resolve().parents[1] / ".cache"
    scratch.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=scratch) as tmp:
        root = Path(tmp)
        manager = CheckpointManager(accelerator, root / "ours", {"benchmark": True}, save_total_limit=1)
        plain = root / "plain"

        def plain_save():
            accelerator.save_state(str(plain))
            fsync_tree(plain)

        save_plain, save_ours, load_plain, load_ours = [], [], [], []
        for i in range(args.repeats):
            shutil.rmtree(plain, ignore_errors=True)
            manager.wait()
            if i % 2:  # alternate which goes first: the second save meets the first one's writeback
                save_ours.append(timed(lambda i=i: manager.save(i + 1, {})))
                save_plain.append(timed(plain_save))
            else:
                save_plain.append(timed(plain_save))
                save_ours.append(timed(lambda i=i: manager.save(i + 1, {})))
            manager.wait()
            load_plain.append(timed(lambda: accelerator.load_state(str(plain))))
            load_ours.append(timed(lambda: manager.resume("auto", checksums=True)))
            print(
                f"repeat {i + 1}/{args.repeats}: save {save_plain[-1]:.2f}s bare, {save_ours[-1]:.2f}s committed; "
                f"load {load_plain[-1]:.2f}s bare, {load_ours[-1]:.2f}s verified",
                flush=True,
            )
        stall = []
        for i in range(args.repeats):
            stall.append(timed(lambda i=i: manager.save(100 + i, {}, background=True)))
            manager.wait()
        size = sum(p.stat().st_size for p in plain.rglob("*") if p.is_file())
    sp, so, lp, lo, st = (statistics.median(x) for x in (save_plain, save_ours, load_plain, load_ours, stall))
    print(f"\n{params / 1e6:.0f}M parameters + AdamW state: {size / 1e9:.2f} GB per checkpoint (medians of {args.repeats})")
    print(f"save_state + fsync          : {sp:.2f}s  ({size / sp / 1e6:,.0f} MB/s)")
    print(f"committed, checksummed save : {so:.2f}s  ({size / so / 1e6:,.0f} MB/s)   throughput ratio {sp / so:.2f}  (goal >= 0.9)")
    print(f"background save, stall      : {st:.2f}s   stall / synchronous committed save {st / so:.2f}  (goal <= 0.1)")
    print(f"load_state                  : {lp:.2f}s")
    print(f"verified resume + load      : {lo:.2f}s   time ratio {lo / lp:.2f}  (goal <= 1.2)")


if __name__ == "__main__":
    main()
