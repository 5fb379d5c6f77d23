"""Turn raw text into tokenized, packed, fixed-length samples on disk, in parallel and resumably.

    python -m infra.data.prepare --output_dir data/stdlib --num_proc 2             # offline default
    python -m infra.data.prepare --source corpus/*.jsonl --tokenizer gpt2 --output_dir data/mine
    python -m infra.data.prepare --source wikitext --split train --max_bytes 100000000 --output_dir data/wiki

Three stages, all inside `OUTPUT_DIR.partial/`, renamed to `OUTPUT_DIR` only when complete:

1. tokenizer: the given one, or a byte-level BPE trained on the same text (`tokenizer/`).
2. tokenize: documents are read in order and cut into chunks of about `chunk_bytes` of text;
   `num_proc` processes tokenize chunks and write each as `tokens/chunk_NNNNNN.npy` (document
   tokens, each followed by EOS), atomically. A chunk file that exists is finished.
3. pack: the chunks' tokens, concatenated in order, are cut into samples of `seq_len` tokens
   (the short tail is dropped) and written as shards of `samples_per_shard` samples; the index
   goes last.

Chunking depends only on the text and `chunk_bytes`, so the output is the same for any
`num_proc`, and equal to packing the whole stream at once. An interrupted prepare, run again
with the same arguments, keeps the tokenizer and every finished chunk and tokenizes only the
rest (a hub stream is read again up to that point, but not tokenized again). Different
arguments start over.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context
from pathlib import Path

import numpy as np
from tqdm import tqdm

from infra.config import ConfigError, parse_config, require
from infra.data.shards import TOKENIZER_DIR, DataIndex, save_npy, token_dtype, write_shard
from infra.data.sources import STDLIB, iter_texts
from infra.files import atomic_write_text

EOS = "<|endoftext|>"
ARGS_FILE = "prepare_args.json"
TOKENS_DIR = "tokens"


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
    samples_per_shard: int = field(default=2048, metadata={"help": "Samples per shard file (the last shard may hold fewer)."})
    num_proc: int = field(default=1, metadata={"help": "Processes that tokenize in parallel."})
    chunk_bytes: int = field(default=1_000_000, metadata={"help": "Text per unit of parallel work (and of resumption), in bytes."})
    batch_documents: int = field(default=256, metadata={"help": "Documents per tokenizer call."})

    def __post_init__(self):
        require(self.seq_len >= 2, "seq_len", self.seq_len, "an integer >= 2")
        require(self.samples_per_shard >= 1, "samples_per_shard", self.samples_per_shard, "an integer >= 1")
        require(self.vocab_size >= 256 + 1, "vocab_size", self.vocab_size, "an integer > 256 (the byte alphabet plus EOS)")
        require(self.max_bytes is None or self.max_bytes > 0, "max_bytes", self.max_bytes, "an integer > 0 or null")
        require(self.num_proc >= 1, "num_proc", self.num_proc, "an integer >= 1")
        require(self.chunk_bytes >= 1, "chunk_bytes", self.chunk_bytes, "an integer >= 1")
        require(self.batch_documents >= 1, "batch_documents", self.batch_documents, "an integer >= 1")


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


def load_tokenizer(name_or_path: str | Path, need_eos: bool = True):
    """The tokenizer at `name_or_path` (a folder or a hub id); with `need_eos`, one that has an EOS token to separate documents."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    if need_eos and tokenizer.eos_token_id is None:
        raise ConfigError(f"tokenizer={str(name_or_path)!r} has no EOS token to separate documents with")
    return tokenizer


def chunks(texts: Iterator[str], chunk_bytes: int) -> Iterator[tuple[list[str], int]]:
    """Consecutive groups of documents holding at least `chunk_bytes` of text (the last: what is left)."""
    group, size = [], 0
    for text in texts:
        group.append(text)
        size += len(text.encode("utf-8", "ignore"))
        if size >= chunk_bytes:
            yield group, size
            group, size = [], 0
    if group:
        yield group, size


_tokenizers: dict[str, object] = {}


def _init_worker() -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism: no threads on top


def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    backend = getattr(tokenizer, "backend_tokenizer", None)  # fast tokenizers: skip the Python wrapper
    if backend is None:
        return tokenizer(texts, add_special_tokens=False)["input_ids"]
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
    return [e.ids for e in encode(texts, add_special_tokens=False)]


def tokenize_chunk(work: Path, chunk_id: int, texts: list[str], batch_documents: int) -> int:
    """Tokenize one chunk into `tokens/chunk_NNNNNN.npy` (each document followed by EOS); returns its token count."""
    key = str(work / TOKENIZER_DIR)
    tokenizer = _tokenizers.get(key)
    if tokenizer is None:
        tokenizer = _tokenizers[key] = load_tokenizer(key)
    dtype = token_dtype(len(tokenizer))
    eos = np.asarray([tokenizer.eos_token_id], dtype=dtype)
    parts = []
    for i in range(0, len(texts), batch_documents):
        for ids in _encode(tokenizer, texts[i : i + batch_documents]):
            parts += [np.asarray(ids, dtype=dtype), eos]
    tokens = np.concatenate(parts) if parts else np.empty(0, dtype=dtype)
    save_npy(work / TOKENS_DIR / f"chunk_{chunk_id:06d}.npy", tokens)
    return len(tokens)


