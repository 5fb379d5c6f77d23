"""Health checks around training: replicas in sync, stragglers (hangs and lost peers: infra.hangs; non-finite steps:
infra.guard)."""

from __future__ import annotations

import contextlib
import time
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from infra.config import require
from infra.environment import zero_stage


@dataclass
class HealthConfig:
    """Hang and straggler flags (part of TrainingArguments); non-finite steps are NonFiniteConfig's."""

    _argument_group_name = "hangs and stragglers"  # its heading in --help

    ddp_timeout: int = field(
        default=1800,
        metadata={"help": "Seconds a collective may wait in start-up, the first step, saves, loads and evaluations before the job fails."},
    )
    ddp_step_timeout: int = field(
        default=0,
        metadata={
            "help": "After the first step, seconds without a finished step before each rank stops, naming the host and rank that "
            "is lost or silent (0: max(30, 5 x the slowest of the last 100 steps))."
        },
    )
    straggler_window_steps: int = field(
        default=50, metadata={"help": "Compare per-rank forward and data-wait times every N steps (0: off)."}
    )
    straggler_factor: float = field(default=1.5, metadata={"help": "A rank slower than this x the median is a straggler."})
    straggler_patience: int = field(default=3, metadata={"help": "Windows in a row a rank must be slow before it is reported."})
    straggler_action: Literal["warn", "checkpoint_and_exit", "rebalance"] = field(
        default="warn",
        metadata={
            "help": "checkpoint_and_exit: save and exit with code 75 so the job is restarted without the slow node. "
            "rebalance: every window, each process's share of every micro-step follows its measured speed (the global "
            "batch and its samples unchanged), so a slow process takes fewer samples instead of setting the pace; with "
            "replica groups, each group's share of the step."
        },
    )
    straggler_min_samples: int = field(
        default=1,
        metadata={"help": "With straggler_action=rebalance, the fewest samples of a micro-step a process keeps (at most the even share)."},
    )
    straggler_read_ahead: bool = field(
        default=True,
        metadata={
            "help": "With straggler_action=rebalance, a process slow at its data (its wait past the median process's over 5% "
            "of its time and over its compute past the median's: a slow disk) reads two steps' micro-batches ahead in a "
            "thread, from then on (held in its memory)."
        },
    )
    straggler_leave_factor: float = field(
        default=4.0,
        metadata={
            "help": "With straggler_action=rebalance, a process slower a sample than this x the median's for straggler_patience "
            "windows, or still the slowest step at straggler_min_samples, is left out: saved, exit 75, its host named in "
            "stopped.json (0: never left out)."
        },
    )

    straggler_replay: str = field(
        default="",
        metadata={
            "help": "A run's checkpoint folder, or its output_dir (its newest checkpoint): each process's samples of every "
            "micro-step as that run had them (its rebalanced shares), instead of even ones: a replay bit-exact with it. "
            "Not with straggler_action=rebalance."
        },
    )

    def __post_init__(self):
        for name in ("ddp_timeout", "ddp_step_timeout", "straggler_window_steps"):
            require(getattr(self, name) >= 0, name, getattr(self, name), "an integer >= 0")
        require(self.straggler_patience >= 1, "straggler_patience", self.straggler_patience, "an integer >= 1")
        require(self.straggler_factor > 1, "straggler_factor", self.straggler_factor, "a number > 1")
        require(self.straggler_min_samples >= 1, "straggler_min_samples", self.straggler_min_samples, "an integer >= 1")
        leave = self.straggler_leave_factor
        above = f"0 or a number > straggler_factor ({self.straggler_factor:g})"
        require(leave == 0 or leave > self.straggler_factor, "straggler_leave_factor", leave, above)
        replay = "a run's checkpoint or output_dir, with straggler_action warn or checkpoint_and_exit (its shares, not measured ones)"
        require(not (self.straggler_replay and self.straggler_action == "rebalance"), "straggler_replay", self.straggler_replay, replay)


def gathers_in_forward(accelerator: Accelerator) -> bool:
    """Whether every forward gathers the parameters (ZeRO-3, FSDP): a rank waits there for the slowest."""
    return accelerator.distributed_type == DistributedType.FSDP or zero_stage(accelerator) == 3


