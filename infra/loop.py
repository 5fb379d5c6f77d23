"""The training loop every recipe shares; a recipe supplies its model, its data and its loss.

    data = open_data(data_args, args)                      # the prepared shards, split for eval
    accelerator = start(args)                              # the launcher's Accelerator, seeded
    model = ...                                            # the recipe's own
    train(accelerator, args, data_args, config, Job("pretrain_clm", model, data, loss=lm_loss, evaluate=lm_eval, ...))

`train` runs the preflight, resumes the newest checkpoint that verifies and the same MLflow run,
then loops: accumulation, clipping, one all-reduce per step (the save schedule, preemption and a
non-finite flag), skipped steps and rollbacks, throughput, stragglers, heartbeats, held-out eval,
scheduled and final saves; at the end it checks the replicas agree and exports the model with
`save_pretrained`. Everything here is the same for every recipe and every launcher config.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import faulthandler
import json
import math
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, set_seed
from torch.distributed.tensor import DTensor
from tqdm.auto import tqdm
from transformers import get_cosine_with_min_lr_schedule_with_warmup

from infra.checkpoint import CheckpointError, CheckpointManager, SaveSchedule, TrainState, environment_facts, write_model_card
from infra.config import DataArguments, TrainingArguments
from infra.data import DataCursor, PackedDataset, ResumableLoader, SampleTrace, check_fits_model, eval_batches
from infra.distributed import LaunchError, all_ranks_ok, build_accelerator, ready_for_fsdp
from infra.files import atomic_write_text, fsync_tree, publish_dir
from infra.health import STRAGGLER_EXIT_CODE, Faults, Heartbeat, StragglerDetector, check_replicas_in_sync, nonfinite
from infra.lock import claim
from infra.metrics import Throughput, flops_per_token, peak_bf16_flops
from infra.preflight import EtaCheck, kept_checkpoints, run_preflight
from infra.tracking import MetricLogger, end_run, last_logged_step, log_model, run_name_for, run_status, run_tags, start_run, tracking_uri

Batch = torch.Tensor | dict[str, torch.Tensor]
# Why the last launch stopped before max_steps, for batch scripts (infra/slurm/pretrain.sbatch): {"step", "reason":
# "preempted" with the "signal" (SIGUSR1: the time limit is near, requeue; SIGTERM: the scheduler decides), or
# "straggler" with the slow "hosts" (requeue without them). Removed when a launch starts.
STOP_RECORD = "stopped.json"


@dataclass
class Data:
    """A recipe's data: the shards, the part trained on, the held-out part (may be empty), and who hashes the shards."""

    dataset: PackedDataset
    train: torch.utils.data.Dataset
    held_out: torch.utils.data.Dataset
    preflight_hashes: bool  # the preflight sha256es them (else they were checked when opened, if asked)


@dataclass
class Job:
    """What a recipe hands to `train`: its model and data, and the few things only it knows."""

    name: str  # the recipe: MLflow experiment (unless set), tags, model card
    model: torch.nn.Module  # not prepared yet: train() builds the optimizer, schedule and loader, then prepares
    data: Data
    loss: Callable[[torch.nn.Module, Batch], torch.Tensor]  # the training loss of one micro-batch
    processor: Any  # tokenizer or image processor, exported next to the weights
    task: str  # MLflow transformers task of the export: text-generation, text-classification, image-classification
    evaluate: Callable[[Accelerator, torch.nn.Module, Iterable[Batch]], dict[str, float]] | None = None
    unit: str = "tokens"  # what throughput counts: perf/{unit}_per_second, train/{unit}_seen
    units_per_sample: int = 1
    flops_per_unit: float | None = None  # training FLOPs per unit, for perf/mfu on known GPUs


