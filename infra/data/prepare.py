"""Turn raw text into tokenized, packed, fixed-length samples on disk.

    python -m infra.data.prepare --output_dir data/stdlib                    # offline default
    python -m infra.data.prepare --source corpus/*.jsonl --tokenizer gpt2 --output_dir data/mine
    python -m infra.data.prepare --source wikitext --split train --max_bytes 100000000 --output_dir data/wiki

Documents are tokenized, joined with the EOS token and cut into samples of `seq_len` tokens
(the tail shorter than `seq_len` is dropped). Without `--tokenizer`, a byte-level BPE tokenizer
is trained on the same text first. The result is built in `OUTPUT_DIR.partial/` and renamed to
`OUTPUT_DIR` when complete, so an interrupted prepare never leaves a dataset that looks whole.
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from infra.config import ConfigError, parse_config, require
from infra.data.shards import TOKENIZER_DIR, DataIndex, token_dtype, write_shard
from infra.data.sources import STDLIB, iter_texts
from infra.files import fsync_dir

EOS = "<|endoftext|>"


@dataclass
class PrepareArguments:
    output_dir: str = field(default="data/stdlib", metadata={"help": "Folder the shards and index are written to."})
    source: str = field(
        default=STDLIB, metadata={"help": "'stdlib', local text/json/jsonl/parquet/csv files (path, folder or glob), or a hub dataset id."}
    )
    text_column: str = field(default="text", metadata={"help": "Column holding the text (json, parquet, csv and hub sources)."})
    split: str = field(default="train", metadata={"help": "Split of a hub dataset."})
    max_bytes: int | None = field(
        default=8_000_000, metadata={"help": "Stop reading the source after about this many bytes of text (null: all)."}
    )
    tokenizer: str | None = field(
        default=None, metadata={"help": "Tokenizer path or hub id; if unset, train a byte-level BPE on the source."}
    )
    vocab_size: int = field(default=4096, metadata={"help": "Vocabulary size of a trained tokenizer."})
    seq_len: int = field(default=256, metadata={"help": "Tokens per sample."})
    samples_per_shard: int = field(default=2048, metadata={"help": "Samples per shard file."})
    batch_documents: int = field(default=256, metadata={"help": "Documents tokenized per call."})

    def __post_init__(self):
        require(self.seq_len >= 2, "seq_len", self.seq_len, "an integer >= 2")
        require(self.samples_per_shard >= 1, "samples_per_shard", self.samples_per_shard, "an integer >= 1")
        require(self.vocab_size >= 256 + 1, "vocab_size", self.vocab_size, "an integer > 256 (the byte alphabet plus EOS)")
        require(self.max_bytes is None or self.max_bytes > 0, "max_bytes", self.max_bytes, "an integer > 0 or null")


def train_tokenizer(texts, vocab_size: int):
    """A byte-level BPE tokenizer trained on `texts`, wrapped for `transformers`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=EOS, eos_token=EOS, pad_token=EOS, unk_token=EOS)


def load_tokenizer(name_or_path: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"tokenizer={name_or_path!r} has no EOS token to separate documents with")
    return tokenizer


def pack(token_batches, seq_len: int, eos_id: int):
    """Join documents (each followed by EOS) and yield full `seq_len` rows; the short tail is dropped."""
    buffer: list[int] = []
    for ids in token_batches:
        buffer.extend(ids)
        buffer.append(eos_id)
        while len(buffer) >= seq_len:
            yield buffer[:seq_len]
            del buffer[:seq_len]


def prepare(args: PrepareArguments) -> DataIndex:
    out = Path(args.output_dir)
    if (out / "index.json").is_file():
        index = DataIndex.load(out)
        print(f"{out} is already prepared ({index.num_samples} samples of {index.seq_len} tokens); delete it to rebuild")
        return index
    work = out.with_name(out.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)

    def texts():
        return iter_texts(args.source, args.text_column, args.split, args.max_bytes)

    if args.tokenizer is None:
        print(f"training a {args.vocab_size}-token byte-level BPE tokenizer on {args.source} ...")
        tokenizer, made_from = train_tokenizer(texts(), args.vocab_size), f"trained:{args.source}"
    else:
        tokenizer, made_from = load_tokenizer(args.tokenizer), args.tokenizer
    tokenizer.save_pretrained(work / TOKENIZER_DIR)

    vocab_size = len(tokenizer)
    dtype = token_dtype(vocab_size)
    index = DataIndex(seq_len=args.seq_len, dtype=dtype.name, vocab_size=vocab_size, tokenizer=made_from, source=args.source)

    def token_batches():
        batch = []
        for text in texts():
            batch.append(text)
            if len(batch) == args.batch_documents:
                yield from tokenizer(batch, add_special_tokens=False)["input_ids"]
                batch = []
        if batch:
            yield from tokenizer(batch, add_special_tokens=False)["input_ids"]

    rows: list[list[int]] = []
    with tqdm(desc="packing", unit=" samples") as bar:
        for row in pack(token_batches(), args.seq_len, tokenizer.eos_token_id):
            rows.append(row)
            bar.update()
            if len(rows) == args.samples_per_shard:
                index.shards.append(write_shard(work, len(index.shards), np.asarray(rows, dtype=dtype)))
                rows = []
        if rows:
            index.shards.append(write_shard(work, len(index.shards), np.asarray(rows, dtype=dtype)))
    if index.num_samples == 0:
        shutil.rmtree(work)
        raise ConfigError(f"source={args.source!r} gave no sample of seq_len={args.seq_len} tokens: it is empty or too short")

    index.save(work)
    shutil.rmtree(out, ignore_errors=True)  # a folder without index.json is an unfinished leftover
    work.rename(out)
    fsync_dir(out.parent)
    print(f"wrote {index.num_samples} samples x {index.seq_len} tokens in {len(index.shards)} shards to {out}")
    return index


def main(argv: list[str] | None = None) -> None:
    (args,) = parse_config((PrepareArguments,), argv)
    try:
        prepare(args)
    except (ConfigError, ValueError) as err:
        print(f"prepare error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
