"""Checkpoints through `accelerator.save_state`: committed atomically, verified, scheduled, resumed.

Layout:

    OUTPUT_DIR/checkpoints/step_00000100/     what save_state writes (model, optimizer, scheduler,
        ...                                   every rank's RNG, registered objects) plus
        config.json                           the resolved configuration
        manifest.json                         step, tokens, data cursor, metrics, every file's size
                                              and xxh3-64, world size, versions, git commit, run id
    OUTPUT_DIR/checkpoints/corrupt/           checkpoints that failed verification, kept for a look

A save goes to `.step_XXXXXXXX.partial/`. When every rank has written its part, each rank reads
its share of the files back once to checksum them while they are fsynced (one thread per file, so
hashing overlaps the disk flush; the files are dealt to the ranks by size), then rank 0 writes
`manifest.json` last, renames the folder into place and only then prunes.
A folder without a whole manifest is never loaded; leftovers of interrupted saves are removed.

Why xxh3-64 and not sha256: the checksum guards against torn, truncated and bit-rotted files (a
digest stored beside the files cannot guard against tampering anyway). Hashing an mmap of a file in
the page cache, xxh3-64 runs at 8.6 GB/s here against zlib's CRC-32 at 2.0-2.6 GB/s and sha256's
1.2 GB/s, and it releases the GIL, so a verified commit stays close to a bare save and a verified
resume close to a bare load. Manifests with CRC-32s (written before) still verify.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import mmap
import os
import shutil
import signal
import threading
import time
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import xxhash
from accelerate import Accelerator
from accelerate.utils import DistributedType, broadcast_object_list

from infra.config import to_json
from infra.distributed import all_ranks_ok, gathered
from infra.environment import git_state, package_versions
from infra.files import atomic_write_text, drop_cached, fsync_dir, fsync_file

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
CONFIG = "config.json"
PREFIX = "step_"
CORRUPT = "corrupt"
BLOCK = 1 << 20  # hashed a block at a time: what a loader taking the checksums over may wait for
CHECKSUM_THREAD = "checkpoint-checksums"
# Test hook: seconds to pause after save_state and before the commit, so a test can kill a save midway.
PAUSE_ENV = "INFRA_TEST_PAUSE_IN_SAVE"


class TrainState:
    """Loop counters that must survive a restart, kept in the checkpoint's manifest."""

    def __init__(self):
        self.step = 0
        self.tokens_seen = 0
        self.skipped_steps = 0  # optimizer steps skipped for a non-finite loss or gradient
        self.rollbacks = 0  # returns to a checkpoint after too many of them in a row

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "skipped_steps": self.skipped_steps, "rollbacks": self.rollbacks}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.rollbacks = int(state.get("rollbacks", 0))


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, or one that was asked for cannot be used."""


class _Crc32:
    """zlib's CRC-32 behind the interface of xxhash's hashers, for manifests written before xxh3-64."""

    def __init__(self):
        self.value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


HASHERS = {"xxh3_64": xxhash.xxh3_64, "crc32": _Crc32}


def _blocks(path: Path) -> Iterator[memoryview]:
    """A file's bytes as views of BLOCK bytes over an mmap of it (no copy)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view, memoryview(view) as whole:
            for start in range(0, len(whole), BLOCK):
                with whole[start : start + BLOCK] as block:
                    yield block


def digest_file(path: Path, kind: str = "xxh3_64") -> str:
    """The digest of a file's bytes (xxhash releases the GIL while it hashes)."""
    hasher = HASHERS[kind]()
    for block in _blocks(path):
        hasher.update(block)
    return hasher.hexdigest()


def _lowest_priority() -> None:
    """Give the calling thread, alone, the lowest CPU priority (nice 19; on Linux niceness is per thread).

    Not SCHED_IDLE: an idle-policy thread also gets the idle I/O class, which a busy disk may never
    serve, and the loader may have to wait for the block it is in.
    """
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


