"""Preflight: what can be known to fail before hours of training are spent, checked in seconds.

Run before every recipe's training loop (`--preflight false` skips it) and alone by `make doctor`
(`--preflight_only true`): the accelerators and their free memory on every rank, a collective
across all ranks, the data index, a real `save_state`/`load_state` round trip of the configured
model and optimizer (timed, and compared), free disk in `output_dir` against what the kept
checkpoints will take (measured from that round trip), checkpoint_upload_dir, and the MLflow store. It prints one table;
any failure ends the run with exit code 1 before a step is taken, each with its own message.
(After the first steps, infra.metrics.EtaCheck prints the pace and the time to `max_steps`.)
"""

from __future__ import annotations

import os
import shutil
import socket
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, gather_object

from infra.checkpoint.integrity import seal_shared
from infra.checkpoint.trainable import load_state
from infra.config import require
from infra.distributed import all_ranks_ok
from infra.errors import RunError
from infra.health import parameter_fingerprint
from infra.memory import GIB, Setup, Shape, estimate, rank_memory, refusal, table


@dataclass
class PreflightConfig:
    """Preflight flags (part of TrainingArguments)."""

    _argument_group_name = "preflight"  # its heading in --help

    preflight: bool = field(
        default=True, metadata={"help": "Check devices, a collective, data, a checkpoint round trip, disk and MLflow before training."}
    )
    preflight_only: bool = field(
        default=False, metadata={"help": "Run the preflight (data checksums included), print it, and exit (make doctor)."}
    )
    time_budget_hours: float = field(
        default=0.0, metadata={"help": "Warn after the first steps if the run needs longer than this (0: no budget)."}
    )

    def __post_init__(self):
        require(self.time_budget_hours >= 0, "time_budget_hours", self.time_budget_hours, "a number of hours >= 0")


class PreflightError(RunError):
    """A preflight check failed: the message names the check and what to do."""

    kind = "preflight"

    def line(self) -> str:
        return str(self)  # "preflight failed: <check>: <what to do>"


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    more: str = ""  # printed under the table (the memory estimate's own)


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:.3g} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return ""


def accelerators(accelerator: Accelerator) -> Check:
    """Device type, name and free memory of every rank (gathered: one line for the whole job)."""
    device = accelerator.device
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        mine = f"{torch.cuda.get_device_name(device)} {free / GIB:.1f}/{total / GIB:.1f} GiB free"
    else:
        import psutil

        mem = psutil.virtual_memory()
        mine = f"cpu {mem.available / GIB:.1f}/{mem.total / GIB:.1f} GiB free"
    mine = (f"{socket.gethostname()}:{mine}", accelerator.mixed_precision)
    every = gather_object([mine]) if accelerator.num_processes > 1 else [mine]
    precisions = sorted({f"{precision} on {where.split(':')[0]}" for where, precision in every})
    if len({precision for _, precision in every}) > 1:  # mixed_precision auto resolved differently on different machines
        return Check("accelerators", False, f"the ranks train in different precisions ({', '.join(precisions)}): set mixed_precision")
    kinds = sorted({where for where, _ in every}, key=[where for where, _ in every].index)
    return Check("accelerators", True, f"{accelerator.num_processes} ranks ({accelerator.distributed_type.value}): " + "; ".join(kinds[:4]))


def memory_fit(accelerator: Accelerator, model: torch.nn.Module, shape: Shape, setup: Setup) -> Check:
    """The estimate of what a training step holds on this rank (infra.memory), with its table, against what the rank may
    use; refused with the levers that would make it fit."""
    usable = rank_memory(accelerator, model)
    rows = estimate(shape, setup)
    title = f"memory estimate per rank ({setup.engine}, {'bf16' if setup.bf16 else 'fp32'}"
    title += f", activation checkpointing {'on' if setup.checkpointing else 'off'}):"
    why = refusal(shape, setup, usable)
    detail = why or f"~{sum(rows.values()) / GIB:.2f} GiB of {usable / GIB:.1f} GiB per rank"
    return Check("memory", why is None, detail, f"{title}\n{table(rows, usable)}")


def collective(accelerator: Accelerator) -> Check:
    """An all-reduce across every rank, timed, and its result checked."""
    if accelerator.num_processes == 1:
        return Check("collective", True, "one process: none needed")
    start = time.perf_counter()
    x = torch.tensor([float(accelerator.process_index)], device=accelerator.device)
    torch.distributed.all_reduce(x)
    seconds = time.perf_counter() - start
    want = accelerator.num_processes * (accelerator.num_processes - 1) / 2
    ok = float(x.item()) == want
    detail = f"all-reduce across {accelerator.num_processes} ranks in {seconds * 1000:.0f} ms"
    return Check("collective", ok, detail if ok else f"all-reduce returned {x.item()}, expected {want}: the ranks do not form one group")