def open_data(
    data_args: DataArguments, args: TrainingArguments, fields: tuple[str, ...] = ("input_ids",), made_by: str = "make data"
) -> Data:
    """The shards, split: sizes checked now; sha256 now only if no preflight will hash them.

    The data must hold exactly `fields` (the recipe's inputs), as `made_by` prepares them.
    """
    preflight_hashes = (args.preflight or args.preflight_only) and (data_args.verify_data_checksums or args.preflight_only)
    try:
        dataset = PackedDataset(
            data_args.data_dir,
            verify_checksums=data_args.verify_data_checksums and not preflight_hashes,
            hash_fetches=data_args.verify_data_checksums,  # remote data: every rank hashes what it fetches later
            # one process per machine reads every shard's header (10k shards: 1.0 s here, from local disk), not
            # every rank: on network storage 64 ranks would open every file 64 times at once. Per machine, not
            # once per job, as data may be copied to each machine's disk. A bad file stops that rank; the
            # launcher then stops the others.
            check=int(os.environ.get("LOCAL_RANK", "0")) == 0,
        )
        train_set, held_out = dataset.split(data_args.eval_samples)
    except ValueError as err:
        raise SystemExit(f"data error: {err}") from None
    if tuple(dataset.fields) != fields:
        raise SystemExit(f"data error: {data_args.data_dir} holds {dataset.fields}, this recipe reads {list(fields)} ({made_by})")
    return Data(dataset, train_set, held_out, preflight_hashes)


def causal_lm_flops(model: torch.nn.Module, dataset: PackedDataset, eos_token_id: int) -> float:
    """Check that the token data fits the causal LM (vocabulary, positions, EOS), or exit in one line; then
    its training FLOPs per token, counted before ZeRO-3 partitions the parameters."""
    with exit_on(ValueError, "data error"):
        check_fits_model(dataset.index, eos_token_id, model.config)
    c = model.config
    return flops_per_token(sum(p.numel() for p in model.parameters()), c.num_hidden_layers, c.hidden_size, dataset.seq_len)


def run_recipe(main: Callable[[], None]) -> NoReturn:
    """A recipe's entry point: main() under `run_status`, then the exit that main() chose (0 at the end or after a
    preemption, 75 for a straggler, 1 with a one-line error), without the interpreter's finalization.

    Why: after a clean finish (process group destroyed, files committed, MLflow run ended), a rank
    sometimes aborted in C++ static destructors at exit ("terminate called without an active
    exception", SIGABRT, no Python frame left: 1 launch in 20 to 40 here, with torch 2.13 and gloo),
    which turned a finished job into a failed one. So the process exits as Python would (other
    threads joined, atexit handlers run, streams flushed) and then skips the C++ teardown. A bug's
    exception propagates and exits the usual way, with its traceback.
    """
    try:
        with run_status():
            main()
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 0 if exit_.code is None else 1
        if not isinstance(exit_.code, int | None):
            print(exit_.code, file=sys.stderr)
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).fflush(None)  # C stdio buffers of native libraries
    os._exit(code)


def start(args: TrainingArguments) -> Accelerator:
    """The Accelerator for the launcher's config, in the precision the recipe's mixed_precision gives here, seeded.

    A fatal signal (a segfault, an abort in C++ at exit) prints every thread's Python stack first.
    """
    faulthandler.enable(all_threads=True)
    try:
        accelerator, precision = build_accelerator(args, log_with=None if args.report_to == "none" else args.report_to)
    except LaunchError as err:
        raise SystemExit(f"launch error: {err}") from None
    accelerator.print(precision)
    set_seed(args.seed)
    return accelerator


def make_loader(accelerator: Accelerator, train_set, held_out, data_args: DataArguments, args: TrainingArguments):
    """This rank's resumable loader over `train_set`, and its cursor."""
    cursor = DataCursor()
    try:
        loader = ResumableLoader(
            train_set,
            args.per_device_train_batch_size,
            args.seed,
            accelerator.process_index,
            accelerator.num_processes,
            cursor,
            num_workers=data_args.num_workers,
            shuffle_window=data_args.shuffle_window,
            pin_memory=accelerator.device.type == "cuda",
        )
    except ValueError as err:
        raise SystemExit(f"data error: {err}") from None
    if 0 < len(held_out) < accelerator.num_processes:
        raise SystemExit(f"data error: eval_samples={len(held_out)} is fewer than the {accelerator.num_processes} processes evaluating it")
    return loader, cursor


def build_optimizer(model: torch.nn.Module, args: TrainingArguments) -> torch.optim.AdamW:
    """AdamW; no weight decay on vectors (norms, biases)."""
    decay = [p for p in model.parameters() if p.ndim >= 2 and p.requires_grad]
    no_decay = [p for p in model.parameters() if p.ndim < 2 and p.requires_grad]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2))