class GatherWaits:
    """The time a forward spends in the hooks that gather a module's parameters before it runs (ZeRO-3's fetch, FSDP2's
    unshard: where a rank waits for the slowest one), so that a rank's forward time is its own compute. Each module's
    forward pre-hooks are bracketed by two of ours, one put before them and one after: the time between is the gather
    (on a GPU, a pair of CUDA events on the compute stream, whose wait for the gather lies between them). Counted only
    inside `StragglerDetector.compute` (not in eval, nor in the recomputed forwards of activation checkpointing)."""

    def __init__(self, model: torch.nn.Module, cuda: bool):
        self.cuda, self.active = cuda, False
        self.seconds = 0.0  # on CPU: the gathers' seconds so far
        self.events: list = []  # on a GPU: (start, end) pairs
        self._began: float | torch.cuda.Event = 0.0
        for module in model.modules():
            if module._forward_pre_hooks:  # a module the engine gathers (it put its hook there)
                module.register_forward_pre_hook(self._before, prepend=True)
                module.register_forward_pre_hook(self._after)

    def _before(self, module, args) -> None:
        if self.active:
            if self.cuda:
                self._began = torch.cuda.Event(enable_timing=True)
                self._began.record()
            else:
                self._began = time.perf_counter()

    def _after(self, module, args) -> None:
        if self.active:
            if self.cuda:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self.events.append((self._began, end))
            else:
                self.seconds += time.perf_counter() - self._began

    def take(self) -> float:
        """The seconds gathered since the last take (a GPU's after a synchronize)."""
        seconds = self.seconds + sum(s.elapsed_time(e) for s, e in self.events) / 1000
        self.seconds, self.events = 0.0, []
        return seconds


class DesyncError(RuntimeError):
    """Data-parallel replicas that should be identical are not."""


def parameter_fingerprint(model: torch.nn.Module) -> str:
    """CRC32 over every parameter's bytes, in name order: equal iff the weights are bit-identical (in practice)."""
    crc = 0
    for name, param in sorted(model.named_parameters()):
        crc = zlib.crc32(name.encode(), crc)
        crc = zlib.crc32(param.detach().float().cpu().contiguous().numpy().tobytes(), crc)
    return f"{crc:08x}"


# ---------------------------------------------------------------------------------------------
# Stragglers


