"""What safety costs: committed, verified checkpoints against a bare `save_state` + fsync, in one run.

    make bench                          # or: python benchmarks/checkpoint_cost.py [--repeats 9] [--hidden_size 768]

The state is a 110M-parameter Llama (tied embeddings) with AdamW moments after one step (1.31 GB).
Alternating, in the same process:

- save: `accelerator.save_state` followed by an fsync of every file (durable, as a bare loop would
  have to be), against `CheckpointManager.save` (the same save_state into a temporary folder, a
  xxh3-64 of every file computed while it is fsynced, manifest, atomic rename, pruning).
  Goal: ours >= 0.9x the bare throughput, end to end: that is the figure that counts. The
  save_state part of every save is timed too, and printed per arm and pooled, to diagnose the
  swings of the end-to-end ratio (save_state alone varies 0.6-1.8 s from call to call here).
- async: the training stall of `CheckpointManager.save(background=True)` (copy to CPU memory, RNG
  written, rank 0 writes from a thread) against the synchronous committed save. Goal: <= 0.1x.
- resume: `accelerator.load_state` against `CheckpointManager.resume("auto")` (sizes, then
  checksums of every file while loading), with both checkpoints read into the page cache first
  (warm: a resume right after a save) and with the page cache dropped (cold: a restart on another
  node, or long after the save; needs root). Goal: ours <= 1.2x the bare time.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from transformers import AutoConfig, AutoModelForCausalLM

from infra.checkpoint import CheckpointManager, RetentionConfig, RetentionPolicy
from infra.files import drop_cached, fsync_tree

DROP_CACHES = "/proc/sys/vm/drop_caches"


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
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--hidden_size", type=int, default=768)
    args = parser.parse_args()
    if args.hidden_size <= 0 or args.hidden_size % 12:
        parser.error(f"--hidden_size={args.hidden_size}: must be a positive multiple of 12, the model's attention heads")
    accelerator = Accelerator()
    params = build(accelerator, args.hidden_size)
    scratch = Path(__file__).resolve().parents[1] / ".cache"
    scratch.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=scratch) as tmp:
        root = Path(tmp)
        manager = CheckpointManager(accelerator, root / "ours", {"benchmark": True}, RetentionPolicy(RetentionConfig(save_total_limit=1)))
        plain = root / "plain"

        save_state, save_state_times = accelerator.save_state, []

        def timed_save_state(*a, **kw):
            start = time.perf_counter()
            save_state(*a, **kw)
            save_state_times.append(time.perf_counter() - start)

        accelerator.save_state = timed_save_state
        fsync_times, commit_times, state_plain, state_ours = [], [], [], []

        def plain_save():
            accelerator.save_state(str(plain))
            state_plain.append(save_state_times[-1])
            fsync_times.append(timed(lambda: fsync_tree(plain)))

        def our_save(step: int):
            total = timed(lambda: manager.save(step, {}))
            state_ours.append(save_state_times[-1])
            commit_times.append(total - save_state_times[-1])

        def settle():
            """Each timed operation starts alike: no background pruning, no dirty pages or pending deletes, and neither
            arm's files in the page cache. The committed save drops its own pages after the commit; the bare arm's
            1.3 GB, left cached, made the next save_state (ours, when it came second) 3x slower on a 2-core VM
            (2.59 s against 0.85 s, medians of 5): new writes then need memory the VM has not touched yet."""
            manager.wait()
            os.sync()
            for folder in (plain, manager.root):
                for p in folder.rglob("*"):
                    if p.is_file():
                        drop_cached(p)

        def cache(folder: Path) -> None:
            """Read every file below `folder` into the page cache (a committed checkpoint leaves it: drop_cached)."""
            for p in folder.rglob("*"):
                if p.is_file():
                    with open(p, "rb") as f:
                        while f.read(1 << 24):
                            pass

        def measured(ops, cold: bool = False, warm: tuple[Path, ...] = ()):
            out = []
            for op in ops:
                settle()
                for folder in warm:  # both checkpoints in the page cache: a resume right after a save
                    cache(folder)
                if cold:  # nothing of the checkpoint in the page cache: a restart on another node, or long after the save
                    Path(DROP_CACHES).write_text("3\n")
                out.append(timed(op))
            return out

        can_drop = os.access(DROP_CACHES, os.W_OK)
        save_plain, save_ours, load_plain, load_ours, cold_plain, cold_ours = [], [], [], [], [], []
        for i in range(args.repeats):
            shutil.rmtree(plain, ignore_errors=True)
            order = 1 - 2 * (i % 2)  # alternate which goes first
            saves = [(save_plain, plain_save), (save_ours, lambda i=i: our_save(i + 1))][::order]
            for times, t in zip((t for t, _ in saves), measured(op for _, op in saves), strict=True):
                times.append(t)
            loads = [
                (load_plain, lambda: accelerator.load_state(str(plain))),
                (load_ours, lambda: manager.resume("auto", checksums=True)),
            ][::order]
            for times, t in zip((t for t, _ in loads), measured((op for _, op in loads), warm=(plain, manager.root)), strict=True):
                times.append(t)
            if can_drop:
                for times, t in zip((cold_plain, cold_ours)[::order], measured((op for _, op in loads), cold=True), strict=True):
                    times.append(t)
            print(
                f"repeat {i + 1}/{args.repeats}: save {save_plain[-1]:.2f}s bare, {save_ours[-1]:.2f}s committed; "
                f"load {load_plain[-1]:.2f}s bare, {load_ours[-1]:.2f}s verified",
                flush=True,
            )
        stall = []
        for i in range(args.repeats):
            settle()
            stall.append(timed(lambda i=i: manager.save(100 + i, {}, background=True)))
        manager.wait()
        size = sum(p.stat().st_size for p in plain.rglob("*") if p.is_file())
    sp, so, lp, lo, st = (statistics.median(x) for x in (save_plain, save_ours, load_plain, load_ours, stall))
    print(f"\n{params / 1e6:.0f}M parameters + AdamW state: {size / 1e9:.2f} GB per checkpoint (medians of {args.repeats})")
    print(f"save_state + fsync          : {sp:.2f}s  ({size / sp / 1e6:,.0f} MB/s)")
    print(f"committed, checksummed save : {so:.2f}s  ({size / so / 1e6:,.0f} MB/s)   throughput ratio {sp / so:.2f}  (goal >= 0.9)")
    print(f"background save, stall      : {st:.2f}s   stall / synchronous committed save {st / so:.2f}  (goal <= 0.1)")
    paired_save = sorted(p / o for p, o in zip(save_plain, save_ours, strict=True))
    print(f"                              paired throughput ratios, repeat by repeat: {paired_save[0]:.2f} to {paired_save[-1]:.2f}")
    shared, fs, cm = (statistics.median(x) for x in (state_plain + state_ours, fsync_times, commit_times))
    print(
        f"  with save_state pooled      : save_state {shared:.2f}s + fsync {fs:.2f}s bare, + commit {cm:.2f}s ours: "
        f"throughput ratio {(shared + fs) / (shared + cm):.2f}  (goal >= 0.9)"
    )
    bare_state, our_state = statistics.median(state_plain), statistics.median(state_ours)
    print(f"                                (save_state alone, medians: {bare_state:.2f}s bare, {our_state:.2f}s ours)")
    print(f"load_state                  : {lp:.2f}s")
    print(f"verified resume + load      : {lo:.2f}s   time ratio {lo / lp:.2f}  (goal <= 1.2)")
    paired_load = sorted(o / p for p, o in zip(load_plain, load_ours, strict=True))
    print(f"                              paired time ratios, repeat by repeat: {paired_load[0]:.2f} to {paired_load[-1]:.2f}")
    if can_drop:
        cp, co = statistics.median(cold_plain), statistics.median(cold_ours)
        paired_cold = sorted(o / p for p, o in zip(cold_plain, cold_ours, strict=True))
        print(f"  cold page cache: load_state {cp:.2f}s, verified resume {co:.2f}s   time ratio {co / cp:.2f}  (goal <= 1.2)")
        print(f"                              paired time ratios, repeat by repeat: {paired_cold[0]:.2f} to {paired_cold[-1]:.2f}")
    else:
        print(f"  (cold page cache not measured: {DROP_CACHES} is not writable; run as root to measure it)")


if __name__ == "__main__":
    main()
