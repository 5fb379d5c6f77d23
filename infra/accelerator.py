"""Build the Accelerator the same way for every recipe.

`accelerate launch` decides the strategy (DDP, DeepSpeed ZeRO, FSDP) from its config file; the
recipe code is identical for all of them. Two things need help on machines without a GPU
(measured on CPU-only machines): the multi-GPU launcher does not tell its CPU processes to form a group, and
DeepSpeed needs the gloo backend.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, InitProcessGroupKwargs, TorchDynamoPlugin

from infra.arguments import TrainingArguments
from infra.config import require
from infra.distributed import (
    FSDP_ON_CPU_ENV,
    LaunchError,
    check_world,
    fsdp_over_cpu_processes,
    group_for_this_attempt,
    launched_world_size,
    requested_engine,
)
from infra.environment import REPO
from infra.precision import Precision, PrecisionError, resolve


def build_accelerator(
    args: TrainingArguments, log_with: str | None = None, dynamo_plugin: TorchDynamoPlugin | None = None
) -> tuple[Accelerator, Precision]:
    """The recipe's Accelerator (mixed precision, accumulation, timeouts, what it compiles and CPU fixes applied) and the
    precision chosen."""
    try:
        precision = resolve(args.mixed_precision)
    except PrecisionError as err:
        raise LaunchError(str(err)) from None
    on_cpu = not torch.cuda.is_available()
    asked_fsdp_on_cpu = requested_engine() == DistributedType.FSDP and os.environ.get(FSDP_ON_CPU_ENV) == "1"
    fsdp_on_cpu = on_cpu and asked_fsdp_on_cpu  # one process too (FSDP needs its group of one, as on one GPU)
    if on_cpu and launched_world_size() > 1 and (requested_engine() is None or fsdp_on_cpu):
        # accelerate's multi-GPU launcher does not pass ACCELERATE_USE_CPU to its workers; without
        # it each CPU process believes it is alone and every rank would train and write as rank 0.
        # (Not for DeepSpeed or FSDP: ACCELERATE_USE_CPU would silently turn them into plain DDP; FSDP on
        # CPU, when asked for, is made FSDP again below.)
        os.environ["ACCELERATE_USE_CPU"] = "1"
    # DeepSpeed JIT-builds its CPU ops on first use (~1 min); keep them between runs.
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))

    accumulate_for_global_batch(args, launched_world_size())
    timeout = timedelta(seconds=args.ddp_timeout)
    gloo = on_cpu and (launched_world_size() > 1 or fsdp_on_cpu)  # DeepSpeed on CPU needs it; one process no group
    if gloo:
        # connect gloo pairs on first use: a group restarted by torch elastic (--max_restarts) otherwise often hangs
        # forming its full mesh (14 of 19 restarts ran without it; with lazy init, see tests/test_pretrain.py)
        os.environ.setdefault("TORCH_GLOO_LAZY_INIT", "1")
    init = InitProcessGroupKwargs(backend="gloo", timeout=timeout) if gloo else InitProcessGroupKwargs(timeout=timeout)
    group_for_this_attempt("gloo" if gloo or on_cpu else "nccl", timeout)
    accelerator = Accelerator(
        mixed_precision=precision.value,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        log_with=log_with,
        step_scheduler_with_optimizer=False,  # the recipe steps the schedule once per optimizer step
        kwargs_handlers=[init],
        dynamo_plugin=dynamo_plugin or TorchDynamoPlugin(backend="no"),  # not the launcher's: infra.levers decides
    )
    if fsdp_on_cpu:
        fsdp_over_cpu_processes(accelerator)
    ask_for_deepspeed_only_where_it_runs()
    check_world(accelerator)
    configure_deepspeed(accelerator, args)
    return accelerator, precision


def ask_for_deepspeed_only_where_it_runs() -> None:
    """accelerate's unwrap_model (each save, export and the preflight's round trip call it) imports deepspeed whenever it
    is installed, to ask whether the model is its engine: 1.7 s of a core at a DDP or FSDP process's first save
    (measured on an AVX-512 EPYC). No model is a DeepSpeed engine in a process that never imported deepspeed, so there
    the question is skipped: the same answer, without the import."""
    from accelerate.utils import other

    installed = other.is_deepspeed_available
    if getattr(installed, "only_where_it_runs", False):
        return

    def imported_and_installed() -> bool:
        return "deepspeed" in sys.modules and installed()

    imported_and_installed.only_where_it_runs = True
    other.is_deepspeed_available = imported_and_installed


def accumulate_for_global_batch(args: TrainingArguments, processes: int) -> None:
    """With `global_batch_size` set, the accumulation steps that give it on this many processes: a job that comes back on
    fewer or more (elastic shrink, a lost node not replaced) trains on the same samples per step."""
    if not args.global_batch_size:
        return
    if args.fault_tolerance == "replicas":  # each step's split among the live replica groups decides it (infra.replicas)
        args.gradient_accumulation_steps = 1
        return
    per_micro_step = args.per_device_train_batch_size * processes
    accepted = f"a multiple of per_device_train_batch_size x processes = {args.per_device_train_batch_size} x {processes}"
    require(args.global_batch_size % per_micro_step == 0, "global_batch_size", args.global_batch_size, accepted)
    args.gradient_accumulation_steps = args.global_batch_size // per_micro_step  # what was given is overridden


def configure_deepspeed(accelerator: Accelerator, args: TrainingArguments) -> None:
    """Give DeepSpeed the batch geometry it would otherwise read from a prepared DataLoader.

    Recipes feed each rank from a ResumableLoader rather than through `accelerator.prepare`, so
    the values DeepSpeed's config leaves as "auto" are set here, from the one place they live.
    """
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return
    config = accelerator.state.deepspeed_plugin.deepspeed_config
    config["train_micro_batch_size_per_gpu"] = args.per_device_train_batch_size
    config["gradient_accumulation_steps"] = args.gradient_accumulation_steps
    config["train_batch_size"] = args.per_device_train_batch_size * args.gradient_accumulation_steps * accelerator.num_processes
    config["gradient_clipping"] = args.max_grad_norm
