"""Tokens that count: padding-free SFT against padded SFT, and document-aware attention against plain causal attention.

    make bench                          # or: python benchmarks/packing.py [--pairs 512] [--seq_len 256 512]

1. SFT: the same prompt/response pairs (docstring -> function of the standard library, the default SFT data),
   prepared one per sample (padded to seq_len) and packed (`--packing true`), trained for one pass each with the
   same freshly built Llama (the default pretraining sizes), batch 8, in this process, in the precision `auto`
   picks here, the arms alternating, the best of two passes each. Rate: response tokens (the ones the loss
   counts) per second. Goal: packed >= 2x padded. At seq_len 256 (the default data) and 512.
2. Pretraining: the default data's samples, the same model, `document_attention` on and off, alternating batches.
   Ratio of step times. Goal: <= 1.15x.

Both arms of each comparison run here, one after the other, on the same batches of the same model.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "recipes"))


def model_and_optimizer(tokenizer, seq_len: int):
    from pretrain_clm import ModelArguments, build_model

    torch.manual_seed(0)
    model = build_model(ModelArguments(), tokenizer, seq_len)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def autocast():
    from infra.precision import resolve

    bf16 = resolve("auto").value == "bf16"
    return torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def train_pass(model, optimizer, batches, loss_fn) -> tuple[float, int]:
    """Seconds and response tokens over `batches` (the first two are a warm-up, neither timed nor counted)."""
    from infra.recipe import predicted_tokens

    seconds, tokens = 0.0, 0
    for i, batch in enumerate(batches):
        start = time.perf_counter()
        with autocast():
            loss = loss_fn(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i >= 2:
            seconds += time.perf_counter() - start
            tokens += int(predicted_tokens(batch["labels"] if isinstance(batch, dict) else batch))
    return seconds, tokens


def sft(pairs: int, seq_len: int, batch_size: int, rounds: int = 2) -> float:
    from sft_clm import sft_loss
    from transformers import AutoTokenizer

    from infra.data import PackedDataset
    from infra.data.tasks import TaskArguments, prepare_task

    tokenizer_dir = REPO / "data" / "stdlib" / "tokenizer"
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    rates: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        batches = {}
        for packing in rates:
            out = Path(tmp) / f"packing_{packing}"
            made = TaskArguments(task="sft", tokenizer=str(tokenizer_dir), output_dir=str(out), seq_len=seq_len, max_examples=pairs)
            made.packing = packing
            prepare_task(made)
            dataset = PackedDataset(out)
            batches[packing] = [
                {k: v.long() for k, v in dataset.__getitems__(list(range(i, min(i + batch_size, len(dataset))))).items()}
                for i in range(0, len(dataset), batch_size)
            ]
        for _, packing in itertools.product(range(rounds), rates):  # alternating: drifts of the machine hit both
            model, optimizer = model_and_optimizer(tokenizer, seq_len)
            seconds, tokens = train_pass(model, optimizer, batches[packing], lambda m, b: sft_loss(m, b).loss)
            rates[packing].append(tokens / seconds)
            arm = "packed" if packing else "padded"
            print(f"sft {arm}: {len(batches[packing])} batches, {tokens:,} response tokens, {tokens / seconds:,.0f}/s")
    ratio = max(rates[True]) / max(rates[False])
    print(f"sft response tokens/s at seq_len {seq_len}, packed / padded: {ratio:.2f}x (best of {rounds}; goal >= 2x; TRL measured 3.7x)")
    return ratio


def documents(steps: int, batch_size: int) -> float:
    from pretrain_clm import lm_loss
    from transformers import AutoTokenizer

    from infra.data import PackedDataset

    dataset = PackedDataset(REPO / "data" / "stdlib")
    tokenizer = AutoTokenizer.from_pretrained(dataset.tokenizer_dir)
    model, optimizer = model_and_optimizer(tokenizer, dataset.seq_len)
    times = {None: [], tokenizer.eos_token_id: []}
    for step in range(steps):
        batch = dataset.__getitems__(list(range(step * batch_size, (step + 1) * batch_size))).long()
        for eos in itertools.islice(itertools.cycle(times), step % 2, step % 2 + 2):  # alternate which arm goes first
            start = time.perf_counter()
            with autocast():
                loss = lm_loss(model, batch, eos_token_id=eos).loss
            loss.backward()
            optimizer.zero_grad(set_to_none=True)  # no step: both arms see the same weights
            if step >= 2:
                times[eos].append(time.perf_counter() - start)
    plain, aware = (statistics.median(t) for t in times.values())
    ratio = aware / plain
    print(f"pretraining step (forward + backward), document_attention / plain: {ratio:.2f}x ({aware:.3f} vs {plain:.3f} s; goal <= 1.15x)")
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=512)
    parser.add_argument("--seq_len", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(2)
    for seq_len in args.seq_len:  # 256: the default SFT data; longer samples leave more to padding
        sft(args.pairs, seq_len, args.batch_size)
    documents(args.steps, args.batch_size)


if __name__ == "__main__":
    main()