def data(dataset, checksums: bool) -> Check:
    """The data set as opened (PackedDataset checked the index and every shard's size), and with `checksums` every shard's sha256."""
    from infra.data.shards import DataError

    if checksums:
        try:
            dataset.check(checksums=True)
        except DataError as err:
            return Check("data", False, str(err))
    how = "sizes and sha256 verified" if checksums else "sizes verified (sha256 with verify_data_checksums)"
    what = f"{dataset.seq_len} tokens" if dataset.fields == ["input_ids"] else ", ".join(dataset.fields)
    return Check("data", True, f"{len(dataset):,} samples of {what} in {len(dataset.index.shards)} shards, {how}")


def writable(output_dir: str | os.PathLike) -> Check:
    out = Path(output_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".preflight_write_{os.getpid()}"
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as err:
        return Check("output_dir", False, f"output_dir={str(out)!r} is not writable ({err.strerror or err})")
    return Check("output_dir", True, f"{out.resolve()} writable")


def round_trip(accelerator: Accelerator, model: torch.nn.Module, output_dir: str | os.PathLike) -> tuple[Check, int, float]:
    """save_state, fsync and checksum, perturb the weights, load_state: the weights must come back bit for bit.

    Returns the check, the bytes one checkpoint takes and the seconds a save takes. The state is the
    one training starts from (loading restores it, RNG included), so the run is unchanged by it.
    Every rank takes the same path whatever fails where: the outcome of each phase is agreed first.
    """
    scratch = Path(output_dir) / ".preflight_checkpoint"
    if accelerator.is_main_process:
        shutil.rmtree(scratch, ignore_errors=True)
    accelerator.wait_for_everyone()
    sharded = accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP)
    unwrapped = accelerator.unwrap_model(model)
    before = None if sharded else parameter_fingerprint(unwrapped)

    def attempt(fn) -> BaseException | None:
        try:
            fn()
        except Exception as err:
            return err
        return None

    # FSDP: torch's sharded optimizer save fills an empty optimizer state with one step of zero gradients at lr 0, so
    # Adam's step counter would start the run at 1 and its bias correction be one step off (the first update 0.74x)
    fsdp = accelerator.distributed_type == DistributedType.FSDP
    fresh = [optimizer for optimizer in accelerator._optimizers if fsdp and not optimizer.state]
    files: dict = {}
    start = time.perf_counter()
    error = attempt(lambda: accelerator.save_state(str(scratch)))
    saved = all_ranks_ok(accelerator, error is None)
    if saved:  # sealed as a real save is, each rank its share
        files, error = seal_shared(accelerator, scratch)
        saved = all_ranks_ok(accelerator, error is None)
    save_seconds = time.perf_counter() - start
    load_seconds = 0.0
    if saved:
        if not sharded:
            with torch.no_grad():
                for p in unwrapped.parameters():
                    if p.requires_grad:  # frozen ones are not in checkpoints (infra.checkpoint.trainable)
                        p.add_(1.0)
        start = time.perf_counter()
        error = attempt(lambda: load_state(accelerator, scratch))
        saved = all_ranks_ok(accelerator, error is None)
        load_seconds = time.perf_counter() - start
    for optimizer in fresh:  # as it was: no state, no gradients
        optimizer.state.clear()
        optimizer.zero_grad(set_to_none=True)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        shutil.rmtree(scratch, ignore_errors=True)
    if not saved:
        why = error if isinstance(error, str) else f"{type(error).__name__}: {error}" if error else "it failed on another rank"
        return Check("checkpoint", False, f"save_state/load_state round trip in {scratch} failed: {why}"), 0, 0.0
    size = sum(f["size"] for f in files.values())
    if not sharded and parameter_fingerprint(unwrapped) != before:
        return Check("checkpoint", False, f"the weights loaded back from {scratch} differ from those saved"), size, save_seconds
    how = "weights identical after the round trip" if not sharded else "saved and loaded (sharded: not compared)"
    detail = f"save {save_seconds:.2f}s, load {load_seconds:.2f}s, {_size(size)} on rank 0's disk; {how}"
    return Check("checkpoint", True, detail), size, save_seconds


def upload_target(url: str) -> Check:
    """checkpoint_upload_dir takes a small object and gives it back (the credentials, the endpoint, the bucket)."""
    from infra.checkpoint.remote import RemoteCheckpoints

    remote = RemoteCheckpoints(url)
    probe = f"{remote.url}/.preflight-{socket.gethostname()}-{os.getpid()}"
    try:
        remote.fs.pipe_file(probe, b"preflight")
        back = remote.fs.cat_file(probe)
        remote.fs.rm(probe)
    except Exception as err:  # whatever the filesystem raises: missing bucket, no credentials, no route
        return Check("upload", False, f"checkpoint_upload_dir={url!r} is not writable ({type(err).__name__}: {err})")
    if back != b"preflight":
        return Check("upload", False, f"checkpoint_upload_dir={url!r} gave back other bytes than were written")
    return Check("upload", True, f"{url} writable")


