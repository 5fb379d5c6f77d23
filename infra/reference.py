"""A frozen model's scores of every sample, computed once ahead and kept as fields of the data.

    data_dir = with_scores(accelerator, data_dir, out_dir, key, score, ("ref_chosen_logps", "ref_rejected_logps"))

DPO's `precompute_ref_log_probs`: the reference's log-probabilities of each pair do not change while the policy
trains, so they are computed in one pass before the first step and the reference is not needed after it. They are
written as a copy of the prepared data with the scores as more fields (float32, one per sample), in OUTPUT_DIR: the
loader, the cursor, the held-out split and a resume then carry them as they carry the tokens, with nothing more to
save. A later launch of the same job (the same reference, data and precision: `key`) reads the copy again instead of
computing it; another key computes a new one. The copy is published whole (a folder renamed into place) by rank 0 once
every rank's share is in.

Each rank scores every world-size-th sample, in batches, with the model whole on its device (under any engine).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator

from infra.data.shards import DataIndex, PackedDataset, write_shard
from infra.files import sha256_file

KEY_FILE = "scored_with.json"


def with_scores(
    accelerator: Accelerator,
    data_dir: str,
    out_dir: Path,
    key: dict,
    score: Callable[[dict[str, torch.Tensor]], torch.Tensor],
    names: tuple[str, ...],
    batch_size: int,
) -> str:
    """The folder of `data_dir` with `names` more fields: `score(batch)` gives a (len(names) x batch) tensor. Computed
    unless `out_dir` holds a copy made with the same `key`."""
    key = {**key, "data": sha256_file(Path(data_dir) / "index.json"), "fields": list(names)}
    if read_key(out_dir) == key:
        accelerator.print(f"reference scores: {out_dir} (computed by an earlier launch)")
        return str(out_dir)
    dataset = PackedDataset(data_dir)
    mine = np.arange(accelerator.process_index, len(dataset), accelerator.num_processes)
    scores = torch.zeros(len(names), len(dataset), dtype=torch.float64, device=accelerator.device)
    with torch.no_grad():
        for start in range(0, len(mine), batch_size):
            ids = mine[start : start + batch_size]
            batch = {k: v.to(accelerator.device) for k, v in dataset.__getitems__(ids.tolist()).items()}
            scores[:, torch.from_numpy(ids).to(accelerator.device)] = score(batch).double()
    scores = accelerator.reduce(scores, "sum").float().cpu().numpy()  # each sample's column came from one rank
    if accelerator.is_main_process:
        write_copy(dataset, Path(data_dir), out_dir, dict(zip(names, scores, strict=True)), key)
    accelerator.wait_for_everyone()
    accelerator.print(f"reference scores: {len(dataset)} samples scored once, kept in {out_dir}")
    return str(out_dir)


def write_copy(dataset: PackedDataset, data_dir: Path, out: Path, scores: dict[str, np.ndarray], key: dict) -> None:
    """The data of `dataset` with `scores` as more fields, published whole at `out`."""
    work = out.with_name(out.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    index = DataIndex.load(data_dir)
    shutil.copytree(dataset.tokenizer_dir, work / dataset.tokenizer_dir.name)
    shards, first = [], 0
    for n, shard in enumerate(index.shards):
        rows = {k: v.numpy() for k, v in dataset.__getitems__(list(range(first, first + shard.num_samples))).items()}
        fields = {name: rows[name].astype(dtype) for name, (dtype, _) in dataset._layout.items()}
        shards.append(write_shard(work, n, fields | {k: v[first : first + shard.num_samples] for k, v in scores.items()}))
        first += shard.num_samples
    index.shards = shards
    index.fields = {**index.fields, **{name: {"dtype": "float32", "shape": []} for name in scores}}
    (work / KEY_FILE).write_text(json.dumps(key, indent=1))
    index.publish(work, out)


def read_key(out_dir: Path) -> dict | None:
    path = out_dir / KEY_FILE
    return json.loads(path.read_text()) if path.is_file() and (out_dir / "index.json").is_file() else None
