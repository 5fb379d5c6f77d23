"""Checkpoints in one process: commit, verification, retention, a full disk, the save schedule."""

from __future__ import annotations

import json
import os
import resource
import signal
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
from accelerate import Accelerator
from accelerate.utils import DistributedType
from hypothesis import given
from hypothesis import strategies as st

from infra.checkpoint import (
    CORRUPT,
    CheckpointError,
    CheckpointManager,
    Checksums,
    RetentionConfig,
    RetentionPolicy,
    SaveClock,
    SaveClockConfig,
    problem,
    read_manifest,
    seal,
    share,
)
from infra.checkpoint.integrity import _lowest_priority
from infra.consensus import StepConsensus
from infra.files import atomic_write_text
from infra.preemption import Preemption
from infra.trainer import TrainState


@pytest.fixture(scope="module")
def accelerator():
    return Accelerator()


@pytest.fixture
def trainer(accelerator):
    """A tiny model and optimizer registered the way recipes do, with a counter to tell states apart."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    state = TrainState()

    def step():
        model(torch.randn(8, 64)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        state.step += 1

    return model, state, step


def manager(accelerator, tmp_path, **retention) -> CheckpointManager:
    policy = RetentionPolicy(RetentionConfig(**{"save_total_limit": None, **retention}))
    return CheckpointManager(accelerator, tmp_path, {"test": True}, policy)


def test_a_damaged_newest_checkpoint_is_skipped_for_the_previous_one(accelerator, trainer, tmp_path, capsys):
    model, state, step = trainer
    checkpoints = manager(accelerator, tmp_path)
    weights = {}
    for _ in range(3):
        step()
        checkpoints.save(state.step, {})
        weights[state.step] = model.weight.detach().clone()
    checkpoints.wait()
    assert [p.name for p in checkpoints.checkpoints()] == ["step_00000001", "step_00000002", "step_00000003"]
    newest = checkpoints.path(3)
    assert problem(newest) is None and read_manifest(newest)["files"]["model.safetensors"]["xxh3_64"]

    target = newest / "model.safetensors"
    raw = bytearray(target.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # one bit, same size: only the checksum can tell
    target.write_bytes(bytes(raw))
    assert problem(newest, checksums=False) is None
    assert problem(newest) == "model.safetensors does not match its checksum (altered or damaged on disk)"

    resume, manifest = checkpoints.resume("auto")  # loads step 3 while checking it, then step 2 over it
    assert resume == checkpoints.path(2) and manifest["step"] == 2
    assert "skipping checkpoint" in capsys.readouterr().out
    assert [p.name.split(".")[0] for p in (tmp_path / "checkpoints" / CORRUPT).iterdir()] == ["step_00000003"]
    assert torch.equal(model.weight, weights[2])

    (checkpoints.path(2) / "optimizer.bin").unlink()
    assert checkpoints.resume("auto")[0] == checkpoints.path(1)
    assert torch.equal(model.weight, weights[1])
    with open(checkpoints.path(1) / "model.safetensors", "r+b") as f:
        f.truncate(100)
    assert checkpoints.resume("auto") == (None, {})
    with pytest.raises(CheckpointError, match="cannot resume from .*step_00000009: no manifest.json"):
        checkpoints.resume(str(tmp_path / "checkpoints" / "step_00000009"))


@given(st.dictionaries(st.text(min_size=1, max_size=8), st.integers(0, 10**9), max_size=40), st.integers(1, 9))
def test_ranks_share_the_checksumming_evenly(sizes, ranks):
    """Every file is checked by exactly one rank, and no rank reads more than the lightest one plus one file."""
    shares = share(sizes, ranks)
    assert len(shares) == ranks and sorted(rel for part in shares for rel in part) == sorted(sizes)
    loads = [sum(sizes[rel] for rel in part) for part in shares]
    assert max(loads) - min(loads) <= max(sizes.values(), default=0)
    assert share(dict(reversed(sizes.items())), ranks) == shares  # the same split on every rank, whatever its listing order


def checksummed_files(folder: Path, flipped: tuple[str, int] | None) -> dict[str, dict]:
    """Three files (one empty) and their manifest entries; then one byte of `flipped` (file, offset) altered on disk."""
    rng = np.random.default_rng(0)
    files = {}
    for name, size in [("a.bin", 100_000), ("empty.bin", 0), ("b.bin", 50_000)]:
        data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        (folder / name).write_bytes(data)
        files[name] = {"size": size, "xxh3_64": xxhash.xxh3_64_hexdigest(data)}
    if flipped is not None:
        name, offset = flipped
        data = bytearray((folder / name).read_bytes())
        data[offset] ^= 1
        (folder / name).write_bytes(bytes(data))
    return files


FLIPS = [None, ("a.bin", 0), ("a.bin", 99_999), ("b.bin", 49_999)]


def verdict(flipped) -> str | None:
    return None if flipped is None else f"{flipped[0]} does not match its checksum (altered or damaged on disk)"


@pytest.mark.parametrize("flipped", FLIPS)
@pytest.mark.parametrize("hashed_in_background", [0, 7, "all"])
def test_checksums_taken_over_at_any_block_find_any_altered_byte(tmp_path, monkeypatch, flipped, hashed_in_background):
    """However many blocks the thread got through (none when it is starved; it is parked here),
    problem() finishes the rest, and the verdict is that of the whole files' xxh3-64."""
    monkeypatch.setattr("infra.checkpoint.integrity.BLOCK", 4096)
    files = checksummed_files(tmp_path, flipped)
    scheduled = threading.Event()  # the thread hashes nothing until the test lets it
    monkeypatch.setattr("infra.checkpoint.integrity._lowest_priority", scheduled.wait)
    before = set(threading.enumerate())
    checking = Checksums(tmp_path, files)
    (worker,) = set(threading.enumerate()) - before
    try:
        if hashed_in_background == "all":
            scheduled.set()
            worker.join(30)
        for _ in range(0 if hashed_in_background == "all" else hashed_in_background):
            checking._advance()  # as the thread would have, a block at a time
        assert checking.problem() == verdict(flipped)
    finally:
        scheduled.set()
    worker.join(30)
    assert not worker.is_alive()


