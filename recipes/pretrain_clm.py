"""Pretrain a Llama-style causal language model on prepared token shards.

    make train                                                        # the default, on this machine
    accelerate launch --config_file accelerate_configs/cpu.yaml recipes/pretrain_clm.py \
        --config recipes/configs/pretrain_tiny.yaml                   # 2 CPU processes (gloo)
    accelerate launch --config_file accelerate_configs/ddp.yaml recipes/pretrain_clm.py \
        --config recipes/configs/pretrain_tiny.yaml                   # every GPU of one node
    accelerate launch --config_file accelerate_configs/zero3.yaml recipes/pretrain_clm.py \
        --config recipes/configs/pretrain_tiny.yaml --learning_rate 3e-4

Any flag overrides the YAML. The run resumes by itself from the newest checkpoint in
`output_dir` (`--resume_from_checkpoint none` starts over) and continues the same MLflow run.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate.utils import DistributedType, set_seed
from tqdm.auto import tqdm
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    get_cosine_with_min_lr_schedule_with_warmup,
)

from infra.checkpoint import CheckpointError, CheckpointManager, SaveSchedule, TrainState, environment_facts, write_model_card
from infra.config import TrainingArguments, parse_config, require, resolved
from infra.data import DataCursor, PackedDataset, ResumableLoader, SampleTrace, check_fits_model, eval_batches
from infra.distributed import LaunchError, build_accelerator
from infra.files import atomic_write_text
from infra.health import STRAGGLER_EXIT_CODE, Faults, Heartbeat, StragglerDetector, check_replicas_in_sync, nonfinite
from infra.metrics import Throughput, flops_per_token, peak_bf16_flops
from infra.preflight import EtaCheck, kept_checkpoints, run_preflight
from infra.tracking import (
    MetricLogger,
    end_run,
    last_logged_step,
    log_model,
    run_name_for,
    run_status,
    run_tags,
    start_run,
    tracking_uri,
)


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Load these weights (path or hub id); else build a new model from the fields below."}
    )
    hidden_size: int = field(default=128, metadata={"help": "Width of the residual stream."})
    intermediate_size: int = field(default=344, metadata={"help": "Width of the MLP."})
    num_hidden_layers: int = field(default=2, metadata={"help": "Decoder layers."})
    num_attention_heads: int = field(default=4, metadata={"help": "Attention heads."})
    num_key_value_heads: int | None = field(default=None, metadata={"help": "KV heads for grouped-query attention (default: all)."})
    attention_dropout: float = field(default=0.0, metadata={"help": "Dropout on attention probabilities."})

    def __post_init__(self):
        require(
            self.hidden_size % self.num_attention_heads == 0,
            "hidden_size",
            self.hidden_size,
            f"a multiple of num_attention_heads={self.num_attention_heads}",
        )
        require(0 <= self.attention_dropout < 1, "attention_dropout", self.attention_dropout, "a number in [0, 1)")


@dataclass
class DataArguments:
    data_dir: str = field(default="data/stdlib", metadata={"help": "Prepared shards (python -m infra.data.prepare)."})
    eval_samples: int = field(
        default=0, metadata={"help": "Hold out the last N samples of data_dir for eval (eval/loss, eval/perplexity); 0: no eval."}
    )
    num_workers: int = field(default=0, metadata={"help": "DataLoader worker processes per rank."})
    shuffle_window: int = field(
        default=1 << 18, metadata={"help": "Samples shuffled together after the shards are shuffled (see infra.data.loader.EpochOrder)."}
    )
    verify_data_checksums: bool = field(
        default=False, metadata={"help": "sha256 every shard before training (in the preflight, on rank 0; make doctor always does)."}
    )
    trace_samples: bool = field(default=False, metadata={"help": "Log each step's global sample ids to OUTPUT_DIR/trace/rank{r}.jsonl."})

    def __post_init__(self):
        require(self.num_workers >= 0, "num_workers", self.num_workers, "an integer >= 0")
        require(self.eval_samples >= 0, "eval_samples", self.eval_samples, "an integer >= 0")
        require(self.shuffle_window >= 1, "shuffle_window", self.shuffle_window, "an integer >= 1")


def check_together(model_args: ModelArguments, data_args: DataArguments, args: TrainingArguments) -> None:
    """What no single section can check alone."""
    if args.keep_best and args.metric_for_best_model.startswith("eval/"):
        require(
            data_args.eval_samples > 0, "eval_samples", data_args.eval_samples, f"> 0 to rank checkpoints by {args.metric_for_best_model}"
        )


def build_model(args: ModelArguments, tokenizer, seq_len: int):
    if args.model_name_or_path:
        return AutoModelForCausalLM.from_pretrained(args.model_name_or_path)
    config = AutoConfig.for_model(
        "llama",
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_hidden_layers,
        num_attention_heads=args.num_attention_heads,
        num_key_value_heads=args.num_key_value_heads or args.num_attention_heads,
        max_position_embeddings=seq_len,
        attention_dropout=args.attention_dropout,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    return AutoModelForCausalLM.from_config(config)


def build_optimizer(model, args: TrainingArguments):
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2))


def build_scheduler(optimizer, args: TrainingArguments):
    """Linear warmup, then cosine decay to min_lr_ratio. Built on the prepared optimizer: ZeRO-3
    regroups parameters, and a schedule made before `prepare` would no longer match."""
    return get_cosine_with_min_lr_schedule_with_warmup(optimizer, args.warmup_steps, args.max_steps, min_lr_rate=args.min_lr_ratio)


@torch.no_grad()
def evaluate(accelerator, model, held_out, batch_size: int) -> dict[str, float]:
    """Mean token loss and perplexity over the held-out samples, all ranks together."""
    model.eval()
    total = torch.zeros(2, device=accelerator.device)  # sum of per-sample mean losses, samples (all of seq_len tokens)
    for batch in eval_batches(held_out, batch_size, accelerator.process_index, accelerator.num_processes):
        batch = batch.to(accelerator.device, non_blocking=True)
        n = torch.tensor(float(len(batch)), device=accelerator.device)
        total += torch.stack([model(input_ids=batch, labels=batch).loss.float() * n, n])
    model.train()
    loss_sum, samples = accelerator.reduce(total, "sum").tolist()
    loss = loss_sum / samples
    return {"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 50.0))}


def main(argv: list[str] | None = None) -> None:
    # Configuration: everything is checked before a process group, file or run exists
    model_args, data_args, args = parse_config((ModelArguments, DataArguments, TrainingArguments), argv, check=check_together)
    config = resolved(model_args, data_args, args)
    try:
        # sizes now; sha256 now only if no preflight will hash the shards (on rank 0 alone)
        preflight_hashes = (args.preflight or args.preflight_only) and (data_args.verify_data_checksums or args.preflight_only)
        dataset = PackedDataset(data_args.data_dir, verify_checksums=data_args.verify_data_checksums and not preflight_hashes)
        train_set, held_out = dataset.split(data_args.eval_samples)
    except ValueError as err:
        raise SystemExit(f"data error: {err}") from None
    tokenizer = AutoTokenizer.from_pretrained(dataset.tokenizer_dir)

    try:
        accelerator = build_accelerator(args, log_with=None if args.report_to == "none" else args.report_to)
    except LaunchError as err:
        raise SystemExit(f"launch error: {err}") from None
    set_seed(args.seed)

    # Model and optimizer
    model = build_model(model_args, tokenizer, dataset.seq_len)
    try:
        check_fits_model(dataset.index, tokenizer.eos_token_id, model.config)
    except ValueError as err:
        raise SystemExit(f"data error: {err}") from None
    optimizer = build_optimizer(model, args)
    mc = model.config  # counted before ZeRO-3 partitions the parameters
    flops = flops_per_token(sum(p.numel() for p in model.parameters()), mc.num_hidden_layers, mc.hidden_size, dataset.seq_len)

    # Data: this rank's slice of every global batch, from the global cursor
    cursor = DataCursor()
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
    if 0 < len(held_out) < accelerator.num_processes:
        raise SystemExit(f"data error: eval_samples={len(held_out)} is fewer than the {accelerator.num_processes} processes evaluating it")
    model, optimizer = accelerator.prepare(model, optimizer)
    scheduler = accelerator.prepare_scheduler(build_scheduler(optimizer, args))

    # Preflight: devices, a collective, data, a checkpoint round trip, disk, MLflow; nothing trains if one fails
    save_seconds = 0.0
    if args.preflight or args.preflight_only:
        save_seconds = run_preflight(
            accelerator,
            model,
            dataset,
            args.output_dir,
            kept_checkpoints(args),
            tracking_uri() if args.report_to == "mlflow" else None,
            data_checksums=preflight_hashes,
        )
        if args.preflight_only:
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
    try:
        resume, manifest = checkpoints.resume(args.resume_from_checkpoint, checksums=args.verify_checksums)
    except CheckpointError as err:
        raise SystemExit(f"checkpoint error: {err}") from None
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
            args.experiment_name or "pretrain_clm",
            run_name_for(config, args),
            config,
            args.output_dir,
            run_id=manifest.get("mlflow_run_id"),
            tags=run_tags(accelerator, "pretrain_clm", state.step),
            restart=args.resume_from_checkpoint == "auto",
        )
    # steps logged after the checkpoint and before a crash come again, identical: not twice in the run
    tracker = MetricLogger(run_id, f"{args.output_dir}/unsent_metrics.jsonl", logged_through=last_logged_step(run_id))
    accelerator.print(
        f"world size {accelerator.num_processes} ({accelerator.distributed_type.value}), "
        f"{'resumed at step ' + str(state.step) + ' from ' + str(resume) if resume else 'starting fresh'}, {cursor}"
    )

    trace = SampleTrace(args.output_dir, accelerator.process_index, state.step) if data_args.trace_samples else None

    metrics: dict[str, float] = manifest.get("metrics", {})

    job_facts = environment_facts(accelerator)  # versions, git state: once, not at every save

    def save(last: bool = False) -> None:
        if trace:
            trace.flush()
        start = time.perf_counter()
        # a copy of the metrics: a background save writes its manifest later, while the loop goes on updating them
        facts = {**state.state_dict(), "cursor": cursor.state_dict(), "metrics": dict(metrics), "mlflow_run_id": run_id}
        try:
            with heartbeat.relaxed():  # a long synchronous save is not a hang
                checkpoints.save(state.step, {**facts, **job_facts}, background=args.async_save and not last)
        except CheckpointError as err:
            raise SystemExit(f"checkpoint error: {err}") from None
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
        try:
            with heartbeat.relaxed():
                checkpoints.wait()
                path, manifest = checkpoints.resume("auto", checksums=args.verify_checksums)
        except CheckpointError as err:
            raise SystemExit(f"checkpoint error: {err}") from None
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

    # Training loop
    tokens_per_step = loader.global_batch_size * args.gradient_accumulation_steps * dataset.seq_len
    peak = peak_bf16_flops(torch.cuda.get_device_name(accelerator.device) if accelerator.device.type == "cuda" else None)
    batches = iter(loader)
    meter = Throughput()
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
    eta = EtaCheck(accelerator, state.step, args.max_steps, tokens_per_step, args.time_budget_hours)
    loss_sum, loss_count = torch.zeros((), device=accelerator.device), 0
    bar = tqdm(total=args.max_steps, initial=state.step, desc="train", disable=not accelerator.is_local_main_process)
    model.train()
    preempted = straggling = False
    try:
        while state.step < args.max_steps:
            step_loss = torch.zeros((), device=accelerator.device)
            for _ in range(args.gradient_accumulation_steps):
                waiting = time.perf_counter()
                batch = next(batches).to(accelerator.device, non_blocking=True)
                waited = time.perf_counter() - waiting
                meter.waited(waited)
                stragglers.waited(waited)
                if trace:
                    trace.write(state.step + 1, loader.last_sample_ids)
                with accelerator.accumulate(model):
                    with stragglers.compute():
                        loss = faults.poison(model(input_ids=batch, labels=batch).loss, loader.batches_consumed)
                        faults.slow_down()
                    accelerator.backward(loss)
                step_loss += loss.detach()
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm) if args.max_grad_norm else None
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
            state.tokens_seen += tokens_per_step
            meter.add(tokens_per_step)
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
                    "train/tokens_seen": state.tokens_seen,
                    "train/epoch": cursor.epoch,
                }
                logged.update({f"perf/{k}": v for k, v in meter.rate().items()})
                if peak:  # model FLOPs utilisation, only where the device's peak is known: never a wrong number
                    logged["perf/mfu"] = logged["perf/tokens_per_second"] * flops / (peak * accelerator.num_processes)
                if grad_norm is not None:
                    logged["train/grad_norm"] = float(grad_norm)
                tracker.log(logged, step=state.step)
                metrics |= logged  # the latest of each metric, eval included: checkpoints and keep_best read them
                loss_sum.zero_()
                loss_count = 0
                bar.set_postfix(loss=f"{mean_loss:.3f}", tok_s=f"{logged['perf/tokens_per_second']:.0f}")
            ratios, report, slow = stragglers.step()  # decided from gathered timings: the same on every rank
            if ratios:
                tracker.log(ratios, step=state.step)
            if report:
                accelerator.print(report)
                straggling = bool(slow) and args.straggler_action == "checkpoint_and_exit"
            if len(held_out) and (state.step == args.max_steps or (args.eval_steps and state.step % args.eval_steps == 0)):
                scores = evaluate(accelerator, model, held_out, args.per_device_eval_batch_size)
                metrics.update(scores)  # kept until the next eval: keep_best may rank checkpoints by eval/loss
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
    schedule.close()
    if trace:
        trace.close()
    if preempted:
        accelerator.print(f"preempted (SIGTERM/SIGUSR1): saved step {state.step}; the next launch resumes from it")
        tracker.close()
        end_run("KILLED")
        return
    if straggling:
        if accelerator.is_main_process:  # for the batch script: requeue without these hosts
            hosts = sorted({stragglers.hosts[rank] for rank in slow})
            atomic_write_text(Path(args.output_dir) / "straggler.json", json.dumps({"step": state.step, "hosts": hosts}))
        accelerator.print(
            f"straggler: saved step {state.step}; exiting with code {STRAGGLER_EXIT_CODE} so the job restarts without the slow rank"
        )
        tracker.close()
        end_run("KILLED")
        raise SystemExit(STRAGGLER_EXIT_CODE)
    check_replicas_in_sync(accelerator, model)

    # Export: safetensors weights + tokenizer that load with from_pretrained
    final = f"{args.output_dir}/final"
    accelerator.unwrap_model(model).save_pretrained(
        final,
        state_dict=accelerator.get_state_dict(model),
        is_main_process=accelerator.is_main_process,
        save_function=accelerator.save,
        safe_serialization=True,
    )
    if accelerator.is_main_process:
        tokenizer.save_pretrained(final)
        write_model_card(final, "pretrain_clm", config, {"step": state.step, "tokens_seen": state.tokens_seen, **metrics})
    accelerator.print(f"done: step {state.step}, {state.tokens_seen} tokens; model exported to {final}")
    tracker.close()
    if args.log_model and accelerator.is_main_process and (uri := log_model(final, "text-generation", args.register_model)):
        accelerator.print(f"model logged to MLflow as {uri}" + (f", registered as {args.register_model!r}" if args.register_model else ""))
    end_run("FINISHED")
    accelerator.end_training()


if __name__ == "__main__":
    with run_status():  # an exception marks the MLflow run FAILED
        main()