def disk(output_dir: str | os.PathLike, checkpoint_bytes: int, kept: int, export_bytes: int) -> Check:
    """Free space against `kept` checkpoints, one more being written, and the exported model, less what a
    resumed run's checkpoints already take (they are replaced, not added to; an earlier export stays
    until the new one is in place)."""
    out = Path(output_dir)
    present = sum(f.stat().st_size for f in (out / "checkpoints").rglob("*") if f.is_file()) if (out / "checkpoints").is_dir() else 0
    need = max(0, checkpoint_bytes * (kept + 1) + export_bytes - present)
    free = shutil.disk_usage(out).free
    detail = f"{_size(free)} free in {output_dir}; checkpoints need ~{_size(need)} more ({kept} kept + 1 being written, and the export)"
    if free < need:
        return Check("disk", False, detail + ": free space, or lower save_total_limit or keep_best")
    return Check("disk", True, detail)


def mlflow_store(uri: str, fresh: bool) -> Check:
    """A server answers /health; a sqlite file's folder is writable. Unreachable fails a fresh run only:
    a resumed one (a requeue at 3 a.m.) goes on and logs to the local store instead."""
    if uri.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=5) as reply:
                ok = reply.status == 200
        except OSError as err:
            ok, why = False, str(getattr(err, "reason", err))
        else:
            why = "" if ok else "not healthy"
        if not ok:
            detail = f"MLFLOW_TRACKING_URI={uri} is unreachable ({why})"
            if fresh:
                return Check("mlflow", False, detail + ": start the server, fix the URI, or pass --report_to none")
            return Check("mlflow", True, detail + "; resuming, so this run logs to the local store")
        return Check("mlflow", True, f"{uri} reachable")
    if uri.startswith("sqlite:///"):
        folder = Path(uri[len("sqlite:///") :]).parent
        ok = folder.is_dir() and os.access(folder, os.W_OK)
        return Check("mlflow", ok, f"{uri} {'writable' if ok else 'is in a folder that is missing or not writable'}")
    return Check("mlflow", True, f"{uri} (not checked)")


def report(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    return "preflight\n" + "\n".join(f"  {'ok  ' if c.ok else 'FAIL'}  {c.name:<{width}}  {c.detail}" for c in checks)


def run_preflight(
    accelerator: Accelerator,
    model: torch.nn.Module,
    dataset,
    output_dir: str,
    most_kept: int,
    tracking_uri: str | None,
    data_checksums: bool = False,
    memory: tuple[Shape, Setup] | None = None,
    upload_dir: str | None = None,
) -> float:
    """Every check, one table on rank 0; raises PreflightError (exit 1) on every rank if a check failed on any.

    Files (data, output_dir, disk, the MLflow store) are checked by rank 0, as rank 0 is the one
    that writes checkpoints' manifests and talks to MLflow; every rank joins the collective and
    the round trip. Returns the seconds a save took.
    """
    main = accelerator.is_main_process
    checks = [accelerators(accelerator), collective(accelerator)]
    if memory is not None:
        checks.append(memory_fit(accelerator, model, *memory))
    if main:
        checks += [data(dataset, data_checksums), writable(output_dir)]
        if upload_dir is not None:
            checks.append(upload_target(upload_dir))
    can_save = all_ranks_ok(accelerator, all(c.ok for c in checks))
    save_seconds = 0.0
    if can_save:
        check, size, save_seconds = round_trip(accelerator, model, output_dir)
        checks.append(check)
        if main:  # before the first step AdamW holds no moments yet: a checkpoint will take 12 bytes per parameter at least
            export = 4 * sum(p.numel() for p in accelerator.unwrap_model(model).parameters())
            checks.append(disk(output_dir, max(size, 3 * export), most_kept, export))
    if main and tracking_uri is not None:
        fresh = not any(Path(output_dir, "checkpoints").glob("step_*/manifest.json"))
        checks.append(mlflow_store(tracking_uri, fresh))
    mine = [f"{c.name}: {c.detail}" + (f" (rank {accelerator.process_index})" if not main else "") for c in checks if not c.ok]
    failed = [f for rank in gather_object([mine]) for f in rank] if accelerator.num_processes > 1 else mine
    accelerator.print(report(checks))
    for check in checks:
        if check.more:
            accelerator.print(check.more)
    if failed:
        raise PreflightError("preflight failed: " + "; ".join(dict.fromkeys(failed)))
    return save_seconds
