"""What the loop trains, made ready for its engine, in the order accelerate and the engines need.

    refuse_or_claim(acc, args, job, own_dir)      refusals first (nothing on disk), then this job's folder claimed
    model, optimizer, scheduler, loader, cursor, shape = prepare(acc, args, data_args, job, hooks)

The order is the engines': activation checkpointing and the FSDP2 layout before the optimizer takes the parameters,
torch.compile before DDP wraps the model (DeepSpeed and FSDP compile in accelerate's prepare), the memory estimate's
shape before prepare shards the model, the gradient sum in rank order and ZeRO's deferred step right after it, the
schedule last (it wraps the optimizer as prepared).
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import torch
from accelerate import Accelerator

from infra.arguments import TrainingArguments
from infra.checkpoint.trainable import has_frozen_parameters, keep_trainable_only
from infra.companions import companion_parameters, prepare_companions
from infra.data import Data, DataArguments
from infra.data.errors import DataError
from infra.data.stream import training_stream
from infra.distributed import LaunchError, ready_for_fsdp
from infra.hooks import Hooks
from infra.job import Job
from infra.levers import checkpoint_activations, compile_blocks
from infra.lock import claim
from infra.lora import check_engine
from infra.memory import Shape
from infra.optim import build_optimizer, build_scheduler
from infra.reduction import sum_in_rank_order
from infra.replay import replay_problem
from infra.sdc import sdc_problem
from infra.stopped import clear_record
from infra.zero_step import defer_zero_step


class Prepared(NamedTuple):
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    loader: object  # this rank's resumable loader (infra.data.stream)
    cursor: object  # its position
    shape: Shape | None  # what the memory estimate needs of the model (None: not a token model)


def refuse_or_claim(acc: Accelerator, args: TrainingArguments, job: Job, own_dir: str) -> None:
    """A refusal (LaunchError) before anything is written, not even the lock; then one job per output_dir, held to the
    end, the last launch's stop record cleared and the job's data prepared (into its own folder: only under the lock)."""
    checkpoint_activations(acc, job.model, args.gradient_checkpointing)
    why = check_engine(acc, job.model) or sdc_problem(acc, args.sdc_action)
    if why := why or replay_problem(acc, args.sdc_replay, args.fault_tolerance):
        raise LaunchError(why)
    claim(acc, own_dir)
    if acc.is_main_process:
        clear_record(own_dir)
    if job.prepare_data is not None:
        job.data = job.prepare_data(own_dir)


def prepare(acc: Accelerator, args: TrainingArguments, data_args: DataArguments, job: Job, hooks: Hooks) -> Prepared:
    """The model, optimizer and schedule prepared by accelerate for the engine, this rank's loader, and the shape."""
    ready_for_fsdp(acc, job.model)  # before the optimizer takes the parameters
    compile_blocks(acc, job.model, args)  # in place, before DDP wraps it (DeepSpeed and FSDP: by accelerate in prepare)
    optimizer = build_optimizer(job.model, args)
    shape = job_shape(job, args)  # before prepare shards it
    loader, cursor = build_loader(acc, job.data, data_args, args)
    loader.on_read = hooks.on_read  # a test's slow disk, where the batches are read (a read-ahead's thread)
    model, optimizer = acc.prepare(job.model, optimizer)
    sum_in_rank_order(model, args.gradient_sum)  # DDP: one order of summation at every step of every launch
    optimizer = defer_zero_step(acc, optimizer)  # ZeRO: its step after the agreement (infra.zero_step)
    if has_frozen_parameters(acc):  # LoRA: checkpoints hold the adapter (and its optimizer state) only
        keep_trainable_only(acc)
    for line in prepare_companions(acc, job.companions):  # frozen models beside it: placed, sharded, never saved
        acc.print(line)
    scheduler = acc.prepare_scheduler(build_scheduler(optimizer, args, args.max_steps))
    return Prepared(model, optimizer, scheduler, loader, cursor, shape)


def job_shape(job: Job, args: TrainingArguments) -> Shape | None:
    """What the memory estimate needs of the job: token models with a transformers config (None otherwise: images)."""
    config = getattr(job.model, "config", None)
    if job.unit != "tokens" or not all(hasattr(config, k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads")):
        return None
    shape = Shape.of(job.model, args.per_device_train_batch_size, job.units_per_sample, causal_lm=job.task == "text-generation")
    return replace(shape, companions=companion_parameters(job.companions))


def build_loader(accelerator: Accelerator, data: Data, data_args: DataArguments, args: TrainingArguments):
    """This rank's resumable loader over the training samples (one dataset, or a mixture of several), and its cursor."""
    acc = accelerator
    stream = training_stream(
        data.train,
        data.mixture,
        data_args,
        args.per_device_train_batch_size,
        args.seed,
        acc.process_index,
        acc.num_processes,
        pin_memory=acc.device.type == "cuda",
    )
    if 0 < len(data.held_out) < acc.num_processes:
        raise DataError(f"eval_samples={len(data.held_out)} is fewer than the {acc.num_processes} processes evaluating it")
    return stream