@pytest.mark.parametrize("flipped", FLIPS)
def test_checksums_hashed_by_the_thread_and_the_caller_at_once(tmp_path, monkeypatch, flipped):
    """The thread at its lowest priority and problem() race for the blocks: the lock keeps the hashing in order."""
    monkeypatch.setattr("infra.checkpoint.integrity.BLOCK", 64)  # thousands of blocks: both threads get some
    files = checksummed_files(tmp_path, flipped)
    niceness = {}
    lowest = lambda: (_lowest_priority(), niceness.update(thread=current_niceness()))  # noqa: E731
    monkeypatch.setattr("infra.checkpoint.integrity._lowest_priority", lowest)
    main_before = current_niceness()
    for _ in range(5):
        assert Checksums(tmp_path, files).problem() == verdict(flipped)
    assert niceness["thread"] == 19  # the hashing thread alone runs at the lowest priority
    assert current_niceness() == main_before


def current_niceness() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_a_manifest_entry_without_a_known_checksum_is_named(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"a\.bin: its manifest entry has no checksum this version knows"):
        Checksums(tmp_path, {"a.bin": {"size": 1, "sha512": "00"}}, background=False).problem()


def test_checkpoints_with_crc32_manifests_still_verify(accelerator, trainer, tmp_path):
    """Manifests written before xxh3-64 carry CRC-32s: they are checked as such, not waved through."""
    _, state, step = trainer
    checkpoints = manager(accelerator, tmp_path)
    step()
    checkpoints.save(state.step, {})
    checkpoints.wait()
    path = checkpoints.path(state.step)
    manifest = read_manifest(path)
    crc32 = {rel: f"{zlib.crc32((path / rel).read_bytes()):08x}" for rel in manifest["files"]}
    manifest["files"] = {rel: {"size": e["size"], "crc32": crc32[rel]} for rel, e in manifest["files"].items()}
    atomic_write_text(path / "manifest.json", json.dumps(manifest))
    assert problem(path) is None
    with open(path / "model.safetensors", "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0x80]))
    assert problem(path) == "model.safetensors does not match its checksum (altered or damaged on disk)"


def test_a_full_disk_leaves_every_earlier_checkpoint_intact(accelerator, trainer, tmp_path):
    """A file-size limit makes writes fail with EFBIG, as a full disk fails them with ENOSPC."""
    _, state, step = trainer
    checkpoints = manager(accelerator, tmp_path)
    step()
    checkpoints.save(state.step, {})
    step()
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    try:
        with pytest.raises(
            CheckpointError, match=r"saving the checkpoint of step 2 failed \(.+\); the earlier checkpoints are intact: step_00000001"
        ):
            checkpoints.save(state.step, {})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000001"]
    assert problem(checkpoints.path(1)) is None


def test_retention_keeps_newest_best_and_milestones_across_a_restart(accelerator, trainer, tmp_path):
    _, state, step = trainer
    losses = {1: 5.0, 2: 3.0, 3: 4.0, 4: 2.5, 5: 6.0, 6: 7.0, 7: 8.0, 8: 9.0}
    kw = dict(save_total_limit=2, keep_best=2, metric_for_best_model="train/loss", save_milestone_steps=3)
    checkpoints = manager(accelerator, tmp_path, **kw)
    for _ in range(5):
        step()
        checkpoints.save(state.step, {"metrics": {"train/loss": losses[state.step]}})
    checkpoints.wait()
    assert [p.name[-1] for p in checkpoints.checkpoints()] == ["2", "3", "4", "5"]  # best 4, 2; milestone 3; newest 4, 5
    restarted = manager(accelerator, tmp_path, **kw)  # a new process: retention reads the manifests
    for _ in range(3):
        step()
        restarted.save(state.step, {"metrics": {"train/loss": losses[state.step]}})
    restarted.wait()
    assert [p.name[-1] for p in restarted.checkpoints()] == ["2", "3", "4", "6", "7", "8"]
    greater = manager(accelerator, tmp_path, save_total_limit=1, keep_best=1, greater_is_better=True)
    greater.prune()
    assert [p.name[-1] for p in greater.checkpoints()] == ["8"]  # the highest loss is also the newest


def consensus(accelerator, save_steps: int, minutes: str) -> StepConsensus:
    clock = SaveClock(SaveClockConfig(save_steps=save_steps, save_every_minutes=minutes))
    return StepConsensus(accelerator, clock, Preemption(grace_seconds=60))


def agreed(schedule: StepConsensus, step: int) -> tuple[bool, bool]:
    agreement = schedule.agree(step)
    return agreement.save_due, agreement.preempted


def test_schedule_saves_on_steps_on_the_clock_and_on_a_signal(accelerator):
    before = {sig: signal.getsignal(sig) for sig in Preemption.SIGNALS}
    by_steps = consensus(accelerator, save_steps=5, minutes="0")
    assert [agreed(by_steps, s) for s in (4, 5)] == [(False, False), (True, False)]
    clock = consensus(accelerator, save_steps=0, minutes="0.001")  # 60 ms
    assert agreed(clock, 1) == (False, False)
    time.sleep(0.07)
    assert agreed(clock, 2) == (True, False)
    assert clock.clock.saved(0.5) is None and agreed(clock, 3) == (False, False)  # the clock restarts at each save
    auto = consensus(accelerator, save_steps=0, minutes="auto")
    assert agreed(auto, 1) == (False, False)  # 30 minutes until a save has been measured
    assert auto.clock.saved(2.0) == pytest.approx((2 * 2.0 * 24 * 3600) ** 0.5 / 60)  # Young/Daly: 9.8 minutes
    for sig in Preemption.SIGNALS:
        schedule = consensus(accelerator, save_steps=0, minutes="0")
        with schedule.preemption.armed():  # leaving it also stops the watchdog that would end this process after the grace period
            assert schedule.agree(6).signal is None
            os.kill(os.getpid(), sig)
            agreement = schedule.agree(7)
            assert agreed(schedule, 7) == (True, True) and agreement.signal == sig.name  # the batch script requeues on SIGUSR1
    assert {sig: signal.getsignal(sig) for sig in Preemption.SIGNALS} == before
    assert schedule.agree(8, torch.tensor(1.0)).nonfinite and not schedule.agree(9, torch.tensor(0.0)).nonfinite


def test_the_preemption_watchdog_ends_a_process_that_does_not_exit(tmp_path):
    import subprocess
    import sys

    script = (
        "import os, signal, time\n"
        "from infra.preemption import Preemption\n"
        "with Preemption(grace_seconds=0.5).armed():\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(60)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "no clean exit within preemption_grace_seconds=0.5" in proc.stdout  # not 0 after the sleep


@pytest.mark.parametrize(
    "was, now", [("DEEPSPEED", "FSDP"), ("MULTI_CPU", "FSDP"), ("NO", "FSDP"), ("FSDP", "MULTI_CPU"), ("FSDP", "DEEPSPEED")]
)
def test_a_change_to_or_from_fsdp_is_refused(accelerator, trainer, tmp_path, monkeypatch, was, now):
    """Another world size, ZeRO stage or DDP <-> ZeRO is converted (tests/test_elastic.py); FSDP loads only its own
    sharded files and writes files no other engine loads: refused in one line (FSDP had crashed looking for them)."""
    _, state, step = trainer
    checkpoints = manager(accelerator, tmp_path)
    step()
    checkpoints.save(state.step, {"distributed_type": was, "world_size": 8})  # as 8 ranks of that engine would write it
    monkeypatch.setattr(accelerator.state, "distributed_type", DistributedType[now])
    refused = rf"written by 8 {was} processes and this run is 1 {now}: an FSDP checkpoint resumes under FSDP only"
    with pytest.raises(CheckpointError, match=refused):
        checkpoints.resume("auto")
    assert checkpoints.path(1).exists()  # refused, not thrown away


def test_a_background_save_holds_the_state_of_its_step(accelerator, trainer, tmp_path):
    """Training goes on while the save is written; the checkpoint still holds the step's weights, optimizer and RNG.

    Twice: the second save copies into the CPU buffers of the first.
    """
    model, state, step = trainer
    checkpoints = manager(accelerator, tmp_path, save_total_limit=None)
    sync = manager(accelerator, tmp_path / "sync", save_total_limit=None)
    for _ in range(2):
        step()
        saved = state.step
        checkpoints.save(saved, {}, background=True)
        weights = model.weight.detach().clone()
        next_draw = torch.rand(3)  # what the generator gives right after the save
        for _ in range(3):  # moves weights, optimizer moments and the RNG on while rank 0 writes
            step()
        checkpoints.wait()
        assert problem(checkpoints.path(saved)) is None
        assert not torch.equal(model.weight, weights)
        resume, _ = checkpoints.resume(str(checkpoints.path(saved)))
        assert resume == checkpoints.path(saved) and torch.equal(model.weight, weights)
        assert torch.equal(torch.rand(3), next_draw)
        sync.save(saved, {})  # the same state saved synchronously gives the same files
        for name in ("model.safetensors", "optimizer.bin", "scheduler.bin"):
            if (checkpoints.path(saved) / name).exists():
                assert (checkpoints.path(saved) / name).read_bytes() == (sync.path(saved) / name).read_bytes(), name
        state.step = saved  # resumed: the counters come from the manifest in a recipe


def test_a_published_folder_replaces_the_old_one_whole(tmp_path):
    """The export and prepared data are renamed into place: the old folder is moved aside, then deleted, never mixed."""
    from infra.files import publish_dir

    out, work = tmp_path / "final", tmp_path / "final.partial"
    for folder, names in ((out, ("a", "old_only")), (work, ("a", "b"))):
        folder.mkdir()
        for name in names:
            (folder / name).write_text(folder.name)
    (tmp_path / "final.old").mkdir()  # left by a crash between the two renames of an earlier publish
    publish_dir(work, out)
    assert sorted(p.name for p in out.iterdir()) == ["a", "b"] and (out / "a").read_text() == "final.partial"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]


def cached_pages(path: Path) -> int:
    """How many of the file's pages are in the page cache (mincore over a shared read-only mapping of it)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        vector = ctypes.create_string_buffer((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE)
        assert libc.mincore(address, size, vector) == 0, os.strerror(ctypes.get_errno())
        libc.munmap(address, size)
    finally:
        os.close(fd)
    return sum(b & 1 for b in vector.raw)


def test_a_sealed_checkpoint_leaves_the_page_cache(tmp_path):
    """Once fsynced and checksummed its pages are dropped: they would push training data out, and slow the next save."""
    data = tmp_path / "model.safetensors"
    data.write_bytes(os.urandom(8 << 20))
    assert cached_pages(data) > 0  # just written: in the cache
    assert seal(tmp_path)["model.safetensors"]["size"] == 8 << 20
    assert cached_pages(data) == 0


def test_a_zero_checkpoint_is_converted_once_and_a_failed_conversion_leaves_nothing(tmp_path, monkeypatch):
    """The universal sibling (infra.checkpoint.reshard; real conversions: tests/test_elastic.py) is made once and reused
    while it verifies; a damaged one is made again; a conversion that fails leaves no folder and names the checkpoint."""
    import subprocess

    from infra.checkpoint import reshard

    checkpoint = tmp_path / "step_00000004"
    (checkpoint / reshard.ZERO_FOLDER).mkdir(parents=True)
    (checkpoint / reshard.ZERO_FOLDER / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"shard")
    (checkpoint / "scheduler.bin").write_bytes(b"scheduler")
    atomic_write_text(checkpoint / "manifest.json", json.dumps({"step": 4, "files": {}}))
    runs = []

    def ds_to_universal(command, **kw):  # writes what DeepSpeed's tool writes from stage 2: the per-parameter folders
        runs.append(command)
        out = Path(command[command.index("--output_folder") + 1])
        (out / "zero" / "w").mkdir(parents=True)
        (out / "zero" / "w" / "exp_avg.pt").write_bytes(b"moments")
        torch.save(torch.tensor(4.0), out / "zero" / "w" / "step.pt")
        torch.save({"param_groups": [{"lr": 0.1, "params": [0]}]}, out / "zero" / "optimizer_state.pt")
        torch.save({"ds_version": "0"}, out / "mp_rank_00_model_states.pt")
        return subprocess.CompletedProcess(command, 0, stdout="")

    monkeypatch.setattr(reshard.subprocess, "run", ds_to_universal)
    made = reshard.to_universal(checkpoint)
    assert made == tmp_path / "step_00000004.universal" and len(runs) == 1
    manifest = read_manifest(made)
    assert manifest["step"] == 4 and manifest["converted_from"] == checkpoint.name
    names = {"mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt", "zero/optimizer_state.pt"}
    names |= {"zero/w/exp_avg.pt", "zero/w/step.pt"}
    assert set(manifest["files"]) == {"scheduler.bin", *(f"pytorch_model/{name}" for name in names)} and problem(made) is None
    stage3 = torch.load(made / "pytorch_model" / "zero" / "optimizer_state.pt")["optimizer_state_dict"]  # what it reads
    assert stage3 == {"state": {0: {"step": torch.tensor(4.0)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}
    assert reshard.to_universal(checkpoint) == made and len(runs) == 1  # whole: reused
    (made / "pytorch_model" / "zero" / "w" / "exp_avg.pt").write_bytes(b"MOMENTS")  # same size, altered
    assert reshard.to_universal(checkpoint) == made and len(runs) == 2 and problem(made) is None

    def failing(command, **kw):
        return subprocess.CompletedProcess(command, 1, stdout="AssertionError: no ZeRO files\n")

    monkeypatch.setattr(reshard.subprocess, "run", failing)
    (made / "scheduler.bin").unlink()
    with pytest.raises(CheckpointError, match=r"converting .*step_00000004 to a universal checkpoint failed \(AssertionError"):
        reshard.to_universal(checkpoint)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000004"]


def test_the_exporter_refuses_bad_input_in_one_line(tmp_path, capsys):
    """`python -m infra.export` (real exports: tests/test_recipes.py): an existing output, a checkpoint that does not
    verify, one without its model description: exit 1, one line, nothing written."""
    from infra.export import main

    checkpoint = tmp_path / "step_00000004"
    checkpoint.mkdir()
    (checkpoint / "model.safetensors").write_bytes(b"weights")
    cases = [
        (["--output", str(tmp_path)], f"--output {tmp_path} exists: give a new folder"),
        (["--output", str(tmp_path / "out")], "is not a usable checkpoint: no manifest.json"),
    ]
    for extra, message in cases:
        with pytest.raises(SystemExit) as exit_:
            main(["--checkpoint", str(checkpoint), *extra])
        assert exit_.value.code == 1 and message in capsys.readouterr().err
    atomic_write_text(checkpoint / "manifest.json", json.dumps({"step": 4, "files": {"model.safetensors": {"size": 7}}}))
    with pytest.raises(SystemExit):
        main(["--checkpoint", str(checkpoint), "--output", str(tmp_path / "out")])
    assert "is not a usable checkpoint: model.safetensors: its manifest entry has no checksum" in capsys.readouterr().err
    atomic_write_text(checkpoint / "manifest.json", json.dumps({"step": 4, "files": seal(checkpoint, ["model.safetensors"])}))
    with pytest.raises(SystemExit):
        main(["--checkpoint", str(checkpoint), "--output", str(tmp_path / "out")])
    assert "has no model/ (checkpoints written before this version lack it)" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000004"]


def test_a_checkpoint_is_converted_for_another_world_size_stage_or_engine_and_refused_for_another_precision(tmp_path):
    """What a DeepSpeed run decides about a ZeRO checkpoint, from its manifest (real launches: tests/test_elastic.py)."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    run = SimpleNamespace(
        distributed_type=DistributedType.DEEPSPEED,
        num_processes=2,
        mixed_precision="bf16",
        state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=3)),
    )
    checkpoints = CheckpointManager(run, tmp_path, {})
    written = {"distributed_type": "DEEPSPEED", "mixed_precision": "bf16", "files": {}}
    for facts, converted, refused in [
        ({"world_size": 2, "zero_stage": 3}, None, None),
        ({"world_size": 4, "zero_stage": 3}, "universal", None),
        ({"world_size": 2, "zero_stage": 2}, "universal", None),
        ({"world_size": 2, "distributed_type": "MULTI_CPU"}, "from DDP", None),
        ({"world_size": 2, "zero_stage": 3, "mixed_precision": "fp16"}, None, "mixed precision fp16 and this run is bf16"),
        ({"world_size": 2, "distributed_type": None}, "from DDP", "does not name the engine that wrote it"),
    ]:
        path = tmp_path / "step_00000001"
        path.mkdir(exist_ok=True)
        atomic_write_text(path / "manifest.json", json.dumps({**written, **facts}))
        assert checkpoints._conversion(path) == converted
        why = checkpoints._incompatibility(path)
        assert why is None if refused is None else refused in why


def test_a_ddp_checkpoint_that_does_not_fit_the_zero_model_is_refused_and_leaves_nothing(accelerator, trainer, tmp_path):
    """DDP -> ZeRO (infra.checkpoint.engines; real conversions: tests/test_elastic.py) numbers the optimizer's state by
    the recipes' groups: a checkpoint of another model is refused in one line, no sibling left behind."""
    from types import SimpleNamespace

    from infra.checkpoint.engines import from_ddp

    _, state, step = trainer
    checkpoints = manager(accelerator, tmp_path)
    step()
    path = checkpoints.save(state.step, {"distributed_type": "MULTI_CPU", "world_size": 2})
    other = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))  # 4 trainable tensors, not 2
    run = SimpleNamespace(deepspeed_engine_wrapped=SimpleNamespace(engine=SimpleNamespace(module=other)))
    with pytest.raises(CheckpointError, match=r"optimizer holds the state of 2 parameters and this model trains 4"):
        from_ddp(path, run)
    assert sorted(p.name for p in tmp_path.glob("checkpoints/*")) == [path.name]
