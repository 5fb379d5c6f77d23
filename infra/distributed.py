"""What every launch needs of the process group whatever the engine: launches that would go wrong refused
(`check_world`, `LaunchError`), the group formed per restart attempt, FSDP over CPU processes, and the small collectives
the other modules agree with (`all_ranks_ok`, `gathered`). The Accelerator itself is built in infra.accelerator."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch.distributed.tensor import DTensor

from infra.errors import RunError

FSDP_ON_CPU_ENV = "INFRA_FSDP_ON_CPU"


class LaunchError(RunError, RuntimeError):
    """The processes of this launch do not form the job they were launched as (or the engine cannot run it)."""

    kind = "launch"


def launched_world_size() -> int:
    """How many processes the launcher started (1 when run as a plain script)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


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


def resharded(model: torch.nn.Module) -> None:
    """Every FSDP2 unit of `model` back to its shards. A forward pass with no backward after it (under no_grad, before
    the optimizer steps) leaves the root unit's parameters gathered, as FSDP2 keeps them for the backward it expects:
    the next forward would then compute with them, the values from before the step."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This process's part of `tensor` (the tensor itself unless sharded: FSDP2's DTensor), writable in place."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
