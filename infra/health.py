"""Health checks around training: replicas in sync, stragglers, hangs (non-finite steps: infra.guard)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Literal

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, gather_object

from infra.config import require

STRAGGLER_EXIT_CODE = 75  # EX_TEMPFAIL: saved and stopped on purpose, to be restarted without the slow rank


@dataclass
class HealthConfig:
    """Hang and straggler flags (part of TrainingArguments); non-finite steps are NonFiniteConfig's."""

    ddp_timeout: int = field(
        default=1800, metadata={"help": "Seconds a collective may wait during start-up and the first step before the job fails."}
    )
    ddp_step_timeout: int = field(
        default=900,
        metadata={
            "help": "After the first step, seconds a collective may wait before the job fails naming the rank that is behind "
            "(0: keep ddp_timeout). Must exceed the longest checkpoint save."
        },
    )
    straggler_window_steps: int = field(
        default=50, metadata={"help": "Compare per-rank forward and data-wait times every N steps (0: off)."}
    )
    straggler_factor: float = field(default=1.5, metadata={"help": "A rank slower than this x the median is a straggler."})
    straggler_patience: int = field(default=3, metadata={"help": "Windows in a row a rank must be slow before it is reported."})
    straggler_action: Literal["warn", "checkpoint_and_exit"] = field(
        default="warn",
        metadata={"help": "checkpoint_and_exit: save and exit with code 75 so the job is restarted without the slow node."},
    )

    def __post_init__(self):
        for name in ("ddp_timeout", "ddp_step_timeout", "straggler_window_steps"):
            require(getattr(self, name) >= 0, name, getattr(self, name), "an integer >= 0")
        require(self.straggler_patience >= 1, "straggler_patience", self.straggler_patience, "an integer >= 1")
        require(self.straggler_factor > 1, "straggler_factor", self.straggler_factor, "a number > 1")


class DesyncError(RuntimeError):
    """Data-parallel replicas that should be identical are not."""


def parameter_fingerprint(model: torch.nn.Module) -> str:
    """CRC32 over every parameter's bytes, in name order: equal iff the weights are bit-identical (in practice)."""
    crc = 0
    for name, param in sorted(model.named_parameters()):
        crc = zlib.crc32(name.encode(), crc)
        crc = zlib.crc32(param.detach().float().cpu().contiguous().numpy().tobytes(), crc)
    return f"{crc:08x}"


def check_replicas_in_sync(accelerator: Accelerator, model: torch.nn.Module) -> list[str]:
    """Gather every rank's parameter fingerprint and raise if data-parallel replicas differ.

    Only meaningful where each rank holds the whole model (DDP, single process); sharded
    strategies (ZeRO-3, FSDP) hold different shards by design and are not checked.
    """
    if accelerator.num_processes == 1 or accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP):
        return []
    fingerprints = gather_object([parameter_fingerprint(accelerator.unwrap_model(model))])
    if len(set(fingerprints)) != 1:
        raise DesyncError(f"data-parallel replicas diverged: parameter fingerprints by rank {fingerprints}")
    accelerator.print(f"parameters identical on all {len(fingerprints)} ranks: fingerprints {fingerprints}")
    return fingerprints


# ---------------------------------------------------------------------------------------------
# Stragglers


