"""Where raw text comes from: the Python standard library (offline default), local files, or the hub.

Every source is a plain iterator of strings, read lazily: nothing is held in memory whole.
Local files and hub datasets go through `datasets` in streaming mode.
"""

from __future__ import annotations

import ast
import glob
import sysconfig
import textwrap
from collections.abc import Iterator
from pathlib import Path

STDLIB = "stdlib"
_BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def stdlib_files() -> list[Path]:
    """The standard library's own Python sources, in a fixed order: real text present wherever Python is."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idle_test", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))


def local_files(source: str) -> list[str]:
    """Files named by `source` (a file, a folder or a glob); empty if it names nothing local."""
    path = Path(source)
    if path.is_dir():
        return sorted(str(p) for p in path.rglob("*") if p.suffix in _BUILDERS)
    return sorted(glob.glob(source)) if any(c in source for c in "*?[") else ([source] if path.is_file() else [])


def iter_texts(source: str, text_column: str = "text", split: str = "train", max_bytes: int | None = None) -> Iterator[str]:
    """Yield documents from `source` until about `max_bytes` of text (all of it if None)."""
    total = 0
    for text in _documents(source, text_column, split):
        if not text:
            continue
        yield text
        total += len(text.encode("utf-8", "ignore"))
        if max_bytes is not None and total >= max_bytes:
            return


def _documents(source: str, text_column: str, split: str) -> Iterator[str]:
    if source == STDLIB:
        for path in stdlib_files():
            yield path.read_text(encoding="utf-8", errors="replace")
        return

    stream = iter_rows(source, split)
    for row in stream:
        if text_column not in row:
            raise ValueError(f"text_column={text_column!r} is not a column of {source!r}: it has {sorted(row)}")
        yield row[text_column]


def iter_rows(source: str, split: str = "train"):
    """Rows of local json/jsonl/parquet/csv files, of a folder of images (one subfolder per label), or of a hub dataset:
    a streaming `datasets.IterableDataset` (its `.features` name the classes of a ClassLabel column)."""
    import datasets

    files = local_files(source)
    if Path(source).is_dir() and not files:  # no table files in it: a folder of images
        return datasets.load_dataset("imagefolder", data_dir=source, split="train", streaming=True)
    if files:
        suffixes = {Path(f).suffix for f in files}
        if len(suffixes) != 1 or next(iter(suffixes)) not in _BUILDERS:
            raise ValueError(f"source={source!r} mixes or names unsupported file types {sorted(suffixes)}: use one of {sorted(_BUILDERS)}")
        return datasets.load_dataset(_BUILDERS[suffixes.pop()], data_files=files, split="train", streaming=True)
    return datasets.load_dataset(source, split=split, streaming=True)  # a dataset on the hub (or a local script)


def stdlib_functions() -> Iterator[tuple[str, ast.FunctionDef, str]]:
    """(module, function node, source text of the function) for every documented public function of the standard library."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in stdlib_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        try:
            tree = ast.parse(text)
        except SyntaxError:  # a few files are deliberately broken (lib2to3 fixtures and the like)
            continue
        module = ".".join(path.relative_to(root).with_suffix("").parts)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not node.name.startswith("_") and ast.get_docstring(node):
                yield module, node, textwrap.dedent(ast.get_source_segment(text, node, padded=True) or "")