def build_scheduler(optimizer, args: TrainingArguments):
    """Linear warmup, then cosine decay to min_lr_ratio. Built on the prepared optimizer: ZeRO-3
    regroups parameters, and a schedule made before `prepare` would no longer match."""
    return get_cosine_with_min_lr_schedule_with_warmup(optimizer, args.warmup_steps, args.max_steps, min_lr_rate=args.min_lr_ratio)


HUB_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")


def model_source(name: str, hint: str) -> str:
    """`name` if it is an existing path or shaped like a hub id; else a one-line exit with `hint`."""
    if Path(name).exists() or HUB_ID.fullmatch(name):
        return name
    raise SystemExit(f"model error: model_name_or_path={name!r} is neither an existing path nor a hub id: {hint}")


def load_pretrained(load: Callable[..., Any], name: str, hint: str, **kwargs) -> Any:
    """`load(name, **kwargs)` (a `from_pretrained`), or a one-line exit naming the model: a name that is neither a path
    nor a hub id, a folder without the model's files, a hub id that cannot be fetched."""
    source = model_source(name, hint)
    with exit_on((OSError, ValueError), "model error"):  # ValueError: a folder whose config.json names no model
        return load(source, **kwargs)


def to_device(batch: Batch, device: torch.device) -> Batch:
    if isinstance(batch, dict):
        return {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    return batch.to(device, non_blocking=True)


@contextlib.contextmanager
def exit_on(error: type[Exception] | tuple[type[Exception], ...], prefix: str):
    """Turn `error` into a one-line exit: `with exit_on(CheckpointError, "checkpoint error"): ...`."""
    try:
        yield
    except error as err:
        raise SystemExit(f"{prefix}: {err}") from None


def train(accelerator: Accelerator, args: TrainingArguments, data_args: DataArguments, config: dict, job: Job) -> None:
    """Prepare, preflight, resume, train to max_steps (or a preemption), save, export. Called on every rank."""
    claim(accelerator, args.output_dir)  # one job per output_dir: before anything is written, held to the end
    if accelerator.is_main_process:
        with contextlib.suppress(OSError):  # the last launch's record: this one has not stopped (an unwritable dir: the preflight)
            (Path(args.output_dir) / STOP_RECORD).unlink()
    held_out = job.data.held_out
    ready_for_fsdp(accelerator, job.model)  # before the optimizer takes the parameters
    optimizer = build_optimizer(job.model, args)
    loader, cursor = make_loader(accelerator, job.data.train, held_out, data_args, args)
    model, optimizer = accelerator.prepare(job.model, optimizer)
    scheduler = accelerator.prepare_scheduler(build_scheduler(optimizer, args))

    # Preflight: devices, a collective, data, a checkpoint round trip, disk, MLflow; nothing trains if one fails
    save_seconds = 0.0
    if args.preflight or args.preflight_only:
        save_seconds = run_preflight(
            accelerator,
            model,
            job.data.dataset,
            args.output_dir,
            kept_checkpoints(args),
            tracking_uri() if args.report_to == "mlflow" else None,
            data_checksums=job.data.preflight_hashes,
        )
        if args.preflight_only:
            accelerator.end_training()  # the process group destroyed before exit, as on every agreed exit
            return

    # Checkpoints and tracking: resume the newest checkpoint and the same MLflow run
    state = TrainState()
    checkpoints = CheckpointManager(
        accelerator,
        args.output_dir,
        config,
        args.save_total_limit,
        args.keep_best,
        args.metric_for_best_model,
        args.greater_is_better,
        args.save_milestone_steps,
    )
    with exit_on(CheckpointError, "checkpoint error"):
        resume, manifest = checkpoints.resume(args.resume_from_checkpoint, checksums=args.verify_checksums)
    if manifest:  # counters and cursor come from the manifest (JSON): nothing of ours is unpickled
        state.load_state_dict(manifest)
        cursor.load_state_dict(manifest["cursor"])
    schedule = SaveSchedule(accelerator, args.save_steps, args.save_interval_minutes, args.mtbf_hours, args.preemption_grace_seconds)
    if save_seconds and args.save_interval_minutes == "auto":  # Young/Daly from the preflight's save, not a default
        accelerator.print(f"a save takes {save_seconds:.1f}s: saving every {schedule.saved(save_seconds):.1f} min (Young/Daly)")
    run_id = None
    if args.report_to == "mlflow":
        run_id = start_run(
            accelerator,
            args.experiment_name or job.name,
            run_name_for(config, args),
            config,
            args.output_dir,
            run_id=manifest.get("mlflow_run_id"),
            tags=run_tags(accelerator, job.name, state.step),
            restart=args.resume_from_checkpoint == "auto",
        )
    # steps logged after the checkpoint and before a crash come again, identical: not twice in the run
    tracker = MetricLogger(run_id, f"{args.output_dir}/unsent_metrics.jsonl", logged_through=last_logged_step(run_id))
    accelerator.print(
        f"world size {accelerator.num_processes} ({accelerator.distributed_type.value}), "
        f"{'resumed at step ' + str(state.step) + ' from ' + str(resume) if resume else 'starting fresh'}, {cursor}"
    )
    trace = SampleTrace(args.output_dir, accelerator.process_index, state.step) if config["DataArguments"]["trace_samples"] else None
    metrics: dict[str, float] = manifest.get("metrics", {})
    job_facts = environment_facts(accelerator)  # versions, git state: once, not at every save

    def save(last: bool = False) -> None:
        if trace:
            trace.flush()
        start = time.perf_counter()
        # a copy of the metrics: a background save writes its manifest later, while the loop goes on updating them
        facts = {**state.state_dict(), "cursor": cursor.state_dict(), "metrics": dict(metrics), "mlflow_run_id": run_id}
        with exit_on(CheckpointError, "checkpoint error"), heartbeat.relaxed():  # a long synchronous save is not a hang
            checkpoints.save(state.step, {**facts, **job_facts}, background=args.async_save and not last)
        seconds = time.perf_counter() - start
        if (minutes := schedule.saved(seconds)) is not None:
            accelerator.print(f"a save takes {seconds:.1f}s: saving every {minutes:.1f} min (Young/Daly, MTBF {args.mtbf_hours:g} h)")
        tracker.log({"checkpoint/save_seconds": seconds, "checkpoint/interval_minutes": schedule.interval / 60}, step=state.step)

    def roll_back() -> None:
        """After max_bad_steps non-finite steps in a row: the newest checkpoint's weights, optimizer and counters, but the
        data cursor stays where it is, so the batches since that checkpoint (the offending ones among them) are skipped."""
        if state.rollbacks >= args.max_rollbacks:
            raise SystemExit(f"health error: non-finite steps again after {state.rollbacks} rollbacks (max_rollbacks={args.max_rollbacks})")
        bad_step, position = state.step, repr(cursor)
        with exit_on(CheckpointError, "checkpoint error"), heartbeat.relaxed():
            checkpoints.wait()
            path, manifest = checkpoints.resume("auto", checksums=args.verify_checksums)
        if path is None:
            raise SystemExit(
                f"health error: {args.max_bad_steps} non-finite steps in a row at step {bad_step} and no checkpoint to roll back to"
            )
        state.load_state_dict({**manifest, "skipped_steps": state.skipped_steps, "rollbacks": state.rollbacks + 1})
        metrics.clear()
        metrics.update(manifest.get("metrics", {}))
        accelerator.print(
            f"health: {args.max_bad_steps} non-finite steps in a row at step {bad_step}: rolled back to {path.name}; "
            f"the data from {DataCursor(**manifest['cursor'])} to {position} is skipped"
        )
        tracker.log({"health/rollbacks": state.rollbacks}, step=state.step)

    def evaluate() -> dict[str, float]:
        model.eval()
        batches = (to_device(b, accelerator.device) for b in eval_batches(held_out, args.per_device_eval_batch_size, *ranks))
        with torch.no_grad():
            scores = job.evaluate(accelerator, model, batches)
        model.train()
        return scores

    # Training loop
    ranks = (accelerator.process_index, accelerator.num_processes)
    units_per_step = loader.global_batch_size * args.gradient_accumulation_steps * job.units_per_sample
    peak = peak_bf16_flops(torch.cuda.get_device_name(accelerator.device) if accelerator.device.type == "cuda" else None)
    batches = iter(loader)
    meter = Throughput(job.unit)
    bad_in_a_row = 0
    fp16 = accelerator.scaler is not None
    skip_note = (  # DeepSpeed's engine steps inside accelerator.backward: too late to skip, a rollback undoes it
        "counted; DeepSpeed already stepped, a rollback undoes it"
        if accelerator.distributed_type == DistributedType.DEEPSPEED
        else "optimizer step skipped"
    )
    stragglers = StragglerDetector(accelerator, model, args.straggler_window_steps, args.straggler_factor, args.straggler_patience)
    heartbeat = Heartbeat(accelerator, args.ddp_timeout, args.ddp_step_timeout)
    faults = Faults(accelerator.process_index)  # test hooks; inert unless INFRA_TEST_FAULTS is set
    eta = EtaCheck(accelerator, state.step, args.max_steps, units_per_step, args.time_budget_hours, unit=job.unit)
    can_evaluate = len(held_out) > 0 and job.evaluate is not None
    loss_sum, loss_count = torch.zeros((), device=accelerator.device), 0
    bar = tqdm(total=args.max_steps, initial=state.step, desc="train", disable=not accelerator.is_local_main_process)
    model.train()
    preempted = straggling = False
    try:
        while state.step < args.max_steps:
            step_loss = torch.zeros((), device=accelerator.device)
            for _ in range(args.gradient_accumulation_steps):
                waiting = time.perf_counter()
                batch = to_device(next(batches), accelerator.device)
                waited = time.perf_counter() - waiting
                meter.waited(waited)
                stragglers.waited(waited)
                if trace:
                    trace.write(state.step + 1, loader.last_sample_ids)
                with accelerator.accumulate(model):
                    with stragglers.compute():
                        loss = faults.poison(job.loss(model, batch), loader.batches_consumed)
                        faults.slow_down()
                    accelerator.backward(loss)
                step_loss += loss.detach()
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm) if args.max_grad_norm else None
            if isinstance(grad_norm, DTensor):  # FSDP2's norm of sharded gradients
                grad_norm = grad_norm.full_tensor()
            # one all-reduce: preemption, rank 0's clock, and a non-finite loss or gradient on any rank (fp16: the loss
            # scaler skips steps with inf/NaN gradients and lowers its scale by itself; only the loss counts)
            save_now, preempted, skipped = schedule.check(state.step + 1, nonfinite(step_loss, None if fp16 else grad_norm))
            bad_in_a_row = bad_in_a_row + 1 if skipped else 0
            if skipped:
                state.skipped_steps += 1
                accelerator.print(f"health: non-finite loss or gradients at step {state.step + 1}: {skip_note}")
            else:
                loss_sum += step_loss
                loss_count += args.gradient_accumulation_steps
            if not skipped or fp16:
                optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            state.step += 1
            state.tokens_seen += units_per_step
            meter.add(units_per_step)
            bar.update()
            faults.maybe_hang(state.step)
            faults.maybe_die(state.step)
            heartbeat.beat(state.step)
            if pace := eta.step(state.step):
                tracker.log(pace, step=state.step)
            if skipped:
                tracker.log({"health/skipped_steps": state.skipped_steps}, step=state.step)
                if bad_in_a_row >= args.max_bad_steps:
                    if args.on_bad_steps == "stop":
                        raise SystemExit(f"health error: {bad_in_a_row} non-finite steps in a row at step {state.step} (on_bad_steps=stop)")
                    roll_back()
                    bad_in_a_row, loss_count = 0, 0
                    loss_sum.zero_()
                    bar.n = state.step
                    if trace:
                        trace.close()
                        trace = SampleTrace(args.output_dir, accelerator.process_index, state.step)
                    continue

            if state.step % args.logging_steps == 0 or state.step == args.max_steps:
                # (no loss when every step of the window was skipped; the count is the same on every rank)
                mean_loss = accelerator.reduce(loss_sum, "mean").item() / loss_count if loss_count else math.nan
                logged = {
                    **({"train/loss": mean_loss} if loss_count else {}),
                    "train/learning_rate": scheduler.get_last_lr()[0],
                    f"train/{job.unit}_seen": state.tokens_seen,
                    "train/epoch": cursor.epoch,
                }
                logged.update({f"perf/{k}": v for k, v in meter.rate().items()})
                if peak and job.flops_per_unit:  # model FLOPs utilisation, only where the device's peak is known
                    logged["perf/mfu"] = logged[f"perf/{job.unit}_per_second"] * job.flops_per_unit / (peak * accelerator.num_processes)
                if grad_norm is not None:
                    logged["train/grad_norm"] = float(grad_norm)
                tracker.log(logged, step=state.step)
                metrics |= logged  # the latest of each metric, eval included: checkpoints and keep_best read them
                loss_sum.zero_()
                loss_count = 0
                bar.set_postfix({"loss": f"{mean_loss:.3f}", f"{job.unit}/s": f"{logged[f'perf/{job.unit}_per_second']:.0f}"})
            ratios, report, slow = stragglers.step()  # decided from gathered timings: the same on every rank
            if ratios:
                tracker.log(ratios, step=state.step)
            if report:
                accelerator.print(report)
                straggling = bool(slow) and args.straggler_action == "checkpoint_and_exit"
            if can_evaluate and (state.step == args.max_steps or (args.eval_steps and state.step % args.eval_steps == 0)):
                scores = evaluate()
                metrics.update(scores)  # kept until the next eval: keep_best may rank checkpoints by an eval/ metric
                tracker.log(scores, step=state.step)
                if accelerator.is_main_process:
                    bar.write(f"step {state.step}: " + ", ".join(f"{k} {v:.4f}" for k, v in scores.items()))
            last = preempted or straggling or state.step == args.max_steps
            if last or (save_now and bad_in_a_row == 0):  # no scheduled save amid non-finite steps: a rollback target stays clean
                save(last=last)
            if preempted or straggling:
                break
    except Exception as err:  # a collective that timed out: name the rank that hung
        if (why := heartbeat.explain(err)) is not None:
            raise SystemExit(why) from err
        raise
    bar.close()
    if trace:
        trace.close()
    if preempted or straggling:  # saved: tell the batch script whether to requeue (STOP_RECORD), end the run KILLED
        if preempted:
            record = {"reason": "preempted", "signal": schedule.agreed_signal}
            message = f"preempted ({schedule.agreed_signal}): saved step {state.step}; the next launch resumes from it"
        else:
            record = {"reason": "straggler", "hosts": sorted({stragglers.hosts[rank] for rank in slow})}
            message = (
                f"straggler: saved step {state.step}; exiting with code {STRAGGLER_EXIT_CODE} so the job restarts without the slow rank"
            )
        if accelerator.is_main_process:
            atomic_write_text(Path(args.output_dir) / STOP_RECORD, json.dumps({"step": state.step, **record}))
        accelerator.print(message)
        tracker.close()
        end_run("KILLED")
        accelerator.end_training()
        schedule.close()  # the grace watchdog stays armed until the process group is down
        if straggling:
            raise SystemExit(STRAGGLER_EXIT_CODE)
        return
    schedule.close()
    check_replicas_in_sync(accelerator, model)

    # Export: safetensors weights and the processor, loadable with from_pretrained; written aside, then renamed into place
    final = Path(args.output_dir) / "final"
    work = final.with_name("final.partial")
    if accelerator.is_main_process:
        shutil.rmtree(work, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.unwrap_model(model).save_pretrained(
        work,
        state_dict=accelerator.get_state_dict(model),
        is_main_process=accelerator.is_main_process,
        save_function=accelerator.save,
        safe_serialization=True,
    )
    accelerator.wait_for_everyone()  # every rank is done with the folder (save_pretrained lists it on each)
    error = None
    if accelerator.is_main_process:
        try:
            job.processor.save_pretrained(work)
            write_model_card(work, job.name, config, {"step": state.step, f"{job.unit}_seen": state.tokens_seen, **metrics})
            fsync_tree(work)
            publish_dir(work, final)
        except Exception as err:  # a full disk, say: every rank must hear of it
            error = err
    if not all_ranks_ok(accelerator, error is None):
        raise SystemExit(f"export error: writing {final} failed ({error or 'on rank 0'}); the checkpoints are intact: relaunch to export")
    accelerator.print(f"done: step {state.step}, {state.tokens_seen} {job.unit}; model exported to {final}")
    tracker.close()
    if args.log_model and accelerator.is_main_process and (uri := log_model(final, job.task, args.register_model)):
        accelerator.print(f"model logged to MLflow as {uri}" + (f", registered as {args.register_model!r}" if args.register_model else ""))
    end_run("FINISHED")
    accelerator.end_training()
