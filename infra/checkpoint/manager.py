"""Checkpoints through `accelerator.save_state`: committed atomically, verified, resumed.

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
`manifest.json` last, renames the folder into place and only then prunes (retention.py).
A folder without a whole manifest is never loaded; leftovers of interrupted saves are removed.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from accelerate.utils import DistributedType, broadcast_object_list

from infra.checkpoint.engines import ddp_path, from_ddp, to_ddp
from infra.checkpoint.integrity import (
    MANIFEST,
    CheckpointError,
    Checksums,
    files_below,
    fsync_dirs,
    problem,
    read_manifest,
    seal,
    seal_shared,
    share,
)
from infra.checkpoint.remote import RemoteCheckpoints
from infra.checkpoint.reshard import load_universal, to_universal, universal_path
from infra.checkpoint.retention import RetentionConfig, RetentionPolicy
from infra.checkpoint.staging import CpuStaging
from infra.checkpoint.trainable import load_state
from infra.config import require, to_json
from infra.data.remote import is_remote
from infra.distributed import all_ranks_ok, gathered
from infra.environment import zero_stage
from infra.files import atomic_write_text, drop_cached, fsync_dir

log = logging.getLogger(__name__)

CONFIG = "config.json"
PREFIX = "step_"
CORRUPT = "corrupt"


def step_of(checkpoint: Path) -> int:
    """The step of a committed checkpoint folder (`step_00000100` -> 100)."""
    return int(checkpoint.name[len(PREFIX) :])


def manifest_of(path: str | os.PathLike, field: str) -> dict[str, Any]:
    """The manifest of the checkpoint folder `path`, or of the newest checkpoint of the run whose output_dir is `path`,
    when it holds `field`; else CheckpointError, in one line."""
    folder = Path(path)
    if not (folder / MANIFEST).is_file():
        found = [p.parent for p in (folder / "checkpoints").glob(f"{PREFIX}*/{MANIFEST}") if p.parent.name[len(PREFIX) :].isdigit()]
        if not found:
            expected = f"expected a checkpoint folder (with {MANIFEST}) or an output_dir with checkpoints"
            raise CheckpointError(f"{path} is not a checkpoint: {expected}")
        folder = max(found, key=step_of)
    manifest = read_manifest(folder)
    if field not in manifest:
        raise CheckpointError(f"{folder} records no {field} (it was saved by an older version)")
    return manifest


BACKGROUND_ENGINES = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)  # what async_save stages


@dataclass
class CheckpointConfig:
    """Checkpoint flags (part of TrainingArguments); when to save is SaveClockConfig's, what to keep RetentionConfig's."""

    _argument_group_name = "checkpoints: where and how"  # its heading in --help

    async_save: bool = field(
        default=False,
        metadata={
            "help": "DDP: copy the state to CPU memory and write it from a thread while training goes on (final saves stay synchronous)."
        },
    )
    verify_checksums: bool = field(
        default=True, metadata={"help": "Check every file's checksum before resuming (sizes are always checked)."}
    )
    resume_from_checkpoint: str = field(
        default="auto",
        metadata={"help": "'auto' resumes from the newest checkpoint in output_dir, 'none' starts fresh, or a checkpoint path."},
    )
    checkpoint_upload_dir: str | None = field(
        default=None,
        metadata={
            "help": "An fsspec URL (s3://bucket/prefix): each checkpoint is uploaded after its local commit, and a resume on "
            "an empty disk downloads the newest remote one that verifies (infra.checkpoint.remote)."
        },
    )

    def __post_init__(self):
        if self.checkpoint_upload_dir is not None:
            require(
                is_remote(self.checkpoint_upload_dir),
                "checkpoint_upload_dir",
                self.checkpoint_upload_dir,
                "an fsspec URL such as s3://bucket/prefix",
            )
        if self.resume_from_checkpoint not in ("auto", "none"):
            require(
                Path(self.resume_from_checkpoint).is_dir(),
                "resume_from_checkpoint",
                self.resume_from_checkpoint,
                "'auto', 'none' or an existing checkpoint directory",
            )


class CheckpointManager:
    """Save, commit, verify, resume and prune the checkpoints of one output_dir."""

    def __init__(
        self,
        accelerator: Accelerator,
        output_dir: str | os.PathLike,
        config: dict,
        retention: RetentionPolicy | None = None,
        before_commit: Callable[[int], None] | None = None,
        describe: Callable[[Path], None] | None = None,
        upload_to: str | None = None,
    ):
        """`config` is written beside every checkpoint, and `describe(folder)` adds what else it needs (on rank 0: the
        model's config, for infra.export); `before_commit(step)` runs between a synchronous save_state and its commit (a
        test hook: infra.testing pauses there so that a test can kill a save midway). `upload_to`: an fsspec URL each
        committed checkpoint is uploaded to (remote.py)."""
        self.accelerator = accelerator
        self.root = Path(output_dir) / "checkpoints"
        self.config = config
        self.retention = retention or RetentionPolicy(RetentionConfig(save_total_limit=None))  # keeps every checkpoint
        self.before_commit = before_commit
        self.describe = describe
        self.remote = RemoteCheckpoints(upload_to) if upload_to else None
        self._upload: threading.Thread | None = None
        self._background: threading.Thread | None = None  # a background save, or pruning
        self._background_error: tuple[int, Exception] | None = None
        self._staging = CpuStaging()  # CPU copies of background saves
        self._said_synchronous = False

    def _remove_leftovers(self) -> None:
        """Before resuming: what interrupted saves left is removed (on rank 0; every rank waits)."""
        if self.accelerator.is_main_process:
            self.root.mkdir(parents=True, exist_ok=True)
            for leftover in [*self.root.glob(f".{PREFIX}*.partial"), *(p for p in self.checkpoints() if not (p / MANIFEST).is_file())]:
                log.warning("removing %s, left by a save that did not finish", leftover)
                shutil.rmtree(leftover, ignore_errors=True)
        self.accelerator.wait_for_everyone()

    def path(self, step: int) -> Path:
        return self.root / f"{PREFIX}{step:08d}"

    def checkpoints(self) -> list[Path]:
        """Committed checkpoint folders, oldest first."""
        found = [p for p in self.root.glob(f"{PREFIX}*") if p.is_dir() and p.name[len(PREFIX) :].isdigit()]
        return sorted(found, key=step_of)

    def resume(self, resume_from_checkpoint: str, checksums: bool = True) -> tuple[Path | None, dict[str, Any]]:
        """Load the checkpoint to resume from; returns it and its manifest, or (None, {}) to start fresh.

        'none' starts fresh; a path must verify; 'auto' takes the newest that verifies, and reports
        in one line and moves to `checkpoints/corrupt/` each one that does not. Rank 0 checks the
        manifest and sizes, then every rank checksums its share of the files while all load it: loading is
        idempotent, so when the checksums disagree the next candidate is simply loaded over it, and
        verification costs little more than the load itself. Counters and the data cursor are
        restored from the manifest (JSON) by the caller, so nothing of ours is unpickled.
        """
        self._remove_leftovers()
        if resume_from_checkpoint == "none":
            return None, {}
        explicit = resume_from_checkpoint != "auto"
        if self.remote is not None and not explicit:
            self._on_main(lambda: self._download_newer(checksums))
        candidates = [Path(resume_from_checkpoint)] if explicit else list(reversed(self.checkpoints()))
        acc = self.accelerator
        for path in candidates:
            why = self._on_main(lambda path=path: problem(path, checksums=False))
            if why is None and (incompatible := self._on_main(lambda path=path: self._incompatibility(path))):
                raise CheckpointError(f"cannot resume from {path}: {incompatible}")
            converted, kind = None, None if why else self._on_main(lambda path=path: self._conversion(path))
            if kind is not None:
                why, converted = self._converted(path, checksums, kind)
            if why is None:
                why = self._load_verified(converted or path, checksums, kind in ("universal", "from DDP"))
                if why is not None and converted is not None:  # the source verified: not a damaged checkpoint
                    raise CheckpointError(f"cannot resume from {path}: its conversion {converted.name} did not load ({why})")
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

    def _download_newer(self, checksums: bool) -> None:
        """On rank 0: the newest remote checkpoint newer than every local one, downloaded and verified; one that does
        not verify is reported and the one before it tried."""
        local = [step_of(p) for p in self.checkpoints()]
        for step in reversed(self.remote.steps()):
            if local and step <= max(local):
                return
            why = self.remote.download(step, self.root, checksums)
            if why is None:
                return
            print(f"warning: skipping remote checkpoint {self.remote.url}/step_{step:08d}: {why}", flush=True)

    def _load_verified(self, path: Path, checksums: bool, universal: bool = False) -> str | None:
        """Load `path` on every rank while each rank checksums its `share` of the files; why it is unusable, or None.
        `universal`: a DeepSpeed universal checkpoint (reshard.py)."""
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
            if universal:
                load_universal(acc, path, load_state)
            else:
                load_state(acc, path)
        except Exception as err:  # a damaged file the checksums will name, usually
            error = f"loading failed ({type(err).__name__}: {err})"
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
        deepspeed, fsdp = DistributedType.DEEPSPEED.value, DistributedType.FSDP.value
        if now == deepspeed and was is None:
            return "its manifest does not name the engine that wrote it (an older version), so resume with that engine"
        if (was == fsdp) != (now == fsdp):  # FSDP's sharded files load under FSDP alone, and it loads nothing else
            return (
                f"it was written by {manifest.get('world_size')} {was} processes and this run is {acc.num_processes} {now}: "
                "an FSDP checkpoint resumes under FSDP only and FSDP resumes no other, so resume with the engine that "
                "wrote it (DDP and ZeRO resume each other's)"
            )
        if was == now == deepspeed and manifest.get("mixed_precision", acc.mixed_precision) != acc.mixed_precision:
            return (
                f"it was written in mixed precision {manifest['mixed_precision']} and this run is {acc.mixed_precision}: DeepSpeed "
                f"keeps its optimizer state per precision, so resume with --mixed_precision {manifest['mixed_precision']}"
            )
        return None

    def _conversion(self, path: Path) -> str | None:
        """What a checkpoint (of a compatible engine) needs before this run loads it: "universal" (a ZeRO one from another
        world size or stage; reshard.py), "from DDP" or "to DDP" (between DDP and ZeRO; engines.py), or None."""
        manifest, acc = read_manifest(path), self.accelerator
        was, now = manifest.get("distributed_type"), acc.distributed_type.value
        deepspeed = DistributedType.DEEPSPEED.value
        if was == now == deepspeed:
            stage = manifest.get("zero_stage", zero_stage(acc))
            return "universal" if manifest.get("world_size") != acc.num_processes or stage != zero_stage(acc) else None
        if now == deepspeed:
            return "from DDP"  # an FSDP one, or one that does not name its engine, is refused (_incompatibility)
        return "to DDP" if was == deepspeed else None

    def _converted(self, path: Path, checksums: bool, kind: str) -> tuple[str | None, Path | None]:
        """(why `path` is unusable, None), or (None, its converted sibling): the source verified, then converted once, on
        rank 0 while the others wait. A conversion that fails stops the run (the checkpoint itself may be fine)."""
        make = {
            "universal": to_universal,
            "from DDP": lambda p: from_ddp(p, self.accelerator),
            "to DDP": lambda p: to_ddp(p, self.accelerator),
        }

        def convert() -> tuple[str | None, str | None, str | None]:
            if (bad := problem(path, checksums=checksums)) is not None:
                return bad, None, None
            try:
                return None, str(make[kind](path)), None
            except CheckpointError as err:
                return None, None, str(err)

        why, converted, failed = self._on_main(convert)
        if failed:
            raise CheckpointError(failed)
        return why, Path(converted) if converted else None

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
        if background and acc.distributed_type not in BACKGROUND_ENGINES:
            if not self._said_synchronous:  # once: the flag is the user's, the engine decides
                acc.print(f"async_save: {acc.distributed_type.value} saves synchronously here (background saves: DDP or one process)")
                self._said_synchronous = True
            background = False
        error, staged = None, None
        try:
            if background:
                staged = self._staging.stage(acc, work)
            else:
                acc.save_state(str(work))
        except Exception as err:  # OSError, and what libraries wrap it in (safetensors raises its own type)
            error = disk_full(err, self.root)
        if not all_ranks_ok(acc, error is None):
            self._give_up(work, step, error)
        if background:
            if acc.is_main_process:
                self._background = threading.Thread(target=self._write_and_commit, args=(work, final, step, manifest, staged))
                self._background.start()
            return final
        if self.before_commit is not None:
            self.before_commit(step)
        files, error = seal_shared(acc, work)
        if acc.is_main_process and error is None:
            try:
                self._commit(work, final, step, manifest, files)
            except Exception as err:
                error = disk_full(err, self.root)
        if not all_ranks_ok(acc, error is None):
            self._give_up(work, step, error)
        if acc.is_main_process:  # deleting old checkpoints is not on the training's critical path
            self._background = threading.Thread(target=self._after_commit, args=(final,), name="checkpoint-prune")
            self._background.start()
        acc.wait_for_everyone()
        return final

    def _after_commit(self, final: Path) -> None:
        """Prune; then upload `final` from a thread of its own, once the previous upload is done (remote.py)."""
        self.prune()
        if self.remote is not None:
            if self._upload is not None:
                self._upload.join()
            self._upload = threading.Thread(target=self._upload_one, args=(final,), name="checkpoint-upload")
            self._upload.start()

    def _upload_one(self, final: Path) -> None:
        start = time.monotonic()
        try:
            sent = self.remote.upload(final)
            self.remote.prune({step_of(p) for p in self.checkpoints()})
        except Exception as err:  # the run goes on: the next checkpoint is uploaded as usual
            print(f"warning: uploading {final.name} to {self.remote.url} failed ({err}); the local checkpoint is intact", flush=True)
            return
        seconds = time.monotonic() - start
        print(f"uploaded {final.name} to {self.remote.url}: {sent / 2**20:.1f} MiB in {seconds:.1f} s", flush=True)

    def close(self) -> None:
        """At the end of a run: the background save, pruning and upload finished (rank 0 waits for them)."""
        self.wait()
        if self._upload is not None:
            self._upload.join()
            self._upload = None

    def _commit(self, work: Path, final: Path, step: int, manifest: dict[str, Any], files: dict | None = None) -> None:
        """On rank 0: config.json, the checksums (of every file, unless `files` has the ranks' own), manifest.json, rename."""
        (work / CONFIG).write_text(to_json(self.config))
        before = set(files_below(work))
        if self.describe is not None:
            self.describe(work)
        ours = [CONFIG, *sorted(set(files_below(work)) - before)]
        files = seal(work) if files is None else {**files, **seal(work, ours)}
        fsync_dirs(work)
        atomic_write_text(work / MANIFEST, json.dumps({**manifest, "step": step, "files": files}, indent=2))
        os.rename(work, final)
        fsync_dir(self.root)

    def _write_and_commit(self, work: Path, final: Path, step: int, manifest: dict[str, Any], staged) -> None:
        try:
            self._staging.write(self.accelerator, work, staged)
            self._commit(work, final, step, manifest)
            self._after_commit(final)
        except Exception as err:
            error = disk_full(err, self.root)
            shutil.rmtree(work, ignore_errors=True)
            self._background_error = (step, error)

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

    def set_aside(self, after: int) -> list[str]:
        """The committed checkpoints of steps after `after` moved to `checkpoints/corrupt/` (not known sound: copies
        found apart since, infra.replicas.copies), on the main process; their names."""
        moved = [p for p in self.checkpoints() if step_of(p) > after]
        if self.accelerator.is_main_process and moved:
            (self.root / CORRUPT).mkdir(exist_ok=True)
            for path in moved:
                os.replace(path, self.root / CORRUPT / f"{path.name}.{int(time.time())}")
        return [p.name for p in moved]

    def newest_through(self, step: int) -> Path | None:
        """The newest committed checkpoint of `step` or before."""
        return next((p for p in reversed(self.checkpoints()) if step_of(p) <= step), None)

    def prune(self) -> None:
        """Delete what the retention policy does not keep."""
        kept = self.retention.keep([(step_of(p), p) for p in self.checkpoints()], read_manifest)
        for old in self.checkpoints():
            if old not in kept:
                shutil.rmtree(old, ignore_errors=True)
                for sibling in (universal_path(old), ddp_path(old)):  # its conversions
                    shutil.rmtree(sibling, ignore_errors=True)


class DiskFullError(OSError):
    """A write failed because the checkpoints' filesystem has no room left (whatever the library's own message)."""


def disk_full(error: Exception, root: Path) -> Exception:
    """`error`, or a DiskFullError naming the folder when the disk is full: libraries word it their own way (safetensors'
    "os error 28", torch.save's "unexpected pos 64 vs 0")."""
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        return error
    if getattr(error, "errno", None) == errno.ENOSPC or free < 2**20:
        return DiskFullError(errno.ENOSPC, f"no space left on the disk of {root}: {free / 2**20:.1f} MiB free")
    return error
