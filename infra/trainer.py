"""The Trainer every recipe shares; a recipe supplies its model, its data and its loss.

    trainer = Trainer(accelerator, args, data_args, config, Job("pretrain_clm", model, data, loss=lm_loss, ...))
    trainer.run()          # or train(...), which does both

`run()` is the whole story: the preflight, the resume of the newest checkpoint that verifies (and of
the same MLflow run), then optimizer steps to `max_steps`, each followed by what is due (logging,
held-out eval, a checkpoint), until the end or a stop (infra.stopped: a preemption, a straggler); then the export
and one exit. Each phase is a method and each concern a component built in the constructor:

    checkpoints  infra.checkpoint    save, commit, verify, resume, retention
    clock        infra.checkpoint    when a save is due (steps, minutes, Young/Daly)
    consensus    infra.consensus     one all-reduce per step: preempted, save due, non-finite
    guard        infra.guard         non-finite steps: skip, roll back, stop
    metrics      infra.metrics       what is logged every logging_steps
    exporter     infra.export        final/ and its model card
    stragglers   infra.health        slow ranks named (and a job that saves and exits without them)
    rebalancing  infra.rebalance     each rank's share after its speed (straggler_action: rebalance)
    shares       infra.data.steps    what each process trains on at a step
    combine      infra.combine       how the processes' gradients are combined, and whether a step counts; it
                                     sees the loop through infra.combine.Loop, never the Trainer
    watch        infra.observers     the watchdog, goodput, progress, MLflow, the sample trace: told what happens

Every flag is in `TrainingArguments`, one flat command line and YAML, made of the sections those
components declare beside themselves.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from torch.distributed.tensor import DTensor
from tqdm.auto import tqdm

from infra.arguments import TrainingArguments
from infra.checkpoint import (
    CheckpointError,
    CheckpointManager,
    RetentionPolicy,
    SaveClock,
    manifest_of,
)
from infra.combine import Combine, EngineSum
from infra.consensus import Agreement, StepConsensus
from infra.data import DataArguments, SampleTrace, eval_batches
from infra.data.steps import EvenShares, Micro, SplitShares
from infra.data.stream import named_parts
from infra.distributed import LaunchError, resharded
from infra.environment import environment_facts
from infra.export import Exporter
from infra.goodput import Goodput, summary
from infra.guard import NonFiniteGuard
from infra.hangs import Watchdog, log_forensics, roster
from infra.health import StragglerDetector
from infra.hooks import Hooks
from infra.job import Batch, Job, LossOutput, attention_of
from infra.leave import leave_out, part_ways
from infra.memory import Setup, sample_caps
from infra.metrics import EtaCheck, TrainMetrics
from infra.observers import Observers
from infra.preemption import Preemption
from infra.preflight import run_preflight
from infra.prepare import prepare, refuse_or_claim
from infra.rebalance import Rebalancing
from infra.replay import Passes, Replays
from infra.sdc import Copies, Mismatch, describe
from infra.shares import Seat
from infra.stopped import Reason, Stop, write_record
from infra.tracking import MetricLogger, end_run, last_logged_step, run_name_for, run_tags, start_run, tracking_uri


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


@dataclass
class StepResult:
    """What one optimizer step did, as every rank agrees."""

    loss: torch.Tensor  # the sum of its micro-batches' losses (on the device)
    grad_norm: torch.Tensor | float | None
    skipped: bool  # non-finite loss or gradients on some rank: no optimizer step
    save_due: bool
    preempted: str | None  # the signal (SIGTERM or SIGUSR1) that reached some rank


def samples_in(batch: Batch) -> int:
    return len(next(iter(batch.values())) if isinstance(batch, dict) else batch)


def to_device(batch: Batch, device: torch.device) -> Batch:
    if isinstance(batch, dict):
        return {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    return batch.to(device, non_blocking=True)


class Trainer:
    """Prepare, preflight, resume, train to max_steps (or a stop), save, export. Built and run on every rank."""

    def __init__(
        self,
        accelerator: Accelerator,
        args: TrainingArguments,
        data_args: DataArguments,
        config: dict,
        job: Job,
        hooks: Hooks | None = None,
        combine: Combine | None = None,
    ):
        acc = self.accelerator = accelerator
        self.args, self.data_args, self.config, self.job = args, data_args, config, job
        self.hooks = hooks or Hooks()
        self.combine = combine or EngineSum()
        refuse_or_claim(acc, args, job, self.own_dir)  # a refusal leaves nothing on disk; then this job's alone
        ready = prepare(acc, args, data_args, job, self.hooks)  # the order accelerate and the engines need
        self.model, self.optimizer, self.scheduler, self.loader, self.cursor, self.shape = ready
        self.shares = self.shares_of(self.loader)
        self.units_per_step = self.shares.samples_per_step * job.units_per_sample

        self.state = TrainState()
        self.retention = RetentionPolicy(args)
        self.exporter = Exporter(acc, args.output_dir, job.name, job.processor, job.task, config, adapter_only=job.adapter_only)
        self.checkpoints = CheckpointManager(
            acc,
            args.output_dir,
            config,
            self.retention,
            before_commit=self.hooks.before_commit,
            describe=lambda folder: self.exporter.describe(self.model, folder),
            upload_to=args.checkpoint_upload_dir,
        )
        self.clock = SaveClock(args)
        self.preemption = Preemption(args.preemption_grace_seconds)
        self.consensus = StepConsensus(acc, self.clock, self.preemption)
        self.guard = NonFiniteGuard(acc, args, self.checkpoints, args.verify_checksums)
        self.copies = Copies(acc, self.model, self.optimizer, args)  # what the processes hold identically (infra.sdc)
        # a suspicious step computed again (infra.replay); a rank it names counts with those the copies name
        self.replays = Replays(acc, args.sdc_replay, args.sdc_spike_factor, args.fault_tolerance, self.copies.named)
        sources = [s.name for s in job.data.mixture.sources] if job.data.mixture and job.per_sample_losses else []
        self.metrics = TrainMetrics(acc, job.unit, job.flops_per_unit, compiled=args.torch_compile, sources=sources)
        self.peers = peers = roster(acc)  # each rank's host and addresses
        watchdog = Watchdog(acc, self.own_dir, args.ddp_timeout, args.ddp_step_timeout, peers)
        self.watch = Observers(watchdog, Goodput(self.own_dir, acc.is_main_process), acc.is_main_process)
        hosts = [p.host for p in peers]
        window, factor, patience = args.straggler_window_steps, args.straggler_factor, args.straggler_patience
        self.stragglers = StragglerDetector(acc, self.model, hosts, window, factor, patience)
        # what each rank's memory holds: its cap (replica groups are rebalanced as wholes, by their number of micro-batches)
        rebalancing = args.straggler_action == "rebalance" and args.fault_tolerance != "replicas" and self.shape is not None
        caps = sample_caps(acc, self.model, self.shape, Setup.of(acc, args.gradient_checkpointing)) if rebalancing else None
        self.rebalancing = Rebalancing(args, hosts, caps, self.watch)  # its speeds learnt are in every checkpoint
        # set by resume(): they depend on the checkpoint resumed from
        self.run_id: str | None = None
        self.latest: dict[str, float] = {}  # the latest of each metric, eval included: checkpoints and keep_best read them
        self.facts: dict[str, Any] = {}  # versions, git state: recorded in every checkpoint
        self.step_started = time.monotonic()
        self.learning_rate = 0.0  # the rate of the last step taken: train/learning_rate
        self.combine.bind(self)  # last: it may read any of the above (a replica group's heal reads the model)

    @property
    def own_dir(self) -> str:
        """Where this job's own files go (its lock, goodput, sample trace, hang reports, stop record, MLflow run id)."""
        return self.args.own_dir

    # -- what a combine may ask of the loop (infra.combine.Loop) ------------------------------------------------------

    @property
    def at_step(self) -> int:
        return self.state.step

    @property
    def hosts(self) -> list[str]:
        return self.stragglers.hosts

    @property
    def samples_per_step(self) -> int:
        return self.shares.samples_per_step

    @property
    def samples_read(self) -> int:
        return self.shares.samples_read

    def live_state(self) -> dict:
        """Everything another copy of this state needs to train on as this one: the state dicts of the model, the
        optimizer, the schedule, the data position and the counters; the latest metrics (a replica group's heal)."""
        acc = self.accelerator
        return {
            "model": acc.unwrap_model(self.model).state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "cursor": self.cursor.state_dict(),
            "train": self.state.state_dict(),
            "metrics": dict(self.latest),
        }

    def load_live_state(self, state: dict, placed) -> None:
        """`live_state`'s of another copy loaded; `placed(value, like)`: a received tensor laid out as this process's
        `like` (under FSDP2 a part of a sharded tensor)."""
        model = self.accelerator.unwrap_model(self.model)
        ours = model.state_dict()
        model.load_state_dict({k: placed(v, ours[k]) for k, v in state["model"].items()})
        params = [p for group in self.optimizer.param_groups for p in group["params"]]  # the optimizer state's numbering
        moments = {i: {k: placed(v, params[i]) for k, v in s.items()} for i, s in state["optimizer"]["state"].items()}
        self.optimizer.load_state_dict({**state["optimizer"], "state": moments})
        self.scheduler.load_state_dict(state["scheduler"])
        self.cursor.load_state_dict(state["cursor"])
        self.state.load_state_dict(state["train"])
        self.latest = dict(state["metrics"])

    def healed(self) -> None:
        """The state was replaced by a live copy's: the test hooks and the progress bar told."""
        self.hooks.on_state("healed", self.state.step, self.model, self.optimizer)
        self.watch.healed(self.state.step)

    # -- the loop -------------------------------------------------------------------------------------------------------

    def shares_of(self, loader) -> EvenShares | SplitShares:
        """What each process trains on at a step: its loader's even share, or with replica groups its part of the step's
        global batch by its group's seat in the quorum (infra.data.steps)."""
        acc, args = self.accelerator, self.args
        if args.fault_tolerance != "replicas":
            return EvenShares(loader, args.gradient_accumulation_steps)
        return SplitShares(
            self.job.data.train,
            self.cursor,
            args.seed,
            self.data_args.shuffle_window,
            args.global_batch_size,
            acc.process_index,
            acc.num_processes,
            args.per_device_train_batch_size,
            args.training_replicas,
        )

    def run(self) -> int:
        """Everything, on every rank: the steps of a run, and one exit: its code (0, or 75 after a straggler)."""
        args, state = self.args, self.state
        save_seconds = self.preflight()
        if args.preflight_only:
            self.accelerator.end_training()  # the process group destroyed before exit, as on every agreed exit
            return 0
        self.resume(save_seconds)
        stop = None
        with self.preemption.armed(), self.watch.explaining():
            while state.step < args.max_steps and stop is None:
                result = self.step()
                self.after_step(result)
                if result.skipped and self.guard.must_act():
                    self.roll_back()
                    continue
                if state.step % args.logging_steps == 0 or state.step == args.max_steps:
                    self.log(result)
                stop = self.stop_reason(result)
                last = stop is not None or state.step == args.max_steps
                saving = last or (result.save_due and self.guard.clean)  # no scheduled save amid non-finite steps
                if self.copies.due(state.step, saving) and (found := self.check_copies()) is not None:
                    stop = self.repair(found, stop)  # the steps since the newest checkpoint again, or a stop there
                    continue
                if self.eval_due():
                    self.evaluate()
                if saving:
                    self.save(last=last)
            self.watch.loop_ended()
            with self.watch.relaxed():
                if stop is None:
                    self.export()
                return self.close(stop)

    def preflight(self) -> float:
        """Devices, a collective, data, a checkpoint round trip, disk, MLflow: nothing trains if one fails. The seconds a save took."""
        args = self.args
        if not (args.preflight or args.preflight_only):
            return 0.0
        return run_preflight(
            self.accelerator,
            self.model,
            self.job.data.dataset,
            self.own_dir,
            self.retention.most_kept(args.max_steps, args.save_steps),
            tracking_uri() if args.report_to == "mlflow" else None,
            data_checksums=self.job.data.preflight_hashes,
            memory=(self.shape, Setup.of(self.accelerator, args.gradient_checkpointing)) if self.shape else None,
            upload_dir=args.checkpoint_upload_dir,
        )

    def resume(self, save_seconds: float = 0.0) -> None:
        """The newest checkpoint that verifies (counters and cursor from its manifest: nothing of ours is unpickled), the same
        MLflow run, and the loop's meters from that step."""
        acc, args, state = self.accelerator, self.args, self.state
        path, manifest = self.restore()
        if args.straggler_replay and (why := self.shares.replay(manifest_of(args.straggler_replay, "shares")["shares"])):
            raise LaunchError(f"straggler_replay={args.straggler_replay} cannot be replayed here: {why}")  # a recorded run's shares
        self.clock.restart()
        if save_seconds and args.save_interval_minutes == "auto":  # Young/Daly from the preflight's save, not a default
            acc.print(f"a save takes {save_seconds:.1f}s: saving every {self.clock.saved(save_seconds):.1f} min (Young/Daly)")
        if args.report_to == "mlflow":
            self.run_id = start_run(
                acc,
                args.experiment_name or self.job.name,
                run_name_for(self.config, args, self.shares.samples_per_step),
                self.config,
                self.own_dir,
                run_id=manifest.get("mlflow_run_id"),
                tags={**run_tags(acc, self.job.name, state.step), **self.data_tags()},
                restart=args.resume_from_checkpoint == "auto",
            )
            if acc.is_main_process:
                self.log_forensics()
                self.watch.on_lost_peer(lambda line: self.log_forensics())  # a surviving rank 0 logs its own at once
        # steps logged after the checkpoint and before a crash come again, identical: not twice in the run
        tracker = MetricLogger(self.run_id, f"{self.own_dir}/unsent_metrics.jsonl", logged_through=last_logged_step(self.run_id))
        acc.print(self.start_line(path))
        self.latest = manifest.get("metrics", {})
        self.facts = environment_facts(acc)  # versions, git state: once, not at every save
        self.shares.start()
        self.watch.resumed(
            manifest,
            tracker,
            (lambda step: SampleTrace(self.own_dir, acc.process_index, step, acc.num_processes)) if self.data_args.trace_samples else None,
            state.step,
            tqdm(total=args.max_steps, initial=state.step, desc="train", disable=not acc.is_local_main_process),
            EtaCheck(self.watch.say, state.step, args.max_steps, self.units_per_step, args.time_budget_hours, unit=self.job.unit),
        )
        self.model.train()

    def restore(self) -> tuple[str | None, dict]:
        """Where the run starts: its path and manifest (none: a fresh start); a replica group's may be a heal."""
        return self.combine.restore(self.load_checkpoint)

    def load_checkpoint(self, which: str | None = None) -> tuple[str | None, dict]:
        """The state of the newest checkpoint that verifies (or `which`: resume_from_checkpoint's), loaded: its path and
        manifest (none: a fresh start)."""
        args, state = self.args, self.state
        path, manifest = self.checkpoints.resume(which or args.resume_from_checkpoint, checksums=args.verify_checksums)
        if manifest:
            state.load_state_dict(manifest)
            self.cursor.load_state_dict(manifest["cursor"])  # DataError: a data_mixture other than the checkpoint's, say
            if line := self.shares.load_state_dict(manifest.get("shares")):
                self.accelerator.print(line)
            self.rebalancing.load_state_dict(manifest.get("speeds"))
            self.hooks.on_state("resumed", state.step, self.model, self.optimizer)
        return path, manifest

    def start_line(self, path: str | None) -> str:
        """The first line of a launch: its size, where it starts and its batch."""
        where = f"resumed at step {self.state.step} from {path}" if path else "starting fresh"
        return f"{self.combine.who()}, {where}, {self.combine.batch()}, {self.cursor}"

    def log_forensics(self) -> None:
        """Where each rank was when an earlier launch stopped for a lost peer (infra.hangs), as artifacts of the run."""
        try:
            if logged := log_forensics(self.run_id, self.own_dir):
                self.accelerator.print(f"logged {logged} hang report(s) to MLflow (artifacts hangs/)")
        except Exception as err:  # tracking never stops training: they wait in OUTPUT_DIR/hangs for the next launch
            self.accelerator.print(f"warning: hang reports not logged to MLflow ({type(err).__name__}: {err})")

    def data_tags(self) -> dict[str, str]:
        """MLflow tags of what the model reads: its attention kernel; a mixture's segments (weights, where each began)."""
        tags = {"attn_implementation": str(attention_of(self.job.model))}
        if self.cursor.segments:
            tags["data_mixture_segments"] = json.dumps(self.cursor.segments)
        return tags

    def step(self) -> StepResult:
        """One optimizer step, tried until it counts (a plain job's always does; a replica group's when its quorum
        commits it, else it is done again on the same samples)."""
        while True:
            seat = self.combine.begin()
            if (result := self.attempt(seat)) is not None:
                return result
            self.combine.not_committed(seat)

    def attempt(self, seat: Seat) -> StepResult | None:
        """This process's share of the step read, its items counted over every process, the passes of its micro-batches,
        the gradients combined (infra.combine) and clipped, then, if the step counts, the ranks' agreement and the update
        unless a rank saw a non-finite value. None: it did not count (nothing of it kept)."""
        acc, args, state = self.accelerator, self.args, self.state
        self.step_started = time.monotonic()
        self.watch.step_began()
        micros = self.read(seat)
        self.watch.entering(self.combine.items_where)
        items = self.count_items([m.batch for m in micros if m.batch is not None])
        self.watch.entering(self.combine.backward_where)
        # each micro-batch's summed loss over this: DDP, ZeRO and FSDP average the ranks' gradients, and accelerate
        # divides each micro-batch's by the accumulation steps, so the sum of all is divided by `items` exactly once
        num_items_in_batch = items / (acc.num_processes * args.gradient_accumulation_steps)
        before = self.replays.before()  # the random state, for a step computed again (infra.replay)
        passes = self.passes(micros, num_items_in_batch)
        self.hooks.before_optimizer_step(state.step + 1, self.model, passes.grad_norm)
        if not self.combine.commit():
            self.optimizer.zero_grad(set_to_none=True)
            self.metrics.end_step(keep=False)  # the recipe's metrics of a try that did not count
            return None
        result = self.update(passes, items, again=lambda first, agreed: self.replay(before, micros, num_items_in_batch, first, agreed))
        self.shares.committed(state.step, self.watch.trace)
        self.combine.committed(seat)
        return result

    def read(self, seat: Seat) -> list[Micro]:
        """This process's micro-batches of the next step on the device; the wait is timed."""
        waiting = time.perf_counter()
        taken = self.shares.take(seat, self.state.step, self.watch.trace)
        micros = [m if m.batch is None else m._replace(batch=to_device(m.batch, self.accelerator.device)) for m in taken]
        waited = time.perf_counter() - waiting
        self.metrics.meter.waited(waited)
        self.stragglers.waited(waited, sum(len(m.ids) for m in micros))
        return micros

    def passes(self, micros: list[Micro], num_items_in_batch: torch.Tensor) -> Passes:
        """The forward and backward passes of this process's micro-batches, the gradients combined (infra.combine) and
        clipped."""
        step_loss = self.backward(micros, num_items_in_batch)
        loss, loss_sum = self.combine.gradients(step_loss, num_items_in_batch)  # this rank's summed item losses
        self.hooks.on_gradients(self.state.step + 1, self.model)
        return Passes(loss, loss_sum, self.clip_gradients())

    def replay(self, before: tuple, micros: list[Micro], items: torch.Tensor, first: Passes, agreed: Agreement) -> tuple[Passes, Agreement]:
        """A suspicious step computed again from the state before it (infra.replay): the same samples and random state,
        every process; both attempts' results judged. The second attempt's passes are the step's, and the agreement with
        its non-finite flag; a process named twice is left out at the next stop_reason."""
        started, step = time.perf_counter(), self.state.step + 1
        self.watch.entering("a step computed again (infra.replay)")
        with self.watch.stalled("repair"):
            tried = self.replays.attempt(first, self.model, self.guard.flag(first.loss, first.grad_norm))
            self.metrics.end_step(keep=False)  # the first attempt's recipe metrics
            self.optimizer.zero_grad(set_to_none=True)
            self.replays.restore(before)
            with self.stragglers.untimed():
                passes = self.passes(micros, items)
            again = self.replays.attempt(passes, self.model, self.guard.flag(passes.loss, passes.grad_norm))
            verdict = self.replays.judge(step, tried, again, time.perf_counter() - started)
            if verdict.suspects and self.accelerator.num_processes > 1:  # the data, or a device wrong every time
                verdict = self.replays.second_opinion(verdict, self.second_opinions(before, micros, items))
        hosts = self.stragglers.hosts
        self.watch.say(f"sdc: {verdict.line()}" + "".join(f"; rank {r} is on {hosts[r]}" for r in verdict.named))
        self.watch.log(dict(self.replays.counts), step=step)
        return passes, replace(agreed, nonfinite=verdict.nonfinite, spike=False, apart=False, withdrawn=verdict.withdrawn)

    def second_opinions(self, before: tuple, micros: list[Micro], items: torch.Tensor) -> list[float]:
        """Each process's micro-batches of this step computed forward by the next process (rank r's by rank r + 1), from
        r's random state as the step began: the loss it got, for every r (infra.replay's second opinion). Every process
        runs as many forward passes (the sharded engines' gather in each), under no_grad; the batches and random states
        travel in one all-gather, only here."""
        acc, n = self.accelerator, self.accelerator.num_processes
        batches = [None if m.batch is None else to_device(m.batch, torch.device("cpu")) for m in micros]
        data = [self.hooks.in_data(m.position) for m in micros]  # a test's poisoned samples poison them anywhere
        gathered: list = [None] * n
        torch.distributed.all_gather_object(gathered, (before, batches, data))
        theirs, their_batches, their_data = gathered[(acc.process_index - 1) % n]
        mine = self.replays.before()
        self.replays.restore(theirs)
        loss = torch.zeros((), dtype=torch.float32, device=acc.device)
        with torch.no_grad():  # as many passes on every process (a share of nothing: a stand-in, its loss not counted)
            for batch, factor in zip(their_batches, their_data, strict=True):
                out = self.job.loss(self.model, to_device(self.shares.stand_in() if batch is None else batch, acc.device), items)
                if batch is not None:
                    loss += out.loss.detach().float() * factor
        resharded(self.model)  # no backward follows these forwards: FSDP2's root would keep its pre-step parameters
        self.replays.restore(mine)
        views = acc.gather(loss.reshape(1)).cpu().tolist()  # views[p]: process p's loss of process p - 1's micro-batches
        return [views[(r + 1) % n] for r in range(n)]

    def backward(self, micros: list[Micro], num_items_in_batch: torch.Tensor) -> torch.Tensor:
        """The forward and backward passes of this process's micro-batches; their summed loss. With a data_mixture (whose
        losses per source the job can give) each sample's source goes with it. In a group of several processes an
        empty micro-batch (a share of nothing) still runs its passes, on a stand-in sample with the loss times zero: the
        other processes' passes wait on this one's (DDP's gradient all-reduce on the last micro-batch, FSDP's gathers on
        every one), and it adds exact zeros."""
        acc = self.accelerator
        step_loss = torch.zeros((), device=acc.device)
        for i, micro in enumerate(micros):
            if micro.batch is None and acc.num_processes == 1:
                continue
            with self.combine.micro_batch(last=i == len(micros) - 1):
                if micro.batch is None:
                    stand_in = to_device(self.shares.stand_in(), acc.device)
                    acc.backward(self.job.loss(self.model, stand_in, num_items_in_batch).loss * 0)
                    continue
                sources = self.loader.source_index(micro.ids) if self.job.per_sample_losses else None
                if sources is not None:
                    sources = torch.from_numpy(sources).to(acc.device)
                with self.stragglers.compute():
                    loss = self.micro_loss(micro.batch, num_items_in_batch, sources)
                    loss = self.hooks.on_loss(loss, micro.position, len(micro.ids))
                acc.backward(loss)
            step_loss += loss.detach()
        return step_loss

    def clip_gradients(self) -> torch.Tensor | None:
        """The gradients' global norm, clipped to max_grad_norm (None when not clipping)."""
        if not self.args.max_grad_norm:
            return None
        grad_norm = self.accelerator.clip_grad_norm_(self.model.parameters(), self.args.max_grad_norm)
        return grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm  # FSDP2's norm of sharded gradients

    def micro_loss(self, batch: Batch, num_items_in_batch: torch.Tensor, sources: torch.Tensor | None = None) -> torch.Tensor:
        """The job's loss of one micro-batch; its metrics (and with a data_mixture each sample's loss, to its source's)
        kept for the log."""
        out = self.job.loss(self.model, batch, num_items_in_batch, per_sample=sources is not None)
        if not isinstance(out, LossOutput):
            raise TypeError(f"the loss of {self.job.name} returned {type(out).__name__}: a recipe's loss returns infra.job.LossOutput")
        if sources is not None:
            self.metrics.add_source_losses(sources, *out.per_sample)
        self.metrics.add_recipe_metrics(out.metrics, samples_in(batch))
        return out.loss

    def update(self, passes: Passes, items: torch.Tensor, again) -> StepResult:
        """The end of a step whose gradients are ready: the ranks' agreement; a suspicious step computed `again` (a
        non-finite or spiking loss or gradient norm: infra.replay); then the update unless some rank saw a non-finite
        loss or gradient; the counters. `items` is the step's."""
        state = self.state
        self.watch.entering("the step agreement's all-reduce")
        loss, grad_norm = passes.loss, passes.grad_norm
        flags = self.guard.flag(loss, grad_norm), self.replays.spike(loss, grad_norm), self.replays.digest(self.model)
        agreed = self.consensus.agree(state.step + 1, *flags)
        if self.replays.due(agreed.nonfinite, agreed.spike, agreed.apart):
            passes, agreed = again(passes, agreed)
        loss, loss_sum, grad_norm = passes
        taken = not (agreed.nonfinite or agreed.withdrawn)  # withdrawn: a machine computes wrong every time (infra.replay)
        if taken:
            self.replays.kept(passes)
        steps = self.guard.record(agreed.nonfinite, state) and not agreed.withdrawn
        if agreed.withdrawn:
            state.skipped_steps += 1
        if taken:
            self.metrics.add_loss(loss_sum, items)
        self.metrics.end_step(keep=taken)  # the sources' losses of a skipped step are dropped
        if steps:
            self.optimizer.step()
        self.learning_rate = self.scheduler.get_last_lr()[0]  # the rate this step used (the scheduler now moves on)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        state.step += 1
        state.tokens_seen += self.units_per_step
        self.metrics.count_step(self.units_per_step)
        self.hooks.on_update(state.step, self.model, self.optimizer)
        return StepResult(loss, grad_norm, agreed.nonfinite, agreed.save_due, agreed.signal)

    def count_items(self, batches: list[Batch]) -> torch.Tensor:
        """The items the loss sums over in these micro-batches, on every rank together (with replica groups, every group
        too): one small all-reduce per step, before the backward passes (a 0-dim float tensor on the device)."""
        count, device = self.job.items or samples_in, self.accelerator.device
        # a share of nothing (more slots than samples, a hot spare) counts none, and still joins the all-reduces
        items = torch.zeros((), device=device)
        if batches:
            items = torch.stack([torch.as_tensor(count(b), device=device).float() for b in batches]).sum()
        if self.accelerator.num_processes > 1:
            torch.distributed.all_reduce(items)
        return self.combine.count(items)

    def after_step(self, result: StepResult) -> None:
        """The test hooks, then the observers: progress, the watchdog, the pace after the first steps, a skipped step's count."""
        step = self.state.step
        self.hooks.on_step_end(step)
        self.watch.step_ended(step, time.monotonic() - self.step_started, self.state.skipped_steps if result.skipped else None)

    def roll_back(self) -> None:
        """After max_bad_steps non-finite steps in a row: the guard reloads the newest checkpoint (or stops); the loop's
        window starts again from its step."""
        self.went_back(self.guard.act(self.state, self.cursor, self.watch.relaxed))

    def go_back(self, which: str, repair: bool = True) -> str | None:
        """The rollback of a repair (copies that disagreed: infra.sdc, infra.replicas): the save under way finished, the
        state of checkpoint `which` (or the newest that verifies: "auto") loaded, its data position included, so the
        steps since are trained again on the same samples; the loop's meters and observers told. Its path (None: no
        checkpoint, nothing changed). The non-finite guard's rollback is another: it keeps the data position, skipping
        the batches since (infra.guard)."""
        with self.watch.relaxed("the rollback"):
            self.checkpoints.wait()
            path, manifest = self.load_checkpoint(which)
        if path is not None:
            self.went_back(manifest, repair=repair)
            self.shares.start()  # from the checkpoint's data position
        return path

    def went_back(self, manifest: dict, repair: bool = False) -> None:
        """After the state of `manifest`'s checkpoint was loaded in the loop (a rollback, a repair): its metrics, the
        loss meter, the observers (`repair`: goodput counts the steps undone as the repair's) and the combine."""
        self.latest = manifest.get("metrics", {})
        self.metrics.reset_loss()
        self.watch.rolled_back(manifest, self.state.step, self.state.rollbacks, repair)
        self.combine.rolled_back()

    def log(self, result: StepResult) -> None:
        state = self.state
        logged, mean_loss = self.metrics.collect(self.learning_rate, state.tokens_seen, self.cursor.epoch, result.grad_norm)
        for name, samples in self.cursor.taken().items():  # a mixture's sources so far: known from the position, no collective
            logged[f"train/samples/{name}"] = samples
            logged[f"train/{self.job.unit}_seen/{name}"] = samples * self.job.units_per_sample
        self.latest |= logged
        unit = self.job.unit
        rate = logged.get(f"perf/{unit}_per_second")  # none in a window of one compiling step
        self.watch.logged(logged, state.step, {"loss": f"{mean_loss:.3f}", **({f"{unit}/s": f"{rate:.0f}"} if rate is not None else {})})

    def stop_reason(self, result: StepResult) -> Stop | None:
        """Why to save and stop after this step (the stop record), or None: a preemption, or a straggler to exclude.
        Decided from agreed or gathered values: the same on every rank."""
        window, behind = self.stragglers.step(), {}
        if window is not None:
            self.watch.log(window.ratios, step=self.state.step)
            if self.args.straggler_action == "rebalance" and self.args.fault_tolerance != "replicas":  # groups: QuorumSum's
                behind = self.rebalancing.window(window, self.shares, self.state.step)
            if window.report:
                self.watch.say(window.report)
        if result.preempted:
            return Stop(Reason.PREEMPTED, signal=result.preempted)
        if (stop := self.combine.stop()) is not None:  # a replica group left out of the quorum (infra.replicas.pace)
            return stop
        if ranks := self.replays.twice:  # named a second time (infra.replay, infra.sdc): a machine that computes wrong
            self.watch.say(f"sdc: {', '.join(f'rank {r}' for r in ranks)} named a second time: a machine that computes wrong")
            return self.leave_out(ranks, Reason.SDC).also(ranks=tuple(ranks), found_at=self.state.step, tensors=())
        if window is not None and window.slow and self.args.straggler_action == "checkpoint_and_exit":
            return self.leave_out(window.slow)
        if behind:
            return self.leave_out(behind)
        return None

    def leave_out(self, ranks, reason: Reason = Reason.STRAGGLER) -> Stop:
        """The stop that leaves the hosts of `ranks` out (infra.leave)."""
        replicas = self.args.fault_tolerance == "replicas"
        return leave_out(self.accelerator, self.peers, ranks, reason, replicas, self.watch.say)

    def check_copies(self) -> Mismatch | None:
        """The copies of the state the processes hold identically, compared (infra.sdc); the counts logged."""
        self.watch.entering("the copies' comparison (an all-gather)")
        found = self.copies.compare(self.state.step)
        self.watch.log(dict(self.copies.counts), step=self.state.step)
        return found

    def repair(self, found: Mismatch, stop: Stop | None) -> Stop | None:
        """Copies disagree (infra.sdc): back to the newest checkpoint (every committed one was compared before it was
        written), its data position and random state included, so the steps since are trained again on the same
        samples. Or, a rank named before (a machine that computes wrong), sdc_action=stop, or no checkpoint: a stop at
        that checkpoint, naming the ranks. A stop already decided (a preemption) stays, at the checkpoint's step."""
        hosts, copies = self.stragglers.hosts, self.copies
        self.watch.say(f"sdc: {describe(found, hosts)}")
        again = copies.again(found)
        why = "named before: a machine that computes wrong" if again else "sdc_action=stop" if copies.action == "stop" else None
        path = self.go_back("auto", repair=why is None)
        if path is None:
            why = why or "no checkpoint to return to"
        if why is None:
            copies.counts["sdc/repairs"] += 1
            self.watch.log(dict(copies.counts), step=self.state.step)
            self.watch.say(f"sdc: repaired: back to {Path(path).name}; the {found.step - self.state.step} steps since are trained again")
            return stop
        ranks = again or found.ranks
        self.watch.say(f"sdc: stopping at step {self.state.step}, the newest sound checkpoint ({why})")
        # left out in-job where the launch is elastic (the others restart from that checkpoint), else a stop there
        stop = self.leave_out(ranks, Reason.SDC) if path is not None else Stop(Reason.SDC, hosts=tuple(sorted({hosts[r] for r in ranks})))
        return stop.also(ranks=tuple(ranks), found_at=found.step, tensors=tuple(found.tensors[:10]))

    def eval_due(self) -> bool:
        args, step = self.args, self.state.step
        can = len(self.job.data.held_out) > 0 and self.job.evaluate is not None
        return can and (step == args.max_steps or (args.eval_steps > 0 and step % args.eval_steps == 0))

    def evaluate(self) -> dict[str, float]:
        """The recipe's eval over the held-out samples, every rank its share; logged and kept for keep_best."""
        acc = self.accelerator
        self.model.eval()
        held_out = self.job.data.held_out
        with torch.no_grad(), self.watch.stalled("eval"):
            scores = self.job.evaluate(acc, self.model, self.eval_batches(held_out))
            for name, part in named_parts(held_out):  # a mixture's sources' held-out samples alone: eval/loss/<name>, ...
                if len(part) >= acc.num_processes:
                    scores |= {f"{k}/{name}": v for k, v in self.job.evaluate(acc, self.model, self.eval_batches(part)).items()}
        self.model.train()
        self.latest.update(scores)  # kept until the next eval: keep_best may rank checkpoints by an eval/ metric
        self.watch.log(scores, step=self.state.step)
        self.watch.say(f"step {self.state.step}: " + ", ".join(f"{k} {v:.4f}" for k, v in scores.items()))
        return scores

    def eval_batches(self, dataset) -> Iterator[Batch]:
        acc = self.accelerator
        batches = eval_batches(dataset, self.args.per_device_eval_batch_size, acc.process_index, acc.num_processes)
        return (to_device(b, acc.device) for b in batches)

    def save(self, last: bool = False) -> None:
        """A checkpoint of this step (in the background with async_save, except the last one), and its cost logged. With
        replica groups, by the group of rank 0 in the quorum only: every group holds the same state."""
        args, state = self.args, self.state
        self.watch.saving()
        if not self.combine.saves:
            return
        start = time.perf_counter()
        # a copy of the metrics: a background save writes its manifest later, while the loop goes on updating them
        facts = {**state.state_dict(), "cursor": self.cursor.state_dict(), "metrics": dict(self.latest), "mlflow_run_id": self.run_id}
        facts["shares"] = self.shares.state_dict()  # each process's samples of every micro-step (rebalanced or even)
        facts["speeds"] = self.rebalancing.state_dict()  # what rebalancing has learnt of each process's speed
        facts["goodput"] = self.watch.ledger()  # the time history of these weights (infra.goodput)
        facts["companions"] = {name: c.source for name, c in self.job.companions.items()}  # not saved: rebuilt from these
        try:
            with self.watch.stalled("checkpoint"):  # a long synchronous save is not a hang
                self.checkpoints.save(state.step, {**facts, **self.facts}, background=args.async_save and not last)
        except CheckpointError as err:  # a full disk, say: the run stops rather than train on with nothing saved
            if self.accelerator.is_main_process:
                with contextlib.suppress(OSError):  # the disk may be too full even for the record
                    write_record(self.own_dir, state.step, Stop(Reason.SAVE_FAILED, error=str(err)))
            raise
        seconds = time.perf_counter() - start
        self.hooks.on_state("saved", state.step, self.model, self.optimizer)
        if (minutes := self.clock.saved(seconds)) is not None:
            self.watch.say(f"a save takes {seconds:.1f}s: saving every {minutes:.1f} min (Young/Daly, MTBF {args.mtbf_hours:g} h)")
        self.watch.log({"checkpoint/save_seconds": seconds, "checkpoint/interval_minutes": self.clock.interval / 60}, step=state.step)

    def export(self) -> None:
        """At max_steps: final/, loadable with from_pretrained (a replica group's: by the group of rank 0)."""
        self.combine.export(self.export_model)

    def export_model(self) -> None:
        """The copies must agree (infra.sdc: compared again, if any); then final/."""
        if line := self.copies.final(self.state.step):
            self.accelerator.print(line)
        state, unit = self.state, self.job.unit
        final = self.exporter.export(self.model, {"step": state.step, f"{unit}_seen": state.tokens_seen, **self.latest})
        self.accelerator.print(f"done: step {state.step}, {state.tokens_seen} {unit}; model exported to {final}")

    def close(self, stop: Stop | None) -> int:
        """The one exit: after a stop, its record for the batch script (requeue or not), its line and the MLflow run
        KILLED; else the model logged on request and the run FINISHED; goodput logged and printed last; then the process
        group destroyed. Its exit code: the stop's (infra.stopped), else 0."""
        acc, state = self.accelerator, self.state
        self.combine.close()
        self.shares.close()
        if stop is not None:
            if acc.is_main_process and not stop.in_job:
                write_record(self.own_dir, state.step, stop)
            acc.print(stop.line(state.step))
        self.checkpoints.close()  # the last upload done
        goodput = self.watch.closed(state.step, finished=stop is None)
        if stop is None and self.args.log_model:
            self.exporter.log_to_mlflow(self.args.register_model)
        end_run("FINISHED" if stop is None else "KILLED")
        acc.print(summary(goodput))
        code = stop.exit_code if stop is not None else 0
        if code:
            rank = self.accelerator.process_index
            part_ways(rank, self.peers[rank].host, stop)
        acc.end_training()
        return code