def _start(work: Path, args: PrepareArguments) -> None:
    """Reuse `work` if an interrupted prepare with the same arguments left it, else start it empty."""
    settings = {k: v for k, v in asdict(args).items() if k not in ("output_dir", "num_proc")}
    saved = work / ARGS_FILE
    if saved.is_file() and json.loads(saved.read_text()) == settings:
        done = len(list((work / TOKENS_DIR).glob("chunk_*.npy")))
        print(f"resuming the interrupted prepare in {work}: {done} chunks already tokenized")
        for leftover in work.rglob("*.tmp"):
            leftover.unlink()
        return
    if work.exists():
        print(f"{work} holds an interrupted prepare with other arguments: starting over")
        shutil.rmtree(work)
    (work / TOKENS_DIR).mkdir(parents=True)
    atomic_write_text(saved, json.dumps(settings, indent=2))


def _tokenizer_for(work: Path, args: PrepareArguments, texts) -> str:
    """Stage 1: the tokenizer, saved in `work/tokenizer` (complete or absent); returns what it was made from."""
    made_from = f"trained:{args.source}" if args.tokenizer is None else args.tokenizer
    if (work / TOKENIZER_DIR).is_dir():
        return made_from
    if args.tokenizer is None:
        print(f"training a {args.vocab_size}-token byte-level BPE tokenizer on {args.source} ...")
        tokenizer = train_tokenizer(texts(), args.vocab_size)
    else:
        tokenizer = load_tokenizer(args.tokenizer)
    tmp = work / (TOKENIZER_DIR + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer.save_pretrained(tmp)
    tmp.rename(work / TOKENIZER_DIR)
    return made_from


def _tokenize(work: Path, args: PrepareArguments, texts) -> int:
    """Stage 2: every chunk not yet on disk, `num_proc` at a time, in bounded memory; returns the chunk count."""
    done = {int(p.stem.split("_")[1]) for p in (work / TOKENS_DIR).glob("chunk_*.npy")}
    bar = tqdm(desc="tokenizing", total=args.max_bytes, unit="B", unit_scale=True)
    pool = None
    if args.num_proc > 1:
        pool = ProcessPoolExecutor(args.num_proc, mp_context=get_context("fork"), initializer=_init_worker)
    pending: deque = deque()
    count = 0
    try:
        for chunk_id, (group, size) in enumerate(chunks(texts(), args.chunk_bytes)):
            count += 1
            if chunk_id in done:
                bar.update(size)
                continue
            if pool is None:
                tokenize_chunk(work, chunk_id, group, args.batch_documents)
                bar.update(size)
                continue
            pending.append((pool.submit(tokenize_chunk, work, chunk_id, group, args.batch_documents), size))
            while len(pending) >= 2 * args.num_proc:  # never more than this much text in flight
                future, size = pending.popleft()
                future.result()
                bar.update(size)
        while pending:
            future, size = pending.popleft()
            future.result()
            bar.update(size)
    finally:
        bar.close()
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    return count


def _pack(work: Path, index: DataIndex, num_chunks: int, samples_per_shard: int) -> None:
    """Stage 3: the chunks' tokens in order -> rows of seq_len -> shards of samples_per_shard rows."""
    dtype, seq_len = np.dtype(index.dtype), index.seq_len
    shard_tokens = samples_per_shard * seq_len
    carry = np.empty(0, dtype=dtype)
    with tqdm(desc="packing", total=num_chunks, unit=" chunks") as bar:
        for chunk_id in range(num_chunks):
            carry = np.concatenate([carry, np.load(work / TOKENS_DIR / f"chunk_{chunk_id:06d}.npy")])
            while len(carry) >= shard_tokens:
                index.shards.append(write_shard(work, len(index.shards), carry[:shard_tokens].reshape(-1, seq_len)))
                carry = carry[shard_tokens:]
            bar.update()
    rows = len(carry) // seq_len
    if rows:
        index.shards.append(write_shard(work, len(index.shards), carry[: rows * seq_len].reshape(-1, seq_len)))


def prepare(args: PrepareArguments) -> DataIndex:
    out = Path(args.output_dir)
    if (out / "index.json").is_file():
        index = DataIndex.load(out)
        print(f"{out} is already prepared ({index.num_samples} samples of {index.seq_len} tokens); delete it to rebuild")
        return index
    work = out.with_name(out.name + ".partial")
    _start(work, args)

    def texts():
        return iter_texts(args.source, args.text_column, args.split, args.max_bytes)

    made_from = _tokenizer_for(work, args, texts)
    vocab_size = len(load_tokenizer(work / TOKENIZER_DIR))
    num_chunks = _tokenize(work, args, texts)

    index = DataIndex(
        seq_len=args.seq_len, dtype=token_dtype(vocab_size).name, vocab_size=vocab_size, tokenizer=made_from, source=args.source
    )
    for stale in work.glob("shard_*.npy"):  # packing is cheap: a resumed prepare packs again
        stale.unlink()
    _pack(work, index, num_chunks, args.samples_per_shard)
    if index.num_samples == 0:
        shutil.rmtree(work)
        raise ConfigError(f"source={args.source!r} gave no sample of seq_len={args.seq_len} tokens: it is empty or too short")

    shutil.rmtree(work / TOKENS_DIR)
    (work / ARGS_FILE).unlink()
    index.publish(work, out)
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