class StragglerDetector:
    """Per-rank forward time and data wait, compared across ranks every `window` steps.

    Forward time is the compute signal: under DDP, once the buffer sync before each forward is
    off (done here: the recipes' buffers are constants), the forward pass runs no collective and measures this rank's own speed,
    while a backward or a step includes waiting for the slowest rank. Under ZeRO-3 and FSDP the
    forward gathers parameters and the signal is blurred by the others' pace. Every window one
    all-gather of two numbers per rank; a rank whose time exceeds `factor` x the median for
    `patience` windows in a row is a straggler. The decision comes from the gathered numbers, so
    every rank reaches it at the same step with no further communication.
    """

    def __init__(self, accelerator: Accelerator, model: torch.nn.Module, window: int, factor: float, patience: int):
        self.accelerator, self.window, self.factor, self.patience = accelerator, window, factor, patience
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model.forward_sync_buffers = False
        self.cuda = accelerator.device.type == "cuda"
        self.hosts = gather_object([socket.gethostname()]) if accelerator.num_processes > 1 else [socket.gethostname()]
        self.streak = [0] * accelerator.num_processes
        self._compute: list = []
        self._data = 0.0
        self._steps = 0

    @contextlib.contextmanager
    def compute(self) -> Iterator[None]:
        """Time the enclosed forward pass (CUDA events on a GPU: no synchronisation in the loop)."""
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._compute.append((start, end))
        else:
            t = time.perf_counter()
            yield
            self._compute.append(time.perf_counter() - t)

    def waited(self, seconds: float) -> None:
        self._data += seconds

    def step(self) -> tuple[dict[str, float], str | None, list[int]]:
        """After each optimizer step: ({straggler/rank_i: ratio}, report, slow ranks) at the end of a window, else ({}, None, [])."""
        self._steps += 1
        if self.window <= 0 or self._steps < self.window:
            return {}, None, []
        if self.cuda:
            torch.cuda.synchronize()
            compute = sum(s.elapsed_time(e) for s, e in self._compute) / 1000
        else:
            compute = sum(self._compute)
        mine = torch.tensor([compute / self._steps, self._data / self._steps], device=self.accelerator.device)
        self._compute, self._data, self._steps = [], 0.0, 0
        times = self.accelerator.gather(mine.reshape(1, 2)).reshape(-1, 2).double().cpu()
        total = times.sum(dim=1)
        median = float(total.sort().values[(len(total) - 1) // 2])  # the lower median: with 2 ranks, the faster one
        ratios = (total / max(median, 1e-9)).tolist()
        slow = []
        for rank, ratio in enumerate(ratios):
            self.streak[rank] = self.streak[rank] + 1 if ratio > self.factor else 0
            if self.streak[rank] >= self.patience:
                slow.append(rank)
        report = None
        if slow:
            med_compute, med_data = (float(c.sort().values[(len(c) - 1) // 2]) for c in times.T)
            parts = []
            for rank in slow:
                c, d = times[rank].tolist()
                cause = "data loading" if d - med_data > c - med_compute else "compute"
                parts.append(
                    f"rank {rank} on {self.hosts[rank]} took {ratios[rank]:.1f}x the median step for {self.streak[rank]} windows "
                    f"of {self.window} steps (forward {c:.3f}s vs {med_compute:.3f}s, data wait {d:.3f}s vs {med_data:.3f}s): {cause}"
                )
            report = "straggler: " + "; ".join(parts)
        return {f"straggler/rank_{r}": ratio for r, ratio in enumerate(ratios)}, report, slow


# ---------------------------------------------------------------------------------------------
# Hangs


class Heartbeat:
    """Each rank's last finished step in the launcher's key-value store, so a timeout can name the rank that is stuck.

    A collective that times out only says that it timed out; the store still answers, and the
    rank whose step lags the others' is the one that hung or died. After the first step the
    collective timeout drops from `start_timeout` to `step_timeout` (start-up is over: from now on
    a long wait means a rank is gone), except inside `relaxed()` (checkpoint saves and loads). On
    NCCL the watchdog aborts the process at the timeout before Python can explain it, so a thread
    prints the diagnosis when no step has finished for 80% of the timeout.
    """

    KEY = "infra/heartbeat/{}"

    def __init__(self, accelerator: Accelerator, start_timeout: float, step_timeout: float):
        self.accelerator, self.start_timeout, self.step_timeout = accelerator, start_timeout, step_timeout
        self.store = None
        self.shortened = self._relaxed = self._reported = False
        self._last = time.monotonic()
        if accelerator.num_processes > 1:
            from torch.distributed.distributed_c10d import _get_default_store

            self.store = _get_default_store()
            if step_timeout > 0:
                threading.Thread(target=self._watch, name="heartbeat-watch", daemon=True).start()

    def _set_timeout(self, seconds: float) -> None:
        from torch.distributed.distributed_c10d import _set_pg_timeout

        _set_pg_timeout(timedelta(seconds=seconds))

    def beat(self, step: int) -> None:
        """After each step; the first one also shortens the collective timeout."""
        self._last = time.monotonic()
        if self.store is None:
            return
        self.store.set(self.KEY.format(self.accelerator.process_index), str(step))
        if not self.shortened and self.step_timeout > 0:
            self._set_timeout(self.step_timeout)
            self.shortened = True

    @contextlib.contextmanager
    def relaxed(self) -> Iterator[None]:
        """The start-up timeout for work that may legitimately keep ranks waiting long (rank 0 checksumming a save)."""
        if not self.shortened:
            yield
            return
        self._relaxed = True
        self._set_timeout(self.start_timeout)
        try:
            yield
        finally:
            self._set_timeout(self.step_timeout)
            self._relaxed, self._last = False, time.monotonic()

    def _watch(self) -> None:
        while True:
            time.sleep(min(30.0, self.step_timeout / 5))
            idle = time.monotonic() - self._last
            if self.shortened and not self._relaxed and not self._reported and idle > 0.8 * self.step_timeout:
                self._reported = True
                print(f"{self.diagnosis()} (no step finished here for {idle:.0f}s)", flush=True)

    def diagnosis(self) -> str:
        """Which ranks are behind, from the store."""
        steps, timeout = {}, self.store.timeout
        self.store.set_timeout(timedelta(seconds=5))  # a key never written must not keep us waiting
        for rank in range(self.accelerator.num_processes):
            try:
                steps[rank] = int(self.store.get(self.KEY.format(rank)))
            except Exception:
                steps[rank] = -1  # never beat, or the store is gone too
        with contextlib.suppress(Exception):
            self.store.set_timeout(timeout)
        ahead = max(steps.values())
        behind = [r for r, s in steps.items() if s < ahead]
        where = ", ".join(f"rank {r} at step {steps[r]}" if steps[r] >= 0 else f"rank {r} before its first step" for r in behind)
        return f"hang: a collective on rank {self.accelerator.process_index} waited past the timeout; " + (
            f"{where} while the others finished step {ahead}: that rank is hung or dead"
            if behind
            else "every rank had finished the same step"
        )

    @contextlib.contextmanager
    def explaining(self) -> Iterator[None]:
        """A collective that times out inside ends the program with one line naming the rank that hung."""
        try:
            yield
        except Exception as err:
            if (why := self.explain(err)) is not None:
                raise SystemExit(why) from err
            raise

    def explain(self, error: BaseException) -> str | None:
        """A one-line diagnosis when `error` is a collective timeout (None for other errors)."""
        if self.store is None or not any(s in str(error).lower() for s in ("timed out", "timeout")):
            return None
        return self.diagnosis()