class Checksums:
    """Checks files of a checkpoint against their manifest entries, a block at a time: begun by a
    thread at the lowest CPU priority, finished by `problem()` at the caller's.

    Started before a load, the thread hashes almost only on the cores the load leaves idle:
    load_state's tensor copies use every core of a small machine, and hashing at normal priority
    beside them made a verified resume 1.26-1.45x a bare load_state on 2 cores; at the lowest
    priority it is 1.0-1.07x, the hashing fitting in the load's single-threaded phases (unpickling the
    optimizer). `problem()` takes the rest over, so no hashing is left to a starved thread but the
    1 MB block it is in.
    """

    def __init__(self, folder: Path, files: dict[str, dict[str, Any]], background: bool = True):
        self._steps = self._hash(Path(folder), files)
        self._lock = threading.Lock()
        self._taken_over = False
        self._mismatch: str | None = None
        self._error: Exception | None = None
        if background:
            threading.Thread(target=self._run_low, name=CHECKSUM_THREAD, daemon=True).start()

    def _hash(self, folder: Path, files: dict[str, dict[str, Any]]) -> Iterator[None]:
        """Hashes one block per step; records the first file whose digest differs."""
        for rel, entry in files.items():
            kind = next((k for k in HASHERS if k in entry), None)
            if kind is None:
                raise CheckpointError(f"{rel}: its manifest entry has no checksum this version knows ({', '.join(HASHERS)})")
            hasher = HASHERS[kind]()
            for block in _blocks(folder / rel):
                hasher.update(block)
                yield
            if hasher.hexdigest() != entry[kind]:
                self._mismatch = f"{rel} does not match its checksum (altered or damaged on disk)"
                return

    def _advance(self) -> bool:
        """One step under the lock; False when the work is done (or failed)."""
        try:
            next(self._steps)
            return True
        except StopIteration:
            return False
        except Exception as err:  # an unreadable file: reported by problem(), in the caller's thread
            self._error = err
            return False

    def _run_low(self) -> None:
        _lowest_priority()
        while True:
            with self._lock:
                if self._taken_over or not self._advance():
                    return

    def problem(self) -> str | None:
        """The first file whose digest differs from its manifest's, or None; raises if a file could not be read."""
        self._taken_over = True
        with self._lock:
            while self._advance():
                pass
        if self._error is not None:
            raise self._error
        return self._mismatch


def share(sizes: dict[str, int], parts: int) -> list[list[str]]:
    """The files of `sizes` dealt into `parts` lists of about equal bytes: largest first, each to the
    lightest list so far. Deterministic, so every rank computes the same split."""
    shares: list[list[str]] = [[] for _ in range(parts)]
    load = [0] * parts
    for rel in sorted(sizes, key=lambda rel: (-sizes[rel], rel)):
        lightest = min(range(parts), key=lambda i: (load[i], i))
        shares[lightest].append(rel)
        load[lightest] += sizes[rel]
    return shares


def files_below(folder: Path) -> dict[str, int]:
    """Every file below `folder` (relative path -> size)."""
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