class StragglerDetector:
    """Per-rank forward time and data wait, compared across ranks every `window` steps.

    Forward time is the compute signal: under DDP, once the buffer sync before each forward is
    off (done here: the recipes' buffers are constants), the forward pass runs no collective and measures this rank's own speed,
    while a backward or a step includes waiting for the slowest rank. Under ZeRO-3 and FSDP the
    forward gathers parameters, where a rank waits for the slowest: those waits are timed apart and left
    out (GatherWaits). Every window one
    all-gather of four numbers per rank (forward and data-wait seconds, samples and micro-batches: a step's on
    average); a rank whose time exceeds `factor` x the median for `patience` windows in a row is a straggler. The
    decision comes from the gathered numbers, so every rank reaches it at the same step with no further communication;
    so do each rank's samples and seconds a micro-batch, which the shares follow (straggler_action: rebalance).
    """

    def __init__(self, accelerator: Accelerator, model: torch.nn.Module, hosts: list[str], window: int, factor: float, patience: int):
        self.accelerator, self.hosts, self.window, self.factor, self.patience = accelerator, hosts, window, factor, patience
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model.forward_sync_buffers = False
        self.cuda = accelerator.device.type == "cuda"
        # under ZeRO-3 and FSDP the forward's gathers are left out of its time: there a rank waits for the slowest
        self.gathers = GatherWaits(model, self.cuda) if window > 0 and gathers_in_forward(accelerator) else None
        self.streak = [0] * accelerator.num_processes
        self._compute: list = []
        self._data = 0.0
        self._samples = 0
        self._steps = 0
        self.timing = True

    @contextlib.contextmanager
    def untimed(self) -> Iterator[None]:
        """Passes that are not this rank's pace left out of its times: a step computed again (infra.replay) would count
        its forwards twice against its samples once."""
        self.timing = False
        try:
            yield
        finally:
            self.timing = True

    @contextlib.contextmanager
    def compute(self) -> Iterator[None]:
        """Time the enclosed forward pass (CUDA events on a GPU: no synchronisation in the loop); under ZeRO-3 and FSDP
        its parameter gathers are timed apart (GatherWaits) and left out at the window's end. Nothing under `untimed`."""
        if not self.timing:
            yield
            return
        if self.gathers is not None:
            self.gathers.active = True
        try:
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
        finally:
            if self.gathers is not None:
                self.gathers.active = False

    def waited(self, seconds: float, samples: int) -> None:
        """This rank's wait for the step's data, and its samples (its share)."""
        self._data += seconds
        self._samples += samples

    def step(self) -> Window | None:
        """After each optimizer step: the window's findings at its end, else None."""
        self._steps += 1
        if self.window <= 0 or self._steps < self.window:
            return None
        if self.cuda:
            torch.cuda.synchronize()
            compute = sum(s.elapsed_time(e) for s, e in self._compute) / 1000
        else:
            compute = sum(self._compute)
        if self.gathers is not None:
            compute = max(compute - self.gathers.take(), 0.0)
        counts = [compute, self._data, self._samples, len(self._compute)]
        mine = torch.tensor(counts, device=self.accelerator.device, dtype=torch.float64) / self._steps
        self._compute, self._data, self._samples, self._steps = [], 0.0, 0, 0
        gathered = self.accelerator.gather(mine.reshape(1, 4)).reshape(-1, 4).cpu()
        times, micro = gathered[:, :2], gathered[:, 3].clamp(min=1)
        # a micro-batch's samples and seconds: a backward costs about two forwards, the wait for data included
        sizes = (gathered[:, 2] / micro).tolist()
        seconds = ((BACKWARD_AND_FORWARD * times[:, 0] + times[:, 1]) / micro).tolist()
        total = times.sum(dim=1)
        median = float(total.sort().values[(len(total) - 1) // 2])  # the lower median: with 2 ranks, the faster one
        ratios = (total / max(median, 1e-9)).tolist()
        slow = []
        for rank, ratio in enumerate(ratios):
            self.streak[rank] = self.streak[rank] + 1 if ratio > self.factor else 0
            if self.streak[rank] >= self.patience:
                slow.append(rank)
        waits = (times[:, 1] / micro).tolist()
        report = None
        if slow:
            med_compute, med_data = (float(c.sort().values[(len(c) - 1) // 2]) for c in times.T)
            at_data = slow_at_data(waits, seconds)
            parts = []
            for rank in slow:
                c, d = times[rank].tolist()
                cause = "data loading" if at_data[rank] else "compute"
                parts.append(
                    f"rank {rank} on {self.hosts[rank]} took {ratios[rank]:.1f}x the median step for {self.streak[rank]} windows "
                    f"of {self.window} steps (forward {c:.3f}s vs {med_compute:.3f}s, data wait {d:.3f}s vs {med_data:.3f}s): {cause}"
                )
            report = "straggler: " + "; ".join(parts)
        return Window({f"straggler/rank_{r}": ratio for r, ratio in enumerate(ratios)}, report, slow, sizes, seconds, waits)


class Window(NamedTuple):
    """What a straggler window found: each rank's step time over the median's (straggler/rank_i), the line naming the
    slow ones (None: none), their ranks, and each rank's mean samples and seconds of a micro-batch, and of those seconds
    its wait for data."""

    ratios: dict[str, float]
    report: str | None
    slow: list[int]
    sizes: list[float]
    seconds: list[float]
    waits: list[float]


BACKWARD_AND_FORWARD = 3.0  # a forward and its backward, in forwards


def slow_at_data(waits: Sequence[float], seconds: Sequence[float], least: float = 0.0) -> list[bool]:
    """Each process slow at its data (a slow disk, a slow mount), from a window's mean wait for data and seconds of a
    micro-batch, a process each: its wait past the median process's over its compute past the median's (not a process
    slow at everything: a throttled CPU reads slowly too) and over `least` of its time. The straggler line's cause
    "data loading", and (with `least` WAITING) who reads ahead."""
    computes = [time - wait for wait, time in zip(waits, seconds, strict=True)]
    median_wait, median_compute = (sorted(values)[(len(values) - 1) // 2] for values in (waits, computes))
    return [
        time > 0 and wait - median_wait > max(least * time, compute - median_compute)
        for wait, time, compute in zip(waits, seconds, computes, strict=True)
    ]


WAITING = 0.05  # a process slow at its data, its wait past the median process's over this part of its time, reads ahead
STEPS_AHEAD = 2  # that far: a step's reads hidden behind the step before, and one step's slack for a slower read


def deeper(depths: Sequence[int], waits: Sequence[float], seconds: Sequence[float], accumulation: int) -> list[int] | None:
    """Each process's batches read ahead (infra.data.ahead) after a window (its mean wait for data and seconds of a
    micro-batch, the same numbers on every process): STEPS_AHEAD steps' micro-batches for a process slow at its data
    (`slow_at_data`) by more than WAITING of its time: not one whose reads are merely a part of a small step (a tiny
    model's), nor one slow at everything (a thread would take the CPU from its step). A depth is never lowered (a
    change of the shares counts the deepest). None: no change."""
    reads = slow_at_data(waits, seconds, least=WAITING)
    new = [max(depth, STEPS_AHEAD * accumulation) if slow else depth for depth, slow in zip(depths, reads, strict=True)]
    return new if new != list(depths) else None
