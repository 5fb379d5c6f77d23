"""Build the Accelerator the same way for every recipe, and refuse launches that would go wrong.

`accelerate launch` decides the strategy (DDP, DeepSpeed ZeRO, FSDP) from its config file; the
recipe code is identical for all of them. Two things need help on machines without a GPU
(measured on CPU-only machines): the multi-GPU launcher does not tell its CPU processes to form a group, and
DeepSpeed needs the gloo backend.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, InitProcessGroupKwargs, TorchDynamoPlugin

from infra.config import require
from infra.environment import REPO
from infra.errors import RunError
from infra.precision import Precision, PrecisionError, resolve

if TYPE_CHECKING:
    from infra.trainer import TrainingArguments


FSDP_ON_CPU_ENV = "INFRA_FSDP_ON_CPU"


class LaunchError(RunError, RuntimeError):
    """The processes of this launch do not form the job they were launched as (or the engine cannot run it)."""

    kind = "launch"


def launched_world_size() -> int:
    """How many processes the launcher started (1 when run as a plain script)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


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
    check_world(accelerator)
    configure_deepspeed(accelerator, args)
    return accelerator, precision


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


def group_for_this_attempt(backend: str, timeout: timedelta) -> None:
    """Under in-job restarts, form the process group in keys of this attempt's own, so no restarted rank reads a key of the
    attempt before.

    torch elastic's static rendezvous (what `accelerate launch` runs, whatever the config's `rdzv_backend` says: its
    command-line default wins) and its c10d rendezvous with the store shared with the agent (torch's default) serve every
    attempt of the workers from one store, under the same key names. A restarted rank that reaches the group's set-up
    before its peer reads the peer's address of the attempt before and fails (gloo: `Connection refused`) or waits on a
    port that is gone: measured on one machine, 2 of 6 restarts of a plain group came through, 4 failed or hung. On
    one machine every rank has the same agent, hence the same restart count: the keys go under it. Across machines the
    agents' counts can differ (one restarts for a failure, another for a membership change, which it does not count), so
    there the launcher must give each attempt a store of its own: `python -m infra.launch` does (c10d rendezvous,
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1); anything else gets a warning.
    """
    if launched_world_size() <= 1 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) == 0:
        return
    if os.environ.get("GROUP_WORLD_SIZE", "1") != "1":
        if int(os.environ.get("RANK", "0")) == 0:
            print(
                "warning: in-job restarts across machines with a store shared by every attempt: a restarted rank can read its "
                "peer's old address and fail. Launch with python -m infra.launch, or accelerate launch --rdzv_backend c10d "
                "with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 set",
                flush=True,
            )
        return
    store = torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    torch.distributed.init_process_group(
        backend,
        store=torch.distributed.PrefixStore(f"infra/attempt_{attempt}", store),
        rank=int(os.environ["RANK"]),
        world_size=launched_world_size(),
        timeout=timeout,
    )


def fsdp_over_cpu_processes(accelerator: Accelerator) -> None:
    """Make a group of CPU processes run FSDP: accelerate enables FSDP on accelerators only, though torch's
    FSDP2 shards over gloo too. Opt-in (INFRA_FSDP_ON_CPU=1), so FSDP's save, resume and export are tested here."""
    from accelerate.state import PartialState
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin()  # from the launcher's FSDP_* variables, as accelerate builds it
    if accelerator.mixed_precision != "no":  # as AcceleratorState does: the plugin knows no "no" (fp32 is its default)
        plugin.set_mixed_precision(accelerator.mixed_precision)
    accelerator.state.fsdp_plugin = plugin
    # as AcceleratorState sets it for accelerators (each new AcceleratorState copies PartialState's)
    accelerator.state.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP


def ready_for_fsdp(accelerator: Accelerator, model: torch.nn.Module) -> None:
    """Work around two failures of accelerate 1.15's FSDP2 preparation of transformers models.

    - Its units: each `_no_split_modules` class, then the input embedding on its own. Where the
      embedding sits inside such a class (BertEmbeddings, ViTEmbeddings) its weight is already
      sharded and `fully_shard` fails on the DTensor. Those classes are left out of the units (their
      other parameters join the root's), unless the launcher named the classes to wrap.
    - With `fsdp_cpu_ram_efficient_loading`, transformers leaves the weights a checkpoint lacks (a
      new classifier head) on the meta device on ranks other than 0. accelerate maps the optimizer's
      parameters to the sharded ones by data_ptr, which is 0 for all of them: two merge, and the
      first save fails on that rank while the others wait in a collective. They get storage here;
      their values do not matter, as rank 0's weights are broadcast after sharding.
    """
    if accelerator.distributed_type != DistributedType.FSDP or accelerator.state.fsdp_plugin.fsdp_version != 2:
        return
    plugin = accelerator.state.fsdp_plugin
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if plugin.transformer_cls_names_to_wrap is None and embedding is not None:
        around = {type(m).__name__ for m in model.modules() if m is not embedding and any(c is embedding for c in m.modules())}
        plugin.transformer_cls_names_to_wrap = [name for name in getattr(model, "_no_split_modules", None) or [] if name not in around]
    if plugin.cpu_ram_efficient_loading and not accelerator.is_main_process:
        for module in model.modules():
            if any(p.is_meta for p in module.parameters(recurse=False)):
                module.to_empty(device="cpu", recurse=False)


def requested_engine() -> DistributedType | None:
    """The sharding engine the launcher's config asked for, if any."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        return DistributedType.DEEPSPEED
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        return DistributedType.FSDP
    return None


def check_world(accelerator: Accelerator) -> None:
    """Refuse a launch whose processes do not form the job the launcher asked for."""
    engine = requested_engine()
    if engine is not None and accelerator.distributed_type != engine:
        hint = ""
        if engine == DistributedType.FSDP and not torch.cuda.is_available():
            hint = (
                ": accelerate runs FSDP on accelerators only (not on CPU processes); here use cpu.yaml, zero2.yaml or zero3.yaml, "
                f"or set {FSDP_ON_CPU_ENV}=1 to run FSDP2 over gloo as the tests do"
            )
        raise LaunchError(f"the accelerate config asks for {engine.value} but this process runs {accelerator.distributed_type.value}{hint}")
    launched = launched_world_size()
    if accelerator.num_processes != launched:
        raise LaunchError(
            f"the launcher started {launched} processes but this one sees a group of {accelerator.num_processes}: "
            "they would each train and write as rank 0. Use an accelerate config from accelerate_configs/ "
            "(cpu.yaml on machines without a GPU)."
        )


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


def all_ranks_ok(accelerator: Accelerator, ok: bool) -> bool:
    """True on every rank iff `ok` on every rank (so no rank waits for one that gave up)."""
    if accelerator.num_processes == 1:
        return ok
    flag = torch.tensor([1.0 if ok else 0.0], device=accelerator.device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
    return bool(flag.item())


def gathered(accelerator: Accelerator, value):
    """`value` of every rank, in rank order, on every rank (any picklable object)."""
    if accelerator.num_processes == 1:
        return [value]
    out = [None] * accelerator.num_processes
    torch.distributed.all_gather_object(out, value)
    return out