def seal(folder: Path, rels: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """Checksum and fsync the files `rels` of `folder` (every file below it by default).

    Each file's fsync and checksum are separate tasks on a thread pool, so reading a file back
    from the page cache overlaps the disk flushing it. The folders are fsynced by `fsync_dirs`.
    """
    rels = list(files_below(folder)) if rels is None else rels
    paths = [folder / rel for rel in rels]
    tasks = [(fsync_file, p) for p in paths] + [(digest_file, p) for p in paths]
    with ThreadPoolExecutor(max_workers=max(1, min(len(tasks), 64))) as pool:
        sums = list(pool.map(lambda task: task[0](task[1]), tasks))[len(paths) :]
    for p in paths:  # on disk now: out of the page cache (see drop_cached)
        drop_cached(p)
    return {rel: {"size": p.stat().st_size, "xxh3_64": c} for rel, p, c in zip(rels, paths, sums, strict=True)}


def fsync_dirs(folder: Path) -> None:
    """fsync `folder` and every folder below it, deepest first."""
    for d in sorted([folder, *(p for p in folder.rglob("*") if p.is_dir())], key=lambda d: len(d.parts), reverse=True):
        fsync_dir(d)


def seal_shared(accelerator: Accelerator, folder: Path) -> tuple[dict[str, dict[str, Any]], str | None]:
    """Every rank checksums and fsyncs its `share` of the files below `folder`; called on every rank.

    Returns the manifest entries of every file (on rank 0; {} elsewhere) and the first failure of any
    rank (rank 0 also checks that the ranks listed the same files). Under ZeRO or FSDP every rank
    writes shards: if rank 0 alone read them all back, the job would wait on one rank's disk
    bandwidth for the whole state; this way each rank reads about 1/world_size of it.
    """
    entries, error = {}, None
    try:
        listing = files_below(folder)
        entries = seal(folder, share(listing, accelerator.num_processes)[accelerator.process_index])
    except Exception as err:
        listing, error = {}, f"{type(err).__name__}: {err}"
    outcomes = gathered(accelerator, (entries, error))
    error = next((e for _, e in outcomes if e), None)
    if not accelerator.is_main_process:
        return {}, error
    files = {rel: entry for found, _ in outcomes for rel, entry in found.items()}
    if error is None and files.keys() != listing.keys():
        error = f"the ranks saw different files in {folder} (a file system without consistent listings?)"
    return dict(sorted(files.items())), error


def read_manifest(path: Path) -> dict[str, Any]:
    return json.loads((Path(path) / MANIFEST).read_text())


def problem(path: Path, checksums: bool = True) -> str | None:
    """Why `path` is not a usable checkpoint, or None if every listed file is there, whole (and unaltered)."""
    manifest_path = Path(path) / MANIFEST
    if not manifest_path.is_file():
        return "no manifest.json (the save never completed)"
    try:
        files = read_manifest(path)["files"]
    except (ValueError, KeyError) as err:
        return f"unreadable manifest.json ({err})"
    for rel, entry in files.items():
        f = Path(path) / rel
        if not f.is_file():
            return f"{rel} is missing"
        if f.stat().st_size != entry["size"]:
            return f"{rel} has {f.stat().st_size} bytes, the manifest says {entry['size']}"
    return Checksums(path, files, background=False).problem() if checksums else None


class _Frozen:
    """Stands in for an optimizer or scheduler whose state was copied: `state_dict()` returns the copy."""

    def __init__(self, state: dict):
        self._state = state

    def state_dict(self) -> dict:
        return self._state


class CheckpointManager:
    """Save, commit, verify, resume and prune the checkpoints of one output_dir."""

    def __init__(
        self,
        accelerator: Accelerator,
        output_dir: str | os.PathLike,
        config: dict,
        save_total_limit: int | None = None,
        keep_best: int = 0,
        metric_for_best_model: str = "train/loss",
        greater_is_better: bool = False,
        save_milestone_steps: int = 0,
    ):
        self.accelerator = accelerator
        self.root = Path(output_dir) / "checkpoints"
        self.config = config
        self.save_total_limit, self.keep_best, self.save_milestone_steps = save_total_limit, keep_best, save_milestone_steps
        self.metric, self.greater_is_better = metric_for_best_model, greater_is_better
        self._background: threading.Thread | None = None  # a background save, or pruning
        self._background_error: tuple[int, Exception] | None = None
        self._staging: dict[tuple, torch.Tensor] = {}  # CPU buffers of background saves, reused from one to the next
        if accelerator.is_main_process:
            self.root.mkdir(parents=True, exist_ok=True)
            for leftover in [*self.root.glob(f".{PREFIX}*.partial"), *(p for p in self.checkpoints() if not (p / MANIFEST).is_file())]:
                log.warning("removing %s, left by a save that did not finish", leftover)
                shutil.rmtree(leftover, ignore_errors=True)
        accelerator.wait_for_everyone()

    def path(self, step: int) -> Path:
        return self.root / f"{PREFIX}{step:08d}"

    def checkpoints(self) -> list[Path]:
        """Committed checkpoint folders, oldest first."""
        found = [p for p in self.root.glob(f"{PREFIX}*") if p.is_dir() and p.name[len(PREFIX) :].isdigit()]
        return sorted(found, key=lambda p: int(p.name[len(PREFIX) :]))

    def resume(self, resume_from_checkpoint: str, checksums: bool = True) -> tuple[Path | None, dict[str, Any]]:
        """Load the checkpoint to resume from; returns it and its manifest, or (None, {}) to start fresh.

        'none' starts fresh; a path must verify; 'auto' takes the newest that verifies, and reports
        in one line and moves to `checkpoints/corrupt/` each one that does not. Rank 0 checks the
        manifest and sizes, then every rank checksums its share of the files while all load it: loading is
        idempotent, so when the checksums disagree the next candidate is simply loaded over it, and
        verification costs little more than the load itself. Counters and the data cursor are
        restored from the manifest (JSON) by the caller, so nothing of ours is unpickled.
        """
        if resume_from_checkpoint == "none":
            return None, {}
        explicit = resume_from_checkpoint != "auto"
        candidates = [Path(resume_from_checkpoint)] if explicit else list(reversed(self.checkpoints()))
        acc = self.accelerator
        for path in candidates:
            why = self._on_main(lambda path=path: problem(path, checksums=False))
            if why is None and (incompatible := self._on_main(lambda path=path: self._incompatibility(path))):
                raise CheckpointError(f"cannot resume from {path}: {incompatible}")
            if why is None:
                why = self._load_verified(path, checksums)
            if why is None:
                return path, read_manifest(path)
            if explicit:
                raise CheckpointError(f"cannot resume from {path}: {why}")
            if acc.is_main_process:
                print(f"warning: skipping checkpoint {path}: {why}; moved to {self.root / CORRUPT}", flush=True)
                (self.root / CORRUPT).mkdir(exist_ok=True)
                os.replace(path, self.root / CORRUPT / f"{path.name}.{int(time.time())}")
            acc.wait_for_everyone()
        return None, {}

    def _load_verified(self, path: Path, checksums: bool) -> str | None:
        """Load `path` on every rank while each rank checksums its `share` of the files; why it is unusable, or None."""
        acc = self.accelerator
        mismatch, error, checking = None, None, None
        if checksums:
            try:
                files = read_manifest(path)["files"]
                mine = share({rel: entry["size"] for rel, entry in files.items()}, acc.num_processes)[acc.process_index]
                checking = Checksums(path, {rel: files[rel] for rel in mine})
            except Exception as err:  # whatever it is, every rank must reach the gather below
                mismatch = f"checksumming failed ({err})"
        try:
            acc.load_state(str(path))
        except Exception as err:  # a damaged file the checksums will name, usually
            error = f"loading failed ({err})"
        if checking is not None:
            try:
                mismatch = checking.problem()
            except Exception as err:
                mismatch = f"checksumming failed ({err})"
        outcomes = gathered(acc, (mismatch, error))  # every rank has loaded: the files may leave the page cache
        if checking is not None:
            for rel in mine:
                drop_cached(path / rel)
        return next((m for m, _ in outcomes if m), None) or next((e for _, e in outcomes if e), None)

    def _on_main(self, fn):
        """fn() computed on rank 0, returned on every rank."""
        box = [fn() if self.accelerator.is_main_process else None]
        if self.accelerator.num_processes > 1:
            broadcast_object_list(box)
        return box[0]

    def _incompatibility(self, path: Path) -> str | None:
        manifest = read_manifest(path)
        acc = self.accelerator
        was, now = manifest.get("distributed_type"), acc.distributed_type.value
        if DistributedType.DEEPSPEED.value in (was, now) and (was != now or manifest.get("world_size") != acc.num_processes):
            return (
                f"it was written by {manifest.get('world_size')} {was} processes and this run is {acc.num_processes} {now}: "
                "ZeRO checkpoints are sharded per rank, so resume with the same world size and engine "
                "(or convert it with DeepSpeed's ds_to_universal)"
            )
        if was == DistributedType.DEEPSPEED.value and manifest.get("mixed_precision", acc.mixed_precision) != acc.mixed_precision:
            return (
                f"it was written in mixed precision {manifest['mixed_precision']} and this run is {acc.mixed_precision}: DeepSpeed "
                f"keeps its optimizer state per precision, so resume with --mixed_precision {manifest['mixed_precision']}"
            )
        return None

    def save(self, step: int, manifest: dict[str, Any], background: bool = False) -> Path:
        """Save, commit (manifest last, then rename), then prune. Called on every rank.

        A failure on any rank (a full disk, say) leaves the earlier checkpoints as they were and
        raises CheckpointError on every rank, instead of leaving the others waiting.

        `background=True` (DDP or one process; DeepSpeed and FSDP save synchronously): the state is
        copied to CPU memory and every rank's RNG state written now, and rank 0 writes, commits and
        prunes from a thread while training goes on. The files are those of a synchronous save. A
        failure there is raised on every rank at the next save.
        """
        final = self.path(step)
        if final.exists():  # this step is already committed (a resume at the final step, say)
            return final
        acc = self.accelerator
        self.wait()  # the previous save is committed (or its failure raised on every rank) first
        work = self.root / f".{PREFIX}{step:08d}.partial"
        if acc.is_main_process:
            shutil.rmtree(work, ignore_errors=True)
        acc.wait_for_everyone()
        background = background and acc.distributed_type in (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)
        error, staged = None, None
        try:
            if background:
                staged = self._stage(work)
            else:
                acc.save_state(str(work))
        except Exception as err:  # OSError, and what libraries wrap it in (safetensors raises its own type)
            error = err
        if not all_ranks_ok(acc, error is None):
            self._give_up(work, step, error)
        if background:
            if acc.is_main_process:
                self._background = threading.Thread(target=self._write_and_commit, args=(work, final, step, manifest, staged))
                self._background.start()
            return final
        if pause := float(os.environ.get(PAUSE_ENV, 0)):
            time.sleep(pause)
        files, error = seal_shared(acc, work)
        if acc.is_main_process and error is None:
            try:
                self._commit(work, final, step, manifest, files)
            except Exception as err:
                error = err
        if not all_ranks_ok(acc, error is None):
            self._give_up(work, step, error)
        if acc.is_main_process:  # deleting old checkpoints is not on the training's critical path
            self._background = threading.Thread(target=self.prune, name="checkpoint-prune")
            self._background.start()
        acc.wait_for_everyone()
        return final

    def _commit(self, work: Path, final: Path, step: int, manifest: dict[str, Any], files: dict | None = None) -> None:
        """On rank 0: config.json, the checksums (of every file, unless `files` has the ranks' own), manifest.json, rename."""
        (work / CONFIG).write_text(to_json(self.config))
        files = seal(work) if files is None else {**files, **seal(work, [CONFIG])}
        fsync_dirs(work)
        atomic_write_text(work / MANIFEST, json.dumps({**manifest, "step": step, "files": files}, indent=2))
        os.rename(work, final)
        fsync_dir(self.root)

    def _stage(self, work: Path):
        """This rank's RNG state to `work` now; on rank 0, CPU copies of what save_state would write."""
        from accelerate.checkpointing import save_accelerator_state

        acc = self.accelerator
        rng = work / f".rng{acc.process_index}"
        rng.mkdir(parents=True)
        save_accelerator_state(str(rng), [], [], [], [], acc.process_index, acc.step, acc.scaler)  # writes only RNG files
        for f in rng.iterdir():
            os.replace(f, work / f.name)
        rng.rmdir()
        if not acc.is_main_process:
            return None
        # One CPU buffer per tensor view, so tied weights stay tied. The buffers of the previous save
        # are reused (its writer has finished): allocating and first touching 1.3 GB of fresh memory
        # costs more than the copy itself. So rank 0 holds one CPU copy of the state while async_save
        # is on. Pinned for GPU tensors, for an asynchronous device-to-host copy.
        previous, copies = self._staging, {}
        on_gpu = False

        def to_cpu(value):
            nonlocal on_gpu
            if isinstance(value, torch.Tensor):
                key = (
                    value.device,
                    value.untyped_storage().data_ptr(),
                    value.storage_offset(),
                    value.stride(),
                    tuple(value.shape),
                    value.dtype,
                )
                if key not in copies:
                    buffer = previous.pop(key, None)
                    if buffer is None:
                        buffer = torch.empty(value.shape, dtype=value.dtype, pin_memory=value.is_cuda)
                    copies[key] = buffer.copy_(value.detach(), non_blocking=value.is_cuda)
                    on_gpu |= value.is_cuda
                return copies[key]
            if isinstance(value, dict):  # keeps OrderedDict: accelerate de-duplicates tied weights only in one
                return type(value)((k, to_cpu(v)) for k, v in value.items())
            if isinstance(value, list | tuple):
                return type(value)(to_cpu(v) for v in value)
            return value

        weights = [to_cpu(acc.get_state_dict(m, unwrap=False)) for m in acc._models]
        optimizers = [_Frozen(to_cpu(o.state_dict())) for o in acc._optimizers]
        schedulers = [_Frozen(to_cpu(s.state_dict())) for s in acc._schedulers]
        if on_gpu:
            torch.cuda.synchronize()  # the non-blocking copies have landed before training changes the source
        self._staging = copies
        return weights, optimizers, schedulers

    def _write_and_commit(self, work: Path, final: Path, step: int, manifest: dict[str, Any], staged) -> None:
        from accelerate.checkpointing import RNG_STATE_NAME, save_accelerator_state

        acc = self.accelerator
        try:
            weights, optimizers, schedulers = staged
            rng = work / f"{RNG_STATE_NAME}_{acc.process_index}.pkl"
            kept = rng.read_bytes()  # save_accelerator_state writes the RNG as it is now: put back the staged one
            save_accelerator_state(str(work), weights, optimizers, schedulers, [], acc.process_index, acc.step, None)
            rng.write_bytes(kept)
            self._commit(work, final, step, manifest)
            self.prune()
        except Exception as err:
            shutil.rmtree(work, ignore_errors=True)
            self._background_error = (step, err)

    def wait(self) -> None:
        """Let a background save or prune finish; raise (on every rank) if a background save failed."""
        if self._background is not None:
            self._background.join()
            self._background = None
        failed = self._background_error
        self._background_error = None
        if not all_ranks_ok(self.accelerator, failed is None):
            step, err = failed if failed else (None, None)
            raise CheckpointError(
                f"the background save of step {step} failed ({err}); the earlier checkpoints are intact: "
                f"{', '.join(p.name for p in self.checkpoints()) or 'none'}"
            )

    def _give_up(self, work: Path, step: int, error: Exception | None) -> None:
        if self.accelerator.is_main_process:
            shutil.rmtree(work, ignore_errors=True)
        kept = [p.name for p in self.checkpoints()]
        cause = f" ({getattr(error, 'strerror', None) or error})" if error else " (on another rank)"
        raise CheckpointError(
            f"saving the checkpoint of step {step} failed{cause}; the earlier checkpoints are intact: {', '.join(kept) or 'none'}"
        )

    def keep(self) -> set[Path]:
        """What retention keeps: the newest save_total_limit, the best keep_best, every milestone."""
        all_ = self.checkpoints()
        kept = set(all_ if self.save_total_limit is None else all_[-self.save_total_limit :])
        if self.save_milestone_steps:
            kept |= {p for p in all_ if int(p.name[len(PREFIX) :]) % self.save_milestone_steps == 0}
        if self.keep_best:
            scored = []
            for p in all_:
                with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                    scored.append((float(read_manifest(p)["metrics"][self.metric]), p))
            scored.sort(key=lambda sp: sp[0], reverse=self.greater_is_better)
            kept |= {p for _, p in scored[: self.keep_best]}
        return kept

    def prune(self) -> None:
        kept = self.keep()
        for old in self.checkpoints():
            if old not in kept:
                shutil.rmtree(old, ignore_errors=True)


class SaveSchedule:
    """When to save: every `save_steps`, every `minutes` of wall clock, and on a preemption signal.

    SIGTERM and SIGUSR1 (SLURM's `--signal=USR1@120`) only set a flag; `check()` runs one small
    all-reduce per step so that every rank learns of a signal that reached any of them (and which), of rank 0's
    clock decision, and of the caller's flags (a non-finite loss), at the same step. After a signal the process has `grace_seconds` to
    save and exit before a watchdog ends it (the commit is atomic: a cut save is never loaded).
    With `minutes="auto"` the interval is Young/Daly's sqrt(2 * C * MTBF), C the last measured
    save time (30 minutes until the first save has been measured).
    """

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self, accelerator: Accelerator, save_steps: int, minutes: float | str, mtbf_hours: float, grace_seconds: float):
        self.accelerator, self.save_steps = accelerator, save_steps
        self.auto = minutes == "auto"
        self.interval = 30 * 60.0 if self.auto else float(minutes) * 60
        self.mtbf = mtbf_hours * 3600
        self.grace = grace_seconds
        self.signal: int | None = None  # this rank's
        self.agreed_signal: str | None = None  # any rank's, once check() has seen it: SIGTERM or SIGUSR1
        self.last_save = time.monotonic()
        self._watchdog = threading.Timer(grace_seconds, self._out_of_time)
        self._watchdog.daemon = True
        self._previous = {sig: signal.signal(sig, self._on_signal) for sig in self.SIGNALS}

    def _on_signal(self, signum, frame) -> None:
        if self.signal is None:
            self.signal = signum
            self._watchdog.start()

    def _out_of_time(self) -> None:
        print(f"preemption: no clean exit within preemption_grace_seconds={self.grace:g}; stopping now", flush=True)
        os._exit(1)

    def close(self) -> None:
        """Stop the watchdog and give the signals back to their previous handlers."""
        self._watchdog.cancel()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def check(self, step: int, *flags: torch.Tensor) -> tuple[bool, ...]:
        """(save at the end of `step`, then stop, *flags), the same on every rank.

        `flags` are this rank's own (0-dim tensors: a non-finite loss, say); they travel in the same
        all-reduce (MAX) and come back true if true on any rank: one collective and one host
        synchronisation per step carry everything the ranks must agree on.
        """
        due = self.interval > 0 and self.accelerator.is_main_process and time.monotonic() - self.last_save >= self.interval
        device = self.accelerator.device
        agreed = torch.cat([torch.tensor([float(self.signal or 0), float(due)], device=device), *(f.float().reshape(1) for f in flags)])
        if self.accelerator.num_processes > 1:
            torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MAX)
        values = agreed.tolist()
        if values[0]:  # the same on every rank: SIGTERM (15) over SIGUSR1 (10) when ranks got different ones
            self.agreed_signal = signal.Signals(int(values[0])).name
        preempted, due, *rest = (v > 0 for v in values)
        by_steps = self.save_steps > 0 and step % self.save_steps == 0
        return (preempted or due or by_steps, preempted, *rest)

    def saved(self, seconds: float) -> float | None:
        """Record a save that took `seconds`; returns the new interval in minutes when it is chosen automatically."""
        self.last_save = time.monotonic()
        if not self.auto:
            return None
        self.interval = math.sqrt(2 * seconds * self.mtbf)
        return self.interval / 60


def environment_facts(accelerator: Accelerator) -> dict[str, Any]:
    """What a checkpoint records about the job that wrote it."""
    commit, dirty = git_state()
    return {
        "world_size": accelerator.num_processes,
        "distributed_type": accelerator.distributed_type.value,
        "mixed_precision": accelerator.mixed_precision,
        "versions": package_versions(),
        "git_commit": commit,
        "git_dirty": dirty,
    }


def write_model_card(folder: str | os.PathLike, recipe: str, config: dict, metrics: dict[str, Any]) -> None:
    """`README.md` beside exported weights: how they were made and where training ended."""
    lines = [f"# {Path(folder).parent.name}", "", f"Trained with `recipes/{recipe}.py`.", "", "## Final metrics", ""]
    lines += [f"- {k}: {v:.6g}" if isinstance(v, float) else f"- {k}: {v}" for k, v in sorted(metrics.items())]
    lines += ["", "## Configuration", "", "```json", to_json(config), "```", ""]
    atomic_write_text(Path(folder) / "README.md", "\n".join(lines))
